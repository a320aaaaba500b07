"""Hostile input at the native layer, second round: destination tensors that share bytes, rows longer than
the device walk can count, bad slots counted once per program step, one check of a program's step and
tensor counts, and bound tensors re-strided after binding.

Each test fails without the check it covers (the copy would be done, wrongly or with the old geometry).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from kvlayout import _C, ops
from kvlayout.ops import _native

ROOT = Path(__file__).resolve().parents[1]
NO_AXIS = -1


def row_launch(num_slots: int, row_bytes: int) -> dict:
    """copy_rows arguments of one segment of contiguous rows (``num_slots`` rows per side)."""
    geom = [num_slots, 1, row_bytes, row_bytes, 0]
    return dict(src_segments=[0, 0], dst_segments=[0, 0], src_geometry=geom, dst_geometry=list(geom),
                num_pieces=1, piece_bytes=row_bytes)


# ---------------------------------------------------------------------------------------
# destination tensors that share bytes
# ---------------------------------------------------------------------------------------

NB, BS, H, D = 8, 4, 2, 8          # per layer: [2, NB, BS, H, D] float16 (vllm_flash_attn_nhd)


def _shifted_layers(device):
    """Two per-layer destination views of one buffer, the second one page further than the first: layer 0 is
    pages [1, 1 + NB) and layer 1 pages [2, 2 + NB) of the buffer, so most rows of one are rows of the other."""
    buf = torch.zeros(2, NB + 3, BS, H, D, dtype=torch.float16, device=device)
    return buf, [buf[:, 1:1 + NB], buf[:, 2:2 + NB]]


def _source(device, layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NB, BS, H, D, generator=g).half().to(device) for _ in range(layers)]


def test_destination_layers_that_partially_overlap_are_refused(device):
    buf, views = _shifted_layers(device)
    src = ops.bind("vllm_flash_attn_nhd", _source(device))
    dst = ops.bind("vllm_flash_attn_nhd", views)
    slots = torch.arange(6, device=device)
    with pytest.raises(ValueError, match=r"dst\[0\] and dst\[1\] overlap in memory"):
        ops.transfer(src, dst, slots, slots)
    with pytest.raises(ValueError, match=r"dst\[0\] and dst\[1\] overlap in memory"):
        ops.prepare(src, dst, slots, slots)
    assert int(buf.count_nonzero()) == 0, "a refused transfer wrote the destination"
    # the raw op with the launch of a plan over two disjoint caches, given the overlapping tensors
    launch = ops.plan(src, ops.bind("vllm_flash_attn_nhd", _source(device, seed=1)), [0, 1], [0, 1], [0, 1],
                      [0, 1])[0]
    with pytest.raises(ValueError, match=r"dst\[0\] and dst\[1\] overlap in memory"):
        _native.copy_rows(list(src.tensors), views, slots, slots, 6, 0, launch.src_segments, launch.dst_segments,
                          launch.src_geometry, launch.dst_geometry, launch.num_pieces, launch.piece_bytes)
    assert int(buf.count_nonzero()) == 0


def test_destination_tensors_of_two_parts_that_share_rows_are_refused(device):
    """SGLang's K and V lists, V of layer 1 four rows into V of layer 0 (same strides, shifted start)."""
    N = NB * 2
    rows = torch.zeros(4 * N, H, D, dtype=torch.float16, device=device)
    k = [rows[:N], rows[N:2 * N]]
    v = [rows[2 * N:3 * N], rows[2 * N + 4:3 * N + 4]]
    src = ops.bind("sglang_mha", ([torch.ones(N, H, D, dtype=torch.float16, device=device)] * 2,
                                  [torch.ones(N, H, D, dtype=torch.float16, device=device)] * 2))
    dst = ops.bind("sglang_mha", (k, v))
    with pytest.raises(ValueError, match=r"dst\[2\] and dst\[3\] overlap in memory"):
        ops.transfer(src, dst, torch.arange(4, device=device), torch.arange(4, device=device))
    assert int(rows.count_nonzero()) == 0


def test_interleaved_planes_of_one_buffer_are_still_accepted(device):
    """K and V of each token side by side in one buffer (``buf[:, 0]`` and ``buf[:, 1]``): their byte ranges
    meet but they share no byte, so the check must let them through, and the copy is exact."""
    N = NB * BS
    g = torch.Generator().manual_seed(3)
    src = ops.bind("sglang_mha", ([torch.randn(N, H, D, generator=g).half().to(device) for _ in range(2)],
                                  [torch.randn(N, H, D, generator=g).half().to(device) for _ in range(2)]))
    bufs = [torch.zeros(N, 2, H, D, dtype=torch.float16, device=device) for _ in range(2)]
    dst = ops.bind("sglang_mha", ([b[:, 0] for b in bufs], [b[:, 1] for b in bufs]))
    plain = ops.bind("sglang_mha", ([torch.zeros(N, H, D, dtype=torch.float16, device=device) for _ in range(2)],
                                    [torch.zeros(N, H, D, dtype=torch.float16, device=device) for _ in range(2)]))
    s = torch.tensor([3, 0, 17, 9], device=device)
    d = torch.tensor([5, 30, 1, 12], device=device)
    ops.transfer(src, dst, s, d)
    ops.transfer(src, plain, s, d)
    for got, want in zip(dst.tensors, plain.tensors):
        assert torch.equal(got, want)
    assert int(plain.tensors[0].count_nonzero()) > 0


def test_per_layer_views_of_a_layer_inner_buffer_are_still_accepted(device):
    """Per-layer views ``buf[:, :, l]`` of one ``[2, NB, L, BS, H, D]`` buffer: each view spans nearly the whole
    buffer (two strided outer axes), yet no two share a byte; the copy is exact."""
    L = 3
    g = torch.Generator().manual_seed(5)
    src = ops.bind("vllm_flash_attn_nhd", [torch.randn(2, NB, BS, H, D, generator=g).half().to(device)
                                           for _ in range(L)])
    buf = torch.zeros(2, NB, L, BS, H, D, dtype=torch.float16, device=device)
    dst = ops.bind("vllm_flash_attn_nhd", [buf[:, :, i] for i in range(L)])
    plain = ops.bind("vllm_flash_attn_nhd", [torch.zeros(2, NB, BS, H, D, dtype=torch.float16, device=device)
                                             for _ in range(L)])
    s = torch.tensor([3, 0, 17, 9, 30], device=device)
    d = torch.tensor([5, 31, 1, 12, 20], device=device)
    ops.transfer(src, dst, s, d)
    ops.transfer(src, plain, s, d)
    for got, want in zip(dst.tensors, plain.tensors):
        assert torch.equal(got, want)
    assert int(buf.count_nonzero()) > 0
    # and the same buffer's views one token apart do share bytes
    layer0 = buf[:, :, 0]
    shifted = [layer0, torch.as_strided(buf, layer0.shape, layer0.stride(), buf.storage_offset() + H * D)]
    with pytest.raises(ValueError, match=r"dst\[0\] and dst\[1\] overlap in memory"):
        ops.transfer(src, ops.bind("vllm_flash_attn_nhd", shifted + [buf[:, :, 2]]), s, d)


# ---------------------------------------------------------------------------------------
# rows longer than the walk's 32-bit vector count
# ---------------------------------------------------------------------------------------

def test_a_row_of_2_to_the_31_bytes_is_refused_before_anything_moves(device):
    """2048 pieces of 1 MiB, every piece at the same offset on both sides (stride_piece 0): the tensors hold
    1 MiB, the row counts 2^31 bytes (2^31 one-byte vectors for the walk, whose count is 32-bit)."""
    src = torch.full((1 << 20,), 7, dtype=torch.uint8, device=device)
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
    geom = [1, 1, 0, 0, 0]
    kwargs = dict(src_segments=[0, 0], dst_segments=[0, 0], src_geometry=geom, dst_geometry=list(geom))
    with pytest.raises(ValueError, match=r"num_pieces \* piece_bytes = 2048 \* 1048576 = 2147483648 bytes is "
                                         r"longer than the 2147483582 bytes a row may hold"):
        _native.copy_rows([src], [dst], None, None, 1, 0, num_pieces=2048, piece_bytes=1 << 20, **kwargs)
    assert int(dst.count_nonzero()) == 0
    # the longest row allowed is still copied (one piece just below the limit would need 2 GiB: one below
    # in pieces instead)
    _native.copy_rows([src], [dst], None, None, 1, 0, num_pieces=2047, piece_bytes=1 << 20, **kwargs)
    assert torch.equal(dst, src)


def test_the_row_limit_is_the_walks_count_limit(walk_lib):
    """The host's limit (kvlayout: the message above) is the header's kMaxWalkCount: a row of that many
    one-byte vectors plus a step of kWalkLanes stays below 2^31."""
    assert walk_lib.kvl_max_walk_count() == 2147483582
    assert walk_lib.kvl_max_walk_count() + 2 * 32 + 1 < 2 ** 31


# ---------------------------------------------------------------------------------------
# bad slots counted once per program step (device backends record, the CPU raises)
# ---------------------------------------------------------------------------------------

INT64_MAX = 2 ** 63 - 1


def _emulate(lib, dst_slots: np.ndarray, dst_num_slots: int, status: np.ndarray) -> np.ndarray:
    """One emulated launch: 16-byte rows, identity source of 16 slots, ``dst_slots`` into ``dst_num_slots``."""
    src_geom = np.array([16, 1, 16, 16, 16], np.int64)
    dst_geom = np.array([dst_num_slots, 1, 16, 16, 16], np.int64)
    src = np.arange(16 * 16, dtype=np.uint8)
    dst = np.zeros(16 * dst_num_slots, np.uint8)
    zero = np.zeros(1, np.int64)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)   # noqa: E731
    rc = lib.kvl_emulate_walk(ptr(src_geom), ptr(dst_geom), None, 1, ptr(dst_slots), 1, 8, 0, len(dst_slots), 1,
                              ptr(zero), ptr(zero), ptr(src), ptr(dst), 1, 16, 16, 4, 64, ptr(status))
    assert rc == 0
    return dst


def test_each_bad_token_of_a_step_is_recorded_once(walk_lib):
    """Two launches of one step read the same slots with their own slot counts (8 and 6): the second records
    only the tokens the first found in range."""
    slots = np.array([0, 7, 9, 1, 12], np.int64)     # out of range: 9, 12 for 8 slots; 7, 9, 12 for 6
    status = np.zeros(5, np.int64)
    try:
        walk_lib.kvl_set_recording(INT64_MAX, INT64_MAX)
        first = _emulate(walk_lib, slots, 8, status)
        assert status[0] == 2 and status[2] in (9, 12)
        walk_lib.kvl_set_recording(INT64_MAX, 8)
        second = _emulate(walk_lib, slots, 6, status)
        assert status[0] == 3, f"{status[0]} records for 3 bad tokens"
        # the rows of the valid tokens still moved in both launches
        assert np.array_equal(first[7 * 16:8 * 16], np.arange(16 * 1, 16 * 2, dtype=np.uint8))
        assert np.array_equal(second[16:32], np.arange(16 * 3, 16 * 4, dtype=np.uint8))
        # a launch that records nothing (the later launches of a split call)
        walk_lib.kvl_set_recording(0, 0)
        _emulate(walk_lib, slots, 6, status)
        assert status[0] == 3
    finally:
        walk_lib.kvl_set_recording(INT64_MAX, INT64_MAX)


def _two_launch_program(num_rows: tuple[int, int], row_bytes: int) -> int:
    """A registered copy program whose step 0 has two launches: tensor i of the source into tensor i of the
    destination, each a flat ``[num_rows[i], row_bytes]`` uint8 slot axis (different slot counts: two row
    geometries, so two launches)."""
    axes = [(NO_AXIS, NO_AXIS, NO_AXIS, 0, NO_AXIS)] * 2
    zero = (0, 0, 0, 0)
    launches = [(1, row_bytes, (zero, [(i, zero)]), (zero, [(i, zero)])) for i in range(2)]
    return _C.register_program([launches], axes, axes)


def test_a_step_of_two_launches_counts_each_bad_slot_once(cuda_device):
    rows = (8, 6)
    handle = _two_launch_program(rows, 16)
    try:
        src = [torch.arange(n * 16, dtype=torch.uint8, device=cuda_device).view(n, 16) for n in rows]
        dst = [torch.zeros(n, 16, dtype=torch.uint8, device=cuda_device) for n in rows]
        ops.check_errors(cuda_device)
        d = torch.tensor([0, 7, 9, 1, 12], device=cuda_device)    # bad: 9, 12 (8 rows); 7, 9, 12 (6 rows)
        s = torch.tensor([0, 1, 2, 3, 4], device=cuda_device)
        status = _native.status_tensor(torch.device(cuda_device))
        torch.ops.kvlayout.copy_program(handle, src, dst, s, d, 0, 5, 0, 0, status, False)
        with pytest.raises(IndexError, match=r"\(2 more out-of-range entries were skipped\)"):
            ops.check_errors(cuda_device)
        assert torch.equal(dst[0][1], src[0][3]) and torch.equal(dst[1][0], src[1][0])
    finally:
        _C.drop_program(handle)


def test_a_step_of_two_launches_raises_on_the_cpu():
    handle = _two_launch_program((8, 6), 16)
    try:
        src = [torch.ones(n, 16, dtype=torch.uint8) for n in (8, 6)]
        dst = [torch.zeros(n, 16, dtype=torch.uint8) for n in (8, 6)]
        status = _native.status_tensor(torch.device("cpu"))
        with pytest.raises(IndexError, match=r"dst_slots\[1\] = 7 is out of range"):
            torch.ops.kvlayout.copy_program(handle, src, dst, torch.arange(3), torch.tensor([0, 7, 1]), 0, 3, 0, 0,
                                            status, False)
    finally:
        _C.drop_program(handle)


# ---------------------------------------------------------------------------------------
# one check of a program call's step and tensor counts
# ---------------------------------------------------------------------------------------

def test_resolving_binding_and_running_check_step_and_counts_alike():
    handle = _two_launch_program((4, 4), 8)
    try:
        src = [torch.ones(4, 8, dtype=torch.uint8) for _ in range(2)]
        dst = [torch.zeros(4, 8, dtype=torch.uint8) for _ in range(2)]
        status = _native.status_tensor(torch.device("cpu"))
        step_text = r"the copy program has 1 steps \(all layers, then one per layer\), got step 3"
        with pytest.raises(IndexError, match=step_text):
            _C.resolve_program(handle, 3, src, dst)
        with pytest.raises(IndexError, match=step_text):
            torch.ops.kvlayout.copy_program(handle, src, dst, None, None, 3, 4, 0, 0, status, False)
        with pytest.raises(IndexError, match=r"got step -1"):
            _C.resolve_program(handle, -1, src, dst)
        count_text = r"the copy program writes a destination of 2 tensors, got 1"
        with pytest.raises(ValueError, match=count_text):
            _C.resolve_program(handle, 0, src, dst[:1])
        with pytest.raises(ValueError, match=count_text):
            torch.ops.kvlayout.copy_program(handle, src, dst[:1], None, None, 0, 4, 0, 0, status, False)
        with pytest.raises(ValueError, match=r"the copy program reads a source of 2 tensors, got 3"):
            _C.resolve_program(handle, 0, src + src[:1], dst)
        torch.ops.kvlayout.copy_program(handle, src, dst, None, None, 0, 4, 0, 0, status, False)
        assert all(torch.equal(d, s) for d, s in zip(dst, src))
    finally:
        _C.drop_program(handle)


# ---------------------------------------------------------------------------------------
# a bound tensor re-strided in place after binding
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["kernel", "copy"])
def test_a_destination_re_strided_after_prepare_is_refused(device, engine):
    src = ops.bind("vllm_flash_attn_nhd", _source(device))
    layers = [torch.zeros(2, NB, BS, H, D, dtype=torch.float16, device=device) for _ in range(2)]
    dst = ops.bind("vllm_flash_attn_nhd", layers)
    slot_device = "cpu" if engine == "copy" else device
    t = ops.prepare(src, dst, torch.arange(4, device=slot_device), torch.arange(4, device=slot_device),
                    engine=engine)
    # the same storage, sizes kept, two axes' strides swapped: rows now lie elsewhere inside the storage
    layers[1].as_strided_(layers[1].shape, (NB * BS * H * D, BS * H * D, H * D, 1, H))
    with pytest.raises(RuntimeError, match=r"re-set or freed|re-strided"):
        t()
    with pytest.raises(RuntimeError, match=r"re-set or freed|re-strided"):
        t.layer(1)
    if engine == "kernel":
        t.layer(0)                        # layer 0 was not touched: it still runs
        assert int(layers[0].count_nonzero()) > 0
    assert int(layers[1].count_nonzero()) == 0


def test_a_copy_of_more_than_2_to_the_63_bytes_is_refused():
    """Identity slots over a geometry of 2^62 slots that all sit at one row (strides 0): num_tokens rows of
    1 MiB would overflow the walk's 64-bit item count; refused before anything moves."""
    src = torch.ones(1 << 20, dtype=torch.uint8)
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    geom = [1 << 62, 1, 0, 0, 0]
    with pytest.raises(ValueError, match=r"num_tokens = 4611686018427387904 tokens of 1048576 bytes each would "
                                         r"move more than 2\^63 bytes"):
        _native.copy_rows([src], [dst], None, None, 1 << 62, 0, [0, 0], [0, 0], geom, list(geom), 1, 1 << 20)
    assert int(dst.count_nonzero()) == 0


def _addresses(t: torch.Tensor) -> set[int]:
    """Every byte address of ``t``'s elements (brute force)."""
    idx = torch.zeros((), dtype=torch.int64)
    for d in range(t.dim()):
        shape = [1] * t.dim()
        shape[d] = t.size(d)
        idx = idx + (torch.arange(t.size(d)) * t.stride(d)).view(shape)
    base = t.data_ptr()
    isz = t.element_size()
    return {base + int(e) * isz + b for e in idx.reshape(-1).tolist() for b in range(isz)}


@pytest.mark.parametrize("seed", range(4))
def test_the_destination_overlap_check_agrees_with_the_byte_addresses(seed):
    """Random strided views of one buffer as two destination tensors of the raw op: refused exactly when two
    of them share a byte, for views of one shape (for views of different shapes: whenever they share one)."""
    rng = np.random.default_rng(seed)
    buffer = torch.zeros(4096, dtype=torch.uint8)
    src = torch.ones(8, dtype=torch.uint8)
    geom = [1, 1, 0, 0, 0]
    seen = {"refused": 0, "accepted": 0}
    for _ in range(150):
        dtype = torch.int16 if rng.random() < 0.3 else torch.uint8
        isz = 2 if dtype == torch.int16 else 1
        flat = buffer.view(dtype)
        dims = int(rng.integers(1, 4))

        def layout():
            """Sizes and strides of a view without internal overlap: each stride past the inner extent (plus
            a gap), in a random order of the dimensions."""
            sizes = [int(rng.integers(1, 5)) for _ in range(dims)]
            strides, extent = [], 1
            for n in sizes:
                strides.append(extent + int(rng.integers(0, 3)) * int(rng.random() < 0.5) * extent)
                extent = strides[-1] * n
            order = rng.permutation(dims)
            return [sizes[i] for i in order], [strides[i] for i in order]

        sizes, strides = layout()
        same = rng.random() < 0.7
        sizes_b, strides_b = (sizes, strides) if same else layout()
        a = flat.as_strided(sizes, strides, int(rng.integers(0, 48)))
        b = flat.as_strided(sizes_b, strides_b, int(rng.integers(0, 48)))
        if torch._debug_has_internal_overlap(a) == 1 or torch._debug_has_internal_overlap(b) == 1:
            continue       # (refused for internal overlap, another check)
        if a.data_ptr() == b.data_ptr():
            continue       # (one base for both segments: refused by the segment check)
        shared = bool(_addresses(a) & _addresses(b))
        try:
            _native.copy_rows([src], [a.view(torch.uint8) if isz == 1 else a, b], None, None, 1, 0, [0, 0, 0, 0],
                              [0, 0, 1, 0], geom, list(geom), 1, isz)
            refused = False
        except ValueError as e:
            assert "dst[0] and dst[1] overlap in memory" in str(e), e
            refused = True
        if same:
            assert refused == shared, (sizes, strides, a.data_ptr() - b.data_ptr(), shared)
        else:
            assert refused or not shared, (sizes, strides, sizes_b, strides_b, "a shared byte was missed")
        seen["refused" if refused else "accepted"] += 1
        buffer.zero_()
    assert seen["refused"] > 10 and seen["accepted"] > 10, seen
