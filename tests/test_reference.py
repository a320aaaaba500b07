"""The reference spec checked against independent numpy oracles (CPU, no torch)."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlayout import reference as R
from kvlayout.conformance import strategies as S

import reference_oracles as O

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                database=None)
ALL_LAYOUTS = S.layout_names(include_rows=True)


def examples(default: int) -> int:
    """Hypothesis examples: ``default`` times ``KVLAYOUT_HYPOTHESIS_EXAMPLES`` (as ``torch_cases.examples``,
    which this torch-free module does not import)."""
    scale = float(os.environ.get("KVLAYOUT_HYPOTHESIS_EXAMPLES", "1") or 1)
    return max(1, int(round(default * scale)))


def np_out(layout, physical):
    """The reference's output as a mutable numpy physical value."""
    return S.copy_cache(layout, R.map_arrays(layout, physical, np.asarray))


def bits_equal(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(S.bits(a), S.bits(b))


# ---------------------------------------------------------------------------------------
# Layouts: round trip and independent oracles
# ---------------------------------------------------------------------------------------

def test_every_catalog_layout_has_an_oracle():
    assert set(O.ORACLES) == set(R.CATALOG), "a layout without an independent oracle (tests/reference_oracles.py)"


# Two per layout: to_logical is checked element by element against the oracles below (four per layout),
# from_logical by every transfer into each layout (test_transfer_every_pair) and every dtype's bits by
# test_every_bit_pattern_survives.
@pytest.mark.parametrize("name", ALL_LAYOUTS)
@settings(max_examples=examples(2), **SETTINGS)
@given(data=st.data())
def test_round_trip(name, data):
    g = data.draw(S.geometries(name, max_layers=5, budget=4096))
    dtype = data.draw(S.dtypes())
    physical = S.random_cache(name, g, dtype, np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))))
    logical = R.to_logical(name, physical, g)
    assert logical.shape == (g.P, g.L, g.N, g.H, g.E)
    back = R.from_logical(name, logical, g)
    assert S.same_bytes(name, back, physical)
    assert R.geometry_of(name, physical, page_size=g.BS if not R.get(name).chunk else None).N == g.N


@pytest.mark.parametrize("name", ALL_LAYOUTS)
@settings(max_examples=examples(4), **SETTINGS)
@given(data=st.data())
def test_oracle_matches_to_logical(name, data):
    g = data.draw(S.geometries(name, max_layers=5, budget=4096))
    physical = S.random_cache(name, g, "uint8", np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))))
    logical = np.asarray(R.to_logical(name, physical, g))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    for _ in range(64):
        p, l, s, h, e = (int(rng.integers(0, n)) for n in (g.P, g.L, g.N, g.H, g.E))
        part, outer, idx = O.ORACLES[name](g, p, l, s, h, e)
        assert part in [q.name for q in R.get(name).parts]
        assert O.element(name, g, physical, p, l, s, h, e) == logical[p, l, s, h, e], (p, l, s, h, e)
        assert R.element_location(name, g, p, l, s, h, e) == (part, outer, idx)
    # The whole array through the row helpers the transfer oracle uses.
    assert np.array_equal(O.logical(name, g, physical), logical.reshape(g.P, g.L, g.N, g.H * g.E))


# ---------------------------------------------------------------------------------------
# Transfers against a plain numpy loop
# ---------------------------------------------------------------------------------------

def oracle_transfer(case: S.TransferCase, src, dst):
    """``dst`` after the transfer, by a loop over tokens, plane pairs and layer pairs."""
    sg, dg = case.src_geom, case.dst_geom
    out = S.copy_cache(case.dst_layout, dst)
    ss, ds = case.slots()
    T = case.T
    ss = np.arange(T) if ss is None else ss
    ds = np.arange(T) if ds is None else ds
    src_layers = range(sg.L) if case.src_layers is None else case.src_layers
    dst_layers = range(dg.L) if case.dst_layers is None else case.dst_layers
    for t in range(T):
        if t < case.skip_prefix or ss[t] < 0 or ds[t] < 0:
            continue
        for p in range(sg.P):
            for ls, ld in zip(src_layers, dst_layers):
                row = O.get_row(case.src_layout, sg, src, p, ls, int(ss[t]))
                O.set_row(case.dst_layout, dg, out, p, ld, int(ds[t]), row)
    return out


def run_case(case: S.TransferCase):
    src, dst = case.caches()
    ss, ds = case.slots()
    got = R.transfer(case.src_layout, src, case.dst_layout, dst, ss, ds, **case.transfer_kwargs())
    want = oracle_transfer(case, src, dst)
    assert S.same_bytes(case.dst_layout, got, want), repr(case)


# Every ordered layout pair also runs, at fixed sizes, in test_transfer_every_pair.
@settings(max_examples=examples(20), **SETTINGS)
@given(case=S.transfer_cases())
def test_transfer_generated(case):
    run_case(case)


def _sweep_geometry(name):
    lay = R.get(name)
    L = 3 if S.has_axis(lay, "l") else 1
    H = 2 if S.has_axis(lay, "h") and lay.planes != 1 else 1
    cols = (8, 4) if S.column_count(lay) else ()
    return R.make_geometry(name, L=L, N=16, H=H, E=12 // H, page_size=1 if lay.chunk else 4, columns=cols)


def test_transfer_every_pair():
    """Every ordered pair with equal plane counts, one fixed-size case each, bf16 (NaN patterns included)."""
    rng = np.random.default_rng(0)
    for a, b in S.layout_pairs():
        ga, gb = _sweep_geometry(a), _sweep_geometry(b)
        k = min(ga.L, gb.L)
        ss = rng.permutation(16)[:10]
        ds = rng.permutation(16)[:10]
        ss[3] = -1
        ds[5] = -1
        case = S.TransferCase(a, ga, b, gb, "bfloat16", tuple(ss.tolist()), tuple(ds.tolist()),
                              tuple(range(k)), tuple(range(k))[::-1], skip_prefix=1,
                              seed=int(rng.integers(2**31)))
        run_case(case)


@pytest.mark.parametrize("name", ["lmcache_kv_t2d", "lmcache_kv_2td", "lmcache_kv_mla_layer"])
def test_single_layer_into_one_layer_chunk(name):
    src_name = "vllm_mla" if R.get(name).planes == 1 else "vllm_flash_attn_hnd"
    sg = _sweep_geometry(src_name)
    dg = R.make_geometry(name, L=1, N=8, H=1, E=12)
    for layer in range(sg.L):
        case = S.TransferCase(src_name, sg, name, dg, "float16", (5, 1, 14, 0, 9, 3, 2, 8), None,
                              (layer,), (0,), seed=layer)
        run_case(case)
        # And back: chunk positions (no slot tensor) into a paged cache.
        back = S.TransferCase(name, dg, src_name, sg, "float16", None, (5, 1, 14, 0, 9, -1, 2, 8),
                              (0,), (layer,), skip_prefix=2, seed=layer)
        run_case(back)


def _simple_pair():
    a, b = "vllm_flash_attn_nhd", "hicache_page_head"
    ga, gb = _sweep_geometry(a), _sweep_geometry(b)
    rng = np.random.default_rng(1)
    return a, ga, S.random_cache(a, ga, "float32", rng), b, gb, S.sentinel_cache(b, gb, "float32")


def test_out_of_range_slots_raise_naming_the_argument():
    a, ga, src, b, gb, dst = _simple_pair()
    with pytest.raises(IndexError, match=r"src_slots\[1\] = 16 .*16 slots"):
        R.transfer(a, src, b, dst, np.array([0, 16]), np.array([0, 1]))
    with pytest.raises(IndexError, match=r"dst_slots\[0\] = 99"):
        R.transfer(a, src, b, dst, np.array([0, 1]), np.array([99, 1]))
    with pytest.raises(IndexError, match="slots"):
        R.gather(a, src, np.array([3, 40]))
    with pytest.raises(IndexError, match="slots"):
        R.move(a, src, np.array([0]), np.array([16]))


def test_duplicate_destination_slots_raise():
    a, ga, src, b, gb, dst = _simple_pair()
    with pytest.raises(ValueError, match="dst_slots repeats slot 4"):
        R.transfer(a, src, b, dst, np.array([0, 1, 2]), np.array([4, -1, 4]))
    # Repeated -1 and repeated sources are fine.
    R.transfer(a, src, b, dst, np.array([0, 0, 2]), np.array([-1, -1, 4]))


def test_negative_slots_write_nothing():
    a, ga, src, b, gb, dst = _simple_pair()
    out = R.transfer(a, src, b, dst, np.array([-1, 3, -1]), np.array([2, -1, -5]))
    assert S.same_bytes(b, out, dst)
    rows = R.gather(a, src, np.array([-1, 2]), out=jnp.full((2, 3, 2, 2, 6), 7.0, jnp.float32))
    assert np.all(np.asarray(rows)[:, :, 0] == 7.0)


def test_empty_transfer_is_a_no_op():
    a, ga, src, b, gb, dst = _simple_pair()
    empty = np.zeros(0, np.int64)
    assert S.same_bytes(b, R.transfer(a, src, b, dst, empty, empty), dst)
    assert S.same_bytes(b, R.transfer(a, src, b, dst, np.array([1, 2]), np.array([3, 4]), skip_prefix=2), dst)
    assert R.gather(a, src, empty).shape == (2, 3, 0, 2, 6)
    assert S.same_bytes(a, R.scatter(a, src, jnp.zeros((2, 3, 0, 2, 6), jnp.float32), empty), src)


# gather and scatter are transfers to and from "rows": the transfer tests above cover their rule as well.
@settings(max_examples=examples(8), **SETTINGS)
@given(data=st.data())
def test_gather_then_scatter_matches_oracle(data):
    name = data.draw(S.layouts())
    g = data.draw(S.geometries(name, max_layers=4, budget=2048))
    dtype = data.draw(S.dtypes())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    cache = S.random_cache(name, g, dtype, rng)
    slots = data.draw(S.slot_patterns(g.N, g.BS))
    skip = data.draw(st.integers(0, len(slots)))
    rows = np.asarray(R.gather(name, cache, slots, skip_prefix=skip))
    assert rows.shape == (g.P, g.L, len(slots), g.H, g.E)
    want = np.zeros_like(rows).reshape(g.P, g.L, len(slots), g.H * g.E)
    for t, s in enumerate(slots):
        if t >= skip and s >= 0:
            for p in range(g.P):
                for l in range(g.L):
                    want[p, l, t] = O.get_row(name, g, cache, p, l, int(s))
    assert bits_equal(rows.reshape(want.shape), want)
    # Scatter the rows back into a sentinel cache: exactly the gathered rows change.
    target = S.sentinel_cache(name, g, dtype)
    out = np_out(name, R.scatter(name, target, rows, slots, skip_prefix=skip))
    expect = S.copy_cache(name, target)
    for t, s in enumerate(slots):
        if t >= skip and s >= 0:
            for p in range(g.P):
                for l in range(g.L):
                    O.set_row(name, g, expect, p, l, int(s), O.get_row(name, g, cache, p, l, int(s)))
    assert S.same_bytes(name, out, expect)


def test_skip_prefix_keeps_positions_absolute():
    slots = R.skip_prefix(jnp.array([7, 3, 9, 1]), 2)
    assert np.asarray(slots).tolist() == [-1, -1, 9, 1]
    assert np.asarray(R.skip_prefix(None, 3, num_tokens=5)).tolist() == [-1, -1, -1, 3, 4]
    with pytest.raises(ValueError):
        R.skip_prefix(None, 1)
    a, ga, src, b, gb, dst = _simple_pair()
    chunk = "lmcache_kv_2ltd"
    cg = R.make_geometry(chunk, L=3, N=6, H=1, E=12)
    out = np_out(chunk, R.transfer(a, src, chunk, S.sentinel_cache(chunk, cg, "float32"),
                                   np.array([4, 5, 6, 7, 8, 9]), None, skip_prefix=4))
    got = O.logical(chunk, cg, out)
    for t in range(6):
        for p in range(2):
            for l in range(3):
                if t < 4:
                    assert np.all(S.bits(got[p, l, t]) == np.uint32(0xA5A5A5A5))
                else:
                    assert bits_equal(got[p, l, t], O.get_row(a, ga, src, p, l, 4 + t))


# ---------------------------------------------------------------------------------------
# Move within one cache
# ---------------------------------------------------------------------------------------

def oracle_move(name, g, cache, src_slots, dst_slots):
    snapshot = S.copy_cache(name, cache)
    out = S.copy_cache(name, cache)
    for s, d in zip(src_slots, dst_slots):
        if s >= 0 and d >= 0:
            for p in range(g.P):
                for l in range(g.L):
                    O.set_row(name, g, out, p, l, int(d), O.get_row(name, g, snapshot, p, l, int(s)))
    return out


def _move_patterns(n):
    return {
        "shift_right": (np.arange(0, n - 3), np.arange(3, n)),
        "shift_left": (np.arange(2, n), np.arange(0, n - 2)),
        "chain": (np.array([0, 1, 2, 3]), np.array([1, 2, 3, 4])),
        "swap": (np.array([1, 5, 6, 7]), np.array([5, 1, 7, 6])),
        "cycle": (np.array([2, 4, 6]), np.array([4, 6, 2])),
        "padded": (np.array([3, -1, 5, 0]), np.array([-1, 2, 0, 5])),
        "empty": (np.zeros(0, np.int64), np.zeros(0, np.int64)),
    }


@pytest.mark.parametrize("pattern", list(_move_patterns(16)))
@pytest.mark.parametrize("name", ["vllm_flash_attn_hnd", "sglang_mha", "hicache_page_head", "vllm_mla",
                                  "hicache_mla_page_first_kv_split"])
def test_move_overlapping(name, pattern):
    g = _sweep_geometry(name)
    cache = S.random_cache(name, g, "bfloat16", np.random.default_rng(3))
    src, dst = _move_patterns(g.N)[pattern]
    out = R.move(name, cache, src, dst)
    assert S.same_bytes(name, np_out(name, out), oracle_move(name, g, cache, src, dst))


def test_move_rejects_duplicates_and_length_mismatch():
    g = _sweep_geometry("vllm_flash_attn_nhd")
    cache = S.random_cache("vllm_flash_attn_nhd", g, "float32", np.random.default_rng(0))
    with pytest.raises(ValueError, match="dst_slots repeats"):
        R.move("vllm_flash_attn_nhd", cache, np.array([0, 1]), np.array([3, 3]))
    with pytest.raises(ValueError, match="differ in length"):
        R.move("vllm_flash_attn_nhd", cache, np.array([0, 1]), np.array([3]))


# ---------------------------------------------------------------------------------------
# Page helpers
# ---------------------------------------------------------------------------------------

HICACHE = S.layout_names("host")


# Two per host layout (each example checks get_page, page_spans, set_page and zero_page); the NaN-payload
# tests and the op tests call the same helpers again.
@pytest.mark.parametrize("name", HICACHE)
@settings(max_examples=examples(2), **SETTINGS)
@given(data=st.data())
def test_page_helpers(name, data):
    g = data.draw(S.geometries(name, max_layers=3, budget=2048, min_slots=2))
    if g.BS == 1 or g.NB < 2:
        g = R.make_geometry(name, L=g.L, N=2 * 4, H=g.H, E=g.E, page_size=4, columns=g.columns)
    dtype = data.draw(S.dtypes())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    a = S.random_cache(name, g, dtype, rng)
    b = S.random_cache(name, g, dtype, rng)
    page = data.draw(st.integers(0, g.NB - 1))
    kw = {"page_size": g.BS}

    flat = np.asarray(R.get_page(name, a, page, **kw))
    assert flat.shape == (g.P * g.L * g.BS * g.H * g.E,)
    # page_spans read from the raw bytes of the arrays give the same bytes.
    arrays = S.arrays_of(name, a)
    spans = R.page_spans(name, g, [page], np.dtype(flat.dtype).itemsize)
    raw = b"".join(arrays[i].tobytes()[off:off + n] for i, off, n in spans)
    assert raw == flat.tobytes()

    # set_page: b takes a's page, nothing else of b changes.
    out = np_out(name, R.set_page(name, b, page, flat, **kw))
    want = S.copy_cache(name, b)
    for s in range(page * g.BS, (page + 1) * g.BS):
        for p in range(g.P):
            for l in range(g.L):
                O.set_row(name, g, want, p, l, s, O.get_row(name, g, a, p, l, s))
    assert S.same_bytes(name, out, want)
    assert np.asarray(R.get_page(name, out, page, **kw)).tobytes() == flat.tobytes()

    # zero_page zeroes exactly the page.
    z = np_out(name, R.zero_page(name, a, page, **kw))
    want = S.copy_cache(name, a)
    zero = np.zeros(g.H * g.E, S.numpy_dtype(dtype))
    for s in range(page * g.BS, (page + 1) * g.BS):
        for p in range(g.P):
            for l in range(g.L):
                O.set_row(name, g, want, p, l, s, zero)
    assert S.same_bytes(name, z, want)


def test_page_helpers_reject_bad_page():
    name = "hicache_page_head"
    g = _sweep_geometry(name)
    cache = S.random_cache(name, g, "uint8", np.random.default_rng(0))
    with pytest.raises(IndexError, match="page = 4 is out of range"):
        R.get_page(name, cache, 4)
    with pytest.raises(IndexError, match="page"):
        R.page_spans(name, g, [0, 9], 1)


# ---------------------------------------------------------------------------------------
# Byte exactness for every dtype (NaN and Inf patterns included)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", S.DTYPES)
def test_every_bit_pattern_survives(dtype):
    dt = S.numpy_dtype(dtype)
    n_patterns = 1 << (8 * dt.itemsize) if dt.itemsize <= 2 else 1 << 16
    words = np.arange(n_patterns, dtype=np.uint64)
    if dt.itemsize == 4:  # spread 65536 patterns over all 32 bits, NaNs included
        words = (words * np.uint64(0x10001)) ^ np.uint64(0x7FC00001)
    raw = words.astype({1: np.uint8, 2: np.uint16, 4: np.uint32}[dt.itemsize])
    E = 16
    src_name, dst_name = "vllm_flash_attn_hnd", "hicache_page_first_direct"
    N = raw.size // (2 * E)
    sg = R.make_geometry(src_name, L=1, N=N, H=1, E=E, page_size=4)
    dg = R.make_geometry(dst_name, L=1, N=N, H=2, E=E // 2, page_size=2)
    src = [raw.view(dt).reshape(sg.part_shape(R.get(src_name).parts[0]))]
    dst = S.sentinel_cache(dst_name, dg, dtype)
    slots = np.random.default_rng(0).permutation(sg.N)
    out = np_out(dst_name, R.transfer(src_name, src, dst_name, dst, slots, slots[::-1].copy()))
    back = np_out(src_name, R.transfer(dst_name, out, src_name, S.sentinel_cache(src_name, sg, dtype),
                                       slots[::-1].copy(), slots))
    assert S.same_bytes(src_name, back, src)
    rows = np.asarray(R.gather(src_name, src, slots))
    assert S.bits(rows).dtype.itemsize == dt.itemsize
    assert bits_equal(rows.reshape(-1), np.asarray(R.to_logical(src_name, src))[:, :, slots].reshape(-1))


# ---------------------------------------------------------------------------------------
# RoPE repositioning
# ---------------------------------------------------------------------------------------

def cos_sin_cache(max_pos, rot, base=10000.0):
    inv = 1.0 / base ** (np.arange(0, rot, 2, dtype=np.float64) / rot)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)


def np_rotate(keys, pos, cache, is_neox):
    """Apply RoPE at ``pos`` to unrotated keys ``[T, H, D]`` (numpy, fp64 math)."""
    keys = keys.astype(np.float64)
    rot = cache.shape[1]
    half = rot // 2
    cos, sin = cache[pos, :half][:, None, :], cache[pos, half:][:, None, :]
    out = keys.copy()
    if is_neox:
        x, y = keys[..., :half], keys[..., half:rot]
        out[..., :half], out[..., half:rot] = x * cos - y * sin, y * cos + x * sin
    else:
        x, y = keys[..., 0:rot:2], keys[..., 1:rot:2]
        out[..., 0:rot:2], out[..., 1:rot:2] = x * cos - y * sin, y * cos + x * sin
    return out


# Five per pairing (the shapes only change which elements are paired; the rotation rule is one expression);
# test_operations_under_jit and test_rope_pairings_differ_and_bf16 call it again with fixed values.
@pytest.mark.parametrize("is_neox", [True, False])
@settings(max_examples=examples(5), **SETTINGS)
@given(data=st.data())
def test_rope_reposition(is_neox, data):
    T = data.draw(st.integers(1, 12))
    H = data.draw(st.integers(1, 4))
    D = data.draw(st.sampled_from([4, 8, 64, 128]))
    rot = data.draw(st.sampled_from([r for r in (2, 4, 8, 32, 64, 128) if r <= D]))
    max_pos = 64
    cache = cos_sin_cache(max_pos, rot)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    raw = rng.standard_normal((T, H, D)).astype(np.float32)
    old = rng.integers(0, max_pos, T)
    new = rng.integers(0, max_pos, T)
    keys = np_rotate(raw, old, cache, is_neox).astype(np.float32)
    tol = dict(rtol=1e-5, atol=2e-5)

    same = np.asarray(R.rope_reposition(keys, old, old, cache, is_neox=is_neox))
    np.testing.assert_allclose(same, keys, **tol)
    moved = np.asarray(R.rope_reposition(keys, old, new, cache, is_neox=is_neox))
    np.testing.assert_allclose(moved, np_rotate(raw, new, cache, is_neox), **tol)
    np.testing.assert_array_equal(moved[..., rot:], keys[..., rot:])
    back = np.asarray(R.rope_reposition(moved, new, old, cache, is_neox=is_neox))
    np.testing.assert_allclose(back, keys, **tol)

    # Negative positions leave the token untouched (bit for bit).
    old_neg = old.copy()
    old_neg[0] = -1
    part = np.asarray(R.rope_reposition(keys, old_neg, new, cache, is_neox=is_neox))
    assert bits_equal(part[0], keys[0])


def test_rope_pairings_differ_and_bf16():
    cache = cos_sin_cache(16, 8)
    raw = np.random.default_rng(0).standard_normal((3, 2, 8)).astype(np.float32)
    a = np.asarray(R.rope_reposition(raw, np.array([1, 2, 3]), np.array([5, 6, 7]), cache, is_neox=True))
    b = np.asarray(R.rope_reposition(raw, np.array([1, 2, 3]), np.array([5, 6, 7]), cache, is_neox=False))
    assert not np.allclose(a, b)
    keys = jnp.asarray(raw, jnp.bfloat16)
    out = R.rope_reposition(keys, np.array([1, 2, 3]), np.array([5, 6, 7]), cache, is_neox=True)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), a, rtol=2e-2, atol=2e-2)


def test_rope_out_of_range_raises():
    cache = cos_sin_cache(16, 8)
    keys = np.zeros((2, 1, 8), np.float32)
    with pytest.raises(IndexError, match=r"new_positions\[1\] = 16 is out of range"):
        R.rope_reposition(keys, np.array([0, 1]), np.array([0, 16]), cache, is_neox=True)
    with pytest.raises(IndexError, match="old_positions"):
        R.rope_reposition(keys, np.array([99, 1]), np.array([0, 1]), cache, is_neox=False)
    with pytest.raises(ValueError, match="rotary dim"):
        R.rope_reposition(keys, np.array([0, 1]), np.array([0, 1]), cos_sin_cache(16, 10), is_neox=True)


# ---------------------------------------------------------------------------------------
# jax.jit with static geometry and traced slots
# ---------------------------------------------------------------------------------------

def test_operations_under_jit():
    a, ga, src, b, gb, dst = _simple_pair()
    src = R.map_arrays(a, src, jnp.asarray)
    dst = R.map_arrays(b, dst, jnp.asarray)
    ss = jnp.array([3, 0, -1, 15, 7])
    ds = jnp.array([1, 9, 4, -1, 15])

    f = jax.jit(lambda s, d, x, y: R.transfer(a, x, b, y, s, d, src_layers=[2, 0], dst_layers=[0, 1],
                                              skip_prefix=1))
    eager = R.transfer(a, src, b, dst, ss, ds, src_layers=[2, 0], dst_layers=[0, 1], skip_prefix=1)
    assert S.same_bytes(b, f(ss, ds, src, dst), eager)

    g = jax.jit(lambda s, x: R.gather(a, x, s))
    rows = g(ss, src)
    assert bits_equal(np.asarray(rows), np.asarray(R.gather(a, src, ss)))

    sc = jax.jit(lambda s, x, r: R.scatter(a, x, r, s))
    assert S.same_bytes(a, sc(ds, src, rows), R.scatter(a, src, rows, ds))

    m = jax.jit(lambda s, d, x: R.move(a, x, s, d))
    ms, md = jnp.array([0, 1, 2, 3]), jnp.array([1, 2, 3, 4])
    assert S.same_bytes(a, m(ms, md, src), np_out(a, oracle_move(a, ga, np_out(a, src), ms, md)))

    cache = cos_sin_cache(32, 8)
    keys = jnp.asarray(np.random.default_rng(0).standard_normal((4, 2, 8)), jnp.float32)
    old, new = jnp.array([0, 5, -1, 31]), jnp.array([3, 5, 9, 0])
    r = jax.jit(lambda k, o, n: R.rope_reposition(k, o, n, cache, is_neox=False))
    np.testing.assert_allclose(np.asarray(r(keys, old, new)),
                               np.asarray(R.rope_reposition(keys, old, new, cache, is_neox=False)),
                               rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------
# The reference never imports torch
# ---------------------------------------------------------------------------------------

REFERENCE_DIR = pathlib.Path(R.__file__).parent


def test_reference_sources_do_not_import_torch():
    for path in sorted(REFERENCE_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n == "torch" or n.startswith("torch.") for n in names), f"{path}: imports {names}"


def test_importing_reference_does_not_load_torch(tmp_path):
    code = ("import sys; from kvlayout import reference as R; "
            "[getattr(R, n) for n in R.__all__]; "
            "from kvlayout.conformance import strategies; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(tmp_path))
