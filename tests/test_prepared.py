"""Prepared transfers (``ops.prepare``) and copy programs against the reference, on every device.

A prepared transfer must move exactly the bytes ``ops.transfer`` (and the
reference) moves, whether called for all layers at once or layer by layer
(the generated samples of the case database's ``prepared`` family, run by
``test_families.py`` and ``kvlayout conformance``).  Here: swap its slots;
refuse tensors that changed under it; keep autograd's rules; and work inside
``torch.compile(fullgraph=True)`` and CUDA graphs.
"""

from __future__ import annotations

import functools
import gc
import importlib
import weakref

import numpy as np
import pytest
import torch

from kvlayout import ops
from kvlayout import reference as R
from kvlayout.conformance import strategies as S
from kvlayout.reference import Geometry

import torch_cases as TC
from test_ops import bind_np


def _pair(device, L=3, NB=4, BS=4, H=2, E=8, seed=0):
    """A vLLM-style paged source with random bytes and a zeroed LMCache chunk destination."""
    g = Geometry(P=2, L=L, NB=NB, BS=BS, H=H, E=E)
    rng = np.random.default_rng(seed)
    src_np = S.random_cache("vllm_flash_attn_nhd", g, "float16", rng)
    src = bind_np("vllm_flash_attn_nhd", src_np, g, device)
    chunk = torch.zeros(2, L, 6, H * E, dtype=torch.float16, device=device)
    return g, src_np, src, ops.bind("lmcache_kv_2ltd", chunk)


def _want_rows(src_np, g, slots, layers=None):
    """[2, L', T, H*E] rows of the numpy source at ``slots`` (reference gather)."""
    rows = np.asarray(R.gather("vllm_flash_attn_nhd", src_np, np.asarray(slots), layers=layers))
    return rows.reshape(rows.shape[0], rows.shape[1], rows.shape[2], -1)


def test_set_slots_swaps_the_next_calls_slots(device):
    g, src_np, src, dst = _pair(device)
    t = ops.prepare(src, dst, TC.slots([0, 5, 9], device=device))
    t.set_slots(TC.slots([15, 1, 2, 3, 4, 6], device=device))
    assert t.num_tokens == 6
    t()
    TC.sync(device)
    assert np.array_equal(TC.bits(dst.tensors[0]), _want_rows(src_np, g, [15, 1, 2, 3, 4, 6]).view(np.uint16))


def test_layer_call_writes_only_its_layer(device):
    g, src_np, src, dst = _pair(device)
    t = ops.prepare(src, dst, TC.slots([3, 2, 1, 0, 7, 8], device=device), src_layers=[2, 0], dst_layers=[0, 1])
    t.layer(1)                                     # source layer 0 -> destination layer 1 only
    TC.sync(device)
    got = TC.bits(dst.tensors[0])
    want = _want_rows(src_np, g, [3, 2, 1, 0, 7, 8], layers=[0]).view(np.uint16)
    assert np.array_equal(got[:, 1], want[:, 0])
    assert not got[:, 0].any() and not got[:, 2].any()
    with pytest.raises(IndexError, match=r"layer = 2 is out of range: the transfer copies 2 layers"):
        t.layer(2)
    with pytest.raises(TypeError, match="layer must be an integer"):
        t.layer(0.0)


def test_a_resized_or_reset_tensor_is_refused(device):
    _, _, src, dst = _pair(device)
    t = ops.prepare(src, dst, TC.slots([0, 1], device=device))
    t()
    dst.tensors[0].resize_(4 * dst.tensors[0].numel())            # new, larger storage
    with pytest.raises(RuntimeError, match="destination tensor 0 was resized, re-set or freed"):
        t()
    _, _, src, dst = _pair(device)
    t = ops.prepare(src, dst, TC.slots([0, 1], device=device))
    src.tensors[1].set_(torch.zeros_like(src.tensors[1]))
    t.layer(0)                                     # layer 0 reads source tensor 0 only
    with pytest.raises(RuntimeError, match="source tensor 1 was resized, re-set or freed"):
        t.layer(1)
    with pytest.raises(RuntimeError, match="source tensor 1 was resized, re-set or freed"):
        t()


def test_the_prepared_transfer_keeps_its_tensors_alive(device):
    g, src_np, src, dst = _pair(device)
    out = dst.tensors[0]
    t = ops.prepare(src, dst, TC.slots([4, 3], device=device))
    del src, dst
    gc.collect()
    t()
    TC.sync(device)
    assert np.array_equal(TC.bits(out)[:, :, :2], _want_rows(src_np, g, [4, 3]).view(np.uint16))


def test_the_layer_calls_runner_keeps_its_binding_and_raises_what_run_raises(device):
    """t.layer(i) and t() call the native binding's run(step) as a builtin function bound to it (no pybind11
    dispatch on the hot path): the function keeps the binding (and its tensors) alive on its own, and a bad
    step raises the exception and message of the bound method."""
    g, src_np, src, dst = _pair(device)
    out = dst.tensors[0]
    t = ops.prepare(src, dst, TC.slots([4, 3], device=device))
    native = t._native
    runner = native.runner()
    for step in (99, -1):
        with pytest.raises(IndexError) as by_method:
            native.run(step)
        with pytest.raises(IndexError) as by_runner:
            runner(step)
        assert str(by_runner.value) == str(by_method.value)
    with pytest.raises(TypeError):
        runner("1")
    del t, native, src, dst
    gc.collect()
    runner(0)
    TC.sync(device)
    assert np.array_equal(TC.bits(out)[:, :, :2], _want_rows(src_np, g, [4, 3]).view(np.uint16))


def test_the_checker_serves_and_refuses_the_calls_run_checking_does(device):
    """A repeated ops.transfer calls its binding's run_checking as a builtin function (``checker()``, no
    pybind11 dispatch): the same calls served (True), the same left to the long way (False), the same errors
    (an out-of-range slot on the CPU), and positional arguments only."""
    g, src_np, src, dst = _pair(device)
    arguments = importlib.import_module("kvlayout.ops.arguments")
    for slots in ([1, 2], [4, 3]):
        ops.transfer(src, dst, TC.slots(slots, device=device))
    native = arguments.checked_choice(src, dst, None, None, None, None, 0, "kernel").bound
    checker = native.checker()

    def outcome(fn, *args):
        try:
            return fn(*args)
        except Exception as e:   # (the error itself is the outcome compared)
            return type(e), str(e)

    calls = [(0, TC.slots([5, 6], device=device), None, 0, 0, False),   # served
             (0, [5, 6], None, 0, 0, False),                               # not a tensor: the long way
             (0, TC.slots([5, 6], device=device), None, 3, 0, False),     # skip_prefix past T: the long way
             (9, TC.slots([5, 6], device=device), None, 0, 0, False)]     # no such step: the long way
    if torch.device(device).type == "cpu":
        calls.append((0, TC.slots([5, 10 ** 6], device=device), None, 0, 0, False))   # raises IndexError
    for args in calls:
        assert outcome(checker, *args) == outcome(native.run_checking, *args), args
    assert checker(*calls[0]) is True
    TC.sync(device)
    assert np.array_equal(TC.bits(dst.tensors[0])[:, :, :2], _want_rows(src_np, g, [5, 6]).view(np.uint16))
    with pytest.raises(TypeError, match="6 positional arguments"):
        checker(0, calls[0][1])


def test_out_of_range_slots(device):
    _, _, src, dst = _pair(device)
    before = TC.snapshot(dst.tensors)
    t = ops.prepare(src, dst, TC.slots([0, 99], device=device))
    if device == "cpu":
        with pytest.raises(IndexError, match=r"src_slots\[1\] = 99 is out of range: the source holds 16 slots"):
            t.layer(0)
        TC.assert_unchanged(dst.tensors, before)
    else:
        t.layer(0)
        torch.cuda.synchronize()
        with pytest.raises(IndexError, match=r"src_slots\[1\] = 99 is out of range"):
            ops.check_errors()
    with pytest.raises(IndexError, match=r"src_slots\[1\] = 99 is out of range"):
        ops.prepare(src, dst, TC.slots([0, 99], device=device), validate=True).layer(0)


def test_set_slots_checks_like_transfer(device):
    _, _, src, dst = _pair(device)
    t = ops.prepare(src, dst, TC.slots([0, 1], device=device))
    with pytest.raises(TypeError, match="src_slots must be int32 or int64"):
        t.set_slots(torch.zeros(2, dtype=torch.float32, device=device))
    with pytest.raises(IndexError, match="positions exceed the destination's 6 slots"):
        t.set_slots(None, num_tokens=7)
    with pytest.raises(ValueError, match="overlaps dst"):
        t.set_slots(dst.tensors[0].view(-1)[:4].view(torch.int64))   # slots inside the destination
        t()


def test_version_counter_and_leaf_rules(device):
    _, _, src, dst = _pair(device)
    t = ops.prepare(src, dst, TC.slots([0, 1], device=device))
    v = dst.tensors[0]._version
    t()
    assert dst.tensors[0]._version > v
    dst.tensors[0].requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"dst\[0\] is a leaf tensor that requires grad"):
        t()
    with torch.no_grad():
        t()


def test_copy_engine_prepared(device):
    g, src_np, src, dst = _pair(device)
    t = ops.prepare(src, dst, torch.tensor([7, 6, 5]), engine="copy")
    for i in range(t.num_layers):
        t.layer(i)
    TC.sync(device)
    assert np.array_equal(TC.bits(dst.tensors[0])[:, :, :3], _want_rows(src_np, g, [7, 6, 5]).view(np.uint16))


def test_prepared_layer_calls_compile_fullgraph(device):
    g, src_np, src, dst = _pair(device)
    slots = TC.slots([9, 8, 7, 1], device=device)
    t = ops.prepare(src, dst, slots)

    @torch.compile(fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    def step(x):
        for i in range(t.num_layers):
            t.layer(i)
        return x + 1

    step(torch.zeros(1, device=device))
    TC.sync(device)
    assert np.array_equal(TC.bits(dst.tensors[0])[:, :, :4], _want_rows(src_np, g, [9, 8, 7, 1]).view(np.uint16))


def test_copy_program_op_opcheck(device):
    from kvlayout.ops import _native, programs
    _, _, src, dst = _pair(device)
    handle = programs.program_handle(programs.program_key(src, dst, [0, 1, 2], [0, 1, 2], [0, 1], [0, 1]))
    args = (handle, list(src.tensors), list(dst.tensors), TC.slots([1, 2], device=device), None, 2, 2, 0, 0,
            _native.status_tensor(device), False)
    torch.library.opcheck(torch.ops.kvlayout.copy_program, args)


def test_copy_program_refuses_a_foreign_tensor_list(device):
    from kvlayout.ops import _native, programs
    _, _, src, dst = _pair(device)
    handle = programs.program_handle(programs.program_key(src, dst, [0, 1, 2], [0, 1, 2], [0, 1], [0, 1]))
    small = torch.zeros(2, 2, 2, 16, dtype=torch.float16, device=device)   # two layers: the program writes three
    with pytest.raises(RuntimeError, match="addresses bytes up to"):
        torch.ops.kvlayout.copy_program(handle, list(src.tensors), [small], None, None, 0, 2, 0, 0,
                                        _native.status_tensor(device), False)
    with pytest.raises(ValueError, match="destination of 1 tensors, got 2"):
        torch.ops.kvlayout.copy_program(handle, list(src.tensors), [small, small], None, None, 0, 2, 0, 0,
                                        _native.status_tensor(device), False)
    with pytest.raises(IndexError, match="no copy program has handle"):
        torch.ops.kvlayout.copy_program(1 << 40, list(src.tensors), list(dst.tensors), None, None, 0, 2, 0, 0,
                                        _native.status_tensor(device), False)


def test_transfer_rebinds_when_a_cache_moves(device):
    """ops.transfer's C++ binding cache is keyed by address: new tensors of the same shapes are new bindings."""
    for seed in range(3):
        g, src_np, src, dst = _pair(device, seed=seed)
        ops.transfer(src, dst, TC.slots([1, 2, 3], device=device))
        TC.sync(device)
        assert np.array_equal(TC.bits(dst.tensors[0])[:, :, :3], _want_rows(src_np, g, [1, 2, 3]).view(np.uint16))


def test_repeated_transfer_keeps_its_binding_and_rebinds_a_moved_tensor(device):
    """A repeated ops.transfer on the same caches runs from a binding kept with its checked choice; a
    destination tensor re-set to new storage is written there (the binding is made again), not where the
    memory used to be."""
    g, src_np, src, dst = _pair(device)
    arguments = importlib.import_module("kvlayout.ops.arguments")
    for slots in ([1, 2, 3], [4, 5, 6]):
        ops.transfer(src, dst, TC.slots(slots, device=device))
    choice = arguments.checked_choice(src, dst, None, None, None, None, 0, "kernel")
    assert choice.bound is not None                     # the second call bound the program
    old = dst.tensors[0]
    kept = old.clone()
    moved = torch.zeros_like(old)
    old_storage = torch.empty(0, dtype=old.dtype, device=old.device).set_(old.untyped_storage())
    old.set_(moved.untyped_storage(), 0, moved.shape, moved.stride())   # same tensor object, new storage
    ops.transfer(src, dst, TC.slots([7, 8, 9], device=device))
    TC.sync(device)
    assert np.array_equal(TC.bits(old)[:, :, :3], _want_rows(src_np, g, [7, 8, 9]).view(np.uint16))
    assert np.array_equal(TC.bits(old_storage.view(kept.shape)), TC.bits(kept))   # the old storage: as it was


def _error_of(call):
    try:
        call()
    except Exception as exc:   # noqa: BLE001 - the exception itself is what is compared
        return type(exc), str(exc)
    return None


def test_a_repeated_transfer_checks_its_slots_as_a_first_call_does(device):
    """A repeated call checks its slots in C++ (the common case) and leaves anything else to the full
    checks: every bad slot argument gets the error a first call gets; lists and shorter calls still work."""
    dev = torch.device(device)
    bad = {"float slots": dict(src_slots=torch.ones(3, device=dev)),
           "2-D slots": dict(src_slots=torch.zeros(1, 3, dtype=torch.int64, device=dev)),
           "lengths differ": dict(src_slots=TC.slots([1, 2, 3], device=device),
                                  dst_slots=TC.slots([0, 1], device=device)),
           "skip beyond T": dict(src_slots=TC.slots([1, 2, 3], device=device), skip_prefix=4),
           "more tokens than chunk positions": dict(src_slots=TC.slots(list(range(7)), device=device)),
           "negative skip": dict(src_slots=TC.slots([1, 2, 3], device=device), skip_prefix=-1)}
    for name, kwargs in bad.items():
        _, _, src, fresh = _pair(device)
        # (planes named: the long way, which checks every argument in Python)
        long_way = _error_of(lambda: ops.transfer(src, fresh, src_planes=[0, 1], dst_planes=[0, 1], **kwargs))
        assert long_way is not None, name
        for budget in (0, 4):
            _, _, src, fresh = _pair(device)      # a new pair of known shapes: its first call checks in C++
            assert _error_of(lambda: ops.transfer(src, fresh, max_ctas=budget, **kwargs)) == long_way, (name, budget)
            _, _, src, dst = _pair(device)
            for _ in range(3):
                ops.transfer(src, dst, TC.slots([4, 5], device=device), max_ctas=budget)
            assert _error_of(lambda: ops.transfer(src, dst, max_ctas=budget, **kwargs)) == long_way, (name, budget)
    g, src_np, src, dst = _pair(device)
    for slots in ([1, 2, 3], [4, 5, 6], [9, 8]):                   # the last two from the kept binding
        ops.transfer(src, dst, TC.slots(slots, device=device))
    ops.transfer(src, dst, [10, 11, 12], skip_prefix=1)              # a list: converted by the full checks
    TC.sync(device)
    want = _want_rows(src_np, g, [9, 11, 12]).view(np.uint16)
    assert np.array_equal(TC.bits(dst.tensors[0])[:, :, :3], want)


def test_calls_under_an_sm_budget_keep_their_binding_too(device):
    """A repeated call under an SM budget (SGLang's block_quota) runs from the binding its pair keeps, as a call
    without one does, and every call writes exactly its rows."""
    g, src_np, src, dst = _pair(device)
    arguments = importlib.import_module("kvlayout.ops.arguments")
    for slots in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        dst.tensors[0].zero_()
        ops.transfer(src, dst, TC.slots(slots, device=device), max_ctas=4)
        TC.sync(device)
        assert np.array_equal(TC.bits(dst.tensors[0])[:, :, :3], _want_rows(src_np, g, slots).view(np.uint16))
        assert not TC.bits(dst.tensors[0])[:, :, 3:].any()
    assert arguments.checked_choice(src, dst, None, None, None, None, 4, "auto").bound is not None


def test_a_kept_binding_lets_the_destination_go(device):
    """The binding holds the destination's tensors; it is dropped with the destination cache, so a
    long-lived source does not keep every destination it was copied to alive."""
    _, _, src, dst = _pair(device)
    for _ in range(2):
        ops.transfer(src, dst, TC.slots([0, 1], device=device))
    gone = weakref.ref(dst.tensors[0])
    del dst
    gc.collect()
    assert gone() is None


def test_a_kept_binding_still_honours_dispatch_modes(device):
    """Under a TorchDispatchMode, a call with a kept binding goes through the dispatcher (the mode sees it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Seen.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    _, _, src, dst = _pair(device)
    slots = TC.slots([0, 1], device=device)
    for _ in range(2):
        ops.transfer(src, dst, slots)
    with Seen():
        ops.transfer(src, dst, slots)
    assert any("kvlayout.copy_program" in op for op in Seen.ops)


# ---------------------------------------------------------------------------------------
# CUDA: dependent launches, graph capture and replay with new slots
# ---------------------------------------------------------------------------------------

def test_dependent_launch_waits_for_the_previous_kernel(cuda_device):
    """Each layer call starts early but must still see what the kernel before it wrote."""
    L = 8
    g, _, src, dst = _pair(cuda_device, L=L, NB=64, BS=16, H=8, E=128)
    slots = torch.randperm(g.N, device=cuda_device)[:6]
    t = ops.prepare(src, dst, slots, dependent_launch=True)
    for round_ in range(3):
        for i in range(L):
            src.tensors[i].fill_(float(round_ * L + i))          # the kernel right before the copy
            t.layer(i)
        torch.cuda.synchronize()
        got = dst.tensors[0].float()
        for i in range(L):
            assert bool((got[:, i] == float(round_ * L + i)).all()), f"layer {i}, round {round_}"


def test_cuda_graph_of_a_step_replays_with_new_slots(cuda_device):
    g, src_np, src, dst = _pair(cuda_device, L=4)
    slots = torch.full((6,), -1, dtype=torch.int64, device=cuda_device)     # capacity 6, unused = -1
    t = ops.prepare(src, dst, slots)
    t()                                                                    # warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        for i in range(t.num_layers):
            t.layer(i)
    for values in ([3, 1, 4, 15, 9, 2], [7, 11, 14, -1, -1, -1]):
        dst.tensors[0].zero_()
        slots.copy_(torch.tensor(values))
        graph.replay()
        torch.cuda.synchronize()
        n = sum(v >= 0 for v in values)
        assert np.array_equal(TC.bits(dst.tensors[0])[:, :, :n], _want_rows(src_np, g, values[:n]).view(np.uint16))
        assert not TC.bits(dst.tensors[0])[:, :, n:].any()
    ops.check_errors()


# ---------------------------------------------------------------------------------------
# CUDA: early loads of layer calls captured in a graph
# ---------------------------------------------------------------------------------------

def _host_chunk_pair(cuda_device, L=6, seed=1):
    """A random vLLM-style device cache and a zeroed pinned LMCache chunk of 256 tokens (layer calls over PCIe)."""
    g = Geometry(P=2, L=L, NB=64, BS=16, H=2, E=64)
    src_np = S.random_cache("vllm_flash_attn_nhd", g, "float16", np.random.default_rng(seed))
    cache = bind_np("vllm_flash_attn_nhd", src_np, g, cuda_device)
    chunk = torch.zeros(2, L, 256, g.H * g.E, dtype=torch.float16).pin_memory()
    return g, src_np, cache, ops.bind("lmcache_kv_2ltd", chunk)


def _capture(calls) -> torch.cuda.CUDAGraph:
    """``calls`` captured once (on a side stream, as capture requires); returns the graph."""
    for call in calls:
        call()                                    # warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream()), torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def test_captured_layer_calls_load_early_after_their_sibling(cuda_device):
    """In a graph, each layer call after the first may load before the previous one ends (it writes
    nothing the next reads); every replay still moves exactly the reference bytes, with new slots."""
    from kvlayout import _C

    g, src_np, cache, chunk = _host_chunk_pair(cuda_device)
    slots = torch.full((256,), -1, dtype=torch.int64, device=cuda_device)
    store = ops.prepare(cache, chunk, slots)                        # device cache -> pinned chunk
    back = bind_np("vllm_flash_attn_nhd", np.zeros_like(src_np), g, cuda_device)
    load = ops.prepare(chunk, back, None, slots)                    # pinned chunk -> another device cache
    before = _C.early_load_launches()
    stores = _capture([functools.partial(store.layer, i) for i in range(g.L)])
    assert _C.early_load_launches() - before == g.L - 1, "every store after the first follows its sibling"
    before = _C.early_load_launches()
    loads = _capture([functools.partial(load.layer, i) for i in range(g.L)])
    assert _C.early_load_launches() - before == g.L - 1, "every load after the first follows its sibling"
    rng = np.random.default_rng(3)
    for _ in range(2):
        values = rng.permutation(g.N)[:256]
        slots.copy_(torch.from_numpy(values))
        stores.replay()
        loads.replay()
        torch.cuda.synchronize()
        assert np.array_equal(TC.bits(chunk.tensors[0]), _want_rows(src_np, g, values).view(np.uint16))
        _assert_same_rows(back, cache, values)
    ops.check_errors()


def _assert_same_rows(a, b, slots):
    """The rows of two vLLM-style caches at ``slots`` hold the same bytes, in every layer."""
    for x, y in zip(a.tensors, b.tensors):           # [2, NB, BS, H, E] per layer
        idx = torch.as_tensor(slots, device=x.device)
        assert torch.equal(x.flatten(1, 2)[:, idx].view(torch.int16), y.flatten(1, 2)[:, idx].view(torch.int16))


def test_captured_launch_waits_when_its_predecessor_writes_what_it_reads(cuda_device):
    """A layer load right after the store that fills its chunk, or after another kernel on the stream,
    is not an early-loads launch; the replay moves exactly the reference bytes."""
    from kvlayout import _C

    g, src_np, cache, chunk = _host_chunk_pair(cuda_device, L=3)
    values = np.random.default_rng(4).permutation(g.N)[:256]
    slots = torch.from_numpy(values).to(cuda_device)
    back = bind_np("vllm_flash_attn_nhd", np.zeros_like(src_np), g, cuda_device)
    store, load = ops.prepare(cache, chunk, slots), ops.prepare(chunk, back, None, slots)
    other = torch.zeros(8, device=cuda_device)
    calls = []
    for i in range(g.L):
        calls += [functools.partial(store.layer, i), functools.partial(load.layer, i),
                  functools.partial(other.add_, 1.0)]
    before = _C.early_load_launches()
    graph = _capture(calls)
    assert _C.early_load_launches() == before, "each load reads its store's writes; each store follows add_"
    chunk.tensors[0].zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert np.array_equal(TC.bits(chunk.tensors[0]), _want_rows(src_np, g, values).view(np.uint16))
    _assert_same_rows(back, cache, values)


def test_eager_layer_calls_without_the_promise_never_load_early(cuda_device):
    from kvlayout import _C

    g, _, cache, chunk = _host_chunk_pair(cuda_device, L=4)
    t = ops.prepare(cache, chunk, torch.arange(256, device=cuda_device))
    before = _C.early_load_launches()
    for i in range(g.L):
        t.layer(i)
    torch.cuda.synchronize()
    assert _C.early_load_launches() == before


def _promised_stream():
    """A side stream that runs only what the test puts on it (after the current stream's work)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return stream


def test_promised_stream_layer_calls_load_early_outside_capture(cuda_device):
    """early_loads=True: on a stream that runs only these calls, each layer call after its sibling loads
    early without a graph; a load right after the store that fills its chunk does not; the bytes are exact."""
    from kvlayout import _C

    g, src_np, cache, chunk = _host_chunk_pair(cuda_device)
    values = np.random.default_rng(5).permutation(g.N)[:256]
    slots = torch.from_numpy(values).to(cuda_device)
    back = bind_np("vllm_flash_attn_nhd", np.zeros_like(src_np), g, cuda_device)
    store = ops.prepare(cache, chunk, slots, early_loads=True)
    load = ops.prepare(chunk, back, None, slots, early_loads=True)
    with torch.cuda.stream(_promised_stream()):
        store.layer(0)                                  # (whatever ran on this stream before: not counted)
        before = _C.early_load_launches()
        for i in range(1, g.L):
            store.layer(i)
        assert _C.early_load_launches() - before == g.L - 1, "every store after its sibling"
        before = _C.early_load_launches()
        for i in range(g.L):
            load.layer(i)
        assert _C.early_load_launches() - before == g.L - 1, "every load but the first, which reads the stores"
    torch.cuda.synchronize()
    assert np.array_equal(TC.bits(chunk.tensors[0]), _want_rows(src_np, g, values).view(np.uint16))
    _assert_same_rows(back, cache, values)
    ops.check_errors()


def test_promised_early_load_waits_for_every_launch_that_may_still_run(cuda_device):
    """An early-loads layer call lets the next one start at once, so a launch may overlap the few before
    it: a load reading what the launch two back writes (the one just before writes elsewhere) does not
    load early; every byte lands as the reference says."""
    from kvlayout import _C

    g, src_np, cache, chunk = _host_chunk_pair(cuda_device, L=2)
    values = np.random.default_rng(6).permutation(g.N)[:256]
    slots = torch.from_numpy(values).to(cuda_device)
    want = _want_rows(src_np, g, values)
    other = ops.bind("lmcache_kv_2ltd", torch.from_numpy(np.ascontiguousarray(want)).pin_memory())
    back = bind_np("vllm_flash_attn_nhd", np.zeros_like(src_np), g, cuda_device)
    back_other = bind_np("vllm_flash_attn_nhd", np.zeros_like(src_np), g, cuda_device)
    store = ops.prepare(cache, chunk, slots, early_loads=True)
    load = ops.prepare(chunk, back, None, slots, early_loads=True)
    load_other = ops.prepare(other, back_other, None, slots, early_loads=True)
    with torch.cuda.stream(_promised_stream()):
        store.layer(0)
        before = _C.early_load_launches()
        store.layer(1)              # follows store.layer(0), writes nothing it reads
        load_other.layer(0)         # reads `other`, which no launch that may still run writes
        assert _C.early_load_launches() - before == 2
        before = _C.early_load_launches()
        load.layer(0)               # reads the chunk store.layer(1), two launches back, may still write
        assert _C.early_load_launches() == before
        load.layer(1)
        load_other.layer(1)
    torch.cuda.synchronize()
    assert np.array_equal(TC.bits(chunk.tensors[0]), want.view(np.uint16))
    _assert_same_rows(back, cache, values)
    _assert_same_rows(back_other, cache, values)
    ops.check_errors()


def test_promised_early_load_after_a_plain_transfer_sees_its_writes(cuda_device):
    """A plain ops.transfer between promised layer calls is an ordinary kernel to them: the next
    early-loads call starts only after it ends, so it loads all that transfer wrote (one CTA writing a
    token at a time, while an early start would already be loading)."""
    from kvlayout import _C

    g, src_np, cache, chunk = _host_chunk_pair(cuda_device, L=2)
    values = np.random.default_rng(7).permutation(g.N)[:256]
    slots = torch.from_numpy(values).to(cuda_device)
    filled = ops.bind("lmcache_kv_2ltd", torch.zeros_like(chunk.tensors[0]).pin_memory())
    back = bind_np("vllm_flash_attn_nhd", np.zeros_like(src_np), g, cuda_device)
    store = ops.prepare(cache, chunk, slots, early_loads=True)
    load = ops.prepare(filled, back, None, slots, early_loads=True)
    with torch.cuda.stream(_promised_stream()):
        store.layer(0)                                    # the stream's last recorded launch
        ops.transfer(cache, filled, slots, max_ctas=1)    # not recorded: it writes `filled` slowly
        before = _C.early_load_launches()
        load.layer(0)
        load.layer(1)
        assert _C.early_load_launches() - before == 2, "both follow a launch that writes nothing they read"
    torch.cuda.synchronize()
    _assert_same_rows(back, cache, values)
    ops.check_errors()


def test_early_loads_need_dependent_launch(device):
    _, _, src, dst = _pair(device)
    with pytest.raises(ValueError, match="early_loads=True needs dependent_launch=True"):
        ops.prepare(src, dst, TC.slots([1, 2], device=device), dependent_launch=False, early_loads=True)
