"""The ``gather``, ``scatter`` and ``move`` families: a cache and the row buffer, and moves inside a cache.

* gather: cache -> rows ``[P', L', T, H, E]`` (plane and layer subsets,
  ``skip_prefix``, chunk positions), into an ``out`` filled with sentinel or
  random bytes (CUDA: possibly pinned host memory) or one the op allocates;
* scatter: rows ``[P', L', T, H', E']`` (any head split of the row) -> a cache
  holding random bytes, so untouched rows must keep them;
* move: ``cache[dst] = old_cache[src]`` for every layer and plane, with
  overlapping sources and destinations (shifts, swaps, chains, padding).

References: ``kvlayout.reference.gather`` / ``scatter`` / ``move``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import strategies as st

from kvlayout import ops
from kvlayout.reference.layouts import Geometry, get

from .. import strategies as S
from . import core
from .core import (
    BadSetup,
    ErrorKind,
    Invalid,
    OnOneCache,
    OpFamily,
    as_list,
    assert_same,
    bind,
    flat,
    pin_if,
    random_array,
    reference,
    rows_geometry,
    slots,
    sync,
    tensor,
)
from .transfer import INDEX_CHOICES, duplicate_dst_slots, past_the_end, valid_token

SLOT_DTYPES = ("int64", "int32")
LAYOUTS = S.layout_names()


def _subset_kwargs(layers, planes, skip_prefix: int) -> dict:
    kw = {}
    if layers is not None:
        kw["layers"] = list(layers)
    if planes is not None:
        kw["planes"] = list(planes)
    if skip_prefix:
        kw["skip_prefix"] = skip_prefix
    return kw


def _label(op: str, layout: str, geom: Geometry, dtype: str, T: int, layers, planes, skip: int) -> str:
    return (f"{op} {layout}[{S.geometry_label(geom)}] {dtype} T={T} layers={as_list(layers)} "
            f"planes={as_list(planes)} skip={skip}")


@dataclasses.dataclass(frozen=True)
class GatherSample(OnOneCache):
    """``ops.gather``: cache -> rows ``[P', L', T, H, E]``.

    ``slots``: ``None`` reads chunk positions ``0..T-1`` (``T = num_tokens``,
    default the cache's slot count).  ``out_fill``: the initial bytes of a
    given ``out`` (``sentinel`` or ``random``), or ``None`` for an ``out``
    the op allocates (zeros).
    """

    layout: str
    geom: Geometry
    dtype: str
    slots: tuple[int, ...] | None
    layers: tuple[int, ...] | None = None
    planes: tuple[int, ...] | None = None
    skip_prefix: int = 0
    out_fill: str | None = "sentinel"
    pinned_out: bool = False
    slot_dtype: str = "int64"
    seed: int = 0
    num_tokens: int | None = None
    family = "gather"

    @property
    def T(self) -> int:
        if self.slots is not None:
            return len(self.slots)
        return self.num_tokens if self.num_tokens is not None else self.geom.N

    def describe(self) -> str:
        out = {None: " (out allocated)", "random": " random out", "sentinel": ""}[self.out_fill]
        return (_label("gather", self.layout, self.geom, self.dtype, self.T, self.layers, self.planes,
                       self.skip_prefix) + out + (" pinned out" if self.pinned_out else ""))

    def run(self, device: str) -> None:
        g = self.geom
        rng = np.random.default_rng(self.seed)
        cache_np = S.random_cache(self.layout, g, self.dtype, rng)
        cache = bind(self.layout, cache_np, g, device)
        P = g.P if self.planes is None else len(self.planes)
        L = g.L if self.layers is None else len(self.layers)
        kw = _subset_kwargs(self.layers, self.planes, self.skip_prefix)
        if self.slots is None and self.num_tokens is not None:
            kw["num_tokens"] = self.num_tokens
        slots_np = None if self.slots is None else np.array(self.slots, np.int64)
        out_np = out = None
        if self.out_fill is not None:
            rows_geom = rows_geometry(P, L, self.T, g.H, g.E)
            out_np = (S.random_cache("rows", rows_geom, self.dtype, rng) if self.out_fill == "random"
                      else S.sentinel_cache("rows", rows_geom, self.dtype))
            out = tensor(out_np, device, pin=pin_if(device, self.pinned_out))
        result = ops.gather(cache, slots(self.slots, self.slot_dtype, device), out=out, **kw)
        sync(device)
        assert out is None or result is out, "gather must return out"
        assert result.device.type == (out.device.type if out is not None else torch.device(device).type)
        assert_same(result, reference.gather(self.layout, cache_np, slots_np, out=out_np, **kw), "gathered rows")
        assert_same(cache.tensors, flat(self.layout, cache_np), "cache (must not change)")


@dataclasses.dataclass(frozen=True)
class ScatterSample(OnOneCache):
    """``ops.scatter``: rows ``[P', L', T, H', E']`` (``H' = rows_heads``) -> a cache holding random bytes."""

    layout: str
    geom: Geometry
    dtype: str
    slots: tuple[int, ...] | None
    rows_heads: int = 1
    layers: tuple[int, ...] | None = None
    planes: tuple[int, ...] | None = None
    skip_prefix: int = 0
    pinned_rows: bool = False
    slot_dtype: str = "int64"
    seed: int = 0
    family = "scatter"

    @property
    def T(self) -> int:
        return len(self.slots) if self.slots is not None else self.geom.N

    def describe(self) -> str:
        return (_label("scatter", self.layout, self.geom, self.dtype, self.T, self.layers, self.planes,
                       self.skip_prefix) + f" rows H'={self.rows_heads}" + (" pinned rows" if self.pinned_rows else ""))

    def run(self, device: str) -> None:
        g = self.geom
        P = g.P if self.planes is None else len(self.planes)
        L = g.L if self.layers is None else len(self.layers)
        H = self.rows_heads
        rng = np.random.default_rng(self.seed)
        cache_np = S.random_cache(self.layout, g, self.dtype, rng)     # random bytes: untouched rows keep them
        rows_np = S.random_cache("rows", rows_geometry(P, L, self.T, H, g.H * g.E // H), self.dtype, rng)
        cache = bind(self.layout, cache_np, g, device)
        rows = tensor(rows_np, device, pin=pin_if(device, self.pinned_rows))
        kw = _subset_kwargs(self.layers, self.planes, self.skip_prefix)
        ops.scatter(cache, rows, slots(self.slots, self.slot_dtype, device), **kw)
        sync(device)
        slots_np = None if self.slots is None else np.array(self.slots, np.int64)
        expected = reference.scatter(self.layout, cache_np, rows_np, slots_np, **kw)
        assert_same(cache.tensors, flat(self.layout, expected), "cache")
        assert_same(rows, rows_np, "rows (must not change)")


@dataclasses.dataclass(frozen=True)
class MoveSample(OnOneCache):
    """``ops.move`` within one cache, sources and destinations overlapping."""

    layout: str
    geom: Geometry
    dtype: str
    src_slots: tuple[int, ...]
    dst_slots: tuple[int, ...]
    slot_dtype: str = "int64"
    seed: int = 0
    family = "move"

    def describe(self) -> str:
        return f"move {self.layout}[{S.geometry_label(self.geom)}] {self.dtype} T={len(self.src_slots)}"

    def run(self, device: str) -> None:
        cache_np = S.random_cache(self.layout, self.geom, self.dtype, np.random.default_rng(self.seed))
        cache = bind(self.layout, cache_np, self.geom, device)
        ops.move(cache, slots(self.src_slots, self.slot_dtype, device), slots(self.dst_slots, self.slot_dtype, device))
        sync(device)
        expected = reference.move(self.layout, cache_np, np.array(self.src_slots, np.int64),
                                  np.array(self.dst_slots, np.int64))
        assert_same(cache.tensors, flat(self.layout, expected), "cache")


# ---------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------

def layouts_of(group: str | None) -> list[str]:
    """Catalog layouts, or those of one catalog family."""
    return [n for n in LAYOUTS if group is None or get(n).family == group]


def _subset(draw, count: int):
    """``None`` (all) or a non-empty ordered subset of ``range(count)``."""
    if draw(st.booleans()):
        return None
    k = draw(st.integers(1, count))
    return tuple(draw(st.permutations(range(count)))[:k])


def _cache_and_slots(draw, group):
    """A layout, a geometry, slots (``None``: chunk positions) and ``skip_prefix``."""
    layout = draw(st.sampled_from(layouts_of(group)))
    geom = draw(S.geometries(layout, max_layers=8, max_slots=64, budget=1 << 14))
    chunk_positions = get(layout).chunk and draw(st.booleans())
    values = None if chunk_positions else tuple(int(v) for v in draw(S.slot_patterns(geom.N, geom.BS)))
    return layout, geom, values


def _skip(draw, T: int) -> int:
    return draw(st.integers(0, T)) if T and draw(st.booleans()) else 0


@st.composite
def gather_samples(draw, device: str, group: str | None = None):
    layout, geom, values = _cache_and_slots(draw, group)
    num_tokens = draw(st.one_of(st.none(), st.integers(0, geom.N))) if values is None else None
    T = len(values) if values is not None else (geom.N if num_tokens is None else num_tokens)
    return GatherSample(layout, geom, draw(S.dtypes()), values, _subset(draw, geom.L), _subset(draw, geom.P),
                        _skip(draw, T), draw(st.sampled_from(("sentinel", "sentinel", "random", None))),
                        pin_if(device, draw(st.booleans())), draw(st.sampled_from(SLOT_DTYPES)),
                        draw(st.integers(0, 2**32 - 1)), num_tokens)


@st.composite
def scatter_samples(draw, device: str, group: str | None = None):
    layout, geom, values = _cache_and_slots(draw, group)
    T = len(values) if values is not None else geom.N
    width = geom.H * geom.E
    heads = draw(st.sampled_from([d for d in range(1, min(64, width) + 1) if width % d == 0]))
    return ScatterSample(layout, geom, draw(S.dtypes()), values, heads, _subset(draw, geom.L),
                         _subset(draw, geom.P), _skip(draw, T), pin_if(device, draw(st.booleans())),
                         draw(st.sampled_from(SLOT_DTYPES)), draw(st.integers(0, 2**32 - 1)))


@st.composite
def move_samples(draw, device: str, group: str | None = None):
    layout = draw(st.sampled_from(layouts_of(group)))
    geom = draw(S.geometries(layout, max_layers=8, max_slots=64, budget=1 << 14))
    src, dst = draw(S.move_slot_pairs(geom.N))
    return MoveSample(layout, geom, draw(S.dtypes()), tuple(int(v) for v in src), tuple(int(v) for v in dst),
                      draw(st.sampled_from(SLOT_DTYPES)), draw(st.integers(0, 2**32 - 1)))


GATHER = OpFamily("gather", "ops.gather: cache -> rows, layer and plane subsets", gather_samples, "gather")
SCATTER = OpFamily("scatter", "ops.scatter: rows -> cache, layer and plane subsets", scatter_samples, "scatter")
MOVE = OpFamily("move", "ops.move within one cache, overlapping slots", move_samples, "move")
SAMPLES = (GatherSample, ScatterSample, MoveSample)


# ---------------------------------------------------------------------------------------
# Error inputs of gather, scatter and move, as data (built on a valid transfer case)
# ---------------------------------------------------------------------------------------

def _gather_setup(b, device, validate, out_width: int | None = None, layers: int | None = None,
                  planes: int | None = None):
    """The case's source cache, slots and a sentinel ``out`` (rows of ``out_width`` elements, ``layers`` and
    ``planes`` of them, if given)."""
    s = BadSetup.of(b.case, device, validate)
    g = b.case.src_geom
    geom = rows_geometry(planes or g.P, layers or g.L, b.case.T,
                         *((g.H, g.E) if out_width is None else (1, out_width)))
    out_np = S.sentinel_cache("rows", geom, b.case.dtype)
    return s, out_np, tensor(out_np, device)


def _gather_slot_out_of_range(b, device, validate):
    s, out_np, out = _gather_setup(b, device, validate)
    t = valid_token(b.case, b.token)
    s.src_slots[t] = b.case.src_geom.N + b.offset

    def deferred():
        ss = np.array(s.src_slots)
        ss[t] = -1
        return [out], [reference.gather(b.case.src_layout, s.src_np, ss, out=out_np)]

    return Invalid(lambda: ops.gather(s.src, slots(s.src_slots, "int64", device), out=out, validate=validate),
                   [([out], [out_np], "out (must not change)")], deferred,
                   values={"token": t, "value": b.case.src_geom.N + b.offset, "bound": b.case.src_geom.N})


def _gather_width(b, device, validate):
    g = b.case.src_geom
    s, out_np, out = _gather_setup(b, device, validate, out_width=g.H * g.E + 1)
    return Invalid(lambda: ops.gather(s.src, slots(s.src_slots, "int64", device), out=out, validate=validate),
                   [([out], [out_np], "out (must not change)")],
                   values={"src": f"{g.H}*{g.E}", "dst": f"1*{g.H * g.E + 1}"})


def _count(geom, what: str) -> int:
    return geom.L if what == "layers" else geom.P


def _gather_index(what: str, value):
    """``ops.gather`` choosing layer or plane ``value(count, sample)``."""
    def build(b, device, validate):
        count = _count(b.case.src_geom, what)
        s, out_np, out = _gather_setup(b, device, validate, **{what: 1})
        bad = value(count, b)
        return Invalid(lambda: ops.gather(s.src, slots(s.src_slots, "int64", device), out=out, validate=validate,
                                          **{what: [bad]}),
                       [([out], [out_np], "out (must not change)")], values={"value": bad, "count": count})
    return build


def _scatter_rows(b, device, dtype=None, layers=None, planes=None):
    """Random rows ``[P', L', T, 1, H * E]`` for the case's destination (``layers``/``planes``: L', P')."""
    g = b.case.dst_geom
    rows_np = random_array((planes or g.P, layers or g.L, b.case.T, 1, g.H * g.E), dtype or b.case.dtype, 1)
    return rows_np, tensor(rows_np, device)


def _scatter_slot_out_of_range(b, device, validate):
    s = BadSetup.of(b.case, device, validate)
    t = valid_token(b.case, b.token)
    s.dst_slots[t] = b.case.dst_geom.N + b.offset
    rows_np, rows = _scatter_rows(b, device)

    def deferred():
        ds = np.array(s.dst_slots)
        ds[t] = -1
        return s.dst.tensors, flat(b.case.dst_layout, reference.scatter(b.case.dst_layout, s.dst_np, rows_np, ds))

    return Invalid(lambda: ops.scatter(s.dst, rows, slots(s.dst_slots, "int64", device), validate=validate),
                   s.dst_unchanged(), deferred,
                   values={"token": t, "value": b.case.dst_geom.N + b.offset, "bound": b.case.dst_geom.N})


def _scatter_call(edit=lambda s, b: None, rows_dtype: bool = False):
    """``ops.scatter`` after ``edit(setup, sample)``; ``rows_dtype``: rows of another element size."""
    def build(b, device, validate):
        s = BadSetup.of(b.case, device, validate)
        edit(s, b)
        other = ("float32" if s.dst.itemsize != 4 else "float16") if rows_dtype else None
        _, rows = _scatter_rows(b, device, other)
        return Invalid(lambda: ops.scatter(s.dst, rows, slots(s.dst_slots, "int64", device), validate=validate),
                       s.dst_unchanged(), values={"src": rows.dtype, "dst": s.dst.dtype})
    return build


def _scatter_index(what: str, value):
    """``ops.scatter`` choosing layer or plane ``value(count, sample)``."""
    def build(b, device, validate):
        count = _count(b.case.dst_geom, what)
        s = BadSetup.of(b.case, device, validate)
        _, rows = _scatter_rows(b, device, **{what: 1})
        bad = value(count, b)
        return Invalid(lambda: ops.scatter(s.dst, rows, slots(s.dst_slots, "int64", device), validate=validate,
                                           **{what: [bad]}), s.dst_unchanged(), values={"value": bad, "count": count})
    return build


def _move(edit, src_dtype: str = "int64"):
    """``ops.move`` inside the case's destination: the first (up to) four slots reversed, then
    ``edit(src, dst, sample)``, which returns what the message must say."""
    def build(b, device, validate):
        s = BadSetup.of(b.case, device, validate)
        n = min(4, b.case.dst_geom.N)
        src, dst = list(range(n)), list(reversed(range(n)))
        values = edit(src, dst, b) or {}

        def deferred():
            ms, md = np.array(src), np.array(dst)
            bad = (ms >= b.case.dst_geom.N) | (md >= b.case.dst_geom.N)
            ms[bad] = md[bad] = -1
            return s.dst.tensors, flat(b.case.dst_layout, reference.move(b.case.dst_layout, s.dst_np, ms, md))

        src_t, dst_t = slots(src, src_dtype, device), slots(dst, "int64", device)
        return Invalid(lambda: ops.move(s.dst, src_t, dst_t, validate=validate), s.dst_unchanged(), deferred,
                       values=values)
    return build


def _move_out_of_range(side: int):
    def edit(src, dst, b):
        token, bound = b.token % len(src), b.case.dst_geom.N
        (src, dst)[side][token] = bound + b.offset
        return {"token": token, "value": bound + b.offset, "bound": bound}
    return edit


def _move_duplicates(src, dst, b):
    if len(dst) >= 2:
        dst[:] = [0] * len(dst)
    else:
        src[:], dst[:] = [0, 0], [0, 0]


def _move_lengths(src, dst, b):
    dst.append(0)
    return {"src": len(src), "dst": len(dst)}


GATHER_ERRORS = (
    ErrorKind("gather: slots out of range", "slot_out_of_range", core.slot_out_of_range_message("slots"),
              _gather_slot_out_of_range, deferrable=True),
    *(ErrorKind(f"gather: {what} {where}", "layer_plane_out_of_range", core.index_out_of_range_message(what),
                _gather_index(what, value))
      for what in ("layers", "planes") for where, value in INDEX_CHOICES),
    ErrorKind("gather: out row width differs", "row_width", core.ROW_WIDTHS_DIFFER, _gather_width),
)
SCATTER_ERRORS = (
    ErrorKind("scatter: slots out of range", "slot_out_of_range", core.slot_out_of_range_message("dst_slots"),
              _scatter_slot_out_of_range, deferrable=True),
    *(ErrorKind(f"scatter: {what} out of range", "layer_plane_out_of_range",
                core.index_out_of_range_message("dst_" + what), _scatter_index(what, past_the_end))
      for what in ("layers", "planes")),
    ErrorKind("scatter: duplicate slots", "duplicate_destination_slot", core.REPEATED_DESTINATION,
              _scatter_call(duplicate_dst_slots)),
    ErrorKind("scatter: rows dtype differs", "element_type", core.DTYPES_DIFFER, _scatter_call(rows_dtype=True)),
)
MOVE_ERRORS = (
    ErrorKind("move: src_slots out of range", "slot_out_of_range", core.slot_out_of_range_message("src_slots"),
              _move(_move_out_of_range(0)), deferrable=True),
    ErrorKind("move: dst_slots out of range", "slot_out_of_range", core.slot_out_of_range_message("dst_slots"),
              _move(_move_out_of_range(1)), deferrable=True),
    ErrorKind("move: duplicate dst_slots", "duplicate_destination_slot", core.REPEATED_DESTINATION,
              _move(_move_duplicates)),
    ErrorKind("move: slot lengths differ", "index_shape",
              r"src_slots \({src},\) and dst_slots \({dst},\) differ in length", _move(_move_lengths)),
    ErrorKind("move: src_slots of float32", "index_dtype", r"src_slots must be int32 or int64, got torch\.float32",
              _move(lambda src, dst, b: None, src_dtype="float32")),
)
GATHER = dataclasses.replace(GATHER, errors=GATHER_ERRORS)
SCATTER = dataclasses.replace(SCATTER, errors=SCATTER_ERRORS)
MOVE = dataclasses.replace(MOVE, errors=MOVE_ERRORS)
