"""Bad input to the op library: a clear exception naming the argument, and nothing written.

Every error kind of every operation family (out-of-range slots, layers,
planes, pages and positions, element types, row widths, slot dtypes and
shapes, duplicates, overlap, flat pages, RoPE geometry) is data in the case
database (``kvlayout.conformance.families``, each kind citing its rule in
``kvlayout.reference.semantics``) and runs on every device in
``test_families.py::test_error_input``.  Here are the cases that need more
than one call or a fixed setting: accepted raw integer storage, host memory
facing CUDA, ``KVLAYOUT_VALIDATE``, the deferred CUDA report with guard
bytes, positions and counts that must pair up, duplicates that are fine,
views of one buffer, page sizes and shapes at bind.  Each test checks the
message names the offending argument (and, where the message promises it,
the value and the bound), and that every destination tensor still holds its
bytes afterwards.  On CUDA the default path never
synchronizes: an out-of-range slot is skipped by the kernel and reported by
``ops.check_errors()``; ``validate=True`` raises before the launch.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from kvlayout import ops
from kvlayout import reference as R
from kvlayout.conformance import strategies as S
from kvlayout.reference import Geometry

import torch_cases as TC

G = Geometry(P=2, L=2, NB=4, BS=4, H=2, E=8)        # 16 slots, rows of 16 elements
T = 6


def make_cache(layout, device, dtype="float16", geom=G, seed=0, *, pin=False) -> ops.KVCache:
    physical = S.random_cache(layout, geom, dtype, np.random.default_rng(seed))
    return ops.bind(layout, TC.to_torch(layout, physical, device, pin=pin),
                    page_size=None if R.get(layout).paged else geom.BS)


def make_chunk(device, dtype="float16", T=T, E=16, seed=1, *, pin=False) -> ops.KVCache:
    return make_cache("lmcache_kv_2ltd", device, dtype, Geometry(P=2, L=2, NB=T, BS=1, H=1, E=E), seed, pin=pin)


def slots(values, device, dtype=torch.int64):
    return TC.slots(values, dtype, device)


@contextlib.contextmanager
def rejects(exc, match, *caches_or_tensors, device="cpu"):
    """The block raises ``exc`` matching ``match``; the given tensors keep their bytes."""
    tensors = []
    for x in caches_or_tensors:
        tensors.extend(x.tensors if isinstance(x, ops.KVCache) else [x])
    before = TC.snapshot(tensors)
    with pytest.raises(exc, match=match):
        yield
    TC.sync(device)
    TC.assert_unchanged(tensors, before)


# ---------------------------------------------------------------------------------------
# element types
# ---------------------------------------------------------------------------------------

def test_raw_integer_storage_of_the_same_size_is_accepted(device):
    """fp8 stored as uint8 (or bf16 as int16) exchanges bytes with the float type."""
    for float_dtype, raw in (("float8_e4m3fn", "uint8"), ("bfloat16", "int8")):
        src = make_cache("vllm_flash_attn_nhd", device, float_dtype)
        if raw == "int8":
            dst = make_chunk(device, "float16")
            dst = ops.bind("lmcache_kv_2ltd", dst.tensors[0].view(torch.int16))
        else:
            dst = make_chunk(device, raw)
        s = [3, 0, 15, -1, 7, 8]
        ops.transfer(src, dst, slots(s, device))
        TC.sync(device)
        got = dst.tensors[0].view(torch.uint8) if dst.itemsize == 1 else dst.tensors[0].view(torch.int16)
        for i, slot in enumerate(s):
            if slot < 0:
                continue
            for p in range(2):
                for layer in range(2):
                    row = src.tensors[layer][p].reshape(-1, 16)[slot]
                    assert torch.equal(got[p, layer, i], row.view(got.dtype))


# ---------------------------------------------------------------------------------------
# devices and host memory
# ---------------------------------------------------------------------------------------

def test_unpinned_host_destination_facing_cuda(cuda_device):
    src = make_cache("vllm_flash_attn_hnd", cuda_device)
    dst = make_cache("hicache_page_first", "cpu")                  # plain host memory
    assert not dst.tensors[0].is_pinned()
    with rejects(ValueError, r"dst\[0\] is an unpinned host tensor.*pin_memory", dst, device=cuda_device):
        ops.transfer(src, dst, slots([0, 1], cuda_device), slots([5, 6], cuda_device))


def test_unpinned_host_source_facing_cuda(cuda_device):
    src = make_cache("hicache_layer_first", "cpu")
    dst = make_cache("vllm_flash_attn_nhd", cuda_device)
    with rejects(ValueError, r"src\[0\] is an unpinned host tensor", dst, device=cuda_device):
        ops.transfer(src, dst, slots([0, 1], cuda_device), slots([5, 6], cuda_device))


def test_unpinned_host_slots_facing_cuda(cuda_device):
    src = make_cache("vllm_flash_attn_hnd", cuda_device)
    dst = make_cache("hicache_page_first", "cpu", pin=True)
    with rejects(ValueError, r"src_slots is an unpinned host tensor", dst, device=cuda_device):
        ops.transfer(src, dst, slots([0, 1], "cpu"), slots([5, 6], cuda_device))


def test_host_caches_with_device_slots(cuda_device):
    """Slots on the GPU while both caches are in host memory (the copy would run on the CPU)."""
    src = make_cache("hicache_layer_first", "cpu")
    dst = make_cache("hicache_page_first", "cpu", seed=2)
    with rejects(ValueError, r"src_slots is on cuda:\d but the operation runs on cpu", dst, device=cuda_device):
        ops.transfer(src, dst, slots([0, 1], cuda_device), slots([5, 6], cuda_device))


def test_unpinned_host_rows_for_gather(cuda_device):
    cache = make_cache("vllm_flash_attn_hnd", cuda_device)
    out = torch.zeros(2, 2, 3, 2, 8, dtype=torch.float16)
    with rejects(ValueError, r"dst\[0\] is an unpinned host tensor", out, device=cuda_device):
        ops.gather(cache, slots([0, 1, 2], cuda_device), out=out)


def test_tensors_of_one_cache_on_different_devices(cuda_device):
    kv = [torch.zeros(2, 4, 4, 2, 8, device=cuda_device), torch.zeros(2, 4, 4, 2, 8)]
    with pytest.raises(ValueError, match=r"vllm_flash_attn_nhd: tensor 1 is on cpu, tensor 0 on cuda"):
        ops.bind("vllm_flash_attn_nhd", kv)


# ---------------------------------------------------------------------------------------
# slots
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("side", ["src_slots", "dst_slots"])
def test_out_of_range_slot_validate_raises_before_launch(device, side, monkeypatch):
    src = make_cache("vllm_flash_attn_hnd", device)
    dst = make_cache("hicache_page_first_direct", device, seed=2)
    good = [0, 1, 2, 3, 4]
    bad = [3, 9, 1000, 2, 1]
    s, d = (bad, good) if side == "src_slots" else (good, bad)
    with rejects(IndexError, rf"{side}\[2\] = 1000 is out of range: the (source|destination) holds 16 slots", dst,
                 device=device):
        ops.transfer(src, dst, slots(s, device), slots(d, device), validate=True)
    monkeypatch.setenv("KVLAYOUT_VALIDATE", "1")
    with rejects(IndexError, rf"{side}\[2\] = 1000", dst, device=device):
        ops.transfer(src, dst, slots(s, device), slots(d, device))


@pytest.mark.parametrize("side", ["src_slots", "dst_slots"])
def test_out_of_range_slot_cuda_recorded_and_memory_outside_untouched(cuda_device, side):
    """Default CUDA path: valid rows are copied, the bad token is skipped and reported by check_errors()."""
    g = Geometry(P=2, L=2, NB=4, BS=4, H=2, E=8)
    rng = np.random.default_rng(4)
    src_np = S.random_cache("vllm_flash_attn_hnd", g, "float16", rng)
    dst_np = S.random_cache("hicache_page_first", g, "float16", rng)
    good = np.array([0, 1, 2, 3, 4])
    bad = np.array([3, 9, 1 << 40, 2, 1])
    s, d = (bad, good) if side == "src_slots" else (good, bad)
    keep = np.where(np.arange(5) == 2, -1, s)              # what the kernel must do: skip token 2
    want = R.transfer("vllm_flash_attn_hnd", src_np, "hicache_page_first", dst_np, keep, d if side == "src_slots"
                      else np.where(np.arange(5) == 2, -1, d), dst_geom=g)
    # the destination lives inside a larger buffer: guard bytes on both sides
    guard = 4096
    host = np.asarray(dst_np)
    buf = TC.tensor(np.concatenate([np.full(guard, 0x5A, np.uint8), host.reshape(-1).view(np.uint8),
                                    np.full(guard, 0x5A, np.uint8)]), cuda_device)
    view = buf[guard:guard + host.nbytes].view(torch.float16).view(host.shape)
    src = ops.bind("vllm_flash_attn_hnd", TC.to_torch("vllm_flash_attn_hnd", src_np, cuda_device))
    dst = ops.bind("hicache_page_first", view, page_size=g.BS)
    ops.transfer(src, dst, slots(s, cuda_device), slots(d, cuda_device))
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match=rf"{side}\[2\] = {1 << 40} is out of range: the "
                                         rf"(source|destination) holds 16 slots"):
        ops.check_errors()
    ops.check_errors()                      # reported once
    TC.assert_same_bytes(view, want, "destination")
    raw = buf.cpu().numpy()
    assert (raw[:guard] == 0x5A).all() and (raw[-guard:] == 0x5A).all(), "bytes outside the destination written"


def test_check_errors_ignores_status_words_made_while_tracing():
    """Tracing with fake tensors leaves a meta status word behind; check_errors() must not try to read it."""
    from kvlayout.ops import _native
    _native.status_tensor("meta")
    try:
        ops.check_errors()
    finally:
        _native._status.pop(torch.device("meta"), None)


def test_positions_beyond_the_destination(device):
    src = make_cache("vllm_flash_attn_nhd", device)
    dst = make_chunk(device, T=4)
    with rejects(IndexError, r"6 positions exceed the destination's 4 slots", dst, device=device):
        ops.transfer(src, dst, slots([0, 1, 2, 3, 4, 5], device), None)


def test_paired_counts_must_match(device):
    src = make_cache("vllm_flash_attn_nhd", device)
    dst = make_cache("vllm_flashinfer_hnd", device, seed=3)
    s = slots([0, 1, 2], device)
    with rejects(ValueError, r"src_slots and dst_slots differ in length: \[3, 4\]", dst, device=device):
        ops.transfer(src, dst, s, slots([0, 1, 2, 3], device))
    with rejects(ValueError, r"the source gives 2 layers \(src_layers\) but the destination takes 1 layer "
                 r"\(dst_layers\)", dst, device=device):
        ops.transfer(src, dst, s, s, src_layers=[0, 1], dst_layers=[1])
    with rejects(ValueError, r"the source gives 1 plane \(src_planes\) but the destination takes 2 planes "
                 r"\(all of its planes\)", dst, device=device):
        ops.transfer(src, dst, s, s, src_planes=[1])
    # an argument left out is named as what it stands for, never as a keyword the caller did not pass
    rows = torch.zeros(2, 1, 3, *src.tensors[0].shape[-2:], dtype=src.dtype, device=device)
    with rejects(ValueError, r"the source gives 1 layer \(all of its layers\) but the destination takes "
                 r"\d+ layers \(all of its layers\)", src, device=device):
        ops.scatter(src, rows, s)
    with rejects(ValueError, r"num_tokens = 5 but the slots hold 3 tokens", dst, device=device):
        ops.transfer(src, dst, s, s, num_tokens=5)
    with rejects(ValueError, r"skip_prefix = 4 must lie in \[0, 3\]", dst, device=device):
        ops.transfer(src, dst, s, s, skip_prefix=4)
    with rejects(ValueError, r"src_slots \(3,\) and dst_slots \(2,\) differ in length", dst, device=device):
        ops.move(dst, s, slots([5, 6], device))
    with pytest.raises(ValueError, match=r"skip_prefix = -1 must be >= 0"):
        ops.skip_prefix(s, -1)


def duplicate_checking(device) -> dict:
    """Where duplicates are rejected: always on CPU, with validate=True elsewhere."""
    return {} if device == "cpu" else {"validate": True}


def test_duplicate_destination_slots(device):
    src = make_cache("vllm_flash_attn_nhd", device)
    dst = make_cache("vllm_flashinfer_hnd", device, seed=3)
    kw = duplicate_checking(device)
    with rejects(ValueError, r"dst_slots repeats slot 3", dst, device=device):
        ops.transfer(src, dst, slots([0, 1, 2], device), slots([3, -1, 3], device), **kw)
    # repeated negatives are "no token" and are fine, repeated sources too
    ops.transfer(src, dst, slots([0, 0, 2], device), slots([-1, 5, -1], device), **kw)
    rows = torch.zeros(2, 2, 2, 2, 8, dtype=torch.float16, device=device)
    with rejects(ValueError, r"dst_slots repeats slot 7", dst, device=device):
        ops.scatter(dst, rows, slots([7, 7], device), **kw)
    with rejects(ValueError, r"dst_slots repeats slot 1", dst, device=device):
        ops.move(dst, slots([4, 5], device), slots([1, 1], device), **kw)


# ---------------------------------------------------------------------------------------
# overlapping buffers
# ---------------------------------------------------------------------------------------

def test_overlapping_source_and_destination(device):
    cache = make_cache("vllm_flash_attn_nhd", device)
    overlap = r"(source tensor 0 and destination tensor 0|src\[0\] and dst\[0\]) overlap in memory.*use move\(\)"
    with rejects(ValueError, overlap,
                 cache, device=device):
        ops.transfer(cache, cache, slots([0, 1], device), slots([2, 3], device))
    # two views of one buffer that intersect
    buf = torch.zeros(2 * 2 * 6 * 16 + 32, dtype=torch.float16, device=device)
    a = ops.bind("lmcache_kv_2ltd", buf[:2 * 2 * 6 * 16].view(2, 2, 6, 16))
    b = ops.bind("lmcache_kv_2ltd", buf[32:].view(2, 2, 6, 16))
    with rejects(ValueError, r"overlap in memory", b, device=device):
        ops.transfer(a, b)
    # disjoint views of one buffer are fine
    c = ops.bind("lmcache_kv_2ltd", torch.zeros(2 * 2 * 6 * 16 * 2, dtype=torch.float16,
                                                device=device).view(2, 2, 2, 6, 16)[0])
    ops.transfer(a, c)


# ---------------------------------------------------------------------------------------
# page size at bind
# ---------------------------------------------------------------------------------------

def test_misaligned_page_size_at_bind(device):
    """A page size that does not divide the slot count, or contradicts the tensors' pages."""
    pool = torch.zeros(2, 2, 18, 2, 8, device=device)                     # hicache_layer_first, N = 18
    with pytest.raises(ValueError, match=r"hicache_layer_first: 18 slots is not a multiple of page_size 4"):
        ops.bind("hicache_layer_first", pool, page_size=4)
    kv = [torch.zeros(2, 4, 4, 2, 8, device=device) for _ in range(2)]   # pages of 4
    with pytest.raises(ValueError, match=r"vllm_flash_attn_nhd: page_size=8 but the tensors have pages of 4"):
        ops.bind("vllm_flash_attn_nhd", kv, page_size=8)


# ---------------------------------------------------------------------------------------
# bind: parts, shapes, tensors
# ---------------------------------------------------------------------------------------

def test_bind_wrong_part_count(device):
    k = [torch.zeros(20, 2, 8, device=device) for _ in range(3)]
    with pytest.raises(ValueError, match=r"sglang_mha: expected 2 parts \(k, v\)"):
        ops.bind("sglang_mha", k)
    with pytest.raises(ValueError, match=r"sglang_mha: expected 2 parts"):
        ops.bind("sglang_mha", (k, k, k))
    with pytest.raises(ValueError, match=r"hicache_mla_page_first_kv_split: expected 2 parts \(nope, rope\)"):
        ops.bind("hicache_mla_page_first_kv_split", torch.zeros(4, 2, 4, 1, 8, device=device))


def test_bind_wrong_shapes(device):
    with pytest.raises(ValueError, match=r"vllm_flash_attn_nhd: part 'kv' must have 5 dims \[P, NB, BS, H, E\], "
                                         r"got shape \[2, 4, 4, 16\]"):
        ops.bind("vllm_flash_attn_nhd", [torch.zeros(2, 4, 4, 16, device=device)])
    with pytest.raises(ValueError, match=r"vllm_flash_attn_hnd: the plane axis must have size 2, got 3"):
        ops.bind("vllm_flash_attn_hnd", [torch.zeros(3, 4, 2, 4, 8, device=device)])
    with pytest.raises(ValueError, match=r"vllm_flashinfer_nhd: part 'kv' has layers of different shapes"):
        ops.bind("vllm_flashinfer_nhd", [torch.zeros(4, 2, 4, 2, 8, device=device),
                                         torch.zeros(5, 2, 4, 2, 8, device=device)])
    with pytest.raises(ValueError, match=r"sglang_mha: part 'v' shape \[20, 2, 4\] has e = 4, elsewhere 8"):
        ops.bind("sglang_mha", ([torch.zeros(20, 2, 8, device=device)], [torch.zeros(20, 2, 4, device=device)]))
    with pytest.raises(ValueError, match=r"vllm_mla: part 'latent' is an empty list of layers"):
        ops.bind("vllm_mla", [])
    with pytest.raises(KeyError, match=r"unknown layout 'vllm_flash'"):
        ops.bind("vllm_flash", [torch.zeros(2, 4, 4, 2, 8, device=device)])


def test_bind_wrong_tensors(device):
    with pytest.raises(TypeError, match=r"vllm_mla: tensor 1 has dtype torch.float16, tensor 0 has torch.bfloat16"):
        ops.bind("vllm_mla", [torch.zeros(4, 16, 8, dtype=torch.bfloat16, device=device),
                              torch.zeros(4, 16, 8, dtype=torch.float16, device=device)])
    with pytest.raises(ValueError, match=r"vllm_cross_layer: part 'kv' needs contiguous elements"):
        ops.bind("vllm_cross_layer", torch.zeros(4, 2, 2, 4, 8, 2, device=device).transpose(-1, -2))
    with pytest.raises(ValueError, match=r"vllm_flash_attn_nhd: part 'kv' layer 1 has strides"):
        ops.bind("vllm_flash_attn_nhd", [torch.zeros(2, 4, 4, 2, 8, device=device),
                                         torch.zeros(2, 4, 2, 4, 8, device=device).transpose(2, 3)])
