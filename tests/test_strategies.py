"""The conformance strategies themselves: shapes, bounds, slot patterns, reproducers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlayout import reference as R
from kvlayout.conformance import strategies as S

SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=150, **SETTINGS)
@given(data=st.data())
def test_geometries_fit_their_layout(data):
    name = data.draw(S.layouts(include_rows=True))
    lay = R.get(name)
    g = data.draw(S.geometries(name))
    assert g.P * g.L * g.N * g.H * g.E <= max(S.DEFAULT_BUDGET, g.P * g.E * g.BS)
    assert 1 <= g.BS <= 256 and g.NB >= 1 and 1 <= g.H <= 64 and g.L <= 8
    if not S.has_axis(lay, "l"):
        assert g.L == 1
    if not S.has_axis(lay, "h") or lay.planes == 1:
        assert g.H == 1
    if lay.chunk:
        assert g.BS == 1
    if g.columns:
        assert sum(g.columns) == g.E and min(g.columns) >= 1
    cache = S.random_cache(name, g, data.draw(S.dtypes()), np.random.default_rng(0))
    shapes = [[np.shape(x) for x in v] if part.per_layer else np.shape(v)
              for part, v in zip(lay.parts, (cache,) if lay.single_part else cache)]
    got = R.infer_geometry(name, shapes, page_size=None if lay.chunk else g.BS)
    assert (got.P, got.L, got.N, got.H, got.E, got.columns) == (g.P, g.L, g.N, g.H, g.E, g.columns)


@settings(max_examples=300, **SETTINGS)
@given(n_pages=st.integers(1, 16), page=st.sampled_from([1, 2, 4, 16]), T=st.integers(0, 40), data=st.data())
def test_slot_patterns(n_pages, page, T, data):
    n = n_pages * page
    slots = data.draw(S.slot_patterns(n, page, T))
    assert slots.dtype == np.int64 and slots.ndim == 1
    assert len(slots) in (0, 1, min(T, n))
    valid = slots[slots >= 0]
    assert valid.size == np.unique(valid).size
    assert np.all(slots < n) and np.all(slots >= -1)


@pytest.mark.parametrize("kind", S.SLOT_PATTERNS)
@settings(max_examples=20, **SETTINGS)
@given(data=st.data())
def test_slot_patterns_cover_every_kind(kind, data):
    slots = data.draw(S.slot_patterns(32, 4, 10, patterns=[kind]))
    if kind == "empty":
        assert slots.size == 0
    elif kind == "one":
        assert slots.size == 1
    elif kind == "sorted":
        assert np.all(np.diff(slots) > 0)
    elif kind == "reversed":
        assert np.all(np.diff(slots) < 0)
    elif kind == "partial_page":
        valid = slots[slots >= 0]
        assert valid[0] % 4 == 0 and np.all(np.diff(valid) == 1) and valid.size % 4 != 0


@settings(max_examples=60, **SETTINGS)
@given(case=S.transfer_cases())
def test_transfer_cases_are_consistent(case):
    sg, dg = case.src_geom, case.dst_geom
    assert sg.H * sg.E == dg.H * dg.E and sg.P == dg.P
    ss, ds = case.slots()
    for slots, g in ((ss, sg), (ds, dg)):
        if slots is not None:
            assert len(slots) == case.T and np.all(slots < g.N)
        else:
            assert case.T <= g.N
    if case.src_layers is None:
        assert sg.L == dg.L
    else:
        assert len(case.src_layers) == len(case.dst_layers) >= 1
    assert 0 <= case.skip_prefix <= case.T
    src, dst = case.caches()
    assert S.same_bytes(case.dst_layout, dst, S.sentinel_cache(case.dst_layout, dg, case.dtype))
    assert case.describe().startswith(case.src_layout)


@settings(max_examples=3, **SETTINGS)
@given(case=S.transfer_cases(src_layout="sglang_mha", dst_layout="hicache_page_head"))
def test_repr_rebuilds_the_case(case):
    """A case's repr is its reproducer: evaluated, it is the same case with the same bytes."""
    again = eval(repr(case), {"TransferCase": S.TransferCase, "Geometry": R.Geometry})  # noqa: S307
    assert again == case
    assert all(S.same_bytes(name, a, b) for name, a, b in zip((case.src_layout, case.dst_layout), again.caches(),
                                                               case.caches()))


def test_dtype_names_work_in_numpy_and_torch():
    for name in S.DTYPES:
        assert S.numpy_dtype(name).name == name
    torch = pytest.importorskip("torch")
    for name in S.DTYPES:
        assert getattr(torch, name).itemsize == S.numpy_dtype(name).itemsize
