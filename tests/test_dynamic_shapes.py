"""A compiled engine step with a dynamic token count: one graph for every T, results equal to the reference.

vLLM and SGLang compile their step with the number of tokens dynamic
(``torch.compile(..., dynamic=True)`` or ``torch._dynamo.mark_dynamic`` on the
token dimension).  Each op below is compiled once and called with ten
different token counts (more than dynamo's default recompile limit of 8): it
must trace one graph (at most two: T = 0 and 1 may specialize; every T here is
>= 2), and every call must write exactly the reference's bytes.  Bad slots
still raise inside compiled code, and a module calling ``ops.transfer``
exports with ``torch.export`` (dynamic T) and runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlayout import ops
from kvlayout import reference as R
from kvlayout.conformance import strategies as S
from kvlayout.ops import _native
from kvlayout.reference import Geometry

import torch_cases as TC

TOKEN_COUNTS = [2, 3, 5, 8, 13, 21, 34, 55, 89, 100]   # (5 is also the status word's length: no tie)
L, NB, BS, H, E = 3, 16, 8, 2, 16                        # 128 slots
CACHE = "vllm_flash_attn_nhd"
GEOM = Geometry(P=2, L=L, NB=NB, BS=BS, H=H, E=E)
CHUNK = "lmcache_kv_2ltd"
POOL = "hicache_layer_first"


def _chunk_geometry(T):
    return Geometry(P=2, L=L, NB=T, BS=1, H=1, E=H * E)


class GraphCounter:
    """A dynamo backend (aot_eager underneath) that counts the graphs it is handed."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def _numpy(layout, physical):
    if isinstance(physical, torch.Tensor):
        return physical.cpu().numpy()
    return type(physical)(_numpy(layout, p) for p in physical)


def _rng_slots(rng, T, bound=NB * BS):
    return rng.permutation(bound)[:T].astype(np.int64)


def _compiled(fn, how):
    counter = GraphCounter()
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=counter, dynamic=True if how == "dynamic" else None), counter


def _mark(how, *tensors_and_dims):
    if how == "mark_dynamic":
        for t, dim in tensors_and_dims:
            torch._dynamo.mark_dynamic(t, dim)


def _assert_one_graph(counter):
    assert 1 <= counter.graphs <= 2, f"{counter.graphs} graphs for {len(TOKEN_COUNTS)} token counts"


HOW = ["dynamic", "mark_dynamic"]


@pytest.fixture
def cache(device):
    rng = np.random.default_rng(0)
    physical = S.random_cache(CACHE, GEOM, "bfloat16", rng)
    return physical, ops.bind(CACHE, TC.to_torch(CACHE, physical, device))


@pytest.mark.parametrize("how", HOW)
def test_transfer_to_chunk(device, cache, how):
    physical, kv = cache

    def step(slots, chunk):
        ops.transfer(kv, ops.bind(CHUNK, chunk), slots)

    fn, counter = _compiled(step, how)
    rng = np.random.default_rng(1)
    for T in TOKEN_COUNTS:
        s = _rng_slots(rng, T)
        s[T // 2] = -1                                         # a token without a row: left as it was
        before = S.random_cache(CHUNK, _chunk_geometry(T), "bfloat16", rng)
        chunk = TC.to_torch(CHUNK, before, device)
        slots = torch.from_numpy(s).to(device)
        _mark(how, (slots, 0), (chunk, 2))
        fn(slots, chunk)
        want = R.transfer(CACHE, physical, CHUNK, before, s, None)
        TC.sync(device)
        TC.assert_same_bytes(chunk, want, f"chunk of {T} tokens")
    _assert_one_graph(counter)


@pytest.mark.parametrize("how", HOW)
def test_transfer_from_chunk(device, cache, how):
    physical, kv = cache
    expected = physical

    def step(chunk, slots):
        ops.transfer(ops.bind(CHUNK, chunk), kv, None, slots)

    fn, counter = _compiled(step, how)
    rng = np.random.default_rng(2)
    for T in TOKEN_COUNTS:
        s = _rng_slots(rng, T)
        rows = S.random_cache(CHUNK, _chunk_geometry(T), "bfloat16", rng)
        chunk = TC.to_torch(CHUNK, rows, device)
        slots = torch.from_numpy(s).to(device)
        _mark(how, (slots, 0), (chunk, 2))
        fn(chunk, slots)
        expected = R.transfer(CHUNK, rows, CACHE, expected, None, s)
        TC.sync(device)
        TC.assert_same_bytes(list(kv.tensors), list(expected), f"cache after {T} tokens")
    _assert_one_graph(counter)


@pytest.mark.parametrize("how", HOW)
def test_gather_and_scatter(device, cache, how):
    physical, kv = cache
    expected = physical

    def step(src_slots, dst_slots):
        rows = ops.gather(kv, src_slots, layers=[2, 0])
        ops.scatter(kv, rows, dst_slots, layers=[1, 2])
        return rows

    fn, counter = _compiled(step, how)
    rng = np.random.default_rng(3)
    for T in TOKEN_COUNTS:
        s, d = _rng_slots(rng, T), _rng_slots(rng, T)
        src_slots, dst_slots = torch.from_numpy(s).to(device), torch.from_numpy(d).to(device)
        _mark(how, (src_slots, 0), (dst_slots, 0))
        rows = fn(src_slots, dst_slots)
        want_rows = R.gather(CACHE, expected, s, layers=[2, 0])
        expected = R.scatter(CACHE, expected, want_rows, d, layers=[1, 2])
        TC.sync(device)
        TC.assert_same_bytes(rows, want_rows, f"rows of {T} tokens")
        TC.assert_same_bytes(list(kv.tensors), list(expected), f"cache after {T} tokens")
    _assert_one_graph(counter)


@pytest.mark.parametrize("how", HOW)
def test_move(device, cache, how):
    physical, kv = cache
    expected = physical

    def step(src_slots, dst_slots):
        ops.move(kv, src_slots, dst_slots)

    fn, counter = _compiled(step, how)
    rng = np.random.default_rng(4)
    for T in TOKEN_COUNTS:
        s, d = _rng_slots(rng, T), _rng_slots(rng, T)
        src_slots, dst_slots = torch.from_numpy(s).to(device), torch.from_numpy(d).to(device)
        _mark(how, (src_slots, 0), (dst_slots, 0))
        fn(src_slots, dst_slots)
        expected = R.move(CACHE, expected, s, d)
        TC.sync(device)
        TC.assert_same_bytes(list(kv.tensors), list(expected), f"cache after moving {T} tokens")
    _assert_one_graph(counter)


@pytest.mark.parametrize("how", HOW)
def test_prepared_layer_calls(device, cache, how):
    """A layer-wise offload prepared once; each step sets new slots (a new T) and runs the compiled layer calls."""
    physical, kv = cache
    pool_geom = Geometry(P=2, L=L, NB=256, BS=1, H=H, E=E)
    pool_np = S.random_cache(POOL, pool_geom, "bfloat16", np.random.default_rng(5))
    pool = ops.bind(POOL, TC.to_torch(POOL, pool_np, device))
    expected = pool_np
    t = ops.prepare(kv, pool, torch.zeros(2, dtype=torch.int64, device=device),
                    torch.zeros(2, dtype=torch.int64, device=device) + 1)

    def step(dummy):
        for i in range(t.num_layers):
            t.layer(i)
        return dummy + 1

    fn, counter = _compiled(step, how)
    rng = np.random.default_rng(6)
    dummy = torch.zeros(1, device=device)
    for T in TOKEN_COUNTS:
        s, d = _rng_slots(rng, T), _rng_slots(rng, T, bound=256)
        src_slots, dst_slots = torch.from_numpy(s).to(device), torch.from_numpy(d).to(device)
        _mark(how, (src_slots, 0), (dst_slots, 0))
        t.set_slots(src_slots, dst_slots)
        fn(dummy)
        expected = R.transfer(CACHE, physical, POOL, expected, s, d)
        TC.sync(device)
        TC.assert_same_bytes(pool.tensors[0], expected, f"pool after {T} tokens")
    _assert_one_graph(counter)


def test_bad_slots_still_raise_in_compiled_code(device, cache):
    _, kv = cache

    def step(slots, chunk):
        ops.transfer(kv, ops.bind(CHUNK, chunk), slots)

    fn, _ = _compiled(step, "dynamic")
    for T in (4, 7):
        fn(torch.arange(T, device=device), torch.zeros(2, L, T, H * E, dtype=torch.bfloat16, device=device))
    bad = torch.arange(9, device=device)
    bad[3] = NB * BS
    with pytest.raises(IndexError, match=r"src_slots\[3\] = 128 is out of range"):
        fn(bad, torch.zeros(2, L, 9, H * E, dtype=torch.bfloat16, device=device))
        ops.check_errors(device)


class Offload(torch.nn.Module):
    """A module that gathers the rows of a token list from a paged cache into a chunk."""

    def __init__(self, kv):
        super().__init__()
        self.kv = kv

    def forward(self, slots, chunk):
        ops.transfer(ops.bind(CACHE, list(self.kv)), ops.bind(CHUNK, chunk), slots)
        return chunk


def test_export_with_dynamic_tokens(device, cache):
    physical, kv = cache
    module = Offload(kv.tensors)
    T0 = 6
    dim = torch.export.Dim("tokens", min=2, max=NB * BS)
    example = (torch.arange(T0, device=device), torch.zeros(2, L, T0, H * E, dtype=torch.bfloat16, device=device))
    exported = torch.export.export(module, example, dynamic_shapes=({0: dim}, {2: dim}))
    rng = np.random.default_rng(7)
    for T in (3, 17, 40):
        s = _rng_slots(rng, T)
        before = S.random_cache(CHUNK, _chunk_geometry(T), "bfloat16", rng)
        chunk = TC.to_torch(CHUNK, before, device)
        got = exported.module()(torch.from_numpy(s).to(device), chunk)
        TC.sync(device)
        TC.assert_same_bytes(got, R.transfer(CACHE, physical, CHUNK, before, s, None), f"exported, {T} tokens")


def test_the_status_word_is_a_static_address_of_compiled_code(device, cache):
    """Every op writes the device's status word (where it records an out-of-range slot), so a compiled step
    takes it as an input it writes; inductor skips CUDA graphs (``mode="reduce-overhead"``), with a warning
    only, for a graph that writes an input not known to stay at one address. The status word is marked as a
    static address (as engines mark their KV buffers): the graph's placeholder for it carries the mark."""
    _, kv = cache
    status = _native.status_tensor(device)
    marks = []

    def backend(gm, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        marks.extend(n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
                     for n, x in zip(placeholders, example_inputs) if x is status)
        return gm.forward

    def step(slots, before):
        chunk = before.clone()
        ops.transfer(kv, ops.bind(CHUNK, chunk), slots)
        return chunk

    torch._dynamo.reset()
    fn = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
    fn(torch.arange(5, device=device), torch.zeros(2, L, 5, H * E, dtype=torch.bfloat16, device=device))
    assert marks and all(m in ("guarded", "unguarded") for m in marks), marks


def _reduce_overhead(step):
    """``step`` compiled as an engine compiles its step for CUDA graphs, the counters cleared."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch.compile(step, fullgraph=True, mode="reduce-overhead", dynamic=True)


def _assert_cuda_graphs_replayed():
    """Inductor recorded CUDA graphs and skipped none (it skips, with only a warning, a graph that mutates an
    input it does not know to be static: then nothing was captured at all)."""
    counters = torch._dynamo.utils.counters
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert counters["inductor"]["cudagraph_recorded_non_static_inputs"] > 0, dict(counters["inductor"])
    assert 1 <= counters["stats"]["unique_graphs"] <= 2


def _static_cache(rng, device):
    """A random cache (its reference value, its binding) whose tensors are static addresses to CUDA graphs
    (``mark_static_address``), as an engine's KV cache buffers are."""
    physical = S.random_cache(CACHE, GEOM, "bfloat16", rng)
    kv = ops.bind(CACHE, TC.to_torch(CACHE, physical, device))
    for t in kv.tensors:
        torch._dynamo.mark_static_address(t)
    return physical, kv


# sizes seen before replay their recorded graphs (cudagraph trees: the first call of a size warms up, the
# second records, the third replays)
REPLAYED_COUNTS = TOKEN_COUNTS + TOKEN_COUNTS[:3] * 2


def test_reduce_overhead_cuda_graphs_to_chunk(cuda_device):
    """mode="reduce-overhead" (inductor + CUDA graphs) with a dynamic token count, the way an engine offloads:
    the cache's tensors are static addresses, the chunk is the graph's own output;
    the captured op replays with each call's slots, results equal to the reference."""
    rng = np.random.default_rng(8)
    physical, kv = _static_cache(rng, cuda_device)

    def step(slots, before):
        chunk = before.clone()    # (an input the graph writes would make inductor skip CUDA graphs)
        ops.transfer(kv, ops.bind(CHUNK, chunk), slots)
        return chunk

    fn = _reduce_overhead(step)
    for T in REPLAYED_COUNTS:
        s = _rng_slots(rng, T)
        s[T // 2] = -1                                         # a token without a row: left as it was
        before = S.random_cache(CHUNK, _chunk_geometry(T), "bfloat16", rng)
        got = fn(torch.from_numpy(s).to(cuda_device), TC.to_torch(CHUNK, before, cuda_device)).clone()
        TC.sync(cuda_device)
        TC.assert_same_bytes(got, R.transfer(CACHE, physical, CHUNK, before, s, None), f"{T} tokens")
    _assert_cuda_graphs_replayed()


def test_reduce_overhead_cuda_graphs_from_chunk(cuda_device):
    """mode="reduce-overhead" with a dynamic token count, the way an engine loads: the graph writes the cache's
    tensors in place (static addresses), each call's chunk and slots are inputs; after every call the cache
    equals the reference's."""
    rng = np.random.default_rng(9)
    expected, kv = _static_cache(rng, cuda_device)

    def step(chunk, slots):
        ops.transfer(ops.bind(CHUNK, chunk), kv, None, slots)
        return slots + 0          # (an output, so that the graph is not empty of results)

    fn = _reduce_overhead(step)
    for T in REPLAYED_COUNTS:
        s = _rng_slots(rng, T)
        rows = S.random_cache(CHUNK, _chunk_geometry(T), "bfloat16", rng)
        fn(TC.to_torch(CHUNK, rows, cuda_device), torch.from_numpy(s).to(cuda_device))
        expected = R.transfer(CHUNK, rows, CACHE, expected, None, s)
        TC.sync(cuda_device)
        TC.assert_same_bytes(list(kv.tensors), list(expected), f"cache after {T} tokens")
    _assert_cuda_graphs_replayed()
