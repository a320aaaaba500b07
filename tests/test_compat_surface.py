"""kvlayout.compat integration surface: LMCache-shaped objects, constructors, getters, streams (CPU)."""

from __future__ import annotations

import enum

import pytest
import torch

from kvlayout.compat import connectors as C
from kvlayout.compat import lmcache as lm

from compat_oracles import (
    LMCacheFormat,
    LMCacheLikeObj,
    Metadata,
    distinct_slots,
    logical,
    make_cache,
    rand,
    same,
    zeros_like,
)

L, NB, BS, H, D = 3, 6, 4, 2, 8
N = NB * BS


class LMCacheGPUKVFormat(enum.Enum):
    """Like LMCache's pybind GPUKVFormat: members with .name/.value, not kvlayout's IntEnum."""
    NL_X_TWO_NB_BS_NH_HS = 1
    NL_X_NB_BS_HS = 3


# ---------------------------------------------------------------------------------------
# Geometry getters
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, shape_of", [
    (0, lambda: (NB, L, 2, BS, H, D)), (1, lambda: (2, NB, BS, H, D)), (2, lambda: (NB, 2, BS, H, D)),
    (3, lambda: (NB, BS, D)), (6, lambda: (2, NB, H, BS, D)), (7, lambda: (NB, 2, H, BS, D)),
    (8, lambda: (NB, L, 2, H, BS, D)), (11, lambda: (NB, BS, H, 2, D))])
def test_geometry_getters_paged(fmt, shape_of):
    kv = make_cache(fmt, L, NB, BS, H, D, torch.float16, "cpu", torch.Generator().manual_seed(fmt))
    mla = fmt == 3
    heads = 1 if mla else H
    assert lm.get_num_layers(kv, fmt) == L
    assert lm.get_num_blocks(kv, fmt) == NB and lm.get_block_size(kv, fmt) == BS
    assert lm.get_page_buffer_size(kv, fmt) == lm.get_tokens_per_layer(kv, fmt) == NB * BS
    assert lm.get_num_heads(kv, fmt) == heads and lm.get_head_size(kv, fmt) == D
    assert lm.get_hidden_dim_size(kv, fmt) == heads * D
    assert lm.get_elements_per_layer(kv, fmt) == (1 if mla else 2) * NB * BS * heads * D
    assert lm.get_dtype(kv, fmt) == torch.float16
    assert lm.is_mla(fmt) == mla and lm.is_hnd(fmt) == (fmt in (6, 7, 8))
    assert lm.is_cross_layer_format(fmt) == (fmt in (0, 8))
    assert lm.get_kv_size(fmt) == (1 if fmt in (3, 11) else 2)
    tensors = [kv] if fmt in (0, 8) else kv
    assert lm.get_kv_cache_data_ptrs(kv, fmt) == [t.data_ptr() for t in tensors]


@pytest.mark.parametrize("fmt", [4, 5])
def test_geometry_getters_sglang(fmt):
    kv = make_cache(fmt, L, NB, BS, H, D, torch.bfloat16, "cpu", torch.Generator().manual_seed(fmt))
    heads = 1 if fmt == 5 else H
    assert lm.get_page_buffer_size(kv, fmt) == N and lm.get_num_heads(kv, fmt) == heads
    assert lm.get_head_size(kv, fmt) == D and lm.get_hidden_dim_size(kv, fmt) == heads * D
    for getter in (lm.get_num_blocks, lm.get_block_size):
        with pytest.raises(ValueError, match="SGLang pools have one flat slot axis"):
            getter(kv, fmt)
    if fmt == 4:   # K_0..K_L-1 then V_0..V_L-1, as LMCache's SGLang connectors flatten them
        assert lm.get_kv_cache_data_ptrs(kv, fmt) == [t.data_ptr() for t in kv[0] + kv[1]]


def test_foreign_enum_members_and_ints():
    """LMCache's own enum members (or their ints) work wherever kvlayout's do; anything else is named."""
    assert lm.as_gpu_kv_format(LMCacheGPUKVFormat.NL_X_NB_BS_HS) is lm.GPUKVFormat.NL_X_NB_BS_HS
    assert lm.as_memory_format(LMCacheFormat.KV_T2D) is lm.MemoryFormat.KV_T2D
    assert lm.as_memory_format(6) is lm.MemoryFormat.KV_MLA_FMT
    gen = torch.Generator().manual_seed(3)
    kv = make_cache(1, L, NB, BS, H, D, torch.float32, "cpu", gen)
    slots = distinct_slots(5, N, gen, "cpu")
    out = torch.zeros(2, L, 5, H * D)
    lm.multi_layer_kv_transfer(out, kv, slots, None, 0, 1, LMCacheGPUKVFormat.NL_X_TWO_NB_BS_NH_HS)
    assert same(out, logical(1, kv)[:, :, slots])
    assert lm.get_head_size(kv, LMCacheGPUKVFormat.NL_X_TWO_NB_BS_NH_HS) == D
    with pytest.raises(ValueError, match="unsupported GPUKVFormat"):
        lm.as_gpu_kv_format(9)
    with pytest.raises(TypeError, match="gpu_kv_format must be an enum member or its integer value"):
        lm.as_gpu_kv_format("NHD")


# ---------------------------------------------------------------------------------------
# Memory objects shaped like LMCache's
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mla", [False, True])
def test_v2_with_lmcache_memory_objects(mla):
    gen = torch.Generator().manual_seed(10 + mla)
    fmt = 3 if mla else 1
    h, d = (1, 24) if mla else (H, D)
    kv = make_cache(fmt, L, NB, BS, h, d, torch.float32, "cpu", gen)
    conn = C.VLLMPagedMemGPUConnectorV2.from_metadata(Metadata(heads=h, head_size=d, use_mla=mla),
                                                      device=torch.device("cpu"), layout_hints={"kv_layout": "NHD"})
    slots = distinct_slots(8, N, gen, "cpu")
    # LMCache's allocator tags objects KV_2LTD; its MLA store re-tags them KV_MLA_FMT
    obj = LMCacheLikeObj(torch.zeros(conn.get_shape(8)), LMCacheFormat.KV_2LTD)
    conn.from_gpu(obj, 0, 8, slot_mapping=slots, kvcaches=kv)
    assert obj.metadata.fmt is (LMCacheFormat.KV_MLA_FMT if mla else LMCacheFormat.KV_2LTD)
    assert same(obj.tensor, logical(fmt, kv)[:, :, slots])
    fresh = zeros_like(kv)
    conn.batched_to_gpu([obj], [0], [8], slot_mapping=slots, kvcaches=fresh)
    assert same(logical(fmt, fresh)[:, :, slots], logical(fmt, kv)[:, :, slots])
    wrong = LMCacheLikeObj(obj.tensor, LMCacheFormat.KV_T2D)
    with pytest.raises(ValueError, match="memory object format is KV_T2D"):
        conn.to_gpu(wrong, 0, 8, slot_mapping=slots)


def test_kvlayout_memory_obj_surface():
    t = torch.zeros(2, 3)
    obj = C.MemoryObj(t, 2)                           # an int is a format too
    assert obj.metadata is obj and obj.raw_tensor is t and obj.get_tensor(0) is t
    assert lm.as_memory_format(obj.metadata.fmt) is lm.MemoryFormat.KV_T2D and obj.metadata.cached_positions is None


# ---------------------------------------------------------------------------------------
# Constructors and from_metadata
# ---------------------------------------------------------------------------------------

def test_from_metadata_reads_kv_shape():
    md = Metadata(layers=4, chunk=16, heads=3, head_size=8, dtype=torch.bfloat16)
    for cls in (C.VLLMPagedMemGPUConnectorV2, C.VLLMPagedMemLayerwiseGPUConnector):
        c = cls.from_metadata(md, use_gpu=False, device=torch.device("cpu"))
        assert (c.hidden_dim_size, c.num_layers, c.chunk_size, c.dtype) == (24, 4, 16, torch.bfloat16)
    assert C.VLLMPagedMemGPUConnectorV2.from_metadata(md).get_shape(5) == (2, 4, 5, 24)
    for cls in (C.SGLangGPUConnector, C.SGLangLayerwiseGPUConnector):
        c = cls.from_metadata(md, device=torch.device("cpu"))
        assert type(c) is cls and (c.hidden_dim_size, c.num_layers, c.dtype) == (24, 4, torch.bfloat16)
    mla = C.VLLMPagedMemLayerwiseGPUConnector.from_metadata(Metadata(heads=1, head_size=24, use_mla=True))
    assert mla.use_mla and mla.get_shape(5) == (5, 24)
    with pytest.raises(ValueError, match="kv_shape must be"):
        C.VLLMPagedMemGPUConnectorV2.from_metadata(type("M", (), {"kv_shape": (4, 2, 16), "kv_dtype": None,
                                                                   "use_mla": False})())
    # positional order of the source's constructors
    c = C.VLLMPagedMemGPUConnectorV2(24, 4, False, chunk_size=16, dtype=torch.float16, device="cpu")
    assert (c.hidden_dim_size, c.num_layers, c.use_gpu) == (24, 4, False) and c.load_stream is None


def test_v3_groups_come_from_the_metadata():
    """Groups [0, 2] and [1]: same shapes everywhere, so only the metadata can tell them."""
    gen = torch.Generator().manual_seed(20)
    kv = make_cache(1, L, NB, BS, H, D, torch.float32, "cpu", gen)
    md = Metadata(groups=[[0, 2], [1]])
    conn = C.VLLMPagedMemGPUConnectorV3.from_metadata(md, use_gpu=False, device=torch.device("cpu"),
                                                      layout_hints={"kv_layout": "NHD"})
    slots = distinct_slots(8, N, gen, "cpu")
    group_tensors = [torch.zeros(2, 2, 8, H * D), torch.zeros(2, 1, 8, H * D)]
    obj = LMCacheLikeObj(None, LMCacheFormat.KV_2LTD, group_tensors)
    conn.from_gpu(obj, 0, 8, slot_mapping=slots, kvcaches=kv)
    lg = logical(1, kv)
    assert same(group_tensors[0], lg[:, [0, 2]][:, :, slots]) and same(group_tensors[1], lg[:, [1]][:, :, slots])
    assert [g[0] for g in conn.groups] == [[0, 2], [1]]
    fresh = zeros_like(kv)
    conn.batched_to_gpu([obj], [0], [8], slot_mapping=slots, kvcaches=fresh)
    assert same(logical(1, fresh)[:, :, slots], lg[:, :, slots])
    with pytest.raises(NotImplementedError):
        conn.get_shape(8)
    bad = C.VLLMPagedMemGPUConnectorV3(Metadata(groups=[[0, 5]]), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"kv_layer_groups\[0\].layer_indices holds layer 5"):
        bad.register_kv_caches(kv)


def test_xpu_classes_construct_as_the_xpu_source():
    gen = torch.Generator().manual_seed(30)
    kv = make_cache(1, L, NB, BS, H, D, torch.float16, "cpu", gen)
    v2 = C.VLLMPagedMemXPUConnectorV2.from_metadata(Metadata(), use_gpu=False, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="once the connector has seen the kv caches"):
        v2.get_shape(4)
    slots = distinct_slots(4, N, gen, "cpu")
    obj = C.MemoryObj(torch.zeros(2, L, 4, H * D, dtype=torch.float16), lm.MemoryFormat.KV_2LTD)
    v2.from_gpu(obj, 0, 4, slot_mapping=slots, kvcaches=kv)
    assert (v2.num_layers, v2.hidden_dim_size, v2.num_blocks, v2.block_size, v2.page_buffer_size) == \
        (L, H * D, NB, BS, N)
    assert (v2.head_size, v2.num_heads, v2.use_mla, v2.dtype) == (D, H, False, torch.float16)
    assert v2.get_shape(4) == (2, L, 4, H * D) and same(obj.tensor, logical(1, kv)[:, :, slots])
    lw = C.VLLMPagedMemLayerwiseXPUConnector(H * D, L, use_xpu=False, chunk_size=8, dtype=torch.float16,
                                             device="cpu")
    assert lw.use_xpu is False and not lw.use_gpu
    lw2 = C.VLLMPagedMemLayerwiseXPUConnector.from_metadata(Metadata(dtype=torch.float16), use_xpu=False,
                                                            device=torch.device("cpu"))
    objs = [[C.MemoryObj(rand((4, 2, H * D), torch.float16, "cpu", gen), lm.MemoryFormat.KV_T2D)] for _ in range(L)]
    fresh = zeros_like(kv)
    gen_obj = lw2.batched_to_gpu(starts=[0], ends=[4], slot_mapping=slots, kvcaches=fresh, sync=True)
    next(gen_obj)
    for l in range(L):
        gen_obj.send(objs[l])
    assert sum(1 for _ in gen_obj) == 1                       # L + 2 yields in all
    got = logical(1, fresh)
    for l in range(L):
        assert same(got[:, l, slots], objs[l][0].tensor.transpose(0, 1))


# ---------------------------------------------------------------------------------------
# Streams and synchronization (recorded with stand-in streams: the order is device-independent)
# ---------------------------------------------------------------------------------------

class _Streams:
    """Stand-ins for the stream helpers the connectors call: every call and transfer is recorded; the tensors
    a connector keeps alive for a stream's work (``InFlight.keep``) are recorded in ``kept`` as
    ``(stream, tensor)``."""

    def __init__(self, monkeypatch):
        import contextlib

        from kvlayout import ops
        self.log, self.current, made = [], "cur", iter(["load", "store"] * 8)
        self.kept = []
        real = ops.transfer
        rec = self

        class Kept:
            def keep(self, stream, *tensors):
                rec.kept += [(stream, t) for t in tensors if t is not None]
        monkeypatch.setattr(C, "InFlight", Kept)
        monkeypatch.setattr(C, "new_stream", lambda device: next(made))
        monkeypatch.setattr(C, "current_stream", lambda device: self.current)
        monkeypatch.setattr(C, "wait_stream", lambda w, p: self.log.append(("wait", w, p)))
        monkeypatch.setattr(C, "synchronize_stream", lambda s: self.log.append(("sync", s)))
        monkeypatch.setattr(ops, "transfer", lambda *a, **k: (self.log.append(("copy", self.current)),
                                                              real(*a, **k))[1])

        @contextlib.contextmanager
        def on_stream(stream):
            prev, self.current = self.current, stream or self.current
            try:
                yield
            finally:
                self.current = prev
        monkeypatch.setattr(C, "on_stream", on_stream)

    def take(self):
        out, self.log[:] = list(self.log), []
        return out


def test_paged_streams_as_lmcache(monkeypatch):
    rec = _Streams(monkeypatch)
    gen = torch.Generator().manual_seed(40)
    kv = make_cache(1, L, NB, BS, H, D, torch.float32, "cpu", gen)
    conn = C.VLLMPagedMemGPUConnectorV2(H * D, L, device="cpu", kv_layout="NHD", kvcaches=kv)
    assert (conn.load_stream, conn.store_stream) == ("load", "store")
    slots = distinct_slots(8, N, gen, "cpu")
    objs = [C.MemoryObj(torch.zeros(conn.get_shape(4)), lm.MemoryFormat.KV_2LTD) for _ in range(2)]
    conn.batched_from_gpu(objs, [0, 4], [4, 8], slot_mapping=slots)
    # each store: the store stream waits for the caller's, copies, and the host waits (host memory object)
    assert rec.take() == [("wait", "store", "cur"), ("copy", "store"), ("sync", "store")] * 2
    # the caller's tensors the store stream used are kept for it: each object and its slots
    kept = {(stream, t.data_ptr()) for stream, t in rec.kept}
    assert {("store", o.tensor.data_ptr()) for o in objs} | {("store", slots[0:4].data_ptr()),
                                                            ("store", slots[4:8].data_ptr())} <= kept
    conn.batched_to_gpu(objs, [0, 4], [4, 8], slot_mapping=slots)
    # loads on the load stream, after it waits for the caller's (which may have just written the caches);
    # returns when they have landed
    assert rec.take() == [("wait", "load", "cur"), ("copy", "load"), ("copy", "load"), ("sync", "load")]
    conn.to_gpu(objs[0], 0, 4, slot_mapping=slots)                            # alone: the caller's stream
    assert rec.take() == [("copy", "cur")]
    sg = C.SGLangGPUConnector(H * D, L, device="cpu", kvcaches=make_cache(4, L, NB, BS, H, D, torch.float32, "cpu",
                                                                          gen))
    sg.batched_to_gpu(objs, [0, 4], [4, 8], slot_mapping=slots)               # SGLang's connector does not wait
    assert rec.take() == [("copy", "cur"), ("copy", "cur")]


def test_layerwise_streams_as_lmcache(monkeypatch):
    rec = _Streams(monkeypatch)
    gen = torch.Generator().manual_seed(41)
    kv = make_cache(1, L, NB, BS, H, D, torch.float32, "cpu", gen)
    conn = C.VLLMPagedMemLayerwiseGPUConnector(H * D, L, device="cpu", kv_layout="NHD", kvcaches=kv)
    slots = distinct_slots(4, N, gen, "cpu")
    objs = [[C.MemoryObj(torch.zeros(conn.get_shape(4)), lm.MemoryFormat.KV_T2D)] for _ in range(L)]
    store = conn.batched_from_gpu(objs, [0], [4], slot_mapping=slots, sync=True)
    next(store)
    assert rec.take() == [("wait", "store", "cur"), ("copy", "store")]
    next(store)                                                # resuming waits (host) for the previous layer
    assert rec.take() == [("sync", "store"), ("wait", "store", "cur"), ("copy", "store")]
    list(store)
    rec.take()
    load = conn.batched_to_gpu([0], [4], slot_mapping=slots, sync=True)
    next(load)
    assert rec.take() == []
    for l in range(L):
        rec.kept.clear()
        load.send(objs[l])                                     # the caller's stream waits (device side) first
        assert rec.take() == [("wait", "cur", "load"), ("copy", "load")]
        assert {(s, t.data_ptr()) for s, t in rec.kept} >= {("load", objs[l][0].tensor.data_ptr()),
                                                            ("load", slots.data_ptr())}
    next(load)
    assert rec.take() == [("wait", "cur", "load")]
    nosync = conn.batched_to_gpu([0], [4], slot_mapping=slots, sync=False, memory_objs=objs)
    for _ in nosync:
        pass
    assert rec.take() == [("copy", "load")] * L
