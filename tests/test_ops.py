"""Focused cases of the torch op library against the reference, bit for bit, on every device.

The generated samples of every operation family (every layout as source and
destination, every dtype, gather/scatter subsets and skips, moves, page
helpers, RoPE, CTA budgets, placements) come from the case database
``kvlayout.conformance.families`` and run in ``test_families.py``.  Here are
the fixed cases that aim at one code path: layer-wise chunks, long
overlapping moves, strided bindings, many segments, vector widths, pinned
host memory on CUDA, remembered plans.  Outputs are compared with the
reference as unsigned bits, untouched rows and sources included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlayout import ops
from kvlayout import reference as R
from kvlayout.conformance import strategies as S
from kvlayout.conformance.families.transfer import TransferSample
from kvlayout.reference import Geometry

import torch_cases as TC

# The reference operations under jax.jit: one compile per case instead of one per primitive (torch_cases._Jitted).
J = TC.jitted_reference

SLOT_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------

def page_size_of(layout, geom: Geometry) -> int | None:
    """``page_size`` for bind: layouts with a flat slot axis cannot tell it from shapes."""
    return None if R.get(layout).paged else geom.BS


def bind_np(layout, physical, geom: Geometry, device="cpu", *, pin: bool = False) -> ops.KVCache:
    """Bind a torch copy of a numpy physical value (on ``device`` or pinned host memory)."""
    return ops.bind(layout, TC.to_torch(layout, physical, device, pin=pin), page_size=page_size_of(layout, geom))


def run_transfer_case(case: S.TransferCase, device, **options) -> None:
    """One transfer through the op and the reference, every byte compared: the database's sample with ``options``."""
    TransferSample(case, **options).run(device)


# ---------------------------------------------------------------------------------------
# transfer: layer by layer into one-layer chunks
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("src_layout", ["vllm_flash_attn_hnd", "vllm_packed_nhd", "sglang_mha", "vllm_cross_layer"])
@pytest.mark.parametrize("chunk", ["lmcache_kv_t2d", "lmcache_kv_2td"])
def test_layerwise_into_one_layer_chunks(device, src_layout, chunk):
    """One layer at a time into a one-layer chunk each (layer-wise pipelines), then back."""
    rng = np.random.default_rng(11)
    g = Geometry(P=2, L=3, NB=5, BS=4, H=2, E=8)
    src_np = S.random_cache(src_layout, g, "bfloat16", rng)
    cg = Geometry(P=2, L=1, NB=7, BS=1, H=1, E=16)
    src_slots = np.array([17, 3, 4, 5, 6, -1, 0], np.int64)
    src = bind_np(src_layout, src_np, g, device)
    back_np = S.sentinel_cache(src_layout, g, "bfloat16")
    back = bind_np(src_layout, back_np, g, device)
    # the eager reference here: every call has the same shapes, so its compiled primitives are reused
    for layer in range(g.L):
        chunk_np = S.sentinel_cache(chunk, cg, "bfloat16")
        want = R.transfer(src_layout, src_np, chunk, chunk_np, src_slots, None, src_layers=[layer],
                          dst_layers=[0], src_geom=g, dst_geom=cg)
        out = bind_np(chunk, chunk_np, cg, device)
        ops.transfer(src, out, TC.slots(src_slots, torch.int32, device), None, src_layers=[layer], dst_layers=0)
        TC.sync(device)
        TC.assert_same_bytes(out.tensors, TC.flat(chunk, want), f"layer {layer}")
        back_np = R.transfer(chunk, want, src_layout, back_np, None, src_slots, src_layers=[0], dst_layers=[layer],
                             src_geom=cg, dst_geom=g)
        ops.transfer(out, back, None, TC.slots(src_slots, torch.int64, device), src_layers=[0],
                     dst_layers=[layer])
    TC.sync(device)
    TC.assert_same_bytes(back.tensors, TC.flat(src_layout, back_np), "round trip")


# ---------------------------------------------------------------------------------------
# gather: the allocated out
# ---------------------------------------------------------------------------------------

def test_gather_default_out_is_zeros(device):
    g = Geometry(P=2, L=2, NB=3, BS=4, H=2, E=4)
    cache_np = S.random_cache("vllm_flashinfer_hnd", g, "float16", np.random.default_rng(1))
    slots = np.array([5, -1, 0, 11], np.int64)
    want = J.gather("vllm_flashinfer_hnd", cache_np, slots, planes=[1], layers=[1, 0])
    got = ops.gather(bind_np("vllm_flashinfer_hnd", cache_np, g, device), TC.slots(slots, device=device),
                     planes=[1], layers=[1, 0])
    TC.sync(device)
    assert got.device.type == torch.device(device).type
    TC.assert_same_bytes(got, want, "gathered rows")


# ---------------------------------------------------------------------------------------
# move (overlapping source and destination slots)
# ---------------------------------------------------------------------------------------

def move_patterns(n_slots: int, rng) -> dict:
    """Named (src, dst) slot pairs whose sets overlap."""
    perm = rng.permutation(n_slots)
    subset = rng.choice(n_slots, 40, replace=False)
    padded_src, padded_dst = np.arange(10, 60), np.arange(13, 63)
    padded_src[::7] = -1
    padded_dst[3::11] = -1
    return {
        "shift_right_long": (np.arange(5, 205), np.arange(8, 208)),      # run of 200 > 128, overlapping
        "shift_left_long": (np.arange(40, 290), np.arange(1, 251)),
        "shift_by_one_chain": (np.arange(0, 150), np.arange(1, 151)),     # every row moves onto the next
        "swap": (np.array([3, 17]), np.array([17, 3])),
        "cycle": (subset, np.roll(subset, 1)),                             # a permutation of one slot set
        "reverse": (np.arange(100, 0, -1), np.arange(1, 101)),
        "permutation_all": (perm, np.arange(n_slots)),
        "with_negatives": (padded_src, padded_dst),
        "empty": (np.zeros(0, np.int64), np.zeros(0, np.int64)),
    }


@pytest.mark.parametrize("layout,geom", [
    ("sglang_mha", Geometry(P=2, L=2, NB=75, BS=4, H=2, E=4)),
    ("vllm_flash_attn_hnd", Geometry(P=2, L=2, NB=19, BS=16, H=2, E=8)),
    ("vllm_mla", Geometry(P=1, L=3, NB=10, BS=32, H=1, E=20)),
    ("vllm_cross_layer", Geometry(P=2, L=2, NB=38, BS=8, H=1, E=6)),
], ids=["sglang_mha", "vllm_flash_attn_hnd", "vllm_mla", "vllm_cross_layer"])
@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES)
def test_move_overlapping(device, layout, geom, slot_dtype):
    rng = np.random.default_rng(7)
    cache_np = S.random_cache(layout, geom, "bfloat16", rng)
    cache = bind_np(layout, cache_np, geom, device)
    for name, (src, dst) in move_patterns(geom.N, rng).items():
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        cache_np = J.move(layout, cache_np, src, dst)
        ops.move(cache, TC.slots(src, slot_dtype, device), TC.slots(dst, slot_dtype, device))
        TC.sync(device)
        TC.assert_same_bytes(cache.tensors, TC.flat(layout, cache_np), f"after move {name}")


# ---------------------------------------------------------------------------------------
# skip_prefix
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 3, 8, 20])
def test_skip_prefix_matches_reference(device, n):
    slots = np.array([4, 9, -1, 2, 7, 1, 0, 3], np.int64)
    for dtype in SLOT_DTYPES:
        got = ops.skip_prefix(TC.slots(slots, dtype, device), n)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.cpu().numpy(), np.asarray(R.skip_prefix(slots, n)))
    got = ops.skip_prefix(None, n, num_tokens=6)
    np.testing.assert_array_equal(got.numpy(), np.asarray(R.skip_prefix(None, n, num_tokens=6)))


# ---------------------------------------------------------------------------------------
# strided binding: a permuted NHD-shaped view of HND memory
# ---------------------------------------------------------------------------------------

def test_permuted_nhd_view_of_hnd_memory(device):
    rng = np.random.default_rng(5)
    g = Geometry(P=2, L=2, NB=6, BS=4, H=3, E=8)
    hnd_np = S.random_cache("vllm_flash_attn_hnd", g, "float16", rng)         # list[L] of [2, NB, H, BS, D]
    nhd_np = [np.ascontiguousarray(x.transpose(0, 1, 3, 2, 4)) for x in hnd_np]   # same values, NHD shape
    memory = [TC.tensor(x, device) for x in hnd_np]
    views = [m.permute(0, 1, 3, 2, 4) for m in memory]                       # NHD-shaped, HND strides
    cache = ops.bind("vllm_flash_attn_nhd", views)
    assert cache.geometry == g

    slots = np.array([3, 22, -1, 9, 10, 11, 0, 23], np.int64)
    cg = Geometry(P=2, L=2, NB=len(slots), BS=1, H=1, E=g.H * g.E)
    chunk_np = S.sentinel_cache("lmcache_kv_2ltd", cg, "float16")
    want = J.transfer("vllm_flash_attn_nhd", nhd_np, "lmcache_kv_2ltd", chunk_np, slots, None)
    chunk = TC.tensor(chunk_np, device)
    ops.transfer(cache, ops.bind("lmcache_kv_2ltd", chunk), TC.slots(slots, device=device))
    TC.sync(device)
    TC.assert_same_bytes(chunk, want, "gathered chunk")

    # and back: scatter new rows into the view, check the HND memory itself
    new_np = S.random_cache("lmcache_kv_2ltd", cg, "float16", rng)
    want = J.transfer("lmcache_kv_2ltd", new_np, "vllm_flash_attn_nhd", nhd_np, None, slots)
    ops.transfer(ops.bind("lmcache_kv_2ltd", TC.tensor(new_np, device)), cache, None, TC.slots(slots, device=device))
    TC.sync(device)
    TC.assert_same_bytes(memory, [np.asarray(x).transpose(0, 1, 3, 2, 4) for x in want], "HND memory")


# ---------------------------------------------------------------------------------------
# kernel paths: many segments, vector widths
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("src_layout,dst_layout", [
    ("vllm_flash_attn_nhd", "lmcache_kv_2ltd"),          # 80 per-layer tensors x 2 planes = 160 segments
    ("hicache_page_head", "vllm_flashinfer_hnd"),        # pieces on both sides, 160 segments
    ("sglang_mha", "hicache_layer_first"),               # 160 tensors on the source side
])
def test_many_layers_several_launches(device, src_layout, dst_layout):
    g = Geometry(P=2, L=80, NB=3, BS=4, H=2, E=8)
    slots = np.array([0, 7, 3, -1, 11, 8, 9, 10], np.int64)
    dg = g if dst_layout != "lmcache_kv_2ltd" else Geometry(P=2, L=80, NB=len(slots), BS=1, H=1, E=16)
    case = S.TransferCase(src_layout, g, dst_layout, dg, "bfloat16", tuple(slots),
                          None if dst_layout == "lmcache_kv_2ltd" else tuple(np.roll(slots, 3)), seed=3)
    launches = ops.plan(bind_np(src_layout, case.caches()[0], g), bind_np(dst_layout, case.caches()[1], dg),
                        list(range(80)), list(range(80)), [0, 1], [0, 1])
    assert sum(len(x.src_segments) // 2 for x in launches) == 160 > 128
    run_transfer_case(case, device)
    run_transfer_case(case, device, max_ctas=3)
    run_transfer_case(case, device, max_ctas=1)


def vector_width(launch) -> int:
    """The vector width (bytes) a device launcher picks for one launch (mirrors widest_vector_bytes)."""
    pb, n = launch.piece_bytes, launch.num_pieces
    sg, dg = launch.src_geometry, launch.dst_geometry    # [num_slots, page, stride_page, stride_in_page, stride_piece]
    if (n == 1 or sg[4] == pb) and (n == 1 or dg[4] == pb):
        pb, n = pb * n, 1
    align = pb
    for geo in (sg, dg):
        if geo[0] > geo[1]:
            align |= geo[2]
        if geo[1] > 1 and geo[0] > 1:
            align |= geo[3]
        if n > 1:
            align |= geo[4]
    for tensors, segments in ((launch.src_tensors, launch.src_segments), (launch.dst_tensors, launch.dst_segments)):
        for i in range(0, len(segments), 2):
            align |= tensors[segments[i]].data_ptr() + segments[i + 1]
    vec = 16
    while vec > 1 and align % vec:
        vec //= 2
    return vec


# (dtype, elements per row, heads, src offset, dst offset in elements) -> vector width
VECTOR_CASES = [
    ("float16", 8, 1, 0, 0, 16),
    ("float16", 4, 1, 0, 0, 8),
    ("float16", 2, 1, 0, 0, 4),
    ("float16", 1, 1, 0, 0, 2),
    ("float16", 8, 1, 1, 0, 2),    # misaligned source
    ("float16", 8, 1, 0, 2, 4),    # destination 4-byte aligned only
    ("float16", 8, 1, 4, 4, 8),
    ("float16", 32, 4, 0, 0, 16),  # heads apart on one side: pieces of 16 bytes
    ("float16", 12, 3, 0, 0, 8),   # pieces of 8 bytes
    ("uint8", 3, 1, 0, 0, 1),
    ("uint8", 16, 1, 1, 1, 1),
    ("float32", 6, 2, 0, 0, 4),
    ("float32", 656, 1, 0, 0, 16),
    ("float16", 576, 1, 0, 0, 16),  # MLA's 1,152-byte rows: two to a CTA on the device (odd token count)
    ("float32", 256, 1, 0, 0, 16),  # 1,024-byte rows, the shortest moved by row of two warps or more
    ("float16", 128, 1, 0, 0, 16),  # L32 H1's 256-byte rows: eight to a CTA of 16 threads each on the device
    ("float16", 256, 1, 0, 0, 16),  # 512-byte rows, one warp: eight to a CTA
    ("float16", 128, 1, 4, 4, 8),   # 256-byte rows in 8-byte vectors: the walk
]


@pytest.mark.parametrize("dtype,width,heads,src_off,dst_off,vec", VECTOR_CASES,
                         ids=[f"{c[0]}-w{c[1]}-h{c[2]}-o{c[3]}.{c[4]}-vec{c[5]}" for c in VECTOR_CASES])
def test_vector_widths(device, dtype, width, heads, src_off, dst_off, vec):
    """Rows whose byte width and alignment select each vector width of the CUDA kernel."""
    rng = np.random.default_rng(width * 31 + src_off)
    E = width // heads
    # source: an HND paged cache (heads apart when H > 1) in a buffer starting `src_off` elements in
    sg = Geometry(P=2, L=2, NB=5, BS=4, H=heads, E=E)
    dg = Geometry(P=2, L=2, NB=9, BS=1, H=1, E=width)
    src_np = S.random_cache("vllm_flash_attn_hnd", sg, dtype, rng)
    dst_np = S.random_cache("lmcache_kv_2ltd", dg, dtype, rng)

    def placed(array, off):
        buf = TC.tensor(np.concatenate([TC.random_array((off,), dtype, rng), array.reshape(-1)]), device)
        return buf, buf[off:].view(array.shape)

    src_bufs, src_views = zip(*(placed(x, src_off) for x in src_np))
    dst_buf, dst_view = placed(dst_np, dst_off)
    src = ops.bind("vllm_flash_attn_hnd", list(src_views))
    dst = ops.bind("lmcache_kv_2ltd", dst_view)
    slots = np.array([19, 0, 1, 2, 3, -1, 8, 7, 12], np.int64)
    launches = ops.plan(src, dst, [0, 1], [0, 1], [0, 1], [0, 1])
    assert {vector_width(x) for x in launches} == {vec}
    dst_before = TC.bits(dst_buf[:dst_off]).copy()

    want = J.transfer("vllm_flash_attn_hnd", src_np, "lmcache_kv_2ltd", dst_np, slots, None)
    ops.transfer(src, dst, TC.slots(slots, device=device))
    TC.sync(device)
    TC.assert_same_bytes(dst_view, want, "gathered")
    np.testing.assert_array_equal(TC.bits(dst_buf[:dst_off]), dst_before)

    # the other direction (scatter into the strided cache)
    want_back = J.transfer("lmcache_kv_2ltd", dst_np, "vllm_flash_attn_hnd", src_np, None, slots)
    ops.transfer(ops.bind("lmcache_kv_2ltd", TC.tensor(dst_np, device)), src, None, TC.slots(slots, device=device))
    TC.sync(device)
    TC.assert_same_bytes(list(src_views), TC.flat("vllm_flash_attn_hnd", want_back), "scattered")


# ---------------------------------------------------------------------------------------
# CUDA: pinned host memory on either side, slots on the device or in pinned memory
# ---------------------------------------------------------------------------------------

@pytest.fixture(params=[("streaming", "row_per_cta"), ("default", "row_per_cta"), ("streaming", "walk"),
                        ("default", "walk")], ids="-".join)
def host_launch_settings(request):
    """Each cache-operator setting (ops.set_host_cache_hints) and launch shape (ops.set_host_launch_shape) of
    launches that touch pinned memory, restored after the test."""
    from kvlayout.ops import _native
    kept = _native.host_cache_hints(), _native.host_launch_shape()
    hints, shape = request.param
    ops.set_host_cache_hints(hints)
    ops.set_host_launch_shape(shape)
    yield request.param
    ops.set_host_cache_hints(kept[0])
    ops.set_host_launch_shape(kept[1])


@pytest.mark.parametrize("direction", ["device_to_pinned", "pinned_to_device"])
@pytest.mark.parametrize("slot_place", ["device", "pinned"])
@pytest.mark.parametrize("pair", [("vllm_flash_attn_hnd", "hicache_page_first"),
                                  ("vllm_mla", "hicache_mla_page_first_kv_split"),
                                  ("sglang_mha", "hicache_page_head"),
                                  ("vllm_packed_nhd", "lmcache_kv_2ltd")], ids=lambda p: f"{p[0]}-{p[1]}")
@settings(max_examples=TC.examples(3))
@given(data=st.data())
def test_pinned_host_transfers(cuda_device, direction, slot_place, pair, host_launch_settings, data):
    """Either side in pinned memory, under both cache-operator settings and both launch shapes: every byte as the
    reference says."""
    device_layout, host_layout = pair
    if direction == "device_to_pinned":
        case = data.draw(S.transfer_cases(src_layout=device_layout, dst_layout=host_layout))
        places = dict(placement="pinned dst")
    else:
        case = data.draw(S.transfer_cases(src_layout=host_layout, dst_layout=device_layout))
        places = dict(placement="pinned src")
    slot_dtypes = data.draw(st.tuples(st.sampled_from(("int32", "int64")), st.sampled_from(("int32", "int64"))))
    # the default grid, and SM budgets (n CTAs of 1024 threads: the budgeted kernels)
    max_ctas = data.draw(st.sampled_from((0, 1, 4)))
    run_transfer_case(case, cuda_device, slot_dtypes=slot_dtypes, pinned_slots=slot_place == "pinned",
                      max_ctas=max_ctas, **places)


@pytest.mark.parametrize("slot_place", ["device", "pinned"])
def test_gather_to_and_scatter_from_pinned_rows(cuda_device, slot_place, host_launch_settings):
    g = Geometry(P=2, L=3, NB=8, BS=16, H=4, E=32)
    rng = np.random.default_rng(9)
    cache_np = S.random_cache("vllm_flashinfer_hnd", g, "bfloat16", rng)
    slots = rng.permutation(g.N)[:50].astype(np.int64)
    slots[::9] = -1
    rows_geom = Geometry(P=2, L=3, NB=50, BS=1, H=4, E=32)
    out_np = S.random_cache("rows", rows_geom, "bfloat16", rng)
    want = J.gather("vllm_flashinfer_hnd", cache_np, slots, out=out_np)
    cache = bind_np("vllm_flashinfer_hnd", cache_np, g, cuda_device)
    out = TC.tensor(out_np, pin=True)
    s = TC.slots(slots, torch.int32, cuda_device, pin=slot_place == "pinned")
    ops.gather(cache, s, out=out)
    TC.sync(cuda_device)
    TC.assert_same_bytes(out, want, "rows in pinned memory")
    rows_np = S.random_cache("rows", rows_geom, "bfloat16", rng)
    want = J.scatter("vllm_flashinfer_hnd", cache_np, rows_np, slots)
    ops.scatter(cache, TC.tensor(rows_np, pin=True), s)
    TC.sync(cuda_device)
    TC.assert_same_bytes(cache.tensors, TC.flat("vllm_flashinfer_hnd", want), "cache after scatter from pinned")


def test_remembered_plans_follow_the_caches_they_are_used_with(device):
    """Caches of equal layout, sizes and strides share one plan; each call still reads and writes its own tensors."""
    gen = torch.Generator().manual_seed(5)
    caches = [[torch.randint(0, 255, (2, 4, 4, 2, 8), dtype=torch.uint8, generator=gen).to(device) for _ in range(3)]
              for _ in range(2)]
    chunks = [torch.zeros(2, 3, 5, 16, dtype=torch.uint8, device=device) for _ in range(2)]
    slots = torch.tensor([3, 0, 9, 15, 4], device=device)
    for kv, chunk in zip(caches, chunks):
        ops.transfer(ops.bind("vllm_flash_attn_nhd", kv), ops.bind("lmcache_kv_2ltd", chunk), slots, None)
    for kv, chunk in zip(caches, chunks):
        want = torch.stack([torch.stack([layer[p].reshape(16, 16)[slots] for layer in kv]) for p in range(2)])
        assert torch.equal(chunk, want)


@pytest.mark.parametrize("threads", [1, 3, 4])
def test_cpu_split_over_threads_moves_every_row_once(threads):
    """The CPU op splits the tokens over torch's threads (grain: 256 KiB of rows); a run of consecutive slots
    that crosses a split is cut there and each part moved by its thread: bit-exact against the reference at
    1, 3 and 4 threads, with whole pages in random order and holes (a row lost at a split shows)."""
    rng = np.random.default_rng(threads)
    g = Geometry(P=2, L=2, NB=96, BS=16, H=2, E=64)    # 1 KiB of rows per token: a split every 256 tokens
    src_np = S.random_cache("vllm_flash_attn_nhd", g, "bfloat16", rng)
    dst_np = S.sentinel_cache("hicache_page_first", g, "bfloat16")
    pages = rng.permutation(g.NB)
    src_slots = (pages[:, None] * g.BS + np.arange(g.BS)).reshape(-1)
    src_slots[rng.choice(src_slots.size, 40, replace=False)] = -1
    # a counting-up stretch that crosses a split, then slots counting down (one row per copy on that side)
    up = g.BS * 20
    dst_slots = np.concatenate([np.arange(up), np.arange(up, src_slots.size)[::-1]])
    want = R.transfer("vllm_flash_attn_nhd", src_np, "hicache_page_first", dst_np, src_slots, dst_slots,
                      src_geom=g, dst_geom=g)
    src = bind_np("vllm_flash_attn_nhd", src_np, g)
    dst = bind_np("hicache_page_first", dst_np, g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ops.transfer(src, dst, TC.slots(src_slots, torch.int64, "cpu"), TC.slots(dst_slots, torch.int32, "cpu"))
    finally:
        torch.set_num_threads(before)
    TC.assert_same_bytes(dst.tensors, TC.flat("hicache_page_first", want))
