"""kvlayout.compat.lmcache against independent torch-indexing oracles (and the JAX reference once)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlayout.compat import lmcache as lm
from kvlayout.compat.lmcache import GPUKVFormat as F
from kvlayout.compat.lmcache import TransferDirection as Dir

from compat_oracles import (
    cos_sin_cache,
    devices,
    distinct_slots,
    gather_chunk,
    logical,
    make_cache,
    planes,
    rand,
    rope_oracle,
    same,
    scatter_chunk,
)

L, NB, BS, H, D = 2, 5, 4, 2, 8
N = NB * BS
ALL_FORMATS = sorted(lm.LAYOUT_OF_FORMAT)


def geometry(fmt):
    return (1, 12) if fmt in lm.MLA_FORMATS else (H, D)


def memobj_shape(fmt, T):
    h, d = geometry(fmt)
    return (planes(fmt), L, T, h * d)


def test_enum_values():
    assert [int(f) for f in F] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11]
    assert [(f.name, f.value) for f in lm.MemoryFormat] == [
        ("UNDEFINED", 0), ("KV_2LTD", 1), ("KV_T2D", 2), ("KV_2TD", 3), ("BINARY", 4), ("BINARY_BUFFER", 5),
        ("KV_MLA_FMT", 6)]
    # a plain Enum, as LMCache's: members are not ints, and ints still name them where a format is read
    assert type(lm.MemoryFormat.KV_2LTD) is lm.MemoryFormat and not isinstance(lm.MemoryFormat.KV_2LTD, int)
    assert lm.MemoryFormat.KV_2LTD != 1
    assert lm.as_memory_format(1) is lm.MemoryFormat.KV_2LTD
    assert lm.TransferDirection.H2D == 0 and lm.TransferDirection.D2H == 1
    assert lm.layout_of(0) == "vllm_cross_layer" and lm.layout_of(8) == "trtllm_cross_layer_hnd"


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_multi_layer_d2h_one_direction(device, fmt):
    """Paged -> memory object, checked against the oracle alone (a K/V swap would fail here)."""
    gen = torch.Generator().manual_seed(int(fmt))
    h, d = geometry(fmt)
    kv = make_cache(fmt, L, NB, BS, h, d, torch.float32, device, gen)
    T, skip = 7, 2
    slots = distinct_slots(T, N, gen, device, negatives=(4,))
    sentinel = torch.full(memobj_shape(fmt, T), -7.0, device=device)
    memobj = sentinel.clone()
    lm.multi_layer_kv_transfer(memobj, kv, slots, device, N, Dir.D2H, fmt, BS, d, skip_prefix_n_tokens=skip)
    expected = gather_chunk(logical(fmt, kv).cpu(), slots.cpu(), skip, out=sentinel.cpu())
    assert same(memobj, expected)
    if planes(fmt) == 2:   # K and V really differ, so the check above would catch a swap
        assert not torch.equal(expected[0, :, skip:], expected[1, :, skip:])


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_multi_layer_h2d_one_direction(device, fmt):
    gen = torch.Generator().manual_seed(100 + int(fmt))
    h, d = geometry(fmt)
    kv = make_cache(fmt, L, NB, BS, h, d, torch.bfloat16, device, gen)
    before = logical(fmt, kv).cpu()
    T, skip = 9, 3
    slots = distinct_slots(T, N, gen, device, negatives=(0, 5))
    memobj = rand(memobj_shape(fmt, T), torch.bfloat16, device, gen)
    lm.multi_layer_kv_transfer(memobj, kv, slots, device, N, Dir.H2D, fmt, BS, d, skip_prefix_n_tokens=skip)
    assert same(logical(fmt, kv), scatter_chunk(before, memobj.cpu(), slots.cpu(), skip))


@pytest.mark.parametrize("fmt", [F.NB_NL_TWO_BS_NH_HS, F.NL_X_NB_TWO_NH_BS_HS])
def test_multi_layer_matches_jax_reference(fmt):
    """The adapter and kvlayout.reference agree (format 0: true cross-layer strides)."""
    ref = pytest.importorskip("kvlayout.reference.operations")
    gen = torch.Generator().manual_seed(7)
    kv = make_cache(fmt, L, NB, BS, H, D, torch.float32, "cpu", gen)
    slots = distinct_slots(6, N, gen, "cpu", negatives=(2,))
    memobj = torch.zeros(2, L, 6, H * D)
    lm.multi_layer_kv_transfer(memobj, kv, slots, "cpu", N, Dir.D2H, fmt, BS, D)
    physical = kv.numpy() if isinstance(kv, torch.Tensor) else [t.numpy() for t in kv]
    want = ref.transfer(lm.layout_of(fmt), physical, "lmcache_kv_2ltd", np.zeros((2, L, 6, H * D), np.float32),
                        slots.numpy(), None)
    assert np.array_equal(np.asarray(want), memobj.numpy())


def test_multi_layer_source_slot_out_of_range():
    gen = torch.Generator().manual_seed(0)
    kv = make_cache(1, L, NB, BS, H, D, torch.float32, "cpu", gen)
    with pytest.raises(IndexError):      # a cache slot beyond the cache (read side)
        lm.multi_layer_kv_transfer(torch.zeros(2, L, 2, H * D), kv, torch.tensor([0, N]), "cpu", N, Dir.D2H, 1)


def test_multi_layer_checks():
    gen = torch.Generator().manual_seed(0)
    kv = make_cache(1, L, NB, BS, H, D, torch.float32, "cpu", gen)
    with pytest.raises(IndexError):      # a cache slot beyond the cache (written side)
        lm.multi_layer_kv_transfer(torch.ones(2, L, 2, H * D), kv, torch.tensor([0, N]), "cpu", N, Dir.H2D, 1)
    with pytest.raises(ValueError, match="2, L, T, D"):
        lm.multi_layer_kv_transfer(torch.zeros(1, L, 2, H * D), kv, torch.tensor([0, 1]), "cpu", N, Dir.D2H, 1)
    with pytest.raises(ValueError, match="page_buffer_size"):
        lm.multi_layer_kv_transfer(torch.zeros(2, L, 2, H * D), kv, torch.tensor([0, 1]), "cpu", N + 1, Dir.D2H, 1)
    with pytest.raises(ValueError, match="block_size"):
        lm.multi_layer_kv_transfer(torch.zeros(2, L, 2, H * D), kv, torch.tensor([0, 1]), "cpu", N, Dir.D2H, 1, BS + 1)
    # empty chunk and skip == T are no-ops
    lm.multi_layer_kv_transfer(torch.zeros(2, L, 0, H * D), kv, torch.zeros(0, dtype=torch.int64), "cpu", N, Dir.H2D, 1)
    before = logical(1, kv)
    lm.multi_layer_kv_transfer(torch.ones(2, L, 3, H * D), kv, torch.tensor([0, 1, 2]), "cpu", N, Dir.H2D, 1,
                               skip_prefix_n_tokens=3)
    assert same(logical(1, kv), before)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("nested", [False, True])
def test_unilateral_sglang_mha(device, nested):
    gen = torch.Generator().manual_seed(3)
    k, v = make_cache(4, L, NB, BS, H, D, torch.float16, device, gen)
    slots = distinct_slots(6, N, gen, device, negatives=(1,))
    memobj = torch.zeros(2, L, 6, H * D, dtype=torch.float16, device=device)
    arg = [k, v] if nested else k + v
    lm.multi_layer_kv_transfer_unilateral(memobj, arg, slots, device, N, Dir.D2H, F.TWO_X_NL_X_NBBS_NH_HS)
    assert same(memobj, gather_chunk(logical(4, [k, v]).cpu(), slots.cpu()))
    fresh = [[torch.zeros_like(t) for t in k], [torch.zeros_like(t) for t in v]]
    arg = fresh if nested else fresh[0] + fresh[1]
    lm.multi_layer_kv_transfer_unilateral(memobj, arg, slots, device, N, Dir.H2D, 4)
    assert same(logical(4, fresh), scatter_chunk(torch.zeros(2, L, N, H * D, dtype=torch.float16), memobj.cpu(),
                                                 slots.cpu()))


@pytest.mark.parametrize("fmt", [3, 5])
def test_unilateral_mla_delegates(fmt):
    gen = torch.Generator().manual_seed(4)
    kv = make_cache(fmt, L, NB, BS, 1, 12, torch.float32, "cpu", gen)
    slots = torch.tensor([1, 3, 4, 7])
    memobj = torch.zeros(1, L, 4, 12)
    lm.multi_layer_kv_transfer_unilateral(memobj, kv, slots, "cpu", N, Dir.D2H, fmt)
    assert same(memobj, gather_chunk(logical(fmt, kv), slots))


SINGLE = [1, 2, 3, 6, 7, 10, 11]


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("fmt", SINGLE)
@pytest.mark.parametrize("token_major", [False, True])
def test_single_layer(device, fmt, token_major):
    gen = torch.Generator().manual_seed(fmt * 2 + token_major)
    h, d = geometry(fmt)
    kv = make_cache(fmt, L, NB, BS, h, d, torch.float32, device, gen)
    layer, T = 1, 6
    slots = distinct_slots(T, N, gen, device, negatives=(3,))
    mla = fmt in lm.MLA_FORMATS
    shape = (T, h * d) if mla else ((T, 2, h * d) if token_major else (2, T, h * d))
    lmc = torch.full(shape, -3.0, device=device)
    lm.single_layer_kv_transfer(lmc, kv[layer], slots, Dir.D2H, fmt, token_major)
    want = gather_chunk(logical(fmt, kv)[:, layer:layer + 1].cpu(), slots.cpu(), out=torch.full(
        (planes(fmt), 1, T, h * d), -3.0))[:, 0]                          # [P, T, W]
    got = lmc.cpu()[None] if mla else (lmc.cpu().transpose(0, 1) if token_major else lmc.cpu())
    assert same(got, want)
    # H2D into the other layer of the same cache: only that layer's chosen slots change
    before = logical(fmt, kv).cpu()
    src = rand(shape, torch.float32, device, gen)
    lm.single_layer_kv_transfer(src, kv[0], slots, Dir.H2D, fmt, token_major)
    chunk = src.cpu()[None] if mla else (src.cpu().transpose(0, 1) if token_major else src.cpu())
    expected = before.clone()
    expected[:, :1] = scatter_chunk(before[:, :1], chunk[:, None], slots.cpu())
    assert same(logical(fmt, kv), expected)


def test_single_layer_rejects_cross_layer():
    with pytest.raises(ValueError, match="per-layer formats"):
        lm.single_layer_kv_transfer(torch.zeros(2, 1, 16), torch.zeros(NB, L, 2, BS, H, D), torch.tensor([0]),
                                    Dir.D2H, 0)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("four_d", [False, True])
def test_single_layer_sgl(device, token_major, four_d):
    gen = torch.Generator().manual_seed(11)
    k, v = rand((N, H, D), torch.float16, device, gen), rand((N, H, D), torch.float16, device, gen)
    slots = torch.arange(0, 3 * 6, 3, device=device)
    shape = (6, 2, H * D) if token_major else (2, 6, H * D)
    lmc = torch.zeros(shape, dtype=torch.float16, device=device)
    kk, vv = (k.view(N, 1, H, D), v.view(N, 1, H, D)) if four_d else (k, v)
    lm.single_layer_kv_transfer_sgl(lmc, kk, vv, slots, Dir.D2H, token_major)
    kv_major = lmc.transpose(0, 1) if token_major else lmc
    assert same(kv_major[0], k.reshape(N, -1)[slots]) and same(kv_major[1], v.reshape(N, -1)[slots])
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    lm.single_layer_kv_transfer_sgl(lmc, k2, v2, slots, Dir.H2D, token_major)
    assert same(k2[slots], k[slots]) and same(v2[slots], v[slots])
    assert k2.reshape(N, -1)[1].abs().sum() == 0


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("flat", [True, False])
def test_rotary_embedding_k_fused(device, is_neox, flat):
    gen = torch.Generator().manual_seed(5)
    T, nh, hs, rot = 6, 2, 16, 8
    key = rand((T, nh, hs), torch.float32, device, gen)
    old = torch.tensor([0, 3, 5, 9, -1, 2], device=device)
    new = old + 1
    table = cos_sin_cache(32, rot).to(device)
    want = rope_oracle(key, old.cpu(), new.cpu(), table, is_neox)
    arg = key.view(T, nh * hs) if flat else key
    lm.rotary_embedding_k_fused(old, new, arg, hs, table, is_neox)
    torch.testing.assert_close(key.cpu(), want, rtol=1e-5, atol=1e-5)
    assert same(key.cpu()[4], want[4])                     # negative position: untouched


# ---------------------------------------------------------------------------------------
# Discovery
# ---------------------------------------------------------------------------------------

def test_discover_vllm_shapes():
    nhd = {"kv_layout": "NHD"}
    hnd = {"kv_layout": "HND"}
    assert lm.discover_gpu_kv_format([torch.zeros(2, 4, 16, 2, 8)], "vllm", nhd) == 1
    assert lm.discover_gpu_kv_format([torch.zeros(4, 2, 16, 2, 8)], "vllm", nhd) == 2
    assert lm.discover_gpu_kv_format([torch.zeros(2, 4, 2, 16, 8)], "vllm", hnd) == 6
    assert lm.discover_gpu_kv_format([torch.zeros(4, 2, 2, 16, 8)], "vllm", hnd) == 7
    assert lm.discover_gpu_kv_format([torch.zeros(4, 16, 576)], "vllm", nhd) == 3
    assert lm.discover_gpu_kv_format(torch.zeros(4, 3, 2, 16, 2, 8), "vllm", nhd) == 0
    assert lm.discover_gpu_kv_format([torch.zeros(4, 16, 3, 2, 8)], "vllm", nhd) == 11
    assert lm.discover_gpu_kv_format([torch.zeros(4, 3, 16, 2, 8)], "vllm", hnd) == 10
    # NB == 2: shape[0] == 2 and shape[1] == 2 both hold; shape[0] wins (format 1, not 2)
    assert lm.discover_gpu_kv_format([torch.zeros(2, 2, 16, 2, 8)], "vllm", nhd) == 1
    assert lm.discover_gpu_kv_format([torch.zeros(2, 2, 2, 16, 8)], "vllm", hnd) == 6
    # no hint: NHD
    assert lm.discover_gpu_kv_format([torch.zeros(2, 4, 16, 2, 8)], "vllm") == 1


def test_discover_sglang_trtllm_and_errors():
    assert lm.discover_gpu_kv_format([torch.zeros(64, 1, 576)], "sglang") == 5
    assert lm.discover_gpu_kv_format([[torch.zeros(64, 2, 8)], [torch.zeros(64, 2, 8)]], "sglang") == 4
    assert lm.discover_gpu_kv_format(torch.zeros(4, 3, 2, 2, 16, 8), "trtllm") == 8
    with pytest.raises(ValueError, match="empty"):
        lm.discover_gpu_kv_format([], "vllm")
    with pytest.raises(ValueError, match="unsupported"):
        lm.discover_gpu_kv_format([torch.zeros(4, 4)], "vllm", {"kv_layout": "NHD"})
    with pytest.raises(ValueError, match="unsupported"):
        lm.discover_gpu_kv_format([torch.zeros(64, 2, 8)], "sglang")
    with pytest.raises(ValueError, match="contiguous"):
        lm.discover_gpu_kv_format([torch.zeros(2, 4, 2, 16, 8).transpose(2, 3)], "vllm", {"kv_layout": "HND"})
    with pytest.raises(ValueError, match="engine"):
        lm.discover_gpu_kv_format([torch.zeros(4, 16, 8)], "other")


@pytest.mark.parametrize("physical, fmt, to_nhd", [((2, 4, 3, 16, 8), 6, (0, 1, 3, 2, 4)),
                                                   ((4, 2, 3, 16, 8), 7, (0, 1, 3, 2, 4))])
def test_permuted_hnd_views_recovered(physical, fmt, to_nhd):
    """vLLM hands out NHD-shaped views of HND memory: recovery is metadata only, then HND is detected."""
    gen = torch.Generator().manual_seed(9)
    phys = [rand(physical, torch.float32, "cpu", gen) for _ in range(L)]
    views = [t.permute(to_nhd) for t in phys]
    assert not views[0].is_contiguous()
    fixed = lm.ensure_contiguous_kv_caches(views, "HND")
    assert [t.data_ptr() for t in fixed] == [t.data_ptr() for t in phys]
    assert all(t.is_contiguous() and t.shape == p.shape for t, p in zip(fixed, phys))
    assert lm.discover_gpu_kv_format(fixed, "vllm", {"kv_layout": "HND"}) == fmt
    fmt2, kv2 = lm.normalize_and_discover(views, "vllm", {"kv_layout": "HND"})
    assert fmt2 == fmt
    # the transfer through the recovered structure reads the same data as the oracle of the physical format
    slots = torch.tensor([0, 5, 17, 30, 47])
    memobj = torch.zeros(2, L, 5, 3 * 8)
    lm.multi_layer_kv_transfer(memobj, kv2, slots, "cpu", 0, Dir.D2H, fmt2)
    assert same(memobj, gather_chunk(logical(fmt, phys), slots))
    assert lm.ensure_contiguous_kv_caches(phys) is phys
    dict_in = {"a": views[0]}
    assert lm.ensure_contiguous_kv_caches(dict_in, "HND")["a"].is_contiguous()
    with pytest.raises(ValueError, match="other than permutation"):
        lm.permute_to_contiguous(torch.zeros(4, 8)[:, :4])


def test_canonicalize_trtllm():
    t = torch.zeros(4, 3, 2, 2 * 16 * 8)
    out = lm.canonicalize_kv_caches([t], {"num_kv_heads": 2, "tokens_per_block": 16, "head_dim": 8})
    assert out.shape == (4, 3, 2, 2, 16, 8) and out.data_ptr() == t.data_ptr()
    six = torch.zeros(4, 3, 2, 2, 16, 8)
    assert lm.canonicalize_kv_caches([six]) is six
    assert lm.discover_gpu_kv_format(out, "trtllm") == 8


@pytest.mark.parametrize("shape, hint, fmt", [((2, BS, H, 2 * D), "NHD", 11),        # 2 blocks
                                              ((NB, 2, H, 2 * D), "NHD", 11),        # block size 2
                                              ((2, H, BS, 2 * D), "HND", 10),        # 2 blocks, HND
                                              ((NB, 2, BS, 2 * D), "HND", 10)])      # 2 heads, HND
def test_normalize_packed_rank4_with_twos(shape, hint, fmt):
    """A rank-4 cache is packed K/V whatever its sizes; the data moved is that of the packed layout."""
    gen = torch.Generator().manual_seed(40)
    phys = [rand(shape, torch.float32, "cpu", gen) for _ in range(L)]
    got_fmt, kv = lm.normalize_and_discover(phys, "vllm", {"kv_layout": hint})
    assert got_fmt == fmt
    assert all(t.shape == (*s.shape[:3], 2, D) and t.data_ptr() == s.data_ptr() for t, s in zip(kv, phys))
    n = shape[0] * (shape[1] if hint == "NHD" else shape[2])
    slots = torch.tensor([0, n - 1, 3])
    memobj = torch.zeros(2, L, 3, (shape[2] if hint == "NHD" else shape[1]) * D)
    lm.multi_layer_kv_transfer(memobj, kv, slots, "cpu", 0, Dir.D2H, got_fmt)
    # oracle: token s of a packed NHD cache is [s // BS, s % BS, h, plane]; HND swaps block-slot and head
    for l in range(L):
        for t, s in enumerate(slots.tolist()):
            for p in range(2):
                if hint == "NHD":
                    want = phys[l][s // shape[1], s % shape[1]].view(shape[2], 2, D)[:, p]
                else:
                    want = phys[l][s // shape[2], :, s % shape[2]].view(shape[1], 2, D)[:, p]
                assert same(memobj[p, l, t], want.reshape(-1))


def test_validate_reaches_kvlayout_and_rope_positions_are_checked(monkeypatch):
    from kvlayout import ops
    seen = []
    real = ops.transfer
    monkeypatch.setattr(ops, "transfer", lambda *a, **k: (seen.append(k.get("validate")), real(*a, **k))[1])
    gen = torch.Generator().manual_seed(41)
    kv = make_cache(1, L, NB, BS, H, D, torch.float32, "cpu", gen)
    slots = torch.tensor([1, 7, 9])
    memobj = torch.zeros(2, L, 3, H * D)
    lm.multi_layer_kv_transfer(memobj, kv, slots, "cpu", 0, Dir.D2H, F.NL_X_TWO_NB_BS_NH_HS, validate=True)
    lm.single_layer_kv_transfer(memobj[:, 0], kv[0], slots, Dir.D2H, F.NL_X_TWO_NB_BS_NH_HS, validate=False)
    sgl = make_cache(4, L, NB, BS, H, D, torch.float32, "cpu", gen)
    lm.multi_layer_kv_transfer_unilateral(memobj, sgl, slots, "cpu", 0, Dir.D2H, validate=True)
    lm.single_layer_kv_transfer_sgl(memobj[:, 0], sgl[0][0], sgl[1][0], slots, Dir.D2H, validate=True)
    assert seen == [True, False, True, True]
    with pytest.raises(IndexError, match=rf"out of range: the source holds {N} slots"):
        lm.multi_layer_kv_transfer(memobj, kv, slots + N, "cpu", 0, Dir.D2H, F.NL_X_TWO_NB_BS_NH_HS, validate=True)
    key = rand((3, H, D), torch.float32, "cpu", gen)
    before = key.clone()
    table = cos_sin_cache(16, D)
    with pytest.raises(IndexError, match=r"new_positions\[1\] = 16 is out of range: cos_sin_cache holds 16"):
        lm.rotary_embedding_k_fused(torch.tensor([0, 1, 2]), torch.tensor([0, 16, 2]), key, D, table, True,
                                    validate=True)
    assert same(key, before)
