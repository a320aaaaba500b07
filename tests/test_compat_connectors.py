"""kvlayout.compat.connectors: LMCache connector behaviours against indexing oracles."""

from __future__ import annotations

import collections
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from kvlayout.compat import connectors as C
from kvlayout.compat.lmcache import MemoryFormat as MF

from compat_oracles import (
    LMCacheFormat,
    LMCacheLikeObj,
    Metadata,
    clear_device_status,
    cos_sin_cache,
    devices,
    distinct_slots,
    host_zeros,
    logical,
    make_cache,
    rand,
    record_skipped_row,
    rope_oracle,
    same,
    zeros_like,
)

L, NB, BS, H, D = 3, 12, 4, 2, 8
N = NB * BS
CHUNKS = [(0, 8), (8, 16), (16, 21)]           # last chunk partial
T_ALL = CHUNKS[-1][1]


def _cache(fmt, device, gen, dtype=torch.float32, h=H, d=D, layers=L):
    return make_cache(fmt, layers, NB, BS, h, d, dtype, device, gen)


def _expected_chunk(fmt, kv, slots, start, end):
    """[P, L, T, W] oracle rows of a chunk."""
    lg = logical(fmt, kv).cpu()
    s = slots[start:end].cpu()
    return lg[:, :, s]


def _hnd_view(kv):
    """vLLM-style NHD views of HND memory."""
    return [t.permute(0, 1, 3, 2, 4) for t in kv]


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("fmt", [1, 2, 3, 6])
@pytest.mark.parametrize("use_gpu", [False, True])
def test_v2_from_gpu_to_gpu(device, fmt, use_gpu):
    gen = torch.Generator().manual_seed(fmt)
    mla = fmt == 3
    h, d = (1, 24) if mla else (H, D)
    kv = _cache(fmt, device, gen, h=h, d=d)
    hint = "HND" if fmt == 6 else "NHD"
    engine_kv = _hnd_view(kv) if fmt == 6 else kv            # the engine holds permuted views
    conn = C.VLLMPagedMemGPUConnectorV2(h * d, L, use_gpu=use_gpu, use_mla=mla, kv_layout=hint, chunk_size=8)
    slots = distinct_slots(T_ALL, N, gen, device)
    objs = [C.MemoryObj(host_zeros(conn.get_shape(e - s), device=device)) for s, e in CHUNKS]   # host objects
    conn.batched_from_gpu(objs, [s for s, _ in CHUNKS], [e for _, e in CHUNKS], slot_mapping=slots,
                          kvcaches=engine_kv)
    assert conn.gpu_kv_format == fmt
    for obj, (s, e) in zip(objs, CHUNKS):
        assert obj.fmt == (MF.KV_MLA_FMT if mla else MF.KV_2LTD)
        assert same(obj.tensor, _expected_chunk(fmt, kv, slots, s, e))      # one direction: K/V order checked
    # retrieve into a fresh cache, with 10 tokens already cached by the engine
    if device == "cuda":
        torch.cuda._sleep(50_000_000)   # the caller's stream busy: its zero-fill of the fresh cache runs late
    fresh = zeros_like(kv)
    conn.batched_to_gpu(objs, [s for s, _ in CHUNKS], [e for _, e in CHUNKS], slot_mapping=slots,
                        kvcaches=_hnd_view(fresh) if fmt == 6 else fresh, vllm_cached_tokens=10)
    got, want = logical(fmt, fresh).cpu(), logical(fmt, kv).cpu()
    s_cpu = slots.cpu()
    assert same(got[:, :, s_cpu[10:]], want[:, :, s_cpu[10:]])
    assert got[:, :, s_cpu[:10]].abs().sum() == 0                            # skipped prefix untouched


def test_skip_rule():
    assert C.skip_tokens(0, 8, 10) == 8
    assert C.skip_tokens(8, 16, 10) == 2
    assert C.skip_tokens(16, 21, 10) == 0
    assert C.skip_tokens(0, 8, 0) == 0


def test_v2_format_checks():
    gen = torch.Generator().manual_seed(0)
    kv = _cache(1, "cpu", gen)
    conn = C.VLLMPagedMemGPUConnectorV2(H * D, L, kv_layout="NHD", kvcaches=kv)
    obj = C.MemoryObj(torch.zeros(conn.get_shape(4)), MF.KV_T2D)
    with pytest.raises(ValueError, match="KV_2LTD"):
        conn.to_gpu(obj, 0, 4, slot_mapping=torch.arange(4))
    with pytest.raises(ValueError, match="use_mla"):
        C.VLLMPagedMemGPUConnectorV2(H * D, L, use_mla=True, kv_layout="NHD", kvcaches=kv)
    assert obj.metadata.fmt == MF.KV_T2D


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("fmt", [1, 2])
@pytest.mark.parametrize("use_gpu", [False, True])
def test_v3_layer_groups_mixed_dtypes(device, fmt, use_gpu):
    """Groups of layers with head sizes 64/66/66 and dtypes uint8/bf16/uint8."""
    gen = torch.Generator().manual_seed(30 + fmt)
    spec = [(64, torch.uint8), (66, torch.bfloat16), (66, torch.uint8)]
    groups = [_cache(fmt, device, gen, dtype=dt, h=2, d=hs, layers=2) for hs, dt in spec]
    kv = [t for g in groups for t in g]
    conn = C.VLLMPagedMemGPUConnectorV3(Metadata(groups=[[0, 1], [2, 3], [4, 5]]), torch.device(device),
                                        use_gpu=use_gpu, kv_layout="NHD", kvcaches=kv)
    assert len(conn.groups) == 3 and conn.get_dtypes() == [dt for _, dt in spec]
    slots = distinct_slots(T_ALL, N, gen, device)
    objs = [conn.allocate(e - s, pin_memory=device != "cpu") for s, e in CHUNKS]
    conn.batched_from_gpu(objs, [s for s, _ in CHUNKS], [e for _, e in CHUNKS], slot_mapping=slots)
    for obj, (s, e) in zip(objs, CHUNKS):
        assert obj.fmt == MF.KV_2LTD
        for g, t in zip(groups, obj.tensors):
            assert t.dtype == g[0].dtype and same(t, _expected_chunk(fmt, g, slots, s, e))
    if device == "cuda":
        torch.cuda._sleep(50_000_000)   # the caller's stream busy: its zero-fill of the fresh caches runs late
    fresh_groups = [zeros_like(g) for g in groups]
    fresh = [t for g in fresh_groups for t in g]
    conn.batched_to_gpu(objs, [s for s, _ in CHUNKS], [e for _, e in CHUNKS], slot_mapping=slots, kvcaches=fresh)
    s_cpu = slots.cpu()
    for g, f in zip(groups, fresh_groups):
        assert same(logical(fmt, f).cpu()[:, :, s_cpu], logical(fmt, g).cpu()[:, :, s_cpu])


def _drive_to_gpu(gen_obj, per_layer_objs):
    """Run a layer-wise load generator; returns how many times it yielded."""
    count = 1
    next(gen_obj)
    for objs in per_layer_objs:
        gen_obj.send(objs)
        count += 1
    for _ in gen_obj:
        count += 1
    return count


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("fmt", [1, 2, 3])
@pytest.mark.parametrize("use_gpu", [False, True])
def test_layerwise_paged(device, fmt, use_gpu):
    gen = torch.Generator().manual_seed(50 + fmt)
    mla = fmt == 3
    h, d = (1, 24) if mla else (H, D)
    kv = _cache(fmt, device, gen, h=h, d=d)
    conn = C.VLLMPagedMemLayerwiseGPUConnector(h * d, L, use_gpu=use_gpu, use_mla=mla, kv_layout="NHD")
    slots = distinct_slots(T_ALL, N, gen, device)
    starts, ends = [s for s, _ in CHUNKS], [e for _, e in CHUNKS]
    objs = [[C.MemoryObj(host_zeros(conn.get_shape(e - s), device=device)) for s, e in CHUNKS] for _ in range(L)]
    store = conn.batched_from_gpu(objs, starts, ends, slot_mapping=slots, kvcaches=kv, sync=True)
    assert sum(1 for _ in store) == L + 1
    lg = logical(fmt, kv).cpu()
    for l in range(L):
        for obj, (s, e) in zip(objs[l], CHUNKS):
            assert obj.fmt == (MF.KV_MLA_FMT if mla else MF.KV_T2D)
            want = lg[:, l, slots[s:e].cpu()]                                  # [P, T, W]
            got = obj.tensor[None] if mla else obj.tensor.transpose(0, 1)      # [T, 2, W] -> [2, T, W]
            assert same(got, want)
    fresh = zeros_like(kv)
    load = conn.batched_to_gpu(starts, ends, slot_mapping=slots, kvcaches=fresh, sync=True, vllm_cached_tokens=3)
    assert _drive_to_gpu(load, objs) == L + 2
    got, s_cpu = logical(fmt, fresh).cpu(), slots.cpu()
    assert same(got[:, :, s_cpu], lg[:, :, s_cpu])          # every position, the cached prefix too (as LMCache)
    # objects given up front instead of sent
    fresh2 = zeros_like(kv)
    load = conn.batched_to_gpu(starts, ends, slot_mapping=slots, kvcaches=fresh2, memory_objs=objs, sync=False)
    assert _drive_to_gpu(load, [None] * L) == L + 2
    if device == "cuda":
        torch.cuda.synchronize()      # sync=False: the loads ran on the load stream, the caller waits for them
    assert same(logical(fmt, fresh2).cpu()[:, :, s_cpu], lg[:, :, s_cpu])


def test_layerwise_rejects_wrong_format():
    gen = torch.Generator().manual_seed(1)
    kv = _cache(1, "cpu", gen)
    conn = C.VLLMPagedMemLayerwiseGPUConnector(H * D, L, kv_layout="NHD", kvcaches=kv)
    with pytest.raises(ValueError, match="sync is required"):
        next(conn.batched_to_gpu([0], [4], slot_mapping=torch.arange(4)))
    load = conn.batched_to_gpu([0], [4], slot_mapping=torch.arange(4), sync=True)
    next(load)
    with pytest.raises(ValueError, match="KV_T2D"):
        load.send([C.MemoryObj(torch.zeros(2, 4, H * D), MF.KV_2TD)])


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("is_neox", [True, False])
def test_buffer_layerwise_cacheblend(device, is_neox):
    """The three-stage pipeline: load, rotate + zero gaps (editable through get_kv), flush every position."""
    gen = torch.Generator().manual_seed(70)
    fmt, rot = 1, D
    kv = _cache(fmt, device, gen)
    table = cos_sin_cache(64, rot)
    conn = C.VLLMBufferLayerwiseGPUConnector(H * D, L, use_gpu=True, kv_layout="NHD",
                                             cos_sin_cache=table.to(device), is_neox_style=is_neox, head_size=D)
    chunks = [(0, 6), (9, 14)]                             # gap: positions 6, 7, 8
    starts, ends = [s for s, _ in chunks], [e for _, e in chunks]
    slots = distinct_slots(14, N, gen, device)
    objs = [[LMCacheLikeObj(torch.zeros(conn.get_shape(e - s), device=device)) for s, e in chunks]
            for _ in range(L)]
    assert sum(1 for _ in conn.batched_from_gpu(objs, starts, ends, slot_mapping=slots, kvcaches=kv)) == L + 1
    lg = logical(fmt, kv).cpu()
    for l in range(L):
        for obj, (s, e) in zip(objs[l], chunks):
            assert same(obj.tensor, lg[:, l, slots[s:e].cpu()])
            assert obj.metadata.cached_positions.tolist() == list(range(s, e))      # positions recorded on store
            assert obj.metadata.fmt is LMCacheFormat.KV_2TD                        # the object's own enum
    # the second chunk's keys were computed at positions 20..24; they are used at 9..13 now
    for l in range(L):
        objs[l][1].metadata.cached_positions = torch.arange(20, 25)
    old = torch.tensor([0, 1, 2, 3, 4, 5, 0, 0, 0, 20, 21, 22, 23, 24])
    new = torch.arange(14)
    fresh = zeros_like(kv)
    for t in fresh:
        t.fill_(7.0)                                                                # gap slots must be overwritten
    if device == "cuda":
        torch.cuda._sleep(50_000_000)   # the caller's stream busy: what it enqueues next (the zeroed buffers) runs late
    load = conn.batched_to_gpu(starts, ends, slot_mapping=slots, kvcaches=fresh)
    next(load)
    yields, edited = 1, {}
    for l in range(L):
        load.send(objs[l])
        yields += 1
        k, v = conn.get_kv(l)                                                       # layer l, before its flush
        assert k.shape == (14, H * D) and k[6:9].abs().sum() == 0 and v[6:9].abs().sum() == 0
        v[0] = 100.0 + l                                                            # a blender's edit
        edited[l] = v[0].clone()
        with pytest.raises(ValueError, match=f"layer {l + 1} is not in a device buffer"):
            conn.get_kv(l + 1)
    yields += sum(1 for _ in load)
    assert yields == L + 2 and conn.buffer_mapping == {}
    got, s_cpu = logical(fmt, fresh).cpu(), slots.cpu()
    assert got[:, :, s_cpu[6:9]].abs().sum() == 0                                  # gaps zeroed and written
    for l in range(L):
        want_k = rope_oracle(lg[0, l, s_cpu].view(14, H, D), old, new, table, is_neox).view(14, -1)
        want_k[6:9] = 0
        torch.testing.assert_close(got[0, l, s_cpu], want_k, rtol=1e-5, atol=1e-5)
        want_v = lg[1, l, s_cpu].clone()
        want_v[6:9] = 0
        want_v[0] = edited[l].cpu()
        assert same(got[1, l, s_cpu], want_v)                                       # V never rotated, edit kept


def test_cacheblend_constructor_and_fused_rotary_emb():
    """use_gpu must be True (as LMCache); a fused_rotary_emb callable is called as (old, new, keys) -> keys."""
    with pytest.raises(ValueError, match="use_gpu must be True"):
        C.VLLMBufferLayerwiseGPUConnector(H * D, L)
    conn = C.VLLMBufferLayerwiseGPUConnector.from_metadata(Metadata(), use_gpu=True, device=torch.device("cpu"))
    assert (conn.hidden_dim_size, conn.num_layers, conn.dtype) == (H * D, L, torch.float32)
    calls = []

    def fused(old, new, keys):
        calls.append((old.tolist(), new.tolist()))
        return keys * 2

    gen = torch.Generator().manual_seed(71)
    kv = _cache(1, "cpu", gen)
    conn.fused_rotary_emb = fused
    slots = distinct_slots(4, N, gen, "cpu")
    objs = [[C.MemoryObj(rand((2, 4, H * D), torch.float32, "cpu", gen), MF.KV_2TD,
                          cached_positions=torch.arange(4) + 3)] for _ in range(L)]
    fresh = zeros_like(kv)
    _drive_to_gpu(conn.batched_to_gpu([0], [4], slot_mapping=slots, kvcaches=fresh), objs)
    assert calls == [([3, 4, 5, 6], [0, 1, 2, 3])] * L
    got = logical(1, fresh)
    for l in range(L):
        assert same(got[0, l, slots], objs[l][0].tensor[0] * 2) and same(got[1, l, slots], objs[l][0].tensor[1])


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("use_mla", [False, True])
@pytest.mark.parametrize("use_gpu", [False, True])
def test_sglang_connector(device, use_mla, use_gpu):
    gen = torch.Generator().manual_seed(80 + use_mla)
    fmt = 5 if use_mla else 4
    h, d = (1, 24) if use_mla else (H, D)
    kv = make_cache(fmt, L, NB, BS, h, d, torch.bfloat16, device, gen)
    conn = C.SGLangGPUConnector(h * d, L, use_gpu=use_gpu, use_mla=use_mla, kvcaches=kv)
    assert conn.gpu_kv_format == fmt
    slots = distinct_slots(T_ALL, N, gen, device)
    objs = [C.MemoryObj(host_zeros(conn.get_shape(e - s), torch.bfloat16, device)) for s, e in CHUNKS]
    conn.batched_from_gpu(objs, [s for s, _ in CHUNKS], [e for _, e in CHUNKS], slot_mapping=slots)
    for obj, (s, e) in zip(objs, CHUNKS):
        assert obj.fmt == (MF.KV_MLA_FMT if use_mla else MF.KV_2LTD)
        assert obj.tensor.shape[0] == 2        # LMCache's SGLang shape, MLA included
        planes = 1 if use_mla else 2
        assert same(obj.tensor[:planes], _expected_chunk(fmt, kv, slots, s, e))
        assert not obj.tensor[planes:].any()   # an MLA object's second plane is not written
    fresh = zeros_like(kv)
    conn.batched_to_gpu(objs, [s for s, _ in CHUNKS], [e for _, e in CHUNKS], slot_mapping=slots, kvcaches=fresh)
    s_cpu = slots.cpu()
    assert same(logical(fmt, fresh).cpu()[:, :, s_cpu], logical(fmt, kv).cpu()[:, :, s_cpu])


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("use_mla", [False, True])
def test_sglang_layerwise(device, use_mla):
    gen = torch.Generator().manual_seed(90 + use_mla)
    fmt = 5 if use_mla else 4
    h, d = (1, 24) if use_mla else (H, D)
    kv = make_cache(fmt, L, NB, BS, h, d, torch.float16, device, gen)
    conn = C.SGLangLayerwiseGPUConnector(h * d, L, use_mla=use_mla, kvcaches=kv)
    slots = distinct_slots(T_ALL, N, gen, device)
    starts, ends = [s for s, _ in CHUNKS], [e for _, e in CHUNKS]
    objs = [[C.MemoryObj(host_zeros(conn.get_shape(e - s), torch.float16, device)) for s, e in CHUNKS]
            for _ in range(L)]
    assert sum(1 for _ in conn.batched_from_gpu(objs, starts, ends, slot_mapping=slots, sync=False)) == L + 1
    lg = logical(fmt, kv).cpu()
    for l in range(L):
        for obj, (s, e) in zip(objs[l], CHUNKS):
            got = obj.tensor[None] if use_mla else obj.tensor.transpose(0, 1)
            assert same(got, lg[:, l, slots[s:e].cpu()])
    fresh = zeros_like(kv)
    assert _drive_to_gpu(conn.batched_to_gpu(starts, ends, slot_mapping=slots, kvcaches=fresh, sync=False),
                         objs) == L + 1                         # SGLang's layer-wise load yields L + 1 times
    s_cpu = slots.cpu()
    assert same(logical(fmt, fresh).cpu()[:, :, s_cpu], lg[:, :, s_cpu])


def test_xpu_names():
    assert C.SGLangXPUConnector is C.SGLangGPUConnector
    assert issubclass(C.VLLMPagedMemXPUConnectorV2, C.VLLMPagedMemGPUConnectorV2)
    assert issubclass(C.VLLMPagedMemLayerwiseXPUConnector, C.VLLMPagedMemLayerwiseGPUConnector)


# ---------------------------------------------------------------------------------------
# Layout hints, SGLang load offset, CacheBlend head size, error reporting
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [6, 7])
def test_layout_hints_select_hnd(fmt):
    """LMCache's keyword: layout_hints={"kv_layout": "HND"}.  With heads == block size only the hint tells HND."""
    gen = torch.Generator().manual_seed(100 + fmt)
    h = BS                                                   # [.., H, BS, D] and [.., BS, H, D] look alike
    kv = make_cache(fmt, L, NB, BS, h, D, torch.float32, "cpu", gen)
    slots = distinct_slots(8, N, gen, "cpu")
    v2 = C.VLLMPagedMemGPUConnectorV2(h * D, L, layout_hints={"kv_layout": "HND"}, kvcaches=kv)
    assert v2.gpu_kv_format == fmt
    obj = C.MemoryObj(torch.zeros(v2.get_shape(8)))
    v2.from_gpu(obj, 0, 8, slot_mapping=slots)
    assert same(obj.tensor, _expected_chunk(fmt, kv, slots, 0, 8))
    v3 = C.VLLMPagedMemGPUConnectorV3(Metadata(groups=[list(range(L))]), layout_hints={"kv_layout": "HND"},
                                      kvcaches=kv)
    assert [f for _, f, _ in v3.groups] == [fmt]
    lw = C.VLLMPagedMemLayerwiseGPUConnector(h * D, L, layout_hints={"kv_layout": "HND"}, kvcaches=kv)
    objs = [[C.MemoryObj(torch.zeros(lw.get_shape(8)))] for _ in range(L)]
    for _ in lw.batched_from_gpu(objs, [0], [8], slot_mapping=slots, sync=True):
        pass
    lg = logical(fmt, kv)
    assert all(same(objs[l][0].tensor.transpose(0, 1), lg[:, l, slots]) for l in range(L))
    with pytest.raises(ValueError, match="kv_layout = 'NHD' contradicts layout_hints"):
        C.VLLMPagedMemGPUConnectorV2(h * D, L, kv_layout="NHD", layout_hints={"kv_layout": "HND"})


def test_sglang_to_gpu_offset():
    """to_gpu reads slot_mapping[start - offset:end - offset]: the mapping starts at token `offset`."""
    gen = torch.Generator().manual_seed(110)
    kv = make_cache(4, L, NB, BS, H, D, torch.float32, "cpu", gen)
    conn = C.SGLangGPUConnector(H * D, L, kvcaches=kv)
    offset, start, end = 8, 8, 16
    slots = distinct_slots(16, N, gen, "cpu")                # slots of tokens 8..23
    obj = C.MemoryObj(rand(conn.get_shape(end - start), torch.float32, "cpu", gen), MF.KV_2LTD)
    fresh = zeros_like(kv)
    conn.to_gpu(obj, start, end, slot_mapping=slots, kvcaches=fresh, offset=offset)
    got = logical(4, fresh)
    for t in range(end - start):
        assert same(got[:, :, slots[t]], obj.tensor[:, :, t])           # token start + t -> slots[start + t - offset]
    assert got[:, :, slots[8:]].abs().sum() == 0
    with pytest.raises(ValueError, match="offset = 20"):
        conn.to_gpu(obj, start, end, slot_mapping=slots, kvcaches=fresh, offset=20)


def test_cacheblend_head_size_from_the_caches():
    """Without head_size every head is rotated (the head size is the caches')."""
    gen = torch.Generator().manual_seed(120)
    fmt = 1
    kv = _cache(fmt, "cpu", gen)
    table = cos_sin_cache(32, D)
    conn = C.VLLMBufferLayerwiseGPUConnector(H * D, L, use_gpu=True, kv_layout="NHD", cos_sin_cache=table,
                                             device="cpu")
    slots = distinct_slots(6, N, gen, "cpu")
    objs = [[C.MemoryObj(torch.zeros(conn.get_shape(6)))] for _ in range(L)]
    for _ in conn.batched_from_gpu(objs, [0], [6], slot_mapping=slots, kvcaches=kv):
        pass
    old, new = torch.arange(6) + 3, torch.arange(6)
    for l in range(L):
        objs[l][0].cached_positions = old
    fresh = zeros_like(kv)
    _drive_to_gpu(conn.batched_to_gpu([0], [6], slot_mapping=slots, kvcaches=fresh), objs)
    lg, got = logical(fmt, kv), logical(fmt, fresh)
    for l in range(L):
        want = rope_oracle(lg[0, l, slots].view(6, H, D), old, new, table, True).view(6, H * D)
        torch.testing.assert_close(got[0, l, slots], want, rtol=1e-5, atol=1e-5)
    bad = C.VLLMBufferLayerwiseGPUConnector(H * D, L, use_gpu=True, kv_layout="NHD", cos_sin_cache=table,
                                            head_size=H * D)
    load = bad.batched_to_gpu([0], [6], slot_mapping=slots, kvcaches=fresh)
    next(load)
    with pytest.raises(ValueError, match=f"head_size = {H * D} but the caches have heads of {D} elements"):
        load.send(objs[0])


def test_skipped_slots_raise_where_lmcache_synchronizes(request):
    request.addfinalizer(clear_device_status)
    gen = torch.Generator().manual_seed(130)
    kv = _cache(1, "cpu", gen)
    slots = distinct_slots(8, N, gen, "cpu")
    v2 = C.VLLMPagedMemGPUConnectorV2(H * D, L, kv_layout="NHD", kvcaches=kv)
    obj = C.MemoryObj(torch.zeros(v2.get_shape(8)), MF.KV_2LTD)
    lw = C.VLLMPagedMemLayerwiseGPUConnector(H * D, L, kv_layout="NHD", kvcaches=kv)
    lw_objs = [[C.MemoryObj(torch.zeros(lw.get_shape(8)))] for _ in range(L)]
    cb = C.VLLMBufferLayerwiseGPUConnector(H * D, L, use_gpu=True, kv_layout="NHD", kvcaches=kv)
    cb_objs = [[C.MemoryObj(torch.zeros(cb.get_shape(8)), MF.KV_2TD)] for _ in range(L)]
    for call in (lambda: v2.from_gpu(obj, 0, 8, slot_mapping=slots),                  # store into host memory
                 lambda: v2.batched_to_gpu([obj], [0], [8], slot_mapping=slots),       # end of a batched load
                 lambda: list(lw.batched_from_gpu(lw_objs, [0], [8], slot_mapping=slots, sync=True)),
                 lambda: _drive_to_gpu(cb.batched_to_gpu([0], [8], slot_mapping=slots), cb_objs)):
        record_skipped_row(48)
        with pytest.raises(IndexError, match=r"dst_slots\[3\] = 999 is out of range"):
            call()
    v2.from_gpu(obj, 0, 8, slot_mapping=slots)                                       # reported once


def test_validate_reaches_kvlayout_from_connectors(monkeypatch):
    from kvlayout import ops
    seen = []
    real = ops.transfer
    monkeypatch.setattr(ops, "transfer", lambda *a, **k: (seen.append(k.get("validate")), real(*a, **k))[1])
    gen = torch.Generator().manual_seed(140)
    kv = _cache(1, "cpu", gen)
    slots = distinct_slots(8, N, gen, "cpu")
    v2 = C.VLLMPagedMemGPUConnectorV2(H * D, L, kv_layout="NHD", kvcaches=kv, validate=True)
    obj = C.MemoryObj(torch.zeros(v2.get_shape(8)))
    v2.from_gpu(obj, 0, 8, slot_mapping=slots)
    v2.to_gpu(obj, 0, 8, slot_mapping=slots, validate=False)
    lw = C.VLLMPagedMemLayerwiseGPUConnector(H * D, L, kv_layout="NHD", kvcaches=kv)
    lw_objs = [[C.MemoryObj(torch.zeros(lw.get_shape(8)))] for _ in range(L)]
    list(lw.batched_from_gpu(lw_objs, [0], [8], slot_mapping=slots, validate=True, sync=True))
    assert seen == [True, False] + [True] * L
    with pytest.raises(IndexError, match=r"out of range"):
        v2.from_gpu(obj, 0, 8, slot_mapping=slots + N)


# ---------------------------------------------------------------------------------------
# Layer-wise connectors: prepared transfers through their own buffers
# ---------------------------------------------------------------------------------------

def _host_staging(cls):
    """``cls`` whose memory objects go through its staging buffers (``use_gpu``) on the host too, so the
    device-staging path runs with CPU caches."""
    class HostStaging(cls):
        def _stages(self, tensor):
            return self.use_gpu
    return HostStaging


def _count_ops(monkeypatch) -> collections.Counter:
    """Counts ops.transfer, ops.prepare, PreparedTransfer.set_slots and .layer calls (and their validate)."""
    from kvlayout import ops
    counts = collections.Counter()

    def counted(name, fn):
        def wrapper(*a, **k):
            counts[name] += 1
            counts[(name, k.get("validate"))] += 1
            return fn(*a, **k)
        return wrapper
    monkeypatch.setattr(ops, "transfer", counted("transfer", ops.transfer))
    monkeypatch.setattr(ops, "prepare", counted("prepare", ops.prepare))
    for name in ("set_slots", "layer"):
        monkeypatch.setattr(ops.PreparedTransfer, name, counted(name, getattr(ops.PreparedTransfer, name)))
    return counts


def _leaves(kv):
    return [kv] if isinstance(kv, torch.Tensor) else [t for x in kv for t in _leaves(x)]


def _only_at(fmt, kv, slots, src_kv) -> bool:
    """Whether ``kv`` holds ``src_kv``'s rows at ``slots`` and zeros everywhere else (every layer and plane)."""
    want = torch.zeros_like(logical(fmt, src_kv))
    want[:, :, slots] = logical(fmt, src_kv)[:, :, slots]
    return same(logical(fmt, kv), want)


LAYERWISE_CASES = [(C.VLLMPagedMemLayerwiseGPUConnector, 1), (C.VLLMPagedMemLayerwiseGPUConnector, 3),
                   (C.VLLMPagedMemLayerwiseGPUConnector, 11), (C.SGLangLayerwiseGPUConnector, 4),
                   (C.SGLangLayerwiseGPUConnector, 5)]


def _layerwise(cls, fmt, kv, **kwargs):
    mla = fmt in (3, 5)
    hints = {"kv_layout": "NHD"} if cls is C.VLLMPagedMemLayerwiseGPUConnector else {}
    width = 24 if mla else H * D
    return _host_staging(cls)(width, L, use_gpu=True, use_mla=mla, kvcaches=kv, **hints, **kwargs)


@pytest.mark.parametrize("cls, fmt", LAYERWISE_CASES)
def test_layerwise_staging_runs_prepared_transfers_rebound_to_each_calls_slots(monkeypatch, cls, fmt):
    """Staged loads and stores run prepared transfers (one launch a layer, the ping-pong buffers serving layer
    after layer), kept across generator calls and rebound to each call's slots: a transfer still bound to
    the previous call's slots would write (or read) the wrong rows."""
    gen = torch.Generator().manual_seed(150 + fmt)
    h, d = (1, 24) if fmt in (3, 5) else (H, D)
    kv = make_cache(fmt, L, NB, BS, h, d, torch.float32, "cpu", gen)
    dst = zeros_like(kv)
    store, load = _layerwise(cls, fmt, kv), _layerwise(cls, fmt, dst)
    starts, ends = [0, 8], [8, 13]                          # a full chunk and a partial one
    counts = _count_ops(monkeypatch)
    lg = logical(fmt, kv)
    for call in range(3):
        slots = distinct_slots(13, N, gen, "cpu")           # other slots at every call
        objs = [[C.MemoryObj(torch.zeros(store.get_shape(e - s))) for s, e in zip(starts, ends)]
                for _ in range(L)]
        assert sum(1 for _ in store.batched_from_gpu(objs, starts, ends, slot_mapping=slots, sync=True)) == L + 1
        for l in range(L):
            for obj, s, e in zip(objs[l], starts, ends):
                got = obj.tensor[None] if fmt in (3, 5) else obj.tensor.transpose(0, 1)
                assert same(got, lg[:, l, slots[s:e]]), (call, l, s)
        for t in _leaves(dst):
            t.zero_()                                        # the same registered tensors, emptied
        _drive_to_gpu(load.batched_to_gpu(starts, ends, slot_mapping=slots, sync=True), objs)
        assert _only_at(fmt, dst, slots, kv), call
    assert counts["transfer"] == 0
    # stores: one transfer per layer and chunk shape; loads: one per ping-pong buffer; made in the first call
    assert counts["prepare"] == 2 * L + 2
    assert counts["set_slots"] == 2 * (2 * L + 2)           # each later call rebinds each once
    assert counts["layer"] == 3 * (2 * L + L)               # a launch per layer and chunk (stores), per layer (loads)


@pytest.mark.parametrize("cls, fmt", LAYERWISE_CASES)
@pytest.mark.parametrize("change", ["register", "replace_in_list", "register_between_layers"])
def test_layerwise_new_caches_are_not_served_by_old_prepared_transfers(cls, fmt, change):
    """Prepared transfers bind the caches: registering other caches (between calls, or between two layers of
    a call), or the engine putting another tensor into the registered list, makes the next transfer bind
    the caches the connector has now."""
    gen = torch.Generator().manual_seed(160 + fmt)
    h, d = (1, 24) if fmt in (3, 5) else (H, D)
    kv = make_cache(fmt, L, NB, BS, h, d, torch.float32, "cpu", gen)
    first = zeros_like(kv)
    load = _layerwise(cls, fmt, first)
    slots = distinct_slots(8, N, gen, "cpu")
    objs = [[C.MemoryObj(torch.zeros(load.get_shape(8)))] for _ in range(L)]
    list(_layerwise(cls, fmt, kv).batched_from_gpu(objs, [0], [8], slot_mapping=slots, sync=True))
    _drive_to_gpu(load.batched_to_gpu([0], [8], slot_mapping=slots, sync=True), objs)
    assert _only_at(fmt, first, slots, kv)
    if change == "replace_in_list":                        # the engine puts a new layer 1 into its list
        lists = [first[0], first[1]] if fmt == 4 else [first]
        old = [x[1] for x in lists]
        for x in lists:
            x[1] = torch.zeros_like(x[1])
        second = first
    else:
        old, second = _leaves(first), zeros_like(kv)
    for t in old:
        t.zero_()
    if change == "register":
        load.register_kv_caches(second)
    gen_obj = load.batched_to_gpu([0], [8], slot_mapping=slots, sync=True)
    next(gen_obj)
    for l in range(L):
        gen_obj.send(objs[l])
        if change == "register_between_layers" and l == 0:
            load.register_kv_caches(second)                # layer 0 went to the old caches, the others go here
    list(gen_obj)
    if change == "register_between_layers":
        lg = logical(fmt, kv)
        assert same(logical(fmt, first)[:, 0, slots], lg[:, 0, slots])
        assert logical(fmt, first)[:, 1:].abs().sum() == 0 and logical(fmt, second)[:, 0].abs().sum() == 0
        assert same(logical(fmt, second)[:, 1:, slots], lg[:, 1:, slots])
        return
    assert _only_at(fmt, second, slots, kv)
    assert all(t.abs().sum() == 0 for t in old)            # nothing written where the old caches were


def test_cacheblend_ping_pong_buffers_run_prepared_transfers_rebound_to_each_calls_slots(monkeypatch):
    """CacheBlend's flushes (from its two ping-pong buffers) and its stores (from one staging buffer) run
    prepared transfers, rebound to every call's slots."""
    gen = torch.Generator().manual_seed(170)
    kv = _cache(1, "cpu", gen)
    dst = zeros_like(kv)
    conn = C.VLLMBufferLayerwiseGPUConnector(H * D, L, use_gpu=True, kv_layout="NHD", kvcaches=kv)
    loader = C.VLLMBufferLayerwiseGPUConnector(H * D, L, use_gpu=True, kv_layout="NHD", kvcaches=dst)
    counts = _count_ops(monkeypatch)
    starts, ends = [0, 6], [6, 10]
    for call in range(3):
        slots = distinct_slots(10, N, gen, "cpu")
        objs = [[C.MemoryObj(torch.zeros(conn.get_shape(e - s))) for s, e in zip(starts, ends)] for _ in range(L)]
        assert sum(1 for _ in conn.batched_from_gpu(objs, starts, ends, slot_mapping=slots)) == L + 1
        for t in dst:
            t.zero_()
        assert _drive_to_gpu(loader.batched_to_gpu(starts, ends, slot_mapping=slots), objs) == L + 2
        assert _only_at(1, dst, slots, kv), call
    assert counts["transfer"] == 0
    assert counts["prepare"] == L + 2                       # stores: one per layer; flushes: one per buffer
    assert counts["set_slots"] == 2 * (L + 2)


@pytest.mark.parametrize("cls, fmt", LAYERWISE_CASES[:2])
def test_layerwise_replaced_staging_buffers_are_let_go(cls, fmt):
    """A staging buffer outgrown by a larger call is freed: the prepared transfers that bound it are dropped."""
    gen = torch.Generator().manual_seed(180 + fmt)
    h, d = (1, 24) if fmt in (3, 5) else (H, D)
    kv = make_cache(fmt, L, NB, BS, h, d, torch.float32, "cpu", gen)
    conn = _layerwise(cls, fmt, kv)
    refs = []
    for n in (4, 12):
        slots = distinct_slots(n, N, gen, "cpu")
        objs = [[C.MemoryObj(torch.zeros(conn.get_shape(n)))] for _ in range(L)]
        list(conn.batched_from_gpu(objs, [0], [n], slot_mapping=slots, sync=True))
        _drive_to_gpu(conn.batched_to_gpu([0], [n], slot_mapping=slots, sync=True), objs)
        refs.append([StorageWeakRef(b.untyped_storage()) for b in conn._staging.values()])
    gc.collect()
    assert len(refs[0]) == 4 and all(r.expired() for r in refs[0])      # two load and two store buffers
    assert not any(r.expired() for r in refs[1])


def test_cacheblend_replaced_buffers_are_let_go():
    gen = torch.Generator().manual_seed(185)
    kv = _cache(1, "cpu", gen)
    conn = C.VLLMBufferLayerwiseGPUConnector(H * D, L, use_gpu=True, kv_layout="NHD", kvcaches=kv, chunk_size=4)
    loader = C.VLLMBufferLayerwiseGPUConnector(H * D, L, use_gpu=True, kv_layout="NHD", kvcaches=zeros_like(kv),
                                               chunk_size=4)
    refs = []
    for n in (4, 12):
        slots = distinct_slots(n, N, gen, "cpu")
        objs = [[C.MemoryObj(torch.zeros(conn.get_shape(n)))] for _ in range(L)]
        list(conn.batched_from_gpu(objs, [0], [n], slot_mapping=slots))
        _drive_to_gpu(loader.batched_to_gpu([0], [n], slot_mapping=slots), objs)
        refs.append([StorageWeakRef(b.untyped_storage()) for b in [*conn._staging.values(), *loader._pingpong]])
    gc.collect()
    assert len(refs[0]) == 3 and all(r.expired() for r in refs[0])      # the store buffer, the ping-pong pair
    assert not any(r.expired() for r in refs[1])


def test_layerwise_validate_reaches_prepared_transfers(monkeypatch):
    """validate (the connector's, or the call's) is prepared with the transfer; with None, KVLAYOUT_VALIDATE
    is read at each call."""
    gen = torch.Generator().manual_seed(190)
    kv = _cache(1, "cpu", gen)
    conn = _layerwise(C.VLLMPagedMemLayerwiseGPUConnector, 1, kv, validate=True)
    counts = _count_ops(monkeypatch)
    slots = distinct_slots(8, N, gen, "cpu")
    objs = [[C.MemoryObj(torch.zeros(conn.get_shape(8)))] for _ in range(L)]
    list(conn.batched_from_gpu(objs, [0], [8], slot_mapping=slots, sync=True))
    _drive_to_gpu(conn.batched_to_gpu([0], [8], slot_mapping=slots, sync=True, validate=False), objs)
    # stores: a transfer per layer; loads: one per ping-pong buffer
    assert counts[("prepare", True)] == L and counts[("prepare", False)] == 2
    for env, prepared in (("0", 2), ("1", 4), ("1", 4)):
        monkeypatch.setenv("KVLAYOUT_VALIDATE", env)
        _drive_to_gpu(conn.batched_to_gpu([0], [8], slot_mapping=slots, sync=True, validate=None), objs)
        assert counts[("prepare", None)] == prepared, env
    with pytest.raises(IndexError, match=r"dst_slots\[2\] = 99 is out of range"):
        _drive_to_gpu(conn.batched_to_gpu([0], [3], slot_mapping=torch.tensor([0, 1, 99]), sync=True),
                      [[C.MemoryObj(torch.zeros(conn.get_shape(3)), MF.KV_T2D)] for _ in range(L)])
