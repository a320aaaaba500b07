"""kvlayout.compat.sglang pool surface: SGLang 0.4.8 device-pool API, HiCache host-pool stand-in (CPU)."""

from __future__ import annotations

import gc
import logging
import types

import pytest
import torch

from kvlayout import ops
from kvlayout.compat import sglang as S

from compat_oracles import SGLangLikeMHAPool, SGLangLikeMLAPool, rand, same

L, H, D, P = 3, 2, 8, 4


def _layer(layer_id):
    """A RadixAttention-like layer object."""
    return types.SimpleNamespace(layer_id=layer_id, tp_q_head_num=H, head_dim=D)


class _Counter:
    """A LayerDoneCounter-like object: records what the pool waits for."""

    def __init__(self):
        self.waited = []

    def wait_until(self, layer):
        self.waited.append(layer)


# ---------------------------------------------------------------------------------------
# Device pools
# ---------------------------------------------------------------------------------------

def test_mha_pool_constructor_getters_and_set_kv_buffer():
    size = 10                                                  # not a whole number of pages: padded as SGLang
    pool = S.MHATokenToKVPool(size, P, torch.bfloat16, H, D, L, "cpu", False, start_layer=2, end_layer=4)
    assert (pool.start_layer, pool.end_layer, pool.enable_memory_saver) == (2, 4, False)
    assert all(t.shape == (size + P, H, D) for t in pool.k_buffer + pool.v_buffer)
    gen = torch.Generator().manual_seed(1)
    loc = torch.tensor([3, 0, 13, 7])
    k, v = rand((4, H, D), torch.bfloat16, "cpu", gen), rand((4, H, D), torch.bfloat16, "cpu", gen)
    pool.set_kv_buffer(_layer(3), loc, k, v)                   # global layer 3 is the pool's layer 1
    for i, s in enumerate(loc.tolist()):
        assert same(pool.k_buffer[1][s], k[i]) and same(pool.v_buffer[1][s], v[i])
    assert pool.k_buffer[0].abs().sum() == 0 and pool.k_buffer[2].abs().sum() == 0
    counter = _Counter()
    pool.register_layer_transfer_counter(counter)
    kb, vb = pool.get_kv_buffer(3)
    assert kb.data_ptr() == pool.k_buffer[1].data_ptr() and vb.data_ptr() == pool.v_buffer[1].data_ptr()
    pool.get_key_buffer(4)
    assert counter.waited == [1, 1, 2]                         # each getter waits for its layer's load
    with pytest.raises(IndexError, match="layer_id = 1 is outside this pool's layers 2..4"):
        pool.get_key_buffer(1)
    es = 2
    row = H * D * es
    bufs = pool.k_buffer + pool.v_buffer
    assert pool.data_ptrs.dtype == torch.uint64 and pool.data_ptrs.tolist() == [t.data_ptr() for t in bufs]
    assert pool.k_data_ptrs.tolist() == [t.data_ptr() for t in pool.k_buffer]
    assert pool.data_strides.tolist() == [row] * (2 * L)
    ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
    assert ptrs == [t.data_ptr() for t in bufs] and lens == [(size + P) * row] * (2 * L)
    assert item_lens == [P * row] * (2 * L)
    assert pool.get_kv_size_bytes() == (L * (size + P) * row, L * (size + P) * row)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no fp8 dtype in this torch")
def test_fp8_pool_casts_and_scales(device):
    pool = S.MHATokenToKVPool(8, P, torch.float8_e4m3fn, H, D, L, device=device)
    assert pool.store_dtype == torch.uint8
    k = torch.full((2, H, D), 3.0, dtype=torch.bfloat16, device=device)
    v = torch.full((2, H, D), -1.5, dtype=torch.bfloat16, device=device)
    pool.set_kv_buffer(_layer(0), torch.tensor([5, 6], device=device), k, v, k_scale=2.0, v_scale=0.5)
    want_k = (k / 2.0).to(torch.float8_e4m3fn).view(torch.uint8)
    want_v = (v / 0.5).to(torch.float8_e4m3fn).view(torch.uint8)
    assert same(pool.k_buffer[0][5:7], want_k) and same(pool.v_buffer[0][5:7], want_v)
    assert (k == 3.0).all()                                    # the caller's tensor is not divided in place
    assert pool.get_key_buffer(0).dtype == torch.float8_e4m3fn


def test_mla_pool_set_mla_kv_buffer():
    rank, rope = 16, 8
    pool = S.MLATokenToKVPool(9, P, torch.float16, rank, rope, L, "cpu", False)
    gen = torch.Generator().manual_seed(2)
    loc = torch.tensor([1, 12])
    nope, pe = rand((2, 1, rank), torch.float16, "cpu", gen), rand((2, 1, rope), torch.float16, "cpu", gen)
    pool.set_mla_kv_buffer(_layer(2), loc, nope, pe)
    assert same(pool.kv_buffer[2][loc][..., :rank], nope) and same(pool.kv_buffer[2][loc][..., rank:], pe)
    assert same(pool.get_value_buffer(2)[loc], nope)
    rows = rand((2, 1, rank + rope), torch.float32, "cpu", gen)   # another dtype: cast to the pool's
    pool.set_kv_buffer(_layer(0), loc, rows, None)
    assert same(pool.kv_buffer[0][loc], rows.to(torch.float16))
    assert pool.data_ptrs.tolist() == [t.data_ptr() for t in pool.kv_buffer]
    assert pool.get_kv_size_bytes() == L * (9 + P) * (rank + rope) * 2
    with pytest.raises(ValueError, match="kv_lora_rank = 16 \\+ qk_rope_head_dim = 8"):
        pool.set_mla_kv_buffer(_layer(0), loc, pe, nope)


# ---------------------------------------------------------------------------------------
# Host pool with SGLang's own device pools
# ---------------------------------------------------------------------------------------

def test_host_pool_names_constructor_and_getters():
    assert S.MHATokenToKVPoolHost is S.HostKVPool and S.MLATokenToKVPoolHost is S.HostKVPool
    gen = torch.Generator().manual_seed(3)
    dev = SGLangLikeMHAPool(16, P, torch.bfloat16, H, D, L, gen, start_layer=5)
    host = S.MHATokenToKVPoolHost(dev, 2.0, 0, P, "layer_first", True, "cpu")   # SGLang's positional order
    es = 2
    assert host.size == (32 // P + 1) * P and host.page_num == 32 // P + 1
    assert host.get_size_per_token() == 2 * L * H * D * es and host.get_ksize_per_token() == L * H * D * es
    assert host.token_stride_size == H * D * es and host.layout_dim == L * H * D * es
    assert (host.start_layer, host.end_layer) == (5, 7)
    assert host.pinned is False                                 # no CUDA runtime here: pageable, and said so
    assert [t.data_ptr() for t in host.k_data_refs] == [host.kv_buffer[0, l].data_ptr() for l in range(L)]
    assert host.v_data_ptrs.tolist() == [host.kv_buffer[1, l].data_ptr() for l in range(L)]
    assert host.data_ptrs.tolist() == host.k_data_ptrs.tolist() + host.v_data_ptrs.tolist()
    mla = S.MLATokenToKVPoolHost(SGLangLikeMLAPool(16, P, torch.float16, 16, 8, L, gen), 2.0, 0, P, "page_first")
    assert mla.is_mla and mla.get_size_per_token() == mla.get_ksize_per_token() == L * 24 * 2
    assert mla.token_stride_size == 24 * 2 and mla.layout_dim == L * 24 * 2
    with pytest.raises(ValueError, match="device = 'cuda'"):
        S.HostKVPool(dev, 2.0, 0, P, "layer_first", True, "cuda")


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_host_pool_with_sglang_shaped_mha_pool(layout, io_backend):
    gen = torch.Generator().manual_seed(4)
    dev = SGLangLikeMHAPool(16, P, torch.bfloat16, H, D, L, gen)
    host = S.HostKVPool(dev, 2.0, 0, P, layout)
    dev_idx = torch.cat([torch.arange(8, 12), torch.arange(4, 8)])          # two device pages
    host_idx = host.alloc(8)
    host.backup_from_device_all_layer(dev, host_idx, dev_idx, io_backend)
    for l in range(L):
        for h_slot, d_slot in zip(host_idx.tolist(), dev_idx.tolist()):
            page, off = divmod(h_slot, P)
            where = {"layer_first": (l, h_slot), "page_first": (h_slot, l), "page_first_direct": (page, l, off),
                     "page_head": (page, slice(None), off, l)}[layout]
            got_k = host.kv_buffer[0][where]
            got_v = host.kv_buffer[1][where]
            assert same(got_k, dev.k_buffer[l][d_slot]) and same(got_v, dev.v_buffer[l][d_slot])
    fresh = SGLangLikeMHAPool(16, P, torch.bfloat16, H, D, L, gen)
    for t in fresh.k_buffer + fresh.v_buffer:
        t.zero_()
    for l in range(L):
        host.load_to_device_per_layer(fresh, host_idx, dev_idx, l, io_backend)
    for l in range(L):
        assert same(fresh.k_buffer[l][dev_idx], dev.k_buffer[l][dev_idx])
        assert same(fresh.v_buffer[l][dev_idx], dev.v_buffer[l][dev_idx])
        assert fresh.k_buffer[l][:4].abs().sum() == 0 and fresh.k_buffer[l][12:].abs().sum() == 0


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_host_pool_with_sglang_shaped_mla_pool(layout):
    gen = torch.Generator().manual_seed(5)
    dev = SGLangLikeMLAPool(16, P, torch.float16, 16, 8, L, gen)
    host = S.MLATokenToKVPoolHost(dev, 2.0, 0, P, layout)
    dev_idx = torch.arange(4, 12)
    host_idx = host.alloc(8)
    host.backup_from_device_all_layer(dev, host_idx, dev_idx, "kernel")
    fresh = SGLangLikeMLAPool(16, P, torch.float16, 16, 8, L, gen)
    for l in range(L):
        host.load_to_device_per_layer(fresh, host_idx, dev_idx, l, "direct")
        assert same(fresh.kv_buffer[l][dev_idx], dev.kv_buffer[l][dev_idx])


def test_direct_backend_uses_the_copy_engine(monkeypatch):
    engines = []
    real = ops.transfer
    monkeypatch.setattr(ops, "transfer", lambda *a, **k: (engines.append(k.get("engine")), real(*a, **k))[1])
    prepare = ops.prepare     # per-layer loads prepare every layer once per index tensors
    monkeypatch.setattr(ops, "prepare",
                        lambda *a, **k: (engines.append(k.get("engine", "kernel")), prepare(*a, **k))[1])
    gen = torch.Generator().manual_seed(6)
    dev = SGLangLikeMHAPool(16, P, torch.bfloat16, H, D, L, gen)
    for layout in ("layer_first", "page_first_direct"):
        host = S.HostKVPool(dev, 2.0, 0, P, layout)
        idx = host.alloc(4)
        host.backup_from_device_all_layer(dev, idx, torch.arange(4, 8), "direct")
        host.load_to_device_per_layer(dev, idx, torch.arange(4, 8), 0, "kernel")
    assert engines == ["copy", "kernel", "copy", "kernel"]
    engines.clear()
    S.transfer_kv_direct([dev.k_buffer[0]], [dev.k_buffer[1]], torch.arange(4), torch.arange(4, 8), P)
    assert engines == ["copy"]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_get_data_page_view_aliases_the_pool(layout):
    gen = torch.Generator().manual_seed(7)
    dev = SGLangLikeMHAPool(16, P, torch.float32, H, D, L, gen)
    host = S.HostKVPool(dev, 2.0, 0, P, layout)
    idx = host.alloc(8)
    host.backup_from_device_all_layer(dev, idx, torch.arange(4, 12))
    first = int(idx[4])                                                     # the second host page
    view = host.get_data_page(first, flat=False)
    assert view.data_ptr() != 0 and same(view.flatten(), host.get_data_page(first))
    view.fill_(5.0)                                                         # writing the view writes the pool
    page, flat = first // P, host.kv_buffer
    if layout == "layer_first":
        assert (flat[:, :, first:first + P] == 5).all() and (flat[:, :, :first] != 5).any()
    elif layout == "page_first":
        assert (flat[:, first:first + P] == 5).all()
    else:
        assert (flat[:, page] == 5).all() and not (flat[:, page - 1] == 5).all()


def test_alloc_errors_as_the_source():
    gen = torch.Generator().manual_seed(8)
    host = S.HostKVPool(SGLangLikeMHAPool(16, P, torch.float16, H, D, L, gen), 2.0, 0, P, "layer_first")
    with pytest.raises(AssertionError, match="need_size = 3 is not a multiple of page_size = 4"):
        host.alloc(3)
    with pytest.raises(ValueError):
        host.alloc(5)
    assert host.alloc(host.available_size() + P) is None


# ---------------------------------------------------------------------------------------
# Pinning with cudaHostRegister (the CUDA runtime replaced by a recorder)
# ---------------------------------------------------------------------------------------

class _RecordingCudart:
    """Stands in for torch.cuda.cudart(): records cudaHostRegister / cudaHostUnregister, answers ``error``."""

    def __init__(self, error=0):
        self.error, self.calls = error, []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        return self.error

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


@pytest.mark.parametrize("nbytes", [1, 4096, 10_000])
def test_page_locked_buffer_owns_whole_pages_and_is_unregistered_when_freed(monkeypatch, nbytes):
    cudart = _RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    buf = S._page_locked_bytes(nbytes)
    (kind, ptr, span, flags), = cudart.calls
    assert kind == "register" and flags == 0 and buf.numel() == nbytes and buf.data_ptr() == ptr
    assert ptr % 4096 == 0 and span % 4096 == 0 and nbytes <= span < nbytes + 4096   # pages of its own
    view = buf.view(torch.uint8)[:1]
    del buf
    gc.collect()
    assert len(cudart.calls) == 1, "unregistered while a view still uses the memory"
    del view
    gc.collect()
    assert cudart.calls[1:] == [("unregister", ptr)]


def test_page_locking_failure_is_reported_and_leaves_pageable_memory(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _RecordingCudart(712))
    collected = []
    monkeypatch.setattr(S, "_collect_cuda_error", lambda: collected.append(True))
    with caplog.at_level(logging.WARNING, logger="kvlayout.compat.sglang"):
        assert S._page_locked_bytes(100) is None
    assert "cudaHostRegister" in caplog.text and "712" in caplog.text
    assert collected == [True], "the failed call's error must not be left for the next kernel launch to report"


def test_host_pool_pins_only_for_a_device_pool_on_a_gpu(monkeypatch):
    cudart = _RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    dev = SGLangLikeMHAPool(16, P, torch.bfloat16, H, D, L, torch.Generator().manual_seed(9))
    host = S.HostKVPool(dev, 2.0, 0, P, "page_first")          # pin_memory=True, as SGLang, but a CPU pool
    assert host.pinned is False and cudart.calls == [] and not host.kv_buffer.is_pinned()


# ---------------------------------------------------------------------------------------
# Decisions kvlayout keeps (docs/compat.md, "Where kvlayout differs from the source")
# ---------------------------------------------------------------------------------------

def test_dtype_mismatch_is_an_error_not_a_byte_copy():
    """bf16 rows into an fp16 pool: the same bytes per row, which SGLang's kernels would copy as they are."""
    src = [torch.zeros(8, H, D, dtype=torch.bfloat16)]
    dst = [torch.zeros(8, H, D, dtype=torch.float16)]
    with pytest.raises(TypeError, match="dtypes differ: source torch.bfloat16, destination torch.float16"):
        S.transfer_kv_all_layer(src, dst, src, dst, torch.arange(2), torch.arange(2), H * D * 2, 1)


def test_small_host_pool_only_warns(caplog):
    gen = torch.Generator().manual_seed(10)
    dev = SGLangLikeMHAPool(64, P, torch.float16, H, D, L, gen)
    with caplog.at_level(logging.WARNING, logger="kvlayout.compat.sglang"):
        host = S.HostKVPool(dev, 0.5, 0, P, "layer_first")
    assert host.size == (32 // P + 1) * P and "not larger than the device pool" in caplog.text


@pytest.mark.parametrize("layout, io", [("layer_first", "kernel"), ("layer_first", "direct"),
                                        ("page_first_direct", "direct")])
def test_per_layer_loads_prepare_once_per_index_tensors(monkeypatch, layout, io):
    """SGLang's per-layer loads reuse one prepared transfer while the index tensors stay the same (direct: the
    copy engine's, with page_first_direct's page slots made once)."""
    prepared, transfers = [], []
    prepare, transfer = ops.prepare, ops.transfer
    monkeypatch.setattr(ops, "prepare", lambda *a, **k: (prepared.append(k.get("engine")), prepare(*a, **k))[1])
    monkeypatch.setattr(ops, "transfer", lambda *a, **k: (transfers.append(1), transfer(*a, **k))[1])
    page_slots = S.page_slots
    made = []
    monkeypatch.setattr(S, "page_slots", lambda *a, **k: (made.append(1), page_slots(*a, **k))[1])
    gen = torch.Generator().manual_seed(8)
    dev = SGLangLikeMHAPool(16, P, torch.bfloat16, H, D, L, gen)
    host = S.HostKVPool(dev, 2.0, 0, P, layout)
    h, d = host.alloc(4), torch.arange(4, 8)
    host.backup_from_device_all_layer(dev, h, d)
    fresh = SGLangLikeMHAPool(16, P, torch.bfloat16, H, D, L, torch.Generator().manual_seed(9))
    for layer in range(L):
        host.load_to_device_per_layer(fresh, h, d, layer, io)
    assert prepared == [None if io == "kernel" else "copy"] and transfers == [1]      # (the backup)
    assert len(made) == (2 if layout == "page_first_direct" else 0)                  # host's and device's
    for layer in range(L):
        assert torch.equal(fresh.k_buffer[layer][d], dev.k_buffer[layer][d])
        assert torch.equal(fresh.v_buffer[layer][d], dev.v_buffer[layer][d])
    d[:] = torch.arange(8, 12)                       # rewritten in place: prepared again
    host.load_to_device_per_layer(fresh, h, d, 0, io)
    assert len(prepared) == 2 and torch.equal(fresh.k_buffer[0][d], dev.k_buffer[0][torch.arange(4, 8)])
    # a layer out of range is refused as the unprepared path refuses it
    refused = "layer_id = 99 is out of range" if io == "kernel" else "src_layers contains 99, out of range"
    with pytest.raises(IndexError, match=refused):
        host.load_to_device_per_layer(fresh, h, d, 99, io)
