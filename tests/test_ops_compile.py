"""The public ops inside torch.compile and CUDA graphs.

* ``torch.library.opcheck`` on the native ops (``kvlayout::copy_rows`` and
  ``kvlayout::rope_reposition``): schema (mutations declared), fake tensors,
  AOT dispatch.
* Every public op called from a ``torch.compile(fullgraph=True)`` function
  gives the same bytes as eager; ``fullgraph=True`` fails on any graph break.
  Graph capture is what matters here, so most cases use the ``aot_eager``
  backend (dynamo + AOT autograd with functionalization of the mutating
  ops, no code generation); one case runs inductor.
* On CUDA every op is captured in a ``torch.cuda.CUDAGraph`` and replayed
  with new slot / position values written into the captured index tensors;
  the result matches eager.
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

G = Geometry(P=2, L=3, NB=6, BS=4, H=2, E=8)      # 24 slots, rows of 16 elements


def cache_tensors(layout, device, seed=0, geom=G, dtype="bfloat16"):
    return TC.to_torch(layout, S.random_cache(layout, geom, dtype, np.random.default_rng(seed)), device)


def clone(value):
    """A deep copy of a tensor / list / tuple of tensors."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    return type(value)(clone(v) for v in value)


def is_index(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in (torch.int32, torch.int64)


def leaves(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in leaves(v)]


# ---------------------------------------------------------------------------------------
# opcheck on the native ops
# ---------------------------------------------------------------------------------------

def copy_rows_samples(device):
    """Representative copy_rows arguments: pieces, identity slots, skip_prefix, int32/int64 slots."""
    samples = []
    pairs = [("vllm_flash_attn_hnd", "vllm_flashinfer_nhd", torch.int64, torch.int32, 0),   # pieces (heads apart)
             ("vllm_cross_layer", "hicache_page_first", torch.int32, torch.int64, 2),       # contiguous rows
             ("vllm_mla", "lmcache_kv_mla", torch.int64, None, 1)]                          # identity dst slots
    for src_layout, dst_layout, s_dtype, d_dtype, skip in pairs:
        planes = 1 if R.get(src_layout).is_mla else 2
        g = Geometry(P=planes, L=2, NB=3, BS=4, H=1 if planes == 1 else 2, E=16 if planes == 1 else 8)
        dg = g if d_dtype is not None else Geometry(P=1, L=2, NB=5, BS=1, H=1, E=16)
        src = ops.bind(src_layout, cache_tensors(src_layout, device, 1, g))
        dst = ops.bind(dst_layout, cache_tensors(dst_layout, device, 2, dg),
                       page_size=None if R.get(dst_layout).paged else dg.BS)
        ss = torch.tensor([3, 0, 11, -1, 7], dtype=s_dtype, device=device)
        ds = None if d_dtype is None else torch.tensor([1, 2, -1, 5, 10], dtype=d_dtype, device=device)
        for launch in ops.plan(src, dst, [0, 1], [1, 0], list(range(planes)), list(range(planes))):
            samples.append((launch.src_tensors, launch.dst_tensors, ss, ds, 5, skip, launch.src_segments,
                            launch.dst_segments, launch.src_geometry, launch.dst_geometry, launch.num_pieces,
                            launch.piece_bytes, 0, _native.status_tensor(device)))
    return samples


def test_opcheck_copy_rows(device):
    for args in copy_rows_samples(device):
        torch.library.opcheck(torch.ops.kvlayout.copy_rows.default, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_rope_reposition(device, dtype):
    keys = torch.randn(6, 2, 2, 32, device=device).to(dtype)[:, :, 0]     # strided K half
    old = torch.tensor([0, 5, -1, 9, 3, 1], device=device)
    new = torch.tensor([2, 1, 4, 0, -1, 8], dtype=torch.int32, device=device)
    cos_sin = torch.randn(10, 16, device=device)
    for is_neox in (True, False):
        torch.library.opcheck(torch.ops.kvlayout.rope_reposition.default,
                              (keys, old, new, cos_sin, is_neox, 0, _native.status_tensor(device)))


# ---------------------------------------------------------------------------------------
# torch.compile(fullgraph=True) of every public op
# ---------------------------------------------------------------------------------------

def slots_of(values, device, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=device)


def op_cases(device):
    """name -> (fn, mutable inputs, other inputs).  fn(*mutable, *other) calls one public op."""
    kv = cache_tensors("vllm_flash_attn_hnd", device, 1)
    pool = cache_tensors("hicache_page_first_direct", device, 2)
    sg_k, sg_v = cache_tensors("sglang_mha", device, 3)
    chunk = TC.to_torch("lmcache_kv_2ltd", S.random_cache("lmcache_kv_2ltd", Geometry(2, 3, 7, 1, 1, 16),
                                                          "bfloat16", np.random.default_rng(4)), device)
    rows = torch.randn(1, 2, 5, 2, 8, device=device).to(torch.bfloat16)
    s7 = slots_of([3, 22, -1, 9, 10, 11, 0], device)
    d7 = slots_of([0, 1, 2, 3, 4, 5, 23], device, torch.int32)
    s5 = slots_of([4, -1, 17, 2, 8], device)
    keys = torch.randn(7, 2, 2, 16, device=device)
    cos_sin = TC.tensor(np.random.default_rng(5).standard_normal((40, 12)).astype(np.float32), device)

    def transfer(kv, chunk, s):
        ops.transfer(ops.bind("vllm_flash_attn_hnd", kv), ops.bind("lmcache_kv_2ltd", chunk), s, None,
                     skip_prefix=1)

    def transfer_pool(kv, pool, s, d):
        ops.transfer(ops.bind("hicache_page_first_direct", pool), ops.bind("vllm_flash_attn_hnd", kv), d, s,
                     src_layers=[2, 0], dst_layers=[0, 1])

    def gather(kv, s):
        return ops.gather(ops.bind("vllm_flash_attn_hnd", kv), s, planes=[1])

    def scatter(k, v, rows, s):
        ops.scatter(ops.bind("sglang_mha", (k, v), page_size=4), rows, s, layers=[1, 2], planes=[0])

    def move(k, v, s, d):
        ops.move(ops.bind("sglang_mha", (k, v)), s, d)

    def skip_prefix(s):
        return ops.skip_prefix(s, 2)

    def get_page(pool):
        return ops.get_page(ops.bind("hicache_page_first_direct", pool), 4)

    def set_page(pool, flat):
        ops.set_page(ops.bind("hicache_page_first_direct", pool), 1, flat)

    def zero_page(pool):
        ops.zero_page(ops.bind("hicache_page_first_direct", pool), 5)

    def rope(keys, old, new, cos_sin):
        ops.rope_reposition(keys[:, :, 1], old, new, cos_sin, is_neox=False)

    flat = torch.randn(2 * 3 * 4 * 2 * 8, device=device).to(torch.bfloat16)
    return {
        "transfer": (transfer, (kv, chunk), (s7,)),
        "transfer_layers": (transfer_pool, (kv,), (pool, slots_of([5, 6, 7, 8, 9, 10, 11], device), s7)),
        "gather": (gather, (), (kv, s7)),
        "scatter": (scatter, (sg_k, sg_v), (rows, s5)),
        "move": (move, (sg_k, sg_v), (slots_of(list(range(3, 15)), device), slots_of(list(range(5, 17)), device))),
        "skip_prefix": (skip_prefix, (), (s7,)),
        "get_page": (get_page, (), (pool,)),
        "set_page": (set_page, (pool,), (flat,)),
        "zero_page": (zero_page, (pool,), ()),
        "rope_reposition": (rope, (keys,), (s7, d7, cos_sin)),
    }


OPS = ["transfer", "transfer_layers", "gather", "scatter", "move", "skip_prefix", "get_page", "set_page", "zero_page",
       "rope_reposition"]


def run_compiled_against_eager(device, name, backend):
    fn, mutable, other = op_cases(device)[name]
    eager_in, compiled_in = clone(mutable), clone(mutable)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    got = compiled(*compiled_in, *other)         # compiled first: it may be the process's first kvlayout call
    want = fn(*eager_in, *other)
    assert_same_results(device, compiled_in, got, eager_in, want)
    return compiled, fn, mutable, other


def assert_same_results(device, compiled_in, got, eager_in, want) -> None:
    """The compiled call wrote the same bytes into its inputs and returned the same bytes as eager."""
    TC.sync(device)
    for g, w in zip(leaves(compiled_in), leaves(eager_in)):
        np.testing.assert_array_equal(TC.bits(g), TC.bits(w))
    if want is not None:
        np.testing.assert_array_equal(TC.bits(got), TC.bits(want))


@pytest.mark.parametrize("name", OPS)
def test_compile_fullgraph(device, name):
    compiled, fn, mutable, other = run_compiled_against_eager(device, name, "aot_eager")
    if name in ("rope_reposition", "skip_prefix", "get_page", "zero_page"):
        return
    # a second call with other slot values reuses the graph and still matches eager
    other = tuple(torch.flip(x, [0]) if is_index(x) else x for x in other)
    eager_in, compiled_in = clone(mutable), clone(mutable)
    want = fn(*eager_in, *other)
    got = compiled(*compiled_in, *other)
    assert_same_results(device, compiled_in, got, eager_in, want)


def at_tokens(name, mutable, other, T):
    """The op case with its first T tokens: slots, chunk / rows / keys cut to T (fresh tensors)."""
    def cut(x, dim):
        return x.narrow(dim, 0, T).clone()
    mutable = [cut(x, 2) if name == "transfer" and i == 1 else cut(x, 0) if name == "rope_reposition" and i == 0
               else clone(x) for i, x in enumerate(mutable)]
    other = [x[:T] if is_index(x) else cut(x, 2) if name == "scatter" and i == 0 else x
             for i, x in enumerate(other)]
    return mutable, other


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic"])
@pytest.mark.parametrize("name", OPS)
def test_compile_with_changing_token_count(device, name, dynamic):
    """A compiled step sees another number of tokens each call: with dynamic=True (symbolic sizes
    from the start) and with automatic dynamic shapes (recompiled once, symbolic), every op
    traces without a graph break and matches eager."""
    fn, mutable, other = op_cases(device)[name]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for T in (2, 4, 5):
        eager_in, eager_other = at_tokens(name, mutable, other, T)
        compiled_in, compiled_other = at_tokens(name, mutable, other, T)
        want = fn(*eager_in, *eager_other)
        got = compiled(*compiled_in, *compiled_other)
        assert_same_results(device, compiled_in, got, eager_in, want)


def test_compile_before_any_eager_call(device):
    """The first kvlayout call of a process may be inside the compiled region (status tensor created there)."""
    key = _native._normalize_device(device)
    saved = _native._status.pop(key, None)
    try:
        run_compiled_against_eager(device, "transfer", "aot_eager")
        assert isinstance(_native._status.get(key), torch.Tensor)
    finally:
        if saved is not None:
            _native._status[key] = saved


def test_compile_inductor(device):
    run_compiled_against_eager(device, "transfer_layers", "inductor")


def test_compile_with_prebound_caches(device):
    """Caches bound once outside (as an engine does), the compiled step only passes slots."""
    kv = ops.bind("vllm_flash_attn_hnd", cache_tensors("vllm_flash_attn_hnd", device, 1))
    pool = ops.bind("hicache_page_first", cache_tensors("hicache_page_first", device, 2), page_size=4)

    def offload(s, d):
        ops.transfer(kv, pool, s, d)

    s = slots_of([0, 1, 2, 3, 9, -1], device)
    d = slots_of([20, 21, 22, 23, 4, 5], device)
    want = pool.tensors[0].clone()
    ops.transfer(kv, ops.bind("hicache_page_first", want, page_size=4), s, d)
    torch._dynamo.reset()
    torch.compile(offload, fullgraph=True, backend="aot_eager")(s, d)
    TC.sync(device)
    np.testing.assert_array_equal(TC.bits(pool.tensors[0]), TC.bits(want))


# ---------------------------------------------------------------------------------------
# CUDA graphs: capture, write new indices, replay
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", OPS)
def test_cuda_graph_replay(cuda_device, name):
    fn, mutable, other = op_cases(cuda_device)[name]
    index_inputs = [x for x in other if is_index(x)]
    # warm up on a side stream (creates the status tensor, loads kernels), then capture
    warm = clone(mutable)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*warm, *other)
    torch.cuda.current_stream().wait_stream(stream)
    captured_in = clone(mutable)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_out = fn(*captured_in, *other)
    torch.cuda.synchronize()
    rng = np.random.default_rng(12)
    for _ in range(3):
        for x in index_inputs:          # new values into the captured index tensors
            x.copy_(x[torch.from_numpy(rng.permutation(x.numel())).to(x.device)])
        start = clone(captured_in)
        graph.replay()
        eager_in = clone(start)
        want = fn(*eager_in, *other)
        TC.sync(cuda_device)
        for g, w in zip(leaves(captured_in), leaves(eager_in)):
            np.testing.assert_array_equal(TC.bits(g), TC.bits(w))
        if want is not None:
            np.testing.assert_array_equal(TC.bits(captured_out), TC.bits(want))
