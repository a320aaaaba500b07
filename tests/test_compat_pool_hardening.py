"""SGLang pools under hostile input, and the host pool's host-memory reserve (CPU).

Each test pins one refusal (or one consistency) that an earlier version got
wrong: a bool taken as a layer id, rows silently dropped, K and V of different
lengths, rows of another head shape, a fractional size, numpy layer ids that
one io backend refused, a ratio that is not a positive number, and a reserve
that refused tiny pools on machines with less than ~10 GiB free.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvlayout.compat import sglang as S

from compat_oracles import rand, same

SIZE, P, HEADS, HD, LAYERS = 16, 4, 2, 8, 3


def _mha(gen=None, device="cpu"):
    pool = S.MHATokenToKVPool(SIZE, P, torch.float16, HEADS, HD, LAYERS, device, False)
    if gen is not None:
        for t in pool.k_buffer + pool.v_buffer:
            t.copy_(rand(t.shape, t.dtype, device, gen))
    return pool


def _mla(gen=None):
    pool = S.MLATokenToKVPool(SIZE, P, torch.float16, 8, 4, LAYERS, "cpu", False)
    if gen is not None:
        for t in pool.kv_buffer:
            t.copy_(rand(t.shape, t.dtype, "cpu", gen))
    return pool


def _snapshot(pool):
    return [t.clone() for t in (pool.kv_buffer if hasattr(pool, "kv_lora_rank") else pool.k_buffer + pool.v_buffer)]


def _unchanged(pool, snap) -> bool:
    now = pool.kv_buffer if hasattr(pool, "kv_lora_rank") else pool.k_buffer + pool.v_buffer
    return all(same(a, b) for a, b in zip(now, snap))


class _Layer:
    def __init__(self, layer_id):
        self.layer_id = layer_id


# ---------------------------------------------------------------------------------------
# Layer ids
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("layer", [True, False, _Layer(True), np.bool_(True)])
def test_a_bool_is_not_a_layer_id(layer):
    pool = _mha(torch.Generator().manual_seed(1))
    snap = _snapshot(pool)
    rows = torch.ones(2, HEADS, HD, dtype=torch.float16)
    with pytest.raises(TypeError, match="integer layer id"):
        pool.set_kv_buffer(layer, torch.tensor([1, 2]), rows, rows)
    assert _unchanged(pool, snap)
    with pytest.raises(TypeError, match="integer layer id"):
        pool.get_key_buffer(True)


@pytest.mark.parametrize("make_id", [int, np.int64, np.int32, lambda i: torch.tensor(i)])
def test_numpy_and_torch_integer_layer_ids_work_everywhere(make_id):
    """The same layer id type gives the same result on the device pool and on both host io backends."""
    gen = torch.Generator().manual_seed(2)
    pool = _mha(gen)
    rows = rand((2, HEADS, HD), torch.float16, "cpu", gen)
    pool.set_kv_buffer(_Layer(make_id(1)), torch.tensor([1, 2]), rows, rows)
    assert same(pool.get_key_buffer(make_id(1))[1:3], rows)
    host = S.HostKVPool(pool, 2.0, layout="page_first", pin_memory=False)
    h = host.alloc(P)
    d = torch.arange(P, 2 * P)
    host.backup_from_device_all_layer(pool, h, d)
    for backend in ("kernel", "direct"):
        target = _mha()
        host.load_to_device_per_layer(target, h, d, make_id(2), io_backend=backend)
        assert same(target.k_buffer[2][d], pool.k_buffer[2][d]) and same(target.v_buffer[2][d], pool.v_buffer[2][d])
        assert not target.k_buffer[1].any()
    for backend in ("kernel", "direct"):
        with pytest.raises(TypeError, match="integer layer id"):
            host.load_to_device_per_layer(_mha(), h, d, True, io_backend=backend)


# ---------------------------------------------------------------------------------------
# Rows that do not fit
# ---------------------------------------------------------------------------------------

def test_set_kv_buffer_refuses_extra_rows():
    pool = _mha(torch.Generator().manual_seed(3))
    snap = _snapshot(pool)
    rows = torch.ones(3, HEADS, HD, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"cache_k must be \[2, 2, 8\]"):
        pool.set_kv_buffer(0, torch.tensor([1, 2]), rows, rows)
    with pytest.raises(ValueError, match=r"cache_k must be \[4, 2, 8\]"):
        pool.set_kv_buffer(0, torch.tensor([1, 2, 3, 4]), rows, rows)          # too few rows too
    assert _unchanged(pool, snap)


def test_set_kv_buffer_refuses_k_and_v_of_different_lengths():
    pool = _mha(torch.Generator().manual_seed(4))
    snap = _snapshot(pool)
    with pytest.raises(ValueError, match="cache_v must be"):
        pool.set_kv_buffer(0, torch.tensor([1, 2]), torch.ones(2, HEADS, HD, dtype=torch.float16),
                           torch.ones(3, HEADS, HD, dtype=torch.float16))
    assert _unchanged(pool, snap)


@pytest.mark.parametrize("shape", [(2, 1, 2 * HD), (2, HEADS * HD), (2, HEADS, HD, 1), (2, 4, HD // 2)])
def test_set_kv_buffer_refuses_rows_of_another_head_shape(shape):
    pool = _mha(torch.Generator().manual_seed(5))
    snap = _snapshot(pool)
    rows = torch.ones(shape, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"cache_k must be \[2, 2, 8\] \(\[tokens, heads, head size\]"):
        pool.set_kv_buffer(0, torch.tensor([1, 2]), rows, rows)
    assert _unchanged(pool, snap)


def test_mla_set_buffers_refuse_rows_that_do_not_fit():
    pool = _mla(torch.Generator().manual_seed(6))
    snap = _snapshot(pool)
    with pytest.raises(ValueError, match=r"cache_k must be \[2, 1, 12\]"):
        pool.set_kv_buffer(0, torch.tensor([1, 2]), torch.ones(3, 1, 12, dtype=torch.float16), None)
    with pytest.raises(ValueError, match=r"cache_k_rope must be \[2, 1, 4\]"):
        pool.set_mla_kv_buffer(0, torch.tensor([1, 2]), torch.ones(2, 1, 8, dtype=torch.float16),
                               torch.ones(3, 1, 4, dtype=torch.float16))
    assert _unchanged(pool, snap)


@pytest.mark.parametrize("mla", [False, True])
def test_load_cpu_copy_refuses_extra_or_missing_rows(mla):
    gen = torch.Generator().manual_seed(7)
    pool = _mla(gen) if mla else _mha(gen)
    idx = torch.tensor([3, 5])
    copy = pool.get_cpu_copy(idx)
    snap = _snapshot(pool)
    longer = torch.tensor([3, 5, 6])
    bigger = pool.get_cpu_copy(longer)
    with pytest.raises(ValueError, match=r"kv_cache_cpu\[0\]\[0\]"):
        pool.load_cpu_copy(bigger, idx)                     # three rows per layer for two slots
    with pytest.raises(ValueError, match=r"kv_cache_cpu\[0\]\[0\]"):
        pool.load_cpu_copy(copy, longer)                    # two rows per layer for three slots
    with pytest.raises(ValueError, match="layers"):
        pool.load_cpu_copy(copy[:1], idx)
    assert _unchanged(pool, snap)
    pool.load_cpu_copy(copy, torch.tensor([7, 9]))          # the right shapes still load
    assert same(pool.get_cpu_copy(torch.tensor([7, 9]))[1][0][0] if not mla else
                pool.get_cpu_copy(torch.tensor([7, 9]))[1][0], copy[1][0][0] if not mla else copy[1][0])


# ---------------------------------------------------------------------------------------
# Sizes and ratios
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, kwargs", [
    ("size", {"size": 2.5}), ("size", {"size": -4}), ("page_size", {"page_size": 0}),
    ("head_num", {"head_num": 1.5}), ("layer_num", {"layer_num": 0}), ("size", {"size": float("nan")})])
def test_device_pool_sizes_must_be_whole_numbers(name, kwargs):
    args = dict(size=SIZE, page_size=P, dtype=torch.float16, head_num=HEADS, head_dim=HD, layer_num=LAYERS,
                device="cpu", enable_memory_saver=False)
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"{name} = "):
        S.MHATokenToKVPool(**args)


def test_device_pool_sizes_refuse_bools_and_take_integral_floats():
    with pytest.raises(TypeError, match="size must be an integer"):
        S.MHATokenToKVPool(True, P, torch.float16, HEADS, HD, LAYERS, "cpu", False)
    assert S.MHATokenToKVPool(16.0, P, torch.float16, HEADS, HD, LAYERS, "cpu", False).size == 16


@pytest.mark.parametrize("ratio", [-1.0, 0.0, math.nan, math.inf, -math.inf])
def test_host_to_device_ratio_must_be_a_positive_finite_number(ratio):
    with pytest.raises(ValueError, match=rf"host_to_device_ratio = {ratio!r} must be a finite number > 0"):
        S.HostKVPool(_mha(), ratio, layout="layer_first", pin_memory=False)


def test_host_size_must_be_finite_and_not_negative():
    for size in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="host_size = "):
            S.HostKVPool(_mha(), 2.0, size, layout="layer_first", pin_memory=False)
    with pytest.raises(TypeError, match="host_to_device_ratio must be a number"):
        S.HostKVPool(_mha(), "2", layout="layer_first", pin_memory=False)


# ---------------------------------------------------------------------------------------
# The host-memory reserve
# ---------------------------------------------------------------------------------------

GIB = 1 << 30


def test_reserve_is_sglangs_for_large_pools_and_the_pools_size_for_small_ones():
    assert S.HOST_MEMORY_RESERVE_BYTES == 10 * GIB
    assert S.host_memory_reserve_for(40 * GIB) == 10 * GIB
    assert S.host_memory_reserve_for(10 * GIB) == 10 * GIB
    assert S.host_memory_reserve_for(3 * GIB) == 3 * GIB
    assert S.host_memory_reserve_for(4096) == 4096


@pytest.mark.parametrize("free_gb", [7, 1, 0.001])
def test_a_small_pool_works_on_a_machine_with_little_free_memory(monkeypatch, free_gb):
    """A 7 GB CI runner, a busy laptop: a pool of a few KiB is made (SGLang's fixed 10 GiB reserve refuses it)."""
    monkeypatch.setattr(S, "_available_host_memory", lambda: int(free_gb * 1e9))
    host = S.HostKVPool(_mha(), 2.0, layout="page_first", pin_memory=False)
    assert host.size * host.size_per_token < 64 * 1024
    assert host.host_memory_reserve == host.size * host.size_per_token
    h = host.alloc(P)
    assert h is not None and host.free(h) == P


def test_an_oversized_pool_is_refused_with_the_numbers_and_the_keyword(monkeypatch):
    monkeypatch.setattr(S, "_available_host_memory", lambda: 7 * 10 ** 9)        # 7 GB free
    with pytest.raises(ValueError) as err:
        S.HostKVPool(_mha(), 2.0, 4.0, layout="page_first", pin_memory=False)    # 4 GB: it would leave 3 GB
    msg = str(err.value)
    assert "not enough host memory for the host pool: need 4.00 GB, 7.00 GB available, 4.00 GB reserved" in msg
    assert "host_memory_reserve=" in msg and "host_to_device_ratio" in msg
    with pytest.raises(ValueError, match=r"need 11\.00 GB, 20\.00 GB available, 10\.74 GB reserved"):
        monkeypatch.setattr(S, "_available_host_memory", lambda: 20 * 10 ** 9)
        S.HostKVPool(_mha(), 2.0, 11.0, layout="page_first", pin_memory=False)  # large pools keep 10 GiB


def test_an_explicit_reserve_is_applied_as_given(monkeypatch):
    monkeypatch.setattr(S, "_available_host_memory", lambda: 7 * 10 ** 9)
    with pytest.raises(ValueError, match="10.74 GB reserved"):
        S.HostKVPool(_mha(), 2.0, layout="page_first", pin_memory=False, host_memory_reserve=10 * GIB)
    host = S.HostKVPool(_mha(), 2.0, layout="page_first", pin_memory=False, host_memory_reserve=0)
    assert host.host_memory_reserve == 0
    with pytest.raises(ValueError, match="host_memory_reserve = -1"):
        S.HostKVPool(_mha(), 2.0, layout="page_first", pin_memory=False, host_memory_reserve=-1)


def test_the_real_probe_is_used_and_a_tiny_pool_fits_beside_it():
    available = S._available_host_memory()
    assert available is None or available > 0
    S.HostKVPool(_mha(), 2.0, layout="page_first", pin_memory=False)               # whatever this machine has
