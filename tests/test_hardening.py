"""Hostile input: aliasing, racing slot tensors, leaks, weak arguments, autograd.

Every case here is something a caller can do with public tensors and ops;
the op library must either do the documented copy or raise a clear
exception naming the argument, and never touch memory it was not given.
"""

from __future__ import annotations

import copy
import gc
import re
import threading
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlayout import ops
from kvlayout import reference as R
from kvlayout.conformance import strategies as S
from kvlayout.ops import _native
from kvlayout.reference import Geometry

import reference_oracles as O
import torch_cases as TC

G = Geometry(P=2, L=2, NB=4, BS=4, H=2, E=8)        # 16 slots, rows of 16 elements


def make_cache(layout, device, dtype="float16", geom=G, seed=0) -> ops.KVCache:
    physical = S.random_cache(layout, geom, dtype, np.random.default_rng(seed))
    return ops.bind(layout, TC.to_torch(layout, physical, device),
                    page_size=None if R.get(layout).paged else geom.BS)


def slots(values, device="cpu", dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=device)


def row_launch(num_slots: int, row_bytes: int) -> dict:
    """copy_rows arguments of one segment of contiguous rows (``num_slots`` rows per side)."""
    geom = [num_slots, 1, row_bytes, row_bytes, 0]
    return dict(src_segments=[0, 0], dst_segments=[0, 0], src_geometry=geom, dst_geometry=list(geom),
                num_pieces=1, piece_bytes=row_bytes)


# ---------------------------------------------------------------------------------------
# slot tensors that change while the op runs
# ---------------------------------------------------------------------------------------

def test_slot_tensor_viewing_the_destination_is_rejected():
    """Slots that live in the destination's memory would be rewritten by the copy itself."""
    dst = torch.zeros(32, dtype=torch.int64)                 # 32 rows of one int64
    src = torch.arange(100, 132, dtype=torch.int64)          # values that are out of range as slots
    dst_slots = dst[:8]                                      # a view of the destination
    dst_slots.copy_(torch.arange(8))
    before = dst.clone()
    with pytest.raises(ValueError, match=r"dst_slots overlaps dst\[0\] in memory"):
        _native.copy_rows([src], [dst], None, dst_slots, 8, 0, **row_launch(32, 8))
    assert torch.equal(dst, before)
    # the same through a second storage over the same bytes (storage identity cannot see it)
    arr = np.zeros(32, dtype=np.int64)
    arr[:8] = np.arange(8)
    dst2, alias = torch.from_numpy(arr), torch.from_numpy(arr)[:8]
    with pytest.raises(ValueError, match=r"dst_slots overlaps dst\[0\] in memory"):
        _native.copy_rows([src], [dst2], None, alias, 8, 0, **row_launch(32, 8))
    with pytest.raises(ValueError, match=r"src_slots overlaps dst\[0\] in memory"):
        _native.copy_rows([src], [dst2], alias, None, 8, 0, **row_launch(32, 8))
    assert (arr[8:] == 0).all() and (arr[:8] == np.arange(8)).all()


def test_slots_rewritten_by_another_thread_never_escape_the_tensors():
    """A thread flips slot values between valid and out-of-range while copies run: every call
    either copies valid rows or raises IndexError; the guard bytes after the cache never change."""
    rows = T = 2048
    row_bytes = 32
    storage = torch.zeros(rows * 2 * row_bytes, dtype=torch.uint8)   # cache rows, then guard rows
    dst = storage[: rows * row_bytes]
    guard = storage[rows * row_bytes:]
    src = torch.full((T * row_bytes,), 7, dtype=torch.uint8)
    good = torch.arange(T, dtype=torch.int64)
    bad = good + rows                                      # lands in the guard rows if ever used
    dst_slots = good.clone()
    stop = threading.Event()

    def flip():
        while not stop.is_set():
            dst_slots.copy_(bad)
            dst_slots.copy_(good)

    outcomes = {"copied": 0, "refused": 0}
    geom = [rows, 1, row_bytes, row_bytes, 0]
    writer = threading.Thread(target=flip)
    writer.start()
    try:
        for i in range(60):
            op = _native.copy_rows if i % 2 else _native.copy_runs   # the kernel and the copy-engine walk
            try:
                op([src], [dst], None, dst_slots, T, 0, [0, 0], [0, 0], geom, list(geom), 1, row_bytes)
                outcomes["copied"] += 1
            except IndexError as exc:
                assert "dst_slots[" in str(exc) and "the destination holds 2048 slots" in str(exc)
                outcomes["refused"] += 1
    finally:
        stop.set()
        writer.join()
    assert outcomes["copied"] + outcomes["refused"] == 60
    assert int(guard.count_nonzero()) == 0, "a slot value that failed the check was used"


# ---------------------------------------------------------------------------------------
# plans hold no tensors
# ---------------------------------------------------------------------------------------

def test_remembered_plans_keep_no_tensor_alive(device):
    cache = make_cache("vllm_flash_attn_nhd", device)
    refs = []
    for T in (3, 5, 3):                      # a new geometry, another, then a remembered one
        out = ops.gather(cache, slots(list(range(T)), device))
        refs.append(weakref.ref(out))
        chunk = ops.bind("lmcache_kv_2ltd", torch.zeros(2, 2, T, 16, dtype=torch.float16, device=device))
        ops.transfer(cache, chunk, slots(list(range(T)), device))
        refs.append(weakref.ref(chunk.tensors[0]))
        del out, chunk
    other = make_cache("vllm_flash_attn_nhd", device, seed=3)
    ops.transfer(other, ops.bind("lmcache_kv_2ltd", torch.zeros(2, 2, 4, 16, dtype=torch.float16, device=device)),
                 slots([0, 1, 2, 3], device))
    refs += [weakref.ref(t) for t in other.tensors]
    del other
    gc.collect()
    assert all(r() is None for r in refs), "a dropped chunk or cache is still referenced"


# ---------------------------------------------------------------------------------------
# overlap by address, self-aliasing destinations, meta tensors
# ---------------------------------------------------------------------------------------

def test_overlap_of_two_storages_over_one_buffer():
    """Storages that start at different bytes of one buffer: their data pointers differ, their
    address ranges meet."""
    n = 2 * 2 * 6 * 16
    arr = np.zeros(n + 64, dtype=np.float16)
    a = ops.bind("lmcache_kv_2ltd", torch.from_numpy(arr[:n]).view(2, 2, 6, 16))
    b = ops.bind("lmcache_kv_2ltd", torch.from_numpy(arr[64:]).view(2, 2, 6, 16))
    assert a.tensors[0].untyped_storage().data_ptr() != b.tensors[0].untyped_storage().data_ptr()
    with pytest.raises(ValueError, match=r"src\[0\] and dst\[0\] overlap in memory"):
        ops.transfer(a, b)
    with pytest.raises(ValueError, match=r"src\[0\] and dst\[0\] overlap in memory"):
        ops.transfer(b, a)
    assert not arr.any()
    raw = bytearray((n + 64) * 2)
    c = ops.bind("lmcache_kv_2ltd", torch.frombuffer(raw, dtype=torch.float16, count=n).view(2, 2, 6, 16))
    d = ops.bind("lmcache_kv_2ltd", torch.frombuffer(raw, dtype=torch.float16, offset=128).view(2, 2, 6, 16))
    with pytest.raises(ValueError, match=r"overlap in memory"):
        ops.transfer(c, d)
    # disjoint parts of one buffer are fine
    halves = np.arange(2 * n, dtype=np.float16)
    ops.transfer(ops.bind("lmcache_kv_2ltd", torch.from_numpy(halves[:n]).view(2, 2, 6, 16)),
                 ops.bind("lmcache_kv_2ltd", torch.from_numpy(halves[n:]).view(2, 2, 6, 16)))
    assert (halves[n:] == halves[:n]).all()
    # the native op itself (what compiled code calls)
    launch = ops.plan(a, b, [0, 1], [0, 1], [0, 1], [0, 1])[0]
    with pytest.raises(ValueError, match=r"src\[0\] and dst\[0\] overlap in memory"):
        _native.copy_rows(list(a.tensors), list(b.tensors), None, None, 6, 0, launch.src_segments,
                          launch.dst_segments, launch.src_geometry, launch.dst_geometry, launch.num_pieces,
                          launch.piece_bytes)


def test_self_aliasing_destinations_are_rejected(device):
    cache = make_cache("vllm_flash_attn_nhd", device)
    expanded = torch.zeros(2, 2, 1, 16, dtype=torch.float16, device=device).expand(2, 2, 6, 16)
    before = expanded.clone()
    with pytest.raises(ValueError, match=r"dst\[0\] has internal overlap"):
        ops.transfer(cache, ops.bind("lmcache_kv_2ltd", expanded), slots([0, 1, 2, 3, 4, 5], device))
    assert torch.equal(expanded, before)
    rows = torch.ones(2, 2, 2, 2, 8, dtype=torch.float16, device=device)
    snap = TC.snapshot(cache.tensors)
    with pytest.raises(ValueError, match=r"dst_layers repeats 0"):
        ops.transfer(ops.bind("rows", rows), cache, None, slots([1, 2], device), dst_layers=[0, 0])
    with pytest.raises(ValueError, match=r"dst_planes repeats 1"):
        ops.transfer(ops.bind("rows", rows), cache, None, slots([1, 2], device), dst_planes=[1, 1])
    with pytest.raises(ValueError, match=r"layers repeats 1"):
        ops.scatter(cache, rows, slots([1, 2], device), layers=[1, 1])
    TC.assert_unchanged(cache.tensors, snap)
    # the native op refuses two segments onto the same rows by itself
    chunk = torch.zeros(2, 6, 16, dtype=torch.float16, device=device)
    launch = row_launch(6, 32)
    launch.update(src_segments=[0, 0, 0, 192], dst_segments=[0, 0, 0, 0])
    with pytest.raises(ValueError, match=r"dst_segments 0 and 1 address the same destination rows"):
        _native.copy_rows([torch.ones_like(chunk)], [chunk], None, None, 6, 0, **launch)
    assert int(chunk.count_nonzero()) == 0


def test_meta_tensors_mixed_with_data_are_rejected():
    cache = make_cache("vllm_flash_attn_nhd", "cpu")
    meta_chunk = ops.bind("lmcache_kv_2ltd", torch.empty(2, 2, 4, 16, dtype=torch.float16, device="meta"))
    with pytest.raises(ValueError, match=r"meta"):
        ops.transfer(cache, meta_chunk, slots([0, 1, 2, 3]))
    with pytest.raises(ValueError, match=r"meta"):
        ops.transfer(meta_chunk, cache, None, slots([0, 1, 2, 3]))
    launch = row_launch(4, 32)
    with pytest.raises(ValueError, match=r"kvlayout::copy_rows: src\[0\] is a meta tensor but dst\[0\] is on cpu"):
        _native.copy_rows([torch.empty(4, 16, dtype=torch.float16, device="meta")],
                          [torch.zeros(4, 16, dtype=torch.float16)], None, None, 4, 0, **launch)
    with pytest.raises(ValueError, match=r"key is a meta tensor"):
        ops.rope_reposition(torch.empty(4, 2, 8, device="meta"), slots([0, 1, 2, 3]), slots([0, 1, 2, 3]),
                            torch.randn(8, 8), is_neox=True)
    # all-meta calls trace shapes and are fine
    ops.transfer(ops.bind("lmcache_kv_2ltd", torch.empty(2, 2, 4, 16, dtype=torch.float16, device="meta")),
                 meta_chunk)


# ---------------------------------------------------------------------------------------
# autograd sees the writes
# ---------------------------------------------------------------------------------------

def test_writes_bump_the_version_counter(device):
    cache = make_cache("vllm_flash_attn_nhd", device)
    chunk = torch.zeros(2, 2, 4, 16, dtype=torch.float16, device=device)
    v = chunk._version
    ops.transfer(cache, ops.bind("lmcache_kv_2ltd", chunk), slots([0, 1, 2, 3], device))
    assert chunk._version > v
    keys = torch.randn(4, 2, 8, device=device)
    v = keys._version
    ops.rope_reposition(keys, slots([0, 1, 2, 3], device), slots([3, 2, 1, 0], device),
                        torch.randn(8, 8, device=device), is_neox=False)
    assert keys._version > v
    # a tensor saved for backward notices the write
    x = torch.randn(2, 2, 4, 16, device=device, requires_grad=True)
    w = (x * 1.0).to(torch.float16)  # a non-leaf that requires grad, saved by the product
    s = w * w
    ops.transfer(cache, ops.bind("lmcache_kv_2ltd", w), slots([0, 1, 2, 3], device))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        s.float().sum().backward()


def test_leaf_requiring_grad_and_inference_tensors_are_refused(device):
    cache = make_cache("vllm_flash_attn_nhd", device)
    leaf = torch.zeros(2, 2, 4, 16, dtype=torch.float16, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"dst\[0\] is a leaf tensor that requires grad"):
        ops.transfer(cache, ops.bind("lmcache_kv_2ltd", leaf), slots([0, 1, 2, 3], device))
    assert int(leaf.detach().count_nonzero()) == 0
    with torch.no_grad():                     # as with torch's in-place ops
        ops.transfer(cache, ops.bind("lmcache_kv_2ltd", leaf), slots([0, 1, 2, 3], device))
    keys = torch.randn(4, 2, 8, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"key is a leaf tensor that requires grad"):
        ops.rope_reposition(keys, slots([0, 1, 2, 3], device), slots([3, 2, 1, 0], device),
                            torch.randn(8, 8, device=device), is_neox=True)
    with torch.inference_mode():
        inference = torch.zeros(2, 2, 4, 16, dtype=torch.float16, device=device)
        ops.transfer(cache, ops.bind("lmcache_kv_2ltd", inference), slots([0, 1, 2, 3], device))
    before = TC.snapshot([inference])
    with pytest.raises(RuntimeError, match=r"dst\[0\] is an inference tensor"):
        ops.transfer(cache, ops.bind("lmcache_kv_2ltd", inference), slots([4, 5, 6, 7], device))
    TC.assert_unchanged([inference], before)


# ---------------------------------------------------------------------------------------
# weak arguments: clear errors naming the argument, the value and the bound
# ---------------------------------------------------------------------------------------

def test_float_and_bool_indices_are_not_truncated():
    cache = make_cache("vllm_flash_attn_nhd", "cpu")
    chunk = ops.bind("lmcache_kv_2ltd", torch.zeros(2, 2, 3, 16, dtype=torch.float16))
    snap = TC.snapshot(chunk.tensors)
    with pytest.raises(TypeError, match=r"src_slots\[1\] must be an integer, got float 1.5"):
        ops.transfer(cache, chunk, [0, 1.5, 2])
    with pytest.raises(TypeError, match=r"src_slots\[0\] must be an integer, got the bool True"):
        ops.transfer(cache, chunk, [True, 1, 2])
    with pytest.raises(TypeError, match=r"src_slots must hold integers, got an array of float64"):
        ops.transfer(cache, chunk, np.array([0.0, 1.0, 2.0]))
    with pytest.raises(TypeError, match=r"src_layers\[0\] must be an integer, got float 0.7"):
        ops.transfer(cache, chunk, [0, 1, 2], src_layers=[0.7, 1])
    with pytest.raises(TypeError, match=r"src_planes\[0\] must be an integer, got the bool True"):
        ops.transfer(cache, chunk, [0, 1, 2], src_planes=True, dst_planes=[0])
    with pytest.raises(TypeError, match=r"skip_prefix must be an integer, got float 1.5"):
        ops.transfer(cache, chunk, [0, 1, 2], skip_prefix=1.5)
    with pytest.raises(TypeError, match=r"skip_prefix must be an integer"):
        ops.skip_prefix(slots([0, 1, 2]), 1.0)
    with pytest.raises(TypeError, match=r"page must be an integer, got float 1.0"):
        ops.get_page(cache, 1.0)
    with pytest.raises(TypeError, match=r"pages\[0\] must be an integer"):
        ops.page_spans(cache, [0.5])
    TC.assert_unchanged(chunk.tensors, snap)


def test_numpy_integers_are_ints():
    cache = make_cache("vllm_flash_attn_nhd", "cpu")
    out = ops.gather(cache, slots([0, 1, 2]), layers=np.int64(1), planes=[np.int32(0)])
    want = ops.gather(cache, slots([0, 1, 2]), layers=[1], planes=[0])
    np.testing.assert_array_equal(TC.bits(out), TC.bits(want))
    got = ops.gather(cache, np.array([0, 1, 2], dtype=np.int32))
    np.testing.assert_array_equal(TC.bits(got), TC.bits(ops.gather(cache, slots([0, 1, 2]))))


def test_overflowing_and_negative_ints_are_named():
    cache = make_cache("vllm_flash_attn_nhd", "cpu")
    chunk = ops.bind("lmcache_kv_2ltd", torch.zeros(2, 2, 3, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"src_slots\[1\] = 36893488147419103232 must be <= 9223372036854775807"):
        ops.transfer(cache, chunk, [0, 2 ** 65, 1])
    with pytest.raises(ValueError, match=r"num_tokens = -1 must be >= 0"):
        ops.gather(cache, num_tokens=-1)
    with pytest.raises(ValueError, match=r"num_tokens = 36893488147419103232 must be <= 9223372036854775807"):
        ops.transfer(cache, chunk, num_tokens=2 ** 65)
    with pytest.raises(ValueError, match=r"skip_prefix = -2 must be >= 0"):
        ops.transfer(cache, chunk, [0, 1, 2], skip_prefix=-2)
    with pytest.raises(ValueError, match=r"max_ctas = -1 must be >= 0"):
        ops.transfer(cache, chunk, [0, 1, 2], max_ctas=-1)
    with pytest.raises(ValueError, match=r"max_ctas = 4294967296 must be <= 2147483647"):
        ops.transfer(cache, chunk, [0, 1, 2], max_ctas=2 ** 32)
    with pytest.raises(ValueError, match=r"max_ctas = -3 must be >= 0"):
        ops.rope_reposition(torch.zeros(2, 1, 8), slots([0, 1]), slots([1, 0]), torch.zeros(4, 8), is_neox=True,
                            max_ctas=-3)
    with pytest.raises(IndexError, match=r"dst_slots is None, so token t uses position t; num_tokens = 40 must be "
                                         r"<= 16"):
        ops.transfer(ops.bind("lmcache_kv_2ltd", torch.zeros(2, 2, 40, 16, dtype=torch.float16)), cache)


def test_move_without_slots_and_bad_page_size():
    cache = make_cache("sglang_mha", "cpu")
    with pytest.raises(TypeError, match=r"move needs src_slots"):
        ops.move(cache, None, None)
    with pytest.raises(TypeError, match=r"move needs dst_slots"):
        ops.move(cache, slots([0, 1]), None)
    k = [torch.zeros(20, 2, 8) for _ in range(2)]
    with pytest.raises(ValueError, match=r"page_size = -4 must be >= 1"):
        ops.bind("sglang_mha", (k, k), page_size=-4)
    with pytest.raises(ValueError, match=r"page_size = 0 must be >= 1"):
        ops.bind("sglang_mha", (k, k), page_size=0)
    with pytest.raises(TypeError, match=r"page_size must be an integer, got float 4.0"):
        ops.bind("sglang_mha", (k, k), page_size=4.0)


def test_gather_out_too_short_is_named():
    cache = make_cache("vllm_flash_attn_nhd", "cpu")
    out = torch.full((2, 2, 2, 2, 8), 3, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"out has shape \(2, 2, 2, 2, 8\); it must be .* T >= 3"):
        ops.gather(cache, slots([0, 1, 2]), out=out)
    with pytest.raises(ValueError, match=r"out has shape"):
        ops.gather(cache, slots([0, 1]), out=torch.zeros(2, 2, 2, 16, dtype=torch.float16))
    assert bool((out == 3).all())


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False),
                                      ("false", False), ("No", False), ("off", False), ("", False)])
def test_validate_environment_variable(monkeypatch, value, on):
    monkeypatch.setenv("KVLAYOUT_VALIDATE", value)
    assert ops.transfer.__globals__["validating"](None) is on


def test_validate_environment_variable_not_understood(monkeypatch):
    monkeypatch.setenv("KVLAYOUT_VALIDATE", "maybe")
    cache = make_cache("vllm_flash_attn_nhd", "cpu")
    with pytest.raises(ValueError, match=r"KVLAYOUT_VALIDATE = 'maybe' is not understood"):
        ops.gather(cache, slots([0, 1]))


def test_page_helpers_on_16_byte_elements_are_named():
    k = [torch.zeros(8, 1, 4, dtype=torch.complex128) for _ in range(2)]
    cache = ops.bind("sglang_mha", (k, k), page_size=4)
    with pytest.raises(TypeError, match=r"cache dtype torch.complex128 .*16-byte elements"):
        ops.get_page(cache, 1)
    with pytest.raises(TypeError, match=r"cache dtype torch.complex128 .*16-byte elements"):
        ops.set_page(cache, 1, torch.zeros(2 * 2 * 4 * 4, dtype=torch.complex128))


# ---------------------------------------------------------------------------------------
# compiled calls refuse what eager calls refuse
# ---------------------------------------------------------------------------------------

def test_compiled_calls_reject_what_eager_rejects(device):
    """CPU ops always check slots inside the op; devices do with validate=True (inside the op too)."""
    cache = make_cache("vllm_flash_attn_nhd", device)
    snap = TC.snapshot(cache.tensors)
    validate = device != "cpu" or None

    def scatter(rows, s):
        ops.scatter(cache, rows, s, validate=validate)

    def copy_within(s, d):
        ops.transfer(cache, cache, s, d)

    rows = torch.ones(2, 2, 3, 2, 8, dtype=torch.float16, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(scatter, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"dst_slots repeats slot 5"):
        compiled(rows, slots([5, 1, 5], device))
    with pytest.raises(Exception, match=r"dst_slots\[1\] = 99 is out of range"):
        compiled(rows, slots([5, 99, 2], device))
    TC.sync(device)
    TC.assert_unchanged(cache.tensors, snap)
    torch._dynamo.reset()
    compiled = torch.compile(copy_within, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception) as info:      # refused while tracing: dynamo reports the ValueError as cause
        compiled(slots([0, 1], device), slots([2, 3], device))
    assert "overlap in memory" in f"{info.value} {info.value.__cause__}"
    TC.assert_unchanged(cache.tensors, snap)


def test_cpu_duplicate_check_of_page_runs_reports_the_first_repeat():
    """Destination slots in runs of consecutive values (whole pages, the common engine call) are checked by their
    runs; a repeat among them (a page twice, runs that overlap in part, a repeat inside a run after a skipped
    token) raises the same error, naming the first repeat in token order, as slots checked one by one; pages in
    any order, holes and runs that only touch pass and move every row."""
    src = make_cache("vllm_flash_attn_nhd", "cpu")
    N = src.geometry.N
    page = list(range(4))                                  # (4-slot runs stand for pages here)
    src_slots = slots(list(range(12)))
    for dst, repeat in ((page + [8 + i for i in page] + page, r"slot 0 \(dst_slots\[0\] and dst_slots\[8\]\)"),
                        ([4, 5, 6, 7, 0, 1, 2, 3, 6, 7, 8, 9], r"slot 6 \(dst_slots\[2\] and dst_slots\[8\]\)"),
                        ([0, 1, -1, 3, 4, 5, 1, 2, 9, 10, 11, 12], r"slot 1 \(dst_slots\[1\] and dst_slots\[6\]\)")):
        dst_cache = make_cache("vllm_flashinfer_hnd", "cpu", seed=3)
        snap = TC.snapshot(dst_cache.tensors)
        with pytest.raises(ValueError, match=r"dst_slots repeats " + repeat):
            ops.transfer(src, dst_cache, src_slots, slots(dst))
        TC.assert_unchanged(dst_cache.tensors, snap)
    for dst in ([8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, -1, 7, 12, 13, 14, 15],
                [N - 12 + i for i in range(12)]):
        dst_cache = make_cache("vllm_flashinfer_hnd", "cpu", seed=3)
        ops.transfer(src, dst_cache, src_slots, slots(dst))
        want = make_cache("vllm_flashinfer_hnd", "cpu", seed=3)
        for t, d in enumerate(dst):                        # token by token, one row each
            if d >= 0:
                ops.transfer(src, want, slots([t]), slots([d]))
        assert all(np.array_equal(TC.bits(a), TC.bits(b)) for a, b in zip(dst_cache.tensors, want.tensors)), dst


GR = Geometry(P=2, L=2, NB=8, BS=4, H=1, E=8)       # 32 slots of 8-element rows (a chunk row is H*E = 8 too)


@st.composite
def run_structured_slots(draw, T: int, num_slots: int, page: int) -> list[int]:
    """Destination slots as engines pass them, and worse: whole pages in any order (runs of consecutive slots),
    runs of any length that may overlap one another or end past the cache, holes (-1) and lone slots out of
    range, so that both the check by sorted runs and the token-by-token check it falls back to are reached."""
    if draw(st.booleans()):                          # distinct pages, shuffled, some tokens dropped: no repeat
        pages = draw(st.permutations(range(num_slots // page)))
        out = [p * page + i for p in pages for i in range(page)]
        holes = draw(st.sets(st.integers(0, len(out) - 1), max_size=3))
        return [-1 if i in holes else v for i, v in enumerate(out)][:T]
    out: list[int] = []
    while len(out) < T:
        kind = draw(st.sampled_from(("run", "run", "run", "hole", "out of range")))
        if kind == "run":
            start = draw(st.integers(0, num_slots - 1))
            out += range(start, start + draw(st.integers(1, 2 * page)))
        else:
            out.append(-1 if kind == "hole" else draw(st.integers(num_slots, num_slots + 3)))
    return out[:T]


def first_bad_token(src, dst, skip: int, src_slots: int, dst_slots: int):
    """The rule the native check implements, token by token: (exception, message pattern) of the first bad token
    at or after ``skip`` (a source or destination slot out of range, or a destination slot seen before), else
    None. A token with a negative slot on either side moves nothing and is not checked further."""
    seen: dict[int, int] = {}
    for t in range(skip, len(dst)):
        s, d = src[t], dst[t]
        if s < 0 or d < 0:
            continue
        if s >= src_slots:
            return IndexError, re.escape(f"src_slots[{t}] = {s} is out of range")
        if d >= dst_slots:
            return IndexError, re.escape(f"dst_slots[{t}] = {d} is out of range")
        if d in seen:
            return ValueError, re.escape(f"dst_slots repeats slot {d} (dst_slots[{seen[d]}] and dst_slots[{t}])")
        seen[d] = t
    return None


@settings(max_examples=TC.examples(60))
@given(data=st.data())
def test_cpu_slot_checks_follow_the_token_by_token_rule(data):
    """Random slots of every structure: the CPU op raises exactly the error of the first bad token (which side,
    which token, which earlier token a repeat repeats), touching nothing, or moves exactly the rows that the
    rule moves (an independent row oracle, tests/reference_oracles.py), whichever check decided."""
    check_slots_by_the_rule(data, GR, max_tokens=40)


# pages of 16 slots: runs of consecutive slots up to 32 long, past the 8 entries the native checks and run
# detection compare at a time
GR_LONG_RUNS = Geometry(P=2, L=1, NB=8, BS=16, H=1, E=8)


@settings(max_examples=TC.examples(40))
@given(data=st.data())
def test_cpu_slot_checks_follow_the_rule_on_long_runs(data):
    """As above, with pages of 16 slots: long runs of consecutive slots, broken anywhere by a hole, a slot out
    of range or a repeat, decide exactly as token by token."""
    check_slots_by_the_rule(data, GR_LONG_RUNS, max_tokens=160)


def check_slots_by_the_rule(data, geom: Geometry, max_tokens: int):
    """One drawn transfer into a ``geom`` cache against :func:`first_bad_token` and the row oracle."""
    N = geom.NB * geom.BS
    T = data.draw(st.integers(1, max_tokens), label="T")
    dst_slots = data.draw(run_structured_slots(T, N, geom.BS), label="dst_slots")
    T = len(dst_slots)
    from_chunk = data.draw(st.booleans(), label="from a chunk (src_slots None)")
    if from_chunk:
        src_layout, src_slots = "lmcache_kv_2ltd", None
        src_geom = Geometry(P=geom.P, L=geom.L, NB=T, BS=1, H=1, E=8)
        src_values = list(range(T))
    else:
        src_layout, src_geom = "vllm_flash_attn_nhd", geom
        if data.draw(st.booleans(), label="source slots in runs too"):    # (rows coalesced on both sides)
            src_values = (data.draw(run_structured_slots(T, N, geom.BS), label="src_slots") + [-1] * T)[:T]
        else:
            src_values = data.draw(st.lists(st.integers(-1, N), min_size=T, max_size=T), label="src_slots")
        src_slots = slots(src_values, dtype=data.draw(st.sampled_from((torch.int32, torch.int64))))
    skip = data.draw(st.integers(0, T), label="skip_prefix")
    dst_layout = "vllm_flashinfer_hnd"
    src_np = S.random_cache(src_layout, src_geom, "float16", np.random.default_rng(1))
    dst_np = S.random_cache(dst_layout, geom, "float16", np.random.default_rng(2))
    src = ops.bind(src_layout, TC.to_torch(src_layout, src_np), page_size=None if from_chunk else geom.BS)
    dst = ops.bind(dst_layout, TC.to_torch(dst_layout, dst_np), page_size=geom.BS)
    d_slots = slots(dst_slots, dtype=data.draw(st.sampled_from((torch.int32, torch.int64))))
    bad = first_bad_token(src_values, dst_slots, skip, src_geom.NB * src_geom.BS, N)
    if bad is not None:
        snap = TC.snapshot(dst.tensors)
        with pytest.raises(bad[0], match=bad[1]):
            ops.transfer(src, dst, src_slots, d_slots, skip_prefix=skip)
        TC.assert_unchanged(dst.tensors, snap)
        return
    ops.transfer(src, dst, src_slots, d_slots, skip_prefix=skip)
    want = copy.deepcopy(dst_np)
    for t in range(skip, T):
        if src_values[t] >= 0 and dst_slots[t] >= 0:
            for p in range(geom.P):
                for layer in range(geom.L):
                    O.set_row(dst_layout, geom, want, p, layer, dst_slots[t],
                              O.get_row(src_layout, src_geom, src_np, p, layer, src_values[t]))
    TC.assert_same_bytes(dst.tensors, TC.flat(dst_layout, want))


def test_cpu_duplicate_check_allows_what_it_should():
    src = make_cache("vllm_flash_attn_nhd", "cpu")
    dst = make_cache("vllm_flashinfer_hnd", "cpu", seed=3)
    # negatives repeat freely; a repeat inside the skipped prefix writes nothing
    ops.transfer(src, dst, slots([0, 0, 2, 3]), slots([-1, -1, 4, 5]))
    ops.transfer(src, dst, slots([0, 1, 2]), slots([6, 6, 7]), skip_prefix=1)
    with pytest.raises(ValueError, match=r"dst_slots repeats slot 6 \(dst_slots\[1\] and dst_slots\[3\]\)"):
        ops.transfer(src, dst, slots([0, 1, 2, 3]), slots([0, 6, 1, 6], dtype=torch.int32))
