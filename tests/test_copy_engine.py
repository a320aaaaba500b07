"""engine="copy": the same transfers done by the copy engine (no SMs), checked against the reference.

On CPU the copy engine is the host walk of the CPU kernel; on CUDA it issues one
memory copy per contiguous block from host-read slots.  Page-granular slots
(whole pages, in random page order) are what it is for; other slot patterns
must still be right.
"""

import numpy as np
import pytest
import torch
from test_ops_compile import copy_rows_samples

from kvlayout import ops
from kvlayout import reference as R
from kvlayout.conformance import strategies as S
from kvlayout.conformance.families.transfer import TransferSample
from kvlayout.reference import Geometry

import torch_cases as TC

PAIRS = [("vllm_flash_attn_nhd", "hicache_page_first_direct"), ("hicache_page_first", "vllm_flash_attn_hnd"),
         ("sglang_mha", "hicache_page_head"), ("vllm_mla", "hicache_mla_page_first")]


def page_slots(rng, num_pages, page, count):
    pages = rng.permutation(num_pages)[:count]
    return (pages[:, None] * page + np.arange(page)).reshape(-1)


@pytest.mark.parametrize("src_layout,dst_layout", PAIRS)
@pytest.mark.parametrize("pattern", ["pages", "random", "with -1"])
def test_copy_engine_equals_the_reference(device, src_layout, dst_layout, pattern):
    """A sample of the case database's transfer family with engine="copy" (destination pinned on CUDA)."""
    rng = np.random.default_rng(len(pattern) + len(src_layout))
    mla = R.get(src_layout).is_mla
    g = Geometry(P=1 if mla else 2, L=3, NB=6, BS=4, H=1 if mla else 2, E=24 if mla else 8)
    if pattern == "pages":
        s, d = page_slots(rng, g.NB, g.BS, 3), page_slots(rng, g.NB, g.BS, 3)
    else:
        s, d = rng.permutation(g.N)[:10], rng.permutation(g.N)[:10]
        if pattern == "with -1":
            s[2] = d[5] = -1
    case = S.TransferCase(src_layout, g, dst_layout, g, "bfloat16", tuple(int(x) for x in s),
                          tuple(int(x) for x in d), seed=len(pattern))
    TransferSample(case, placement="pinned dst" if device == "cuda" else "device", dst_fill="random",
                   engine="copy").run(device)


def test_copy_engine_rejects_bad_slots_before_copying(device):
    g = Geometry(P=2, L=2, NB=4, BS=4, H=2, E=8)
    rng = np.random.default_rng(0)
    src = ops.bind("vllm_flash_attn_nhd", TC.to_torch("vllm_flash_attn_nhd", S.random_cache(
        "vllm_flash_attn_nhd", g, "float16", rng), device))
    dst_np = S.random_cache("hicache_layer_first", g, "float16", rng)
    dst = ops.bind("hicache_layer_first", TC.to_torch("hicache_layer_first", dst_np, "cpu", pin=device == "cuda"),
                   page_size=4)
    before = TC.snapshot(dst.tensors)
    with pytest.raises(IndexError, match=r"dst_slots\[1\] = 16 is out of range"):
        ops.transfer(src, dst, torch.tensor([0, 1]), torch.tensor([3, 16]), engine="copy")
    with pytest.raises(ValueError, match=r"dst_slots repeats slot 3 \(dst_slots\[0\] and dst_slots\[2\]\)"):
        ops.transfer(src, dst, torch.tensor([0, 1, 2]), torch.tensor([3, -1, 3], dtype=torch.int32), engine="copy")
    TC.assert_unchanged(dst.tensors, before)
    with pytest.raises(ValueError, match="engine must be one of 'kernel', 'copy', 'staged', 'auto', got 'dma'"):
        ops.transfer(src, dst, torch.tensor([0]), torch.tensor([3]), engine="dma")


def test_copy_engine_needs_host_slots_and_refuses_graph_capture(cuda_device):
    g = Geometry(P=2, L=1, NB=2, BS=4, H=1, E=8)
    rng = np.random.default_rng(1)
    src = ops.bind("vllm_flash_attn_nhd", TC.to_torch("vllm_flash_attn_nhd", S.random_cache(
        "vllm_flash_attn_nhd", g, "float16", rng), cuda_device))
    dst = ops.bind("vllm_flash_attn_nhd", TC.to_torch("vllm_flash_attn_nhd", S.random_cache(
        "vllm_flash_attn_nhd", g, "float16", rng), cuda_device))
    with pytest.raises(ValueError, match="src_slots is on cuda"):
        ops.transfer(src, dst, torch.tensor([0, 1], device=cuda_device), torch.tensor([2, 3]), engine="copy")
    graph = torch.cuda.CUDAGraph()
    s, d = torch.tensor([0, 1]), torch.tensor([2, 3])
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(graph):
            ops.transfer(src, dst, s, d, engine="copy")


def test_opcheck_copy_runs():
    for args in copy_rows_samples("cpu"):
        torch.library.opcheck(torch.ops.kvlayout.copy_runs.default, args[:12])


def _page_first_pair(device, g, seed):
    """A vLLM cache on ``device`` and a pinned (or CPU) HiCache page-first-direct pool, random bits."""
    rng = np.random.default_rng(seed)
    src_np = S.random_cache("vllm_flash_attn_nhd", g, "bfloat16", rng)
    dst_np = S.random_cache("hicache_page_first_direct", g, "bfloat16", rng)
    src = ops.bind("vllm_flash_attn_nhd", TC.to_torch("vllm_flash_attn_nhd", src_np, device))
    dst = ops.bind("hicache_page_first_direct", TC.to_torch("hicache_page_first_direct", dst_np, "cpu",
                                                            pin=device == "cuda"), page_size=g.BS)
    return src_np, dst_np, src, dst, rng


@pytest.mark.parametrize("stream", ["default", "user"])
@pytest.mark.parametrize("batch", ["1", "0"])
def test_copy_engine_keeps_stream_order(cuda_device, stream, batch, monkeypatch):
    """Work queued before the copy on the caller's stream is seen by it; work after it sees its result.

    ``batch``: KVLAYOUT_COPY_BATCH, the batched copy API (1) or one cudaMemcpyAsync per copy (0)."""
    monkeypatch.setenv("KVLAYOUT_COPY_BATCH", batch)
    g = Geometry(P=2, L=2, NB=16, BS=8, H=2, E=64)
    src_np, dst_np, src, dst, rng = _page_first_pair(cuda_device, g, 3)
    s = torch.from_numpy(page_slots(rng, g.NB, g.BS, 6))
    d = torch.from_numpy(page_slots(rng, g.NB, g.BS, 6))
    on = torch.cuda.Stream() if stream == "user" else torch.cuda.default_stream()
    with torch.cuda.stream(on):
        fresh = TC.to_torch("vllm_flash_attn_nhd", S.random_cache("vllm_flash_attn_nhd", g, "bfloat16", rng),
                            cuda_device)
        torch.cuda._sleep(20_000_000)                # the copy must wait for this stream's earlier work
        for t, f in zip(src.tensors, fresh):
            t.copy_(f)
        ops.transfer(src, dst, s, d, engine="copy")
        back = [torch.empty_like(t, device=cuda_device) for t in dst.tensors]
        for b, t in zip(back, dst.tensors):
            b.copy_(t, non_blocking=True)
    on.synchronize()
    want = R.transfer("vllm_flash_attn_nhd", [TC.bits(f).view(src_np[0].dtype) for f in fresh],
                      "hicache_page_first_direct", dst_np, s.numpy(), d.numpy())
    for got, expected in zip(back, R.flat_arrays("hicache_page_first_direct", want)):
        assert np.array_equal(TC.bits(got), S.bits(np.asarray(expected)))


def test_copy_engine_with_more_runs_than_one_batch(device):
    """Over 8192 separate copies (single tokens in random order) are all issued and land."""
    g = Geometry(P=2, L=2, NB=640, BS=16, H=1, E=8)
    src_np, dst_np, src, dst, rng = _page_first_pair(device, g, 4)
    s = torch.from_numpy(rng.permutation(g.N)[:9000])
    d = torch.from_numpy(rng.permutation(g.N)[:9000])
    ops.transfer(src, dst, s, d, engine="copy")
    TC.sync(device)
    want = TC.jitted_reference.transfer("vllm_flash_attn_nhd", src_np, "hicache_page_first_direct", dst_np,
                                        s.numpy(), d.numpy())
    for got, expected in zip(dst.tensors, R.flat_arrays("hicache_page_first_direct", want)):
        assert np.array_equal(TC.bits(got), S.bits(np.asarray(expected)))


def test_run_list_is_one_copy_per_page_and_layer_plane_and_merges_what_continues():
    """The copy engine's run list (built in C++ as copy_runs builds it, _C.copy_run_list): whole pages in random
    order give one copy per (page, layer, plane); slots in order into an LMCache chunk give one copy per
    (layer, plane), every page of it merged; a slot out of range raises before any list exists."""
    from kvlayout.bench import cases as C

    device = torch.device("cpu")
    paged = C.Case("copy_engine", "L32_H1_D128", "vllm_flash_attn_nhd", "hicache_page_first_direct", 256, 16,
                   "to_host", engine="copy")
    data = C.build(paged, C.Inputs(device), min_cache_slots=512)
    assert C.copy_run_list_fn(paged, data)() == (256 // 16) * 32 * 2
    chunked = C.Case("copy_engine", "L32_H1_D128", "vllm_flash_attn_nhd", "lmcache_kv_2ltd", 256, 16, "to_host",
                     engine="copy")
    data = C.build(chunked, C.Inputs(device), min_cache_slots=512)
    data["cache_slots"] = torch.arange(256)
    assert C.copy_run_list_fn(chunked, data)() == 32 * 2
    data["cache_slots"] = torch.arange(256) + 512          # past the cache's 512 slots
    with pytest.raises(IndexError, match="src_slots"):
        C.copy_run_list_fn(chunked, data)()


def _model_run_list(src_geom, dst_geom, src_segments, dst_segments, src_slots, dst_slots, row):
    """The run list by its definition, token by token: a token whose rows start where the previous token's
    rows end on both sides continues its run; each run gives one copy per segment, in segment order; a copy
    that continues the one before it on both sides is merged into it. Returns the copies, in issue order:
    ((source tensor, byte offset), (destination tensor, byte offset), bytes)."""
    def offset(g, slot):
        return slot // g[1] * g[2] + slot % g[1] * g[3]

    runs = []                                   # (src offset, dst offset, tokens)
    for s, d in zip(src_slots, dst_slots):
        if s < 0 or d < 0:
            runs.append(None)
            continue
        last = runs[-1] if runs else None
        so, do = offset(src_geom, s), offset(dst_geom, d)
        if last is not None and so == last[0] + last[2] * row and do == last[1] + last[2] * row:
            runs[-1] = (last[0], last[1], last[2] + 1)
        else:
            runs.append((so, do, 1))
    copies = []                                 # (src address, dst address, bytes)
    for run in filter(None, runs):
        for g in range(len(src_segments) // 2):
            src = (src_segments[2 * g], src_segments[2 * g + 1] + run[0])
            dst = (dst_segments[2 * g], dst_segments[2 * g + 1] + run[1])
            if copies and copies[-1][0] == (src[0], src[1] - copies[-1][2]) \
                    and copies[-1][1] == (dst[0], dst[1] - copies[-1][2]):
                copies[-1] = (copies[-1][0], copies[-1][1], copies[-1][2] + run[2] * row)
            else:
                copies.append((src, dst, run[2] * row))
    return copies


def test_run_list_coalesces_exactly_the_rows_that_continue_each_other():
    """_C.copy_run_list against the definition of the run list (_model_run_list) over random paged geometries
    (pages back to back or apart, rows back to back or apart within a page), slots that run across page
    boundaries, jump and skip (-1), and segments whose bases lie equally far apart on both sides (a run's
    copies in consecutive segments may then continue each other) or not: the same copies, addresses and
    lengths, in the same order."""
    from kvlayout import _C

    rng = np.random.default_rng(5)
    row = 16
    checked = 0
    for case in range(300):
        geoms = []
        for _ in range(2):
            page = int(rng.choice([1, 2, 4, 16]))
            in_page = row * int(rng.choice([1, 1, 2]))
            stride_page = page * in_page + int(rng.choice([0, 0, row, 3 * row]))
            geoms.append([64, page, stride_page, in_page, 0])
        T = int(rng.integers(1, 40))
        slots = []
        for _ in range(2):
            s, out = int(rng.integers(0, 64)), []
            for _ in range(T):
                out.append(s if rng.random() > 0.1 else -1)
                s = s + 1 if rng.random() < 0.8 else int(rng.integers(0, 64))
                s = s if s < 64 else int(rng.integers(0, 64))
            slots.append(out)
        segments = 3
        span = [max(g[2] * (63 // g[1]) + g[3] * (63 % g[1]), g[2] * (63 // g[1] - 1) + g[3] * (g[1] - 1))
                + row for g in geoms]
        if case % 2:                                       # bases equally far apart on both sides
            span = [max(span)] * 2
        src_segments = [x for g in range(segments) for x in (0, g * span[0])]
        dst_segments = [x for g in range(segments) for x in (0, g * span[1])]
        dst = [torch.zeros(segments * span[1], dtype=torch.uint8)]
        src = [torch.zeros(segments * span[0], dtype=torch.uint8)]
        src_slots, dst_slots = (torch.tensor(x, dtype=torch.int64) for x in slots)
        if len(set(x for x in slots[1] if x >= 0)) < sum(x >= 0 for x in slots[1]):
            continue                                       # (the copy engine refuses repeated destinations)
        args = (src, dst, src_slots, dst_slots, T, 0, src_segments, dst_segments, geoms[0], geoms[1], 1, row)
        entries = _C.copy_run_list(*args, entries=True)
        got = [((0, s - src[0].data_ptr()), (0, d - dst[0].data_ptr()), n) for s, d, n in entries]
        assert got == _model_run_list(geoms[0], geoms[1], src_segments, dst_segments, slots[0], slots[1], row), \
            (case, geoms, slots)
        assert _C.copy_run_list(*args) == len(entries)
        checked += 1
    assert checked >= 100, checked
    # segments back to back on both sides, each holding the whole run: the run's copies continue each other
    # from segment to segment, into one copy
    T, geom = 8, [8, 4, 4 * row, row, 0]
    flat = [torch.zeros(3 * T * row, dtype=torch.uint8)]
    one_side = [x for g in range(3) for x in (0, g * T * row)]
    slots = torch.arange(T, dtype=torch.int64)
    entries = _C.copy_run_list(flat, [torch.zeros_like(flat[0])], slots, slots, T, 0, one_side, one_side, geom, geom,
                               1, row, entries=True)
    assert [n for _, _, n in entries] == [3 * T * row]
