"""kvlayout.compat.sglang against independent indexing oracles."""

from __future__ import annotations

import ctypes

import pytest
import torch

from compat_oracles import devices, host_zeros, rand, same
from kvlayout.compat import sglang as S

L, H, D, P = 3, 2, 8, 4
POOL = 64                                   # device pool size (tokens), + one padding page
ITEM = H * D * 2                            # bf16 rows


def _pages(n_pages, total_pages, gen, first=0):
    """Page-contiguous slots of n random distinct pages (the production index pattern)."""
    pages = torch.randperm(total_pages - first, generator=gen)[:n_pages] + first
    return (pages[:, None] * P + torch.arange(P)).reshape(-1)


def _device_pool(device, gen, mla=False, dtype=torch.bfloat16):
    if mla:
        pool = S.MLATokenToKVPool(POOL, P, dtype, 16, 8, L, device=device)
        for t in pool.kv_buffer:
            t.copy_(rand(t.shape, t.dtype, device, gen))
    else:
        pool = S.MHATokenToKVPool(POOL, P, dtype, H, D, L, device=device)
        for t in pool.k_buffer + pool.v_buffer:
            t.copy_(rand(t.shape, t.dtype, device, gen))
    return pool


def _oracle_copy(dst, src, d_idx, s_idx):
    """dst[d] = src[s] for pairs with both indices >= 0 (a new tensor)."""
    out = dst.clone().cpu()
    src = src.cpu()
    for s, d in zip(s_idx.tolist(), d_idx.tolist()):
        if s >= 0 and d >= 0:
            out[d] = src[s]
    return out


# ---------------------------------------------------------------------------------------
# transfer_kv_* family
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", devices)
def test_per_layer_and_all_layer(device):
    gen = torch.Generator().manual_seed(1)
    src_k = [rand((POOL, H, D), torch.bfloat16, device, gen) for _ in range(L)]
    src_v = [rand((POOL, H, D), torch.bfloat16, device, gen) for _ in range(L)]
    dst_k = [torch.full((POOL, H, D), 3.0, dtype=torch.bfloat16, device=device) for _ in range(L)]
    dst_v = [torch.full((POOL, H, D), 5.0, dtype=torch.bfloat16, device=device) for _ in range(L)]
    s, d = _pages(3, POOL // P, gen).to(device), _pages(3, POOL // P, gen).to(device)
    s[2] = -1                                             # kvlayout: a negative index is skipped
    want_k0 = _oracle_copy(dst_k[0], src_k[0], d, s)
    want_v0 = _oracle_copy(dst_v[0], src_v[0], d, s)
    S.transfer_kv_per_layer(src_k[0], dst_k[0], src_v[0], dst_v[0], s, d, ITEM, block_quota=2)
    assert same(dst_k[0], want_k0) and same(dst_v[0], want_v0)
    wants = [(_oracle_copy(dk, sk, d, s), _oracle_copy(dv, sv, d, s)) for sk, sv, dk, dv in zip(src_k, src_v, dst_k, dst_v)]
    S.transfer_kv_all_layer(src_k, dst_k, src_v, dst_v, s, d, ITEM, L)
    assert all(same(dk, wk) and same(dv, wv) for dk, dv, (wk, wv) in zip(dst_k, dst_v, wants))
    # N = 0 is a no-op
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    S.transfer_kv_all_layer(src_k, dst_k, src_v, dst_v, empty, empty, ITEM, L)
    with pytest.raises(ValueError, match="item_size"):
        S.transfer_kv_per_layer(src_k[0], dst_k[0], src_v[0], dst_v[0], s, d, ITEM + 8)
    with pytest.raises(ValueError, match="num_layers"):
        S.transfer_kv_all_layer(src_k, dst_k, src_v, dst_v, s, d, ITEM, L + 1)


@pytest.mark.parametrize("device", devices)
def test_page_first_and_page_head(device):
    gen = torch.Generator().manual_seed(2)
    host_n = 48
    NP = host_n // P
    dev_k = [rand((POOL, H, D), torch.bfloat16, device, gen) for _ in range(L)]
    dev_v = [rand((POOL, H, D), torch.bfloat16, device, gen) for _ in range(L)]
    dev_idx = _pages(4, POOL // P, gen, first=1).to(device)
    host_idx = _pages(4, NP, gen).to(device)
    layout_dim = ITEM * L
    # lf -> pf: host half [N, L, H, D]
    pf = host_zeros((2, host_n, L, H, D), torch.bfloat16, device)
    S.transfer_kv_all_layer_lf_pf(dev_k, pf[0], dev_v, pf[1], dev_idx, host_idx, ITEM, layout_dim, L)
    for l in range(L):
        assert same(pf[0, host_idx.cpu(), l], dev_k[l][dev_idx].cpu())
        assert same(pf[1, host_idx.cpu(), l], dev_v[l][dev_idx].cpu())
    untouched = torch.ones(host_n, dtype=torch.bool)
    untouched[host_idx.cpu()] = False
    assert pf[:, untouched].abs().sum() == 0
    # lf -> ph: host half [NP, H, P, L, D]
    ph = host_zeros((2, NP, H, P, L, D), torch.bfloat16, device)
    S.transfer_kv_all_layer_lf_ph(dev_k, ph[0], dev_v, ph[1], dev_idx, host_idx, ITEM, layout_dim, L, P, H)
    hi = host_idx.cpu()
    for l in range(L):
        for p, bufs in ((0, dev_k), (1, dev_v)):
            got = ph[p, hi // P, :, hi % P, l]                              # [n, H, D]
            assert same(got, bufs[l][dev_idx].cpu())
    # pf -> lf and ph -> lf, one layer, into fresh device layers
    for layer_id in range(L):
        for host, fn, extra in ((pf, S.transfer_kv_per_layer_pf_lf, ()),
                                (ph, S.transfer_kv_per_layer_ph_lf, (P, H))):
            k = torch.zeros(POOL, H, D, dtype=torch.bfloat16, device=device)
            v = torch.zeros_like(k)
            fn(host[0], k, host[1], v, host_idx, dev_idx, layer_id, ITEM, layout_dim, *extra)
            assert same(k[dev_idx], dev_k[layer_id][dev_idx]) and same(v[dev_idx], dev_v[layer_id][dev_idx])
            mask = torch.ones(POOL, dtype=torch.bool)
            mask[dev_idx.cpu()] = False
            assert k.cpu()[mask].abs().sum() == 0


@pytest.mark.parametrize("device", devices)
def test_mla_variants(device):
    gen = torch.Generator().manual_seed(3)
    kd, item = 24, 24 * 2
    dev = [rand((POOL, 1, kd), torch.float16, device, gen) for _ in range(L)]
    host_n = 32
    dev_idx = _pages(2, POOL // P, gen, first=1).to(device)
    host_idx = _pages(2, host_n // P, gen).to(device)
    out = [torch.zeros(POOL, 1, kd, dtype=torch.float16, device=device) for _ in range(L)]
    S.transfer_kv_per_layer_mla(dev[1], out[1], dev_idx, dev_idx, item)
    assert same(out[1][dev_idx], dev[1][dev_idx])
    S.transfer_kv_all_layer_mla(dev, out, dev_idx, dev_idx, item, L)
    assert all(same(o[dev_idx], x[dev_idx]) for o, x in zip(out, dev))
    pf = host_zeros((host_n, L, 1, kd), torch.float16, device)
    S.transfer_kv_all_layer_mla_lf_pf(dev, pf, dev_idx, host_idx, item, item * L, L)
    for l in range(L):
        assert same(pf[host_idx.cpu(), l], dev[l][dev_idx].cpu())
    back = torch.zeros(POOL, 1, kd, dtype=torch.float16, device=device)
    S.transfer_kv_per_layer_mla_pf_lf(pf, back, host_idx, dev_idx, 2, item, item * L)
    assert same(back[dev_idx], dev[2][dev_idx])


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("mla", [False, True])
def test_direct_functions(device, mla):
    gen = torch.Generator().manual_seed(4 + mla)
    NP = 10
    row = (1, 24) if mla else (H, D)
    planes = 1 if mla else 2
    dev = [[rand((POOL,) + row, torch.bfloat16, device, gen) for _ in range(L)] for _ in range(planes)]
    dev_idx = _pages(3, POOL // P, gen, first=1).to(device)
    host_idx = _pages(3, NP, gen)                          # direct paths read host indices on the host
    host = [host_zeros((NP, L, P) + row, torch.bfloat16, device) for _ in range(planes)]
    S.transfer_kv_all_layer_direct_lf_pf([t for plane in dev for t in plane], host, dev_idx, host_idx, P)
    for p in range(planes):
        for l in range(L):
            assert same(host[p][host_idx // P, l, host_idx % P], dev[p][l][dev_idx].cpu())
    for layer_id in range(L):
        fresh = [torch.zeros((POOL,) + row, dtype=torch.bfloat16, device=device) for _ in range(planes)]
        S.transfer_kv_per_layer_direct_pf_lf(host, fresh, host_idx, dev_idx, layer_id, P)
        assert all(same(f[dev_idx], dev[p][layer_id][dev_idx]) for p, f in enumerate(fresh))
    # transfer_kv_direct: a list of tensors to a list of tensors, any direction
    flat_src = [t for plane in dev for t in plane]
    flat_dst = [torch.zeros_like(t) for t in flat_src]
    S.transfer_kv_direct(flat_src, flat_dst, dev_idx, dev_idx.flip(0), P)
    assert all(same(d[dev_idx.flip(0)], s[dev_idx]) for s, d in zip(flat_src, flat_dst))
    with pytest.raises(ValueError, match="whole pages"):
        S.transfer_kv_direct(flat_src, flat_dst, dev_idx[:3], dev_idx[:3], P)


def test_page_slots_reads_first_index_of_each_page():
    idx = torch.tensor([8, 99, 99, 99, 0, 1, 7, 7])
    assert S.page_slots(idx, 4).tolist() == [8, 9, 10, 11, 0, 1, 2, 3]


def test_page_slots_negative_means_no_token():
    # a page whose first index is -1 holds no token; a -1 inside a page is that token only
    assert S.page_slots([-1] * 4, 4).tolist() == [-1, -1, -1, -1]
    assert S.page_slots(torch.tensor([-1, 5, 6, 7, 8, -1, 10, 11]), 4).tolist() == [-1, -1, -1, -1, 8, -1, 10, 11]
    with pytest.raises(ValueError, match=r"host_indices\[4\] = 6 is not the first slot of a page"):
        S.page_slots([0, 1, 2, 3, 6, 7, 8, 9], 4, name="host_indices", aligned=True)
    assert S.page_slots([-1, -1, -1, -1], 4, aligned=True).tolist() == [-1] * 4


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("n", [5, 300])
def test_move_kv_cache_overlap(device, mla, n):
    """Shifted chains (src and tgt overlap) follow snapshot semantics at any size."""
    gen = torch.Generator().manual_seed(n)
    size = 400
    pool = (S.MLATokenToKVPool(size, 1, torch.float32, 8, 4, 2, device=device) if mla
            else S.MHATokenToKVPool(size, 1, torch.float32, H, D, 2, device=device))
    bufs = pool.kv_buffer if mla else pool.k_buffer + pool.v_buffer
    for t in bufs:
        t.copy_(rand(t.shape, t.dtype, device, gen))
    before = [t.clone().cpu() for t in bufs]
    src = torch.arange(10, 10 + n, device=device)
    tgt = src + 3                                           # each target is a later chain's source
    pool.move_kv_cache(tgt, src)
    for b, t in zip(before, bufs):
        want = b.clone()
        want[tgt.cpu()] = b[src.cpu()]
        assert same(t, want)
    # the module-level function does the same on plain lists
    before = [t.clone().cpu() for t in bufs]
    S.move_kv_cache(pool.kv_buffer if mla else pool.k_buffer, None if mla else pool.v_buffer, src, tgt)
    for b, t in zip(before, bufs):
        want = b.clone()
        want[src.cpu()] = b[tgt.cpu()]
        assert same(t, want)


# ---------------------------------------------------------------------------------------
# Device pool and HiCache host pool
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("mla", [False, True])
def test_device_pool_cpu_copy(device, mla):
    gen = torch.Generator().manual_seed(6)
    pool = _device_pool(device, gen, mla)
    idx = _pages(3, POOL // P, gen, first=1).to(device)
    copy = pool.get_cpu_copy(idx)
    assert len(copy) == L
    fresh = (S.MLATokenToKVPool(POOL, P, torch.bfloat16, 16, 8, L, device=device) if mla
             else S.MHATokenToKVPool(POOL, P, torch.bfloat16, H, D, L, device=device))
    fresh.load_cpu_copy(copy, idx)
    a = pool.kv_buffer if mla else pool.k_buffer + pool.v_buffer
    b = fresh.kv_buffer if mla else fresh.k_buffer + fresh.v_buffer
    assert all(same(x[idx], y[idx]) for x, y in zip(a, b))
    if not mla:
        assert same(copy[1][0][1], pool.v_buffer[1][idx])


def _host_row(pool: S.HostKVPool, plane: int, layer: int, slot: int) -> torch.Tensor:
    """Where SGLang puts (plane, layer, host slot) in each host layout (independent of kvlayout)."""
    pg, off = divmod(slot, pool.page_size)
    b = pool.kv_buffer
    if pool.is_mla:
        if pool.layout == "layer_first":
            return b[layer, slot]
        if pool.layout == "page_first":
            return b[slot, layer]
        if pool.layout == "page_first_direct":
            return b[pg, layer, off]
        return torch.cat([pool.k_buffer[pg, layer, off], pool.v_buffer[pg, layer, off]], dim=-1)
    if pool.layout == "layer_first":
        return b[plane, layer, slot]
    if pool.layout == "page_first":
        return b[plane, slot, layer]
    if pool.layout == "page_first_direct":
        return b[plane, pg, layer, off]
    return b[plane, pg, :, off, layer]                       # page_head: [2, NP, H, P, L, D]


HOST_CASES = [(False, lay, io) for lay in S.HOST_LAYOUTS["mha"] for io in ("kernel", "direct")] + \
             [(True, lay, io) for lay in S.HOST_LAYOUTS["mla"] for io in ("kernel", "direct")]


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("mla, layout, io", HOST_CASES)
def test_host_pool_backup_and_load(device, mla, layout, io):
    gen = torch.Generator().manual_seed(HOST_CASES.index((mla, layout, io)))
    pool = _device_pool(device, gen, mla)
    host = S.HostKVPool(pool, 2.0, layout=layout)
    assert host.kv_buffer.is_pinned() == (device != "cpu")
    host_idx = host.alloc(3 * P)
    host.free(host_idx[:P])
    host_idx = host_idx[P:]
    dev_idx = _pages(2, POOL // P, gen, first=1).to(device)
    host.backup_from_device_all_layer(pool, host_idx, dev_idx, io)
    # one direction: the host bytes sit where SGLang's layout formula puts them
    for l in range(L):
        for i, (h, d) in enumerate(zip(host_idx.tolist(), dev_idx.tolist())):
            if mla:
                assert same(_host_row(host, 0, l, h), pool.kv_buffer[l][d].cpu())
            else:
                assert same(_host_row(host, 0, l, h), pool.k_buffer[l][d].cpu())
                assert same(_host_row(host, 1, l, h), pool.v_buffer[l][d].cpu())
    fresh = (S.MLATokenToKVPool(POOL, P, torch.bfloat16, 16, 8, L, device=device) if mla
             else S.MHATokenToKVPool(POOL, P, torch.bfloat16, H, D, L, device=device))
    for l in range(L):
        host.load_to_device_per_layer(fresh, host_idx, dev_idx, l, io)
    a = pool.kv_buffer if mla else pool.k_buffer + pool.v_buffer
    b = fresh.kv_buffer if mla else fresh.k_buffer + fresh.v_buffer
    assert all(same(x[dev_idx], y[dev_idx]) for x, y in zip(a, b))
    mask = torch.ones(POOL + P, dtype=torch.bool)
    mask[dev_idx.cpu()] = False
    assert all(y.cpu()[mask].abs().sum() == 0 for y in b)


@pytest.mark.parametrize("mla, layout", [(False, lay) for lay in S.HOST_LAYOUTS["mha"]] +
                         [(True, lay) for lay in S.HOST_LAYOUTS["mla"]])
def test_host_pool_pages(mla, layout):
    gen = torch.Generator().manual_seed(7)
    pool = _device_pool("cpu", gen, mla)
    host = S.HostKVPool(pool, 2.0, layout=layout)
    for t in ([host.k_buffer, host.v_buffer] if layout == "page_first_kv_split" else [host.kv_buffer]):
        t.copy_(rand(t.shape, t.dtype, "cpu", gen))
    pages = [3, 1]
    indices = torch.cat([torch.arange(p * P, p * P + P) for p in pages])
    ptrs, sizes = host.get_page_buffer_meta(indices)
    es = host.kv_buffer.element_size()
    # expected spans in SGLang's order, as slices of the buffers
    expected = []
    for pg in pages:
        sl = slice(pg * P, pg * P + P)
        b = host.kv_buffer
        if mla:
            if layout == "layer_first":
                expected += [b[l, sl] for l in range(L)]
            elif layout == "page_first":
                expected.append(b[sl])
            elif layout == "page_first_direct":
                expected.append(b[pg])
            else:
                expected += [host.k_buffer[pg], host.v_buffer[pg]]
        else:
            if layout == "layer_first":
                expected += [b[p, l, sl] for l in range(L) for p in (0, 1)]
            elif layout == "page_first":
                expected += [b[0, sl], b[1, sl]]
            else:
                expected += [b[0, pg], b[1, pg]]
    assert sizes == [t.numel() * es for t in expected]
    for ptr, size, t in zip(ptrs, sizes, expected):           # read the bytes through the pointers
        assert ctypes.string_at(ptr, size) == t.contiguous().view(torch.uint8).numpy().tobytes()
    # flat pages: SGLang's flatten order, round trip through set_from_flat_data_page
    page = host.get_data_page(pages[0] * P)
    if not mla and layout == "layer_first":
        assert same(page, host.kv_buffer[:, :, pages[0] * P:pages[0] * P + P].flatten())
    if not mla and layout == "page_head":
        assert same(page, host.kv_buffer[:, pages[0]].flatten())
    if mla and layout == "page_first":
        assert same(page, host.kv_buffer[pages[0] * P:pages[0] * P + P].flatten())
    dummy = host.get_dummy_flat_data_page()
    assert dummy.numel() == page.numel() and dummy.abs().sum() == 0
    host.set_from_flat_data_page(pages[1] * P, page)
    assert same(host.get_data_page(pages[1] * P), page)
    if layout != "page_first_kv_split":
        assert host.get_data_page(pages[0] * P, flat=False).shape == host._page_shape()
    with pytest.raises(ValueError, match="first slot of a page"):
        host.get_data_page(1)


@pytest.fixture(autouse=True)
def no_host_memory_reserve(monkeypatch):
    """The tests' pools are tiny: whether the machine has 10 GiB spare must not matter."""
    monkeypatch.setattr(S, "HOST_MEMORY_RESERVE_BYTES", 0)


def test_host_pool_refuses_more_than_the_available_memory_minus_the_reserve(monkeypatch):
    pool = _device_pool("cpu", torch.Generator().manual_seed(9))
    assert S._available_host_memory() > 0
    monkeypatch.setattr(S, "_available_host_memory", lambda: 11 * (1 << 30))
    with pytest.raises(ValueError, match="not enough host memory for the host pool"):
        S.HostKVPool(pool, layout="page_first", host_memory_reserve=11 * (1 << 30))
    S.HostKVPool(pool, layout="page_first", host_memory_reserve=10 * (1 << 30))   # fits beside a 10 GiB reserve


def test_host_pool_sizing_and_allocator():
    gen = torch.Generator().manual_seed(8)
    pool = _device_pool("cpu", gen)
    host = S.HostKVPool(pool, 2.0, layout="page_first")
    assert host.size_per_token == 2 * L * H * D * 2
    assert host.page_num == (POOL * 2) // P + 1 and host.size == host.page_num * P
    sized = S.HostKVPool(pool, host_size=host.size_per_token * 10 / 1e9, layout="layer_first")
    assert sized.size == (10 // P + 1) * P
    a = host.alloc(2 * P)
    assert a.tolist() == list(range(2 * P))
    with pytest.raises(ValueError, match="multiple of page_size"):
        host.alloc(P + 1)
    assert host.alloc(host.size) is None
    host.free(a)
    with pytest.raises(ValueError, match=r"indices\[0\] = 0 is not allocated"):
        host.free(a)
    assert host.available_size() == host.size
    with pytest.raises(ValueError, match="unsupported layout"):
        S.HostKVPool(pool, layout="page_first_kv_split")
    with pytest.raises(ValueError, match="io_backend"):
        host.load_to_device_per_layer(pool, a, a, 0, "kernel_ascend")
