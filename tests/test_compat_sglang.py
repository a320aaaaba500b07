"""kvlayout.compat.sglang against independent indexing oracles."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvlayout.compat import sglang as S

from compat_oracles import clear_device_status, devices, host_zeros, rand, record_skipped_row, same

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
    wants = [(_oracle_copy(dk, sk, d, s), _oracle_copy(dv, sv, d, s))
             for sk, sv, dk, dv in zip(src_k, src_v, dst_k, dst_v)]
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


# ---------------------------------------------------------------------------------------
# Negative indices, allocator, argument checks, direct granularity, error reporting
# ---------------------------------------------------------------------------------------

SENTINEL = -7.0


def _sentinel_host(pool, layout):
    host = S.HostKVPool(pool, 2.0, layout=layout)
    host.kv_buffer.fill_(SENTINEL)
    return host


@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first"])
def test_direct_backup_with_negative_host_indices_writes_nothing(layout):
    """A page of -1 host indices is no token: no host slot (0..P-1 included) is written for it."""
    gen = torch.Generator().manual_seed(20)
    pool = _device_pool("cpu", gen)
    host = _sentinel_host(pool, layout)
    host_idx = torch.cat([torch.full((P,), -1), torch.arange(2 * P, 3 * P)])      # page 2 is real
    dev_idx = torch.cat([torch.arange(P, 2 * P), torch.arange(3 * P, 4 * P)])
    host.backup_from_device_all_layer(pool, host_idx, dev_idx, "direct")
    for l in range(L):
        for slot in range(host.size):
            want_k = pool.k_buffer[l][3 * P + slot - 2 * P] if 2 * P <= slot < 3 * P else None
            got_k, got_v = _host_row(host, 0, l, slot), _host_row(host, 1, l, slot)
            if want_k is None:
                assert (got_k == SENTINEL).all() and (got_v == SENTINEL).all(), (l, slot)
            else:
                assert same(got_k, want_k) and same(got_v, pool.v_buffer[l][3 * P + slot - 2 * P])
    # loading the -1 page back writes no device slot either
    fresh = S.MHATokenToKVPool(POOL, P, torch.bfloat16, H, D, L)
    for l in range(L):
        host.load_to_device_per_layer(fresh, host_idx, dev_idx, l, "direct")
    for l in range(L):
        assert fresh.k_buffer[l][P:2 * P].abs().sum() == 0
        assert same(fresh.k_buffer[l][3 * P:4 * P], pool.k_buffer[l][3 * P:4 * P])


def test_direct_pf_functions_skip_negative_pages():
    gen = torch.Generator().manual_seed(21)
    NP = 4
    dev = [[rand((POOL, H, D), torch.bfloat16, "cpu", gen) for _ in range(L)] for _ in range(2)]
    host = [torch.full((NP, L, P, H, D), SENTINEL, dtype=torch.bfloat16) for _ in range(2)]
    S.transfer_kv_all_layer_direct_lf_pf(dev[0] + dev[1], host, torch.arange(P, 2 * P), torch.full((P,), -1), P)
    assert all((h == SENTINEL).all() for h in host)
    out = [torch.zeros(POOL, H, D, dtype=torch.bfloat16) for _ in range(2)]
    S.transfer_kv_per_layer_direct_pf_lf(host, out, torch.full((P,), -1), torch.arange(P), 0, P)
    assert all(o.abs().sum() == 0 for o in out)
    with pytest.raises(ValueError, match=r"dst_indices\[0\] = 5 is not the first slot of a page"):
        S.transfer_kv_all_layer_direct_lf_pf(dev[0] + dev[1], host, torch.arange(P, 2 * P), torch.arange(5, 5 + P), P)


def test_layer_first_direct_copies_exactly_the_listed_indices():
    """SGLang's layer_first direct path is transfer_kv_direct: token by token, unaligned indices included."""
    gen = torch.Generator().manual_seed(22)
    pool = _device_pool("cpu", gen)
    host = _sentinel_host(pool, "layer_first")
    host_idx = torch.tensor([1, 3, 5, 7])                 # one "page" whose slots are not consecutive
    dev_idx = torch.tensor([4, 5, 6, 7])
    host.backup_from_device_all_layer(pool, host_idx, dev_idx, "direct")
    for l in range(L):
        for slot in range(3 * P):
            got = host.kv_buffer[:, l, slot]
            if slot in host_idx.tolist():
                d = int(dev_idx[host_idx.tolist().index(slot)])
                assert same(got[0], pool.k_buffer[l][d]) and same(got[1], pool.v_buffer[l][d])
            else:
                assert (got == SENTINEL).all(), (l, slot)      # slots 2, 4, 6 were never listed
    fresh = S.MHATokenToKVPool(POOL, P, torch.bfloat16, H, D, L)
    host.load_to_device_per_layer(fresh, host_idx, torch.tensor([9, 11, 13, 15]), 1, "direct")
    for i, d in enumerate([9, 11, 13, 15]):
        assert same(fresh.k_buffer[1][d], pool.k_buffer[1][dev_idx[i]])
    assert fresh.k_buffer[1][[8, 10, 12, 14]].abs().sum() == 0


def test_allocator_rejects_bad_frees_and_sizes():
    pool = _device_pool("cpu", torch.Generator().manual_seed(23))
    host = S.HostKVPool(pool, 2.0, layout="page_first")
    everything = host.alloc(host.size)
    assert host.available_size() == 0
    with pytest.raises(ValueError, match=r"indices\[0\] = -1 is negative"):
        host.free([-1])
    with pytest.raises(ValueError, match=rf"indices\[1\] = {host.size} is out of range: the host pool holds "
                                         rf"{host.size}"):
        host.free([0, host.size])
    with pytest.raises(ValueError, match="indices repeats slot 4"):
        host.free([4, 4, 5, 6])
    assert host.available_size() == 0                     # a rejected free frees nothing
    with pytest.raises(ValueError, match="need_size = -4 must be >= 0"):
        host.alloc(-4)
    host.free(torch.arange(4, 8))
    with pytest.raises(ValueError, match=r"indices\[0\] = 4 is not allocated"):
        host.free([4])
    again = host.alloc(P)
    assert again.tolist() == [4, 5, 6, 7] and host.alloc(P) is None
    assert host.alloc(0).numel() == 0
    assert len(set(everything.tolist())) == host.size


def test_allocator_hands_out_whole_aligned_pages_only():
    pool = _device_pool("cpu", torch.Generator().manual_seed(24))
    host = S.HostKVPool(pool, 2.0, layout="page_first")
    host.alloc(host.size)
    host.free([2, 3])                                     # half of page 0: not allocatable yet
    host.free(torch.arange(2 * P, 3 * P))                 # all of page 2
    assert host.available_size() == P
    block = host.alloc(P)
    assert block.tolist() == list(range(2 * P, 3 * P))
    assert host.alloc(P) is None
    host.free([0, 1])                                     # page 0 is whole again
    assert host.alloc(P).tolist() == [0, 1, 2, 3]


def test_alloc_that_finds_a_used_slot_takes_nothing():
    pool = _device_pool("cpu", torch.Generator().manual_seed(25))
    host = S.HostKVPool(pool, 2.0, layout="page_first")
    host.slot_used[1] = True                              # a corrupted free list: slot 1 is in use
    before = host.free_slots.clone()
    with pytest.raises(RuntimeError, match="twice"):
        host.alloc(P)
    assert torch.equal(host.free_slots, before)


def test_page_head_arguments_must_match_the_host_shape():
    gen = torch.Generator().manual_seed(26)
    NP = 4
    dev_k = [rand((POOL, H, D), torch.bfloat16, "cpu", gen) for _ in range(L)]
    dev_v = [rand((POOL, H, D), torch.bfloat16, "cpu", gen) for _ in range(L)]
    ph = torch.zeros(2, NP, H, P, L, D, dtype=torch.bfloat16)          # [2, NP, H=2, P=4, L, D]
    idx = torch.arange(P, 2 * P)
    dim = ITEM * L
    # same bytes, other factors: these views would scramble rows silently
    with pytest.raises(ValueError, match="head_num = 4 contradicts dst_k"):
        S.transfer_kv_all_layer_lf_ph(dev_k, ph[0], dev_v, ph[1], idx, idx, ITEM, dim, L, P // 2, 4)
    with pytest.raises(ValueError, match="page_size = 8 contradicts dst_k"):
        S.transfer_kv_all_layer_lf_ph(dev_k, ph[0], dev_v, ph[1], idx, idx, ITEM, dim, L, 2 * P, H)
    with pytest.raises(ValueError, match="page_size = 2 contradicts src_k"):
        S.transfer_kv_per_layer_ph_lf(ph[0], dev_k[0], ph[1], dev_v[0], idx, idx, 0, ITEM, dim, P // 2, H)
    with pytest.raises(ValueError, match="src_layout_dim"):
        S.transfer_kv_per_layer_ph_lf(ph[0], dev_k[0], ph[1], dev_v[0], idx, idx, 0, ITEM, dim * 2, P, H)
    assert ph.abs().sum() == 0
    pf = torch.zeros(2, 16, L, H, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dst_layout_dim = 32 means 1 layers"):
        S.transfer_kv_all_layer_lf_pf(dev_k[:1], pf[0], dev_v[:1], pf[1], idx, idx, ITEM, ITEM, 1)


def test_validate_reaches_kvlayout(monkeypatch):
    from kvlayout import ops
    seen = []
    real = ops.transfer
    monkeypatch.setattr(ops, "transfer", lambda *a, **k: (seen.append(k.get("validate")), real(*a, **k))[1])
    prepare = ops.prepare     # per-layer loads prepare every layer once per index tensors
    monkeypatch.setattr(ops, "prepare", lambda *a, **k: (seen.append(k.get("validate")), prepare(*a, **k))[1])
    gen = torch.Generator().manual_seed(27)
    pool = _device_pool("cpu", gen)
    host = S.HostKVPool(pool, 2.0, layout="page_first")
    idx = torch.arange(P, 2 * P)
    host.backup_from_device_all_layer(pool, idx, idx, "kernel", validate=True)
    host.load_to_device_per_layer(pool, idx, idx, 0, "kernel", validate=False)
    host.load_to_device_per_layer(pool, idx, idx, 0, "kernel")
    host.load_to_device_per_layer(pool, idx, idx, 0, "direct")        # direct: read on the host, so checked
    S.transfer_kv_per_layer(pool.k_buffer[0], pool.k_buffer[1], pool.v_buffer[0], pool.v_buffer[1], idx, idx + P,
                            ITEM, validate=True)
    assert seen == [True, False, None, True, True]
    with pytest.raises(IndexError, match="out of range"):
        S.transfer_kv_per_layer(pool.k_buffer[0], pool.k_buffer[1], pool.v_buffer[0], pool.v_buffer[1],
                                idx, idx + POOL + P, ITEM, validate=True)


def test_skipped_rows_raise_where_sglang_synchronizes(request):
    request.addfinalizer(clear_device_status)
    gen = torch.Generator().manual_seed(28)
    pool = _device_pool("cpu", gen)
    idx = torch.arange(P, 2 * P)
    copy = pool.get_cpu_copy(idx)
    for call in (lambda: pool.get_cpu_copy(idx),
                 lambda: pool.load_cpu_copy(copy, idx),
                 lambda: S.transfer_kv_direct(pool.k_buffer, pool.v_buffer, idx, idx + P, P)):
        record_skipped_row(68)
        with pytest.raises(IndexError, match=r"dst_slots\[3\] = 999 is out of range"):
            call()
    S.transfer_kv_direct(pool.k_buffer, pool.v_buffer, idx, idx + P, P)   # reported once, then clear
