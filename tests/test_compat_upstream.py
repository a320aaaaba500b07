"""kvlayout.compat against the behaviours LMCache's and SGLang's own suites check.

Each test states the behaviour it covers: hybrid models (layer groups that
differ in head size and dtype) through V3 and LMCache's geometry helpers,
LMCache's older per-layer ops against the reference, SGLang's current host
pool constructor and assertions, the layer-wise connectors'
``gpu_buffer_allocator``, one warning for a missing layout hint, no re-binding
when an engine passes the same cache tensors in a new list, SGLang 0.4.8's
flat-data helpers and LMCache's SGLang object shape.  Device-generic tests run
on the CPU and, where present, on CUDA.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kvlayout.compat import connectors as C
from kvlayout.compat import lmcache as lm
from kvlayout.compat import sglang as S
from kvlayout.compat.lmcache import MemoryFormat as MF

from compat_oracles import (
    Metadata,
    devices,
    distinct_slots,
    host_zeros,
    logical,
    make_cache,
    rand,
    same,
    zeros_like,
)

NB, BS, H = 12, 4, 2
N = NB * BS


# ---------------------------------------------------------------------------------------
# Hybrid models: layer groups of other head sizes and dtypes
# ---------------------------------------------------------------------------------------

GROUP_HEAD_SIZES = [8, 6, 10]                         # 6 / 10 uint8 elements: rows of no 8-byte multiple
GROUP_DTYPES = [torch.uint8, torch.bfloat16, torch.uint8]
LAYERS_PER_GROUP = 2


def _hybrid_caches(fmt, groups, device, gen):
    """Per group a list of per-layer caches of ``fmt`` with its own head size and dtype, and all layers in order."""
    heads = 1 if fmt == 3 else H
    per_group = [make_cache(fmt, LAYERS_PER_GROUP, NB, BS, heads, GROUP_HEAD_SIZES[g], GROUP_DTYPES[g], device, gen)
                 for g in range(groups)]
    return per_group, [t for group in per_group for t in group]


@pytest.mark.parametrize("fmt", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_geometry_helpers_read_layer_0_of_a_hybrid_model(fmt, groups):
    """LMCache's helpers read layer 0: a hybrid model's layers may differ in head size and dtype."""
    _, layers = _hybrid_caches(fmt, groups, "cpu", torch.Generator().manual_seed(fmt * 10 + groups))
    assert lm.get_num_layers(layers, fmt) == groups * LAYERS_PER_GROUP
    assert lm.get_num_blocks(layers, fmt) == NB and lm.get_block_size(layers, fmt) == BS
    assert lm.get_page_buffer_size(layers, fmt) == N
    assert lm.get_head_size(layers, fmt) == GROUP_HEAD_SIZES[0]
    assert lm.get_num_heads(layers, fmt) == (1 if fmt == 3 else H)
    assert lm.get_hidden_dim_size(layers, fmt) == (1 if fmt == 3 else H) * GROUP_HEAD_SIZES[0]
    assert lm.get_dtype(layers, fmt) == GROUP_DTYPES[0]
    assert lm.get_elements_per_layer(layers, fmt) == layers[0].numel()
    assert lm.get_kv_cache_data_ptrs(layers, fmt) == [t.data_ptr() for t in layers]


def test_geometry_helpers_still_check_layer_0_and_the_structure():
    kv = make_cache(1, 2, NB, BS, H, 8, torch.float16, "cpu", torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="no layers"):
        lm.get_num_blocks([], 1)
    with pytest.raises(ValueError, match="list of per-layer tensors"):
        lm.get_num_blocks(kv[0], 1)
    with pytest.raises(ValueError):                 # a [2, NB, BS, H, D] layer read as FlashInfer [NB, 2, ...]
        lm.get_num_blocks([kv[0][:, :, :1]], 2)
    k, v = make_cache(4, 3, NB, BS, H, 8, torch.float16, "cpu", torch.Generator().manual_seed(2))
    assert lm.get_num_layers([k, v], 4) == 3 and lm.get_page_buffer_size([k, v], 4) == N
    assert lm.get_kv_cache_data_ptrs([k, v], 4) == [t.data_ptr() for t in k + v]


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("fmt", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize("use_gpu", [False, True])
def test_v3_round_trip_of_a_hybrid_model(device, fmt, groups, use_gpu):
    """Store every chunk of a hybrid model with one V3 connector, load it into fresh caches with another: every
    group's slots equal the source, bit for bit; the metadata is built with ``get_num_blocks`` over all layers,
    as LMCache's engine builds it."""
    gen = torch.Generator().manual_seed(100 * fmt + 10 * groups + use_gpu)
    src_groups, src = _hybrid_caches(fmt, groups, device, gen)
    dst_groups = [zeros_like(g) for g in src_groups]
    dst = [t for g in dst_groups for t in g]
    layer_groups = [list(range(g * LAYERS_PER_GROUP, (g + 1) * LAYERS_PER_GROUP)) for g in range(groups)]
    assert lm.get_num_blocks(src, fmt) == NB                 # what the metadata of a hybrid model is built with
    md = Metadata(layers=len(src), chunk=8, heads=1 if fmt == 3 else H, use_mla=fmt == 3, groups=layer_groups)
    store = C.VLLMPagedMemGPUConnectorV3(md, torch.device(device), use_gpu=use_gpu, kv_layout="NHD")
    load = C.VLLMPagedMemGPUConnectorV3(md, torch.device(device), use_gpu=use_gpu, kv_layout="NHD")
    slots = distinct_slots(21, N, gen, device)
    for start in range(0, 21, 8):
        end = min(start + 8, 21)
        store.register_kv_caches(list(src))
        obj = store.allocate(end - start, device="cpu", pin_memory=device != "cpu")
        store.from_gpu(obj, start, end, kvcaches=list(src), slot_mapping=slots)
        assert obj.fmt == (MF.KV_MLA_FMT if fmt == 3 else MF.KV_2LTD)
        assert [t.dtype for t in obj.tensors] == GROUP_DTYPES[:groups]
        load.to_gpu(obj, start, end, kvcaches=list(dst), slot_mapping=slots)
    s = slots.cpu()
    for g in range(groups):
        assert same(logical(fmt, dst_groups[g]).cpu()[:, :, s], logical(fmt, src_groups[g]).cpu()[:, :, s])
        untouched = torch.ones(N, dtype=torch.bool)
        untouched[s] = False
        assert not logical(fmt, dst_groups[g]).cpu()[:, :, untouched].any()


# ---------------------------------------------------------------------------------------
# LMCache's older per-layer ops
# ---------------------------------------------------------------------------------------

def _flash_cache(layers, dtype, device, gen, d=8):
    """vLLM FlashAttention caches: per layer [2, NB, BS, H, D]; layer l's K and V are ``kv[l][0]``, ``kv[l][1]``."""
    return make_cache(1, layers, NB, BS, H, d, dtype, device, gen)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("num_tokens", [1, 13, N])
def test_load_and_reshape_flash_extracts_and_loads_back(device, num_tokens):
    """Layer by layer into a [2, L, T, H*D] object, then back into fresh caches: the object equals the
    indexing oracle; the fresh caches equal the source at the slots and stay zero elsewhere."""
    layers = 3
    gen = torch.Generator().manual_seed(num_tokens)
    kv = _flash_cache(layers, torch.bfloat16, device, gen)
    slots = distinct_slots(num_tokens, N, gen, device)
    obj = host_zeros((2, layers, num_tokens, H * 8), torch.bfloat16, device)
    for l in range(layers):
        lm.load_and_reshape_flash(obj, kv[l][0], kv[l][1], slots, l)
    if device != "cpu":
        torch.cuda.synchronize()
    assert same(obj, logical(1, kv).cpu()[:, :, slots.cpu()])
    fresh = zeros_like(kv)
    for l in range(layers):
        lm.reshape_and_cache_back_flash(obj, fresh[l][0], fresh[l][1], slots, l)
    s = slots.cpu()
    got, want = logical(1, fresh).cpu(), logical(1, kv).cpu()
    assert same(got[:, :, s], want[:, :, s])
    rest = torch.ones(N, dtype=torch.bool)
    rest[s] = False
    assert not got[:, :, rest].any()


@pytest.mark.parametrize("direction", ["extract", "load_back"])
def test_flash_ops_match_the_reference(direction):
    """Both ops agree with kvlayout.reference's transfer (vLLM FlashAttention NHD <-> lmcache_kv_2ltd, one layer
    pair), negative slots included; the other layers of the object stay as they were."""
    ref = pytest.importorskip("kvlayout.reference.operations")
    layers, T = 3, 7
    gen = torch.Generator().manual_seed(5)
    kv = _flash_cache(layers, torch.float32, "cpu", gen)
    obj = rand((2, layers, T, H * 8), torch.float32, "cpu", gen)
    slots = distinct_slots(T, N, gen, "cpu", negatives=(0, 4))
    for l in range(layers):
        if direction == "extract":
            before = obj.clone()
            lm.load_and_reshape_flash(obj, kv[l][0], kv[l][1], slots, l)
            want = ref.transfer("vllm_flash_attn_nhd", [t.numpy() for t in kv], "lmcache_kv_2ltd", before.numpy(),
                                slots.numpy(), None, src_layers=[l], dst_layers=[l])
            assert np.array_equal(np.asarray(want), obj.numpy())
        else:
            before = [t.clone() for t in kv]
            lm.reshape_and_cache_back_flash(obj, kv[l][0], kv[l][1], slots, l)
            want = ref.transfer("lmcache_kv_2ltd", obj.numpy(), "vllm_flash_attn_nhd", [t.numpy() for t in before],
                                None, slots.numpy(), src_layers=[l], dst_layers=[l])
            assert all(np.array_equal(np.asarray(w), t.numpy()) for w, t in zip(want, kv))


def test_flash_ops_refuse_bad_arguments_by_name():
    kv = _flash_cache(2, torch.float32, "cpu", torch.Generator().manual_seed(6))
    obj = torch.zeros(2, 2, 3, H * 8)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(IndexError, match="layer_idx = 2 is out of range"):
        lm.load_and_reshape_flash(obj, kv[0][0], kv[0][1], slots, 2)
    with pytest.raises(TypeError, match="layer_idx"):
        lm.load_and_reshape_flash(obj, kv[0][0], kv[0][1], slots, True)
    with pytest.raises(ValueError, match="slot_mapping"):
        lm.reshape_and_cache_back_flash(obj, kv[0][0], kv[0][1], torch.tensor([0, 1]), 0)
    with pytest.raises(ValueError, match=r"key_value must be \[2, L, T, NH\*HS\]"):
        lm.load_and_reshape_flash(obj[0], kv[0][0], kv[0][1], slots, 0)
    with pytest.raises(ValueError, match="value_cache"):
        lm.load_and_reshape_flash(obj, kv[0][0], kv[0][1][:, :2], slots, 0)
    with pytest.raises(IndexError):                          # a slot beyond the cache: nothing is written
        lm.reshape_and_cache_back_flash(torch.ones(2, 2, 3, H * 8), kv[0][0], kv[0][1], torch.tensor([0, 1, N]), 0)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("head_size", [66, 576])
def test_mla_multi_layer_rows_of_no_16_byte_multiple(device, head_size):
    """MLA (format 3) rows of 132 bytes (an indexer cache's 66 bf16 elements) and 1152 bytes: out into a
    [1, L, T, HS] object and back into fresh caches, bit for bit."""
    gen = torch.Generator().manual_seed(head_size)
    kv = make_cache(3, 2, NB, BS, 1, head_size, torch.bfloat16, device, gen)
    slots = distinct_slots(11, N, gen, device, negatives=(3,))
    obj = torch.zeros(1, 2, 11, head_size, dtype=torch.bfloat16, device=device)
    lm.multi_layer_kv_transfer(obj, kv, slots, device, 0, lm.TransferDirection.D2H, 3)
    s = slots.cpu()
    want = logical(3, kv).cpu()[:, :, s.clamp(min=0)]
    want[:, :, 3] = 0
    assert same(obj.cpu(), want)
    fresh = zeros_like(kv)
    lm.multi_layer_kv_transfer(obj, fresh, slots, device, 0, lm.TransferDirection.H2D, 3)
    valid = s[s >= 0]
    assert same(logical(3, fresh).cpu()[:, :, valid], logical(3, kv).cpu()[:, :, valid])
    assert int(logical(3, fresh).cpu().count_nonzero()) == int(logical(3, fresh).cpu()[:, :, valid].count_nonzero())


# ---------------------------------------------------------------------------------------
# SGLang's current host pool: constructor and assertions
# ---------------------------------------------------------------------------------------

def _small_host_pool(**kw):
    device_pool = S.MHATokenToKVPool(4, 2, torch.float16, 2, 4, 2, "cpu", False)
    return S.MHATokenToKVPoolHost(device_pool=device_pool, host_to_device_ratio=2.0, host_size=0, page_size=2,
                                  layout="layer_first", pin_memory=False, device="cpu", **kw)


def test_host_pool_takes_allocator_type():
    host = _small_host_pool(allocator_type="default")
    assert host.allocator_type == "default"
    # SGLang's sizes: a row of H*D elements, 2*L rows per token, the buffer exactly size tokens
    assert host.element_dim == 2 * 4 and host.token_stride_size == 2 * 4 * 2
    assert host.size_per_token == 2 * 2 * host.token_stride_size
    assert host.kv_buffer.nbytes == host.size * host.size_per_token
    with pytest.raises(ValueError, match="allocator_type = 'shm' is not supported"):
        _small_host_pool(allocator_type="shm")


def test_double_alloc_is_sglangs_assertion():
    host = _small_host_pool(allocator_type="default")
    got = host.alloc(4)
    host.free_slots = torch.cat([got[:1], host.free_slots])          # a corrupted free list: an in-use slot first
    before = host.free_slots.clone()
    with pytest.raises(AssertionError, match=rf"Double-alloc: host slots \[{int(got[0])}\]") as err:
        host.alloc(4)
    assert isinstance(err.value, RuntimeError)
    assert torch.equal(host.free_slots, before)                    # nothing was taken


def test_double_free_is_sglangs_assertion():
    host = _small_host_pool()
    got = host.alloc(4)
    host.free(got[:2])
    with pytest.raises(AssertionError, match=rf"Double-free of host slots \[{int(got[1])}\]") as err:
        host.free(got[1:])
    assert isinstance(err.value, ValueError)
    assert host.slot_used[got[2:]].all()                           # nothing was freed
    with pytest.raises(AssertionError, match=r"Double-free of host slots \[1\]"):
        _small_host_pool().free(torch.tensor([1]))                 # never allocated


def test_free_after_clear_is_a_double_free_of_every_slot():
    host = _small_host_pool()
    got = host.alloc(4)
    host.clear()
    with pytest.raises(AssertionError, match="Double-free") as err:
        host.free(got)
    assert str(got.tolist()) in str(err.value)


# ---------------------------------------------------------------------------------------
# Layer-wise connectors: gpu_buffer_allocator
# ---------------------------------------------------------------------------------------

LAYER_CLASSES = [C.VLLMPagedMemLayerwiseGPUConnector, C.SGLangLayerwiseGPUConnector]


def _layerwise_round_trip(cls, device, gen, layers=3, chunks=((0, 8), (8, 13))):
    fmt = 4 if cls is C.SGLangLayerwiseGPUConnector else 1
    kv = make_cache(fmt, layers, NB, BS, H, 8, torch.float32, device, gen)
    conn = cls(H * 8, layers, use_gpu=True, device=device, kv_layout="NHD", kvcaches=kv)
    slots = distinct_slots(chunks[-1][1], N, gen, device)
    starts, ends = [s for s, _ in chunks], [e for _, e in chunks]
    objs = [[C.MemoryObj(host_zeros(conn.get_shape(e - s), device=device), MF.KV_T2D) for s, e in chunks]
            for _ in range(layers)]
    for _ in conn.batched_from_gpu(objs, starts, ends, slot_mapping=slots, sync=True):
        pass
    fresh = zeros_like(kv)
    load = conn.batched_to_gpu(starts, ends, slot_mapping=slots, sync=True, kvcaches=fresh)
    next(load)
    for l in range(layers):
        load.send(objs[l])
    for _ in load:
        pass
    if device != "cpu":
        torch.cuda.synchronize()
    s = slots.cpu()
    assert same(logical(fmt, fresh).cpu()[:, :, s], logical(fmt, kv).cpu()[:, :, s])
    return conn


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("cls", LAYER_CLASSES + [C.VLLMPagedMemGPUConnectorV2, C.VLLMBufferLayerwiseGPUConnector])
def test_every_connector_has_a_gpu_buffer_allocator(device, cls):
    if cls is C.VLLMBufferLayerwiseGPUConnector:
        conn = cls(H * 8, 3, use_gpu=True, device=device)
    else:
        conn = cls(H * 8, 3, device=device)
    assert conn.gpu_buffer_allocator.memcheck() and conn.gpu_buffer_allocator.nbytes == 0


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("cls", LAYER_CLASSES)
def test_gpu_buffer_allocator_memcheck_after_a_layerwise_round_trip(device, cls):
    conn = _layerwise_round_trip(cls, device, torch.Generator().manual_seed(31))
    alloc = conn.gpu_buffer_allocator
    assert alloc.memcheck()
    # staging happens where the objects are elsewhere than the caches (host objects, device caches)
    assert (alloc.nbytes > 0) == (device != "cpu")


def test_gpu_buffer_allocator_memcheck_finds_broken_bookkeeping():
    conn = C.VLLMPagedMemLayerwiseGPUConnector(H * 8, 3, device="cpu")
    conn._staging[0] = torch.zeros(64, dtype=torch.uint8)
    conn._staging_views[0] = ((8,), conn._staging[0][:8])
    assert conn.gpu_buffer_allocator.memcheck()
    conn._staging[1] = conn._staging[0][32:]                        # two buffers sharing memory
    assert not conn.gpu_buffer_allocator.memcheck()
    del conn._staging[1]
    conn._staging_views[0] = ((8,), torch.zeros(8, dtype=torch.uint8))   # a view of no buffer of its slot
    assert not conn.gpu_buffer_allocator.memcheck()
    conn._staging_views[0] = ((8,), conn._staging[0][:8])
    conn._staging_views[("store", 0)] = ((8,), conn._staging[0][:8])    # a view whose buffer is gone
    assert not conn.gpu_buffer_allocator.memcheck()


@pytest.mark.parametrize("device", devices)
def test_two_layerwise_requests_interleaved(device):
    """Two requests' layer-wise stores and loads interleaved layer by layer, one with ``sync=True`` and one
    without (LMCache's batched layer-wise test): both land whole."""
    gen = torch.Generator().manual_seed(32)
    layers = 3
    kv = make_cache(1, layers, NB, BS, H, 8, torch.float32, device, gen)
    conn = C.VLLMPagedMemLayerwiseGPUConnector(H * 8, layers, use_gpu=True, device=device, kv_layout="NHD")
    slots = distinct_slots(30, N, gen, device)
    reqs = [([0, 8], [8, 13]), ([13, 21], [21, 30])]
    objs = [[[C.MemoryObj(host_zeros(conn.get_shape(e - s), device=device), MF.KV_T2D)
              for s, e in zip(*r)] for _ in range(layers)] for r in reqs]
    stores = [conn.batched_from_gpu(objs[i], *reqs[i], kvcaches=kv, slot_mapping=slots, sync=i == 0)
              for i in range(2)]
    for _ in range(layers + 1):
        for g in stores:
            next(g)
    fresh = zeros_like(kv)
    loads = [conn.batched_to_gpu(*reqs[i], kvcaches=fresh, slot_mapping=slots, sync=i == 1) for i in range(2)]
    for g in loads:
        next(g)
    for l in range(layers):
        for i, g in enumerate(loads):
            g.send(objs[i][l])
    for g in loads:
        next(g)
    if device != "cpu":
        torch.cuda.synchronize()
    s = slots.cpu()
    assert same(logical(1, fresh).cpu()[:, :, s], logical(1, kv).cpu()[:, :, s])
    assert conn.gpu_buffer_allocator.memcheck()


# ---------------------------------------------------------------------------------------
# Logging and registration
# ---------------------------------------------------------------------------------------

def test_missing_layout_hint_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(lm, "_warned_no_layout_hint", False)
    kv = make_cache(1, 2, NB, BS, H, 8, torch.float32, "cpu", torch.Generator().manual_seed(40))
    with caplog.at_level(logging.DEBUG, logger=lm.__name__):
        for _ in range(3):
            assert lm.discover_gpu_kv_format(kv, "vllm") == lm.GPUKVFormat.NL_X_TWO_NB_BS_NH_HS
            lm.normalize_and_discover([t.view(NB, BS, H, 16) for t in make_cache(
                11, 1, NB, BS, H, 8, torch.float32, "cpu", torch.Generator())], "vllm")
    said = [r for r in caplog.records if "no kv_layout hint" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING] + [logging.DEBUG] * 5
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=lm.__name__):
        lm.discover_gpu_kv_format(kv, "vllm", {"kv_layout": "NHD"})        # a hint: nothing to say
    assert not caplog.records


@pytest.mark.parametrize("cls", [C.VLLMPagedMemGPUConnectorV2, C.VLLMPagedMemLayerwiseGPUConnector])
def test_the_same_tensors_in_a_new_list_are_not_registered_again(cls, monkeypatch, caplog):
    """An engine that builds a new list of the same cache tensors for every call: one registration (and no
    warning per call); a replaced, moved or added tensor, or another kv_layout, registers again."""
    monkeypatch.setattr(lm, "_warned_no_layout_hint", True)
    gen = torch.Generator().manual_seed(41)
    kv = make_cache(1, 3, NB, BS, H, 8, torch.float32, "cpu", gen)
    conn = cls(H * 8, 3, device="cpu")
    registered = []
    real = conn.register_kv_caches
    monkeypatch.setattr(conn, "register_kv_caches", lambda kvc, layout=None: (registered.append(kvc),
                                                                              real(kvc, layout))[1])
    slots = distinct_slots(8, N, gen, "cpu")

    def call(caches, **kw):
        if cls is C.VLLMPagedMemGPUConnectorV2:
            conn.from_gpu(C.MemoryObj(torch.zeros(conn.get_shape(8))), 0, 8, kvcaches=caches, slot_mapping=slots,
                          **kw)
        else:
            objs = [[C.MemoryObj(torch.zeros(conn.get_shape(8)))] for _ in range(3)]
            for _ in conn.batched_from_gpu(objs, [0], [8], kvcaches=caches, slot_mapping=slots, sync=False, **kw):
                pass
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            call(list(kv))                                  # a new list each time, the same tensors
    assert len(registered) == 1 and not caplog.records
    call([kv[0], kv[1], kv[2].clone()])                    # one tensor replaced
    call([kv[0], kv[2], kv[1]])                            # two moved
    call([kv[0], kv[2], kv[1]], kv_layout="NHD")           # a layout named now (none before)
    assert len(registered) == 4
    same_list = list(kv)
    call(same_list)
    same_list[1] = kv[1].clone()                           # the same list object, a tensor replaced in place
    call(same_list)
    assert len(registered) == 6
    # a tensor dropped from the list and a new one made in its place: the registration still holds the old
    # tensor, so the new one cannot take its identity
    own = [kv[0].clone(), kv[1].clone(), kv[2].clone()]
    call(own)
    del own[1]
    own.insert(1, kv[1].clone())
    call(own)
    assert len(registered) == 8


# ---------------------------------------------------------------------------------------
# SGLang 0.4.8's flat-data helpers; LMCache's SGLang object shape
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("mla", [False, True])
def test_device_pool_flat_data_round_trip(device, mla):
    gen = torch.Generator().manual_seed(50 + mla)
    if mla:
        pool = S.MLATokenToKVPool(16, 4, torch.bfloat16, 8, 4, 3, device, False, start_layer=2)
        bufs = [pool.kv_buffer]
    else:
        pool = S.MHATokenToKVPool(16, 4, torch.bfloat16, 2, 8, 3, device, False, start_layer=2)
        bufs = [pool.k_buffer, pool.v_buffer]
    for lst in bufs:
        for t in lst:
            t.copy_(rand(t.shape, t.dtype, device, gen))
    idx = torch.tensor([5, 0, 19, 7], device=device)
    flat = pool.get_flat_data(idx)
    want = torch.stack([torch.stack([t[idx] for t in lst]) for lst in bufs])      # [P, L, n, H, D]
    assert same(flat, want[0] if mla else want)
    # transfer: all layers, at other slots
    new = torch.tensor([1, 2, 3, 4], device=device)
    before = [[t.clone() for t in lst] for lst in bufs]
    pool.transfer(new, flat.cpu())
    for lst, old, w in zip(bufs, before, want):
        for t, o, rows in zip(lst, old, w):
            o[new] = rows
            assert same(t, o)
    # transfer_per_layer: one layer (global id 3), rows of another layer
    one = flat[:, 0] if not mla else flat[0]
    pool.transfer_per_layer(idx, one, 3)
    for p, lst in enumerate(bufs):
        assert same(lst[1][idx], (want[p, 0]))
        assert same(lst[0][new], want[p, 0]) and same(lst[2][new], want[p, 2])
    with pytest.raises(ValueError, match="flat_data must be"):
        pool.transfer_per_layer(idx, flat, 3)                   # every layer given to one layer
    with pytest.raises(IndexError, match="layer_id = 1 is outside"):
        pool.transfer_per_layer(idx, one, 1)


@pytest.mark.parametrize("device", devices)
def test_sglang_mla_objects_have_lmcaches_shape_and_one_plane_still_works(device):
    gen = torch.Generator().manual_seed(60)
    kv = make_cache(5, 3, NB, BS, 1, 24, torch.float16, device, gen)
    conn = C.SGLangGPUConnector(24, 3, use_mla=True, kvcaches=kv)
    assert conn.get_shape(5) == (2, 3, 5, 24)
    slots = distinct_slots(5, N, gen, device)
    two = C.MemoryObj(torch.zeros(conn.get_shape(5), dtype=torch.float16, device=device))
    one = C.MemoryObj(torch.zeros(1, 3, 5, 24, dtype=torch.float16, device=device))
    for obj in (two, one):
        conn.from_gpu(obj, 0, 5, slot_mapping=slots)
        assert obj.fmt == MF.KV_MLA_FMT
        assert same(obj.tensor[:1], logical(5, kv)[:, :, slots.cpu()].to(obj.tensor.device))
    assert not two.tensor[1].any()
    fresh = zeros_like(kv)
    conn.to_gpu(two, 0, 5, slot_mapping=slots, kvcaches=fresh)
    assert same(logical(5, fresh)[:, :, slots.cpu()], logical(5, kv)[:, :, slots.cpu()])
