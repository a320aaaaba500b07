"""Hypothesis strategies and case builders for kvlayout conformance.

Everything here is numpy + hypothesis: no torch, no jax.  A runner converts the
numpy arrays to tensors on its devices; the pytest suite hands them to the
reference.

* :func:`layouts` - catalog names, optionally only MHA / MLA / chunk / paged;
* :func:`geometries` - a :class:`~kvlayout.reference.Geometry` for a layout,
  small enough that a case stays cheap;
* :func:`dtypes` - element type names valid in numpy (ml_dtypes) and torch;
* :func:`slot_patterns` - slot arrays: random, page-contiguous, sorted,
  reversed, padded with -1, empty, one token, a partial last page;
* :func:`transfer_cases` - a source and a destination cache that can exchange
  rows, with layers, slots and skip_prefix: a :class:`TransferCase` whose
  ``repr`` rebuilds it (the case database's samples wrap it);
* :func:`random_cache` / :func:`sentinel_cache` - the physical numpy value of a
  cache (same structure as the reference's physical values) filled with random
  bytes or one repeated byte.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from kvlayout.reference.layouts import CATALOG, Geometry, Layout, get

# ---------------------------------------------------------------------------------------
# Element types
# ---------------------------------------------------------------------------------------

DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8", "int8")
"""Element types of KV caches; each name is an attribute of ``torch`` and of numpy/ml_dtypes."""

_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a :data:`DTYPES` name (fp8 and bf16 come from ml_dtypes)."""
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def dtypes(names: Sequence[str] = DTYPES) -> st.SearchStrategy[str]:
    """Element type names (see :data:`DTYPES`)."""
    return st.sampled_from(tuple(names))


def bits(x) -> np.ndarray:
    """``x`` viewed as unsigned integers of its element size: compare these for byte-exactness."""
    x = np.asarray(x)
    return x.view(_UINT_OF_SIZE[x.dtype.itemsize])


# ---------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------

KINDS = ("mha", "mla", "chunk", "paged", "device", "host")


def layout_names(kind: str | None = None, *, include_rows: bool = False) -> tuple[str, ...]:
    """Catalog names, optionally only one kind.

    ``kind``: ``"mha"`` (2 planes), ``"mla"`` (1 plane), ``"chunk"`` (contiguous
    chunk formats), ``"paged"`` (page-structured slot axis), ``"device"``
    (engine caches and pools), ``"host"`` (HiCache host pools).  ``rows`` (the
    logical row buffer, any plane count) is left out unless ``include_rows``.
    """
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    out = []
    for name, lay in CATALOG.items():
        if name == "rows" and not include_rows:
            continue
        if kind == "mha" and lay.planes != 2:
            continue
        if kind == "mla" and lay.planes != 1:
            continue
        if kind == "chunk" and not lay.chunk:
            continue
        if kind == "paged" and not lay.paged:
            continue
        if kind == "device" and lay.family not in ("vllm", "sglang"):
            continue
        if kind == "host" and lay.family != "hicache":
            continue
        out.append(name)
    return tuple(out)


def layouts(kind: str | None = None, *, include_rows: bool = False) -> st.SearchStrategy[str]:
    """Catalog layout names (see :func:`layout_names`)."""
    return st.sampled_from(layout_names(kind, include_rows=include_rows))


def _axes(layout: Layout) -> set[str]:
    return {a for part in layout.parts for a in part.full_axes}


def has_axis(layout: Layout | str, axis: str) -> bool:
    """Whether any part of the layout has ``axis`` (``"l"``, ``"h"``, ``"nb"``, ...)."""
    return axis in _axes(get(layout))


def column_count(layout: Layout | str) -> int:
    """Number of column blocks the row is split into (0 = not split)."""
    return len({p.column for p in get(layout).parts if p.column is not None})


# ---------------------------------------------------------------------------------------
# Geometries
# ---------------------------------------------------------------------------------------

ELEMENT_WIDTHS = (1, 2, 3, 4, 5, 8, 16, 32, 64, 66, 128, 576, 656)
"""Per-head element counts drawn for E: row byte sizes that are multiples of 1, 2, 4,
8 and 16 bytes for every element size, odd widths (66 bf16 = 132 B) and MLA latents
(576 = 512 + 64, 656 = 512 + 128 + 16)."""

PAGE_SIZES = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256)

ROW_BYTES = (128, 130, 132, 136, 144, 160, 192, 256, 264, 384, 520, 1024, 1040, 1152, 2048, 2056, 4096)
"""Row sizes in bytes (H * E * element size) from 128 B to 4 KiB: multiples of 16 and sizes
that are multiples of 8, 4 or 2 bytes only (the widest vector a kernel may use differs)."""

MLA_ROW_ELEMENTS = (576, 656)
"""MLA latent rows in elements: 512 + 64 (DeepSeek) and 512 + 128 + 16 (with a scale block)."""

DEFAULT_BUDGET = 1 << 14
"""Default bound on P * L * N * H * E (elements per cache) to keep cases fast."""


@st.composite
def geometries(draw, layout: Layout | str, *, row_width: int | None = None, planes: int | None = None,
               max_layers: int = 8, max_slots: int = 64, max_page: int = 256, max_heads: int = 64,
               min_slots: int = 1, layers: int | None = None, budget: int = DEFAULT_BUDGET) -> Geometry:
    """A geometry for ``layout``.

    Axes the layout lacks get size 1 (L for one-layer chunks, H for MLA caches
    and LMCache chunks, the page size of chunk formats).  ``row_width`` fixes
    ``H * E`` (H is then a divisor of it); ``planes`` fixes P for the ``rows``
    layout; ``layers`` fixes L (when the layout has layers).  ``budget`` bounds
    ``P * L * N * H * E``; ``max_page`` and ``max_slots`` bound pages and slots
    (slots may exceed ``max_slots`` by less than one page so that a drawn page
    size always fits once).
    """
    layout = get(layout)
    P = planes if layout.planes is None and planes is not None else (layout.planes or draw(st.sampled_from((1, 2))))
    has_l = has_axis(layout, "l")
    # An MLA latent is one head (the pools keep a unit head axis).
    has_h = has_axis(layout, "h") and layout.planes != 1
    n_cols = column_count(layout)

    # Row: H heads of E elements.
    if row_width is not None:
        if has_h:
            divisors = [d for d in range(1, min(max_heads, row_width) + 1) if row_width % d == 0]
            if n_cols:
                divisors = [d for d in divisors if row_width // d >= n_cols]
            H = draw(st.sampled_from(divisors))
        else:
            H = 1
        E = row_width // H
    else:
        min_e = max(1, n_cols)
        widths = [w for w in ELEMENT_WIDTHS if w >= min_e and P * w <= budget]
        E = draw(st.sampled_from(widths))
        H = draw(st.integers(1, max(1, min(max_heads, budget // (P * E))))) if has_h else 1
    columns: tuple[int, ...] = ()
    if n_cols == 2:
        rope = draw(st.integers(1, E - 1))
        columns = (E - rope, rope)
    elif n_cols:
        raise NotImplementedError(f"{layout.name}: {n_cols} column blocks")

    row = P * H * E
    left = max(1, budget // row)
    if layers is not None:
        if not has_l and layers != 1:
            raise ValueError(f"{layout.name} has no layer axis")
        L = layers
    else:
        L = draw(st.integers(1, max(1, min(max_layers, left // max(1, min_slots))))) if has_l else 1
    left = max(1, left // L)

    # Slots: NB pages of BS slots (chunk formats: BS = 1).
    if layout.chunk:
        BS = 1
    else:
        sizes = [b for b in PAGE_SIZES if b <= max_page and b <= max(1, left)]
        BS = draw(st.sampled_from(sizes))
    max_nb = max(1, min(left, max(max_slots, BS)) // BS)
    min_nb = min(max_nb, max(1, math.ceil(min_slots / BS)))
    NB = draw(st.integers(min_nb, max_nb))
    return Geometry(P=P, L=L, NB=NB, BS=BS, H=H, E=E, columns=columns)


# ---------------------------------------------------------------------------------------
# Slots
# ---------------------------------------------------------------------------------------

SLOT_PATTERNS = ("random", "pages", "sorted", "reversed", "padded", "empty", "one", "partial_page")


@st.composite
def slot_patterns(draw, n_slots: int, page_size: int = 1, T: int | None = None,
                  patterns: Sequence[str] = SLOT_PATTERNS) -> np.ndarray:
    """An int64 slot array into a cache of ``n_slots`` slots (pages of ``page_size``).

    Non-negative entries are distinct.  ``T`` is the length (default drawn,
    clamped to ``n_slots``); ``"empty"`` gives length 0 and ``"one"`` length 1
    whatever ``T`` is.  Patterns: ``random`` (distinct, any order), ``pages``
    (whole random pages in random order, slots ascending inside a page, cut to
    ``T``), ``sorted``, ``reversed`` (descending), ``padded`` (random with some
    entries -1), ``partial_page`` (consecutive pages from a page start with a
    last page that is cut short; padded with -1 to ``T`` when needed).
    """
    kind = draw(st.sampled_from(tuple(patterns)))
    if T is None:
        T = draw(st.integers(1, max(1, min(n_slots, 32))))
    T = min(T, n_slots)
    if kind == "empty" or T == 0:
        return np.zeros(0, np.int64)
    if kind == "one":
        return np.array([draw(st.integers(0, n_slots - 1))], np.int64)
    if kind == "pages" or kind == "partial_page":
        n_pages = n_slots // page_size
        need = math.ceil(T / page_size)
        if kind == "pages":
            order = draw(st.permutations(range(n_pages)))[:need]
        else:
            first = draw(st.integers(0, n_pages - need))
            order = list(range(first, first + need))
        slots = np.concatenate([np.arange(p * page_size, (p + 1) * page_size) for p in order])[:T]
        if kind == "partial_page" and T % page_size == 0 and page_size > 1:
            cut = draw(st.integers(1, page_size - 1))
            slots = np.concatenate([slots[:T - cut], np.full(cut, -1)])
        return slots.astype(np.int64)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    slots = rng.choice(n_slots, size=T, replace=False).astype(np.int64)
    if kind == "sorted":
        slots.sort()
    elif kind == "reversed":
        slots = np.sort(slots)[::-1].copy()
    elif kind == "padded":
        holes = rng.random(T) < draw(st.sampled_from((0.1, 0.3, 0.7, 1.0)))
        slots[holes] = -1
    return slots


# ---------------------------------------------------------------------------------------
# Physical caches
# ---------------------------------------------------------------------------------------

def _build(layout: Layout | str, geom: Geometry, make) -> object:
    """Physical value of ``layout`` with each tensor from ``make(shape)``.

    One-part layouts: the tensor, or the list of per-layer tensors; several
    parts: a tuple with one entry per part (as the reference expects).
    """
    layout = get(layout)
    parts = []
    for part in layout.parts:
        shape = geom.part_shape(part)
        parts.append([make(shape) for _ in range(geom.L)] if part.per_layer else make(shape))
    return parts[0] if len(parts) == 1 else tuple(parts)


def random_cache(layout: Layout | str, geom: Geometry, dtype: str, rng: np.random.Generator) -> object:
    """A physical cache filled with random bytes (NaN and Inf patterns of float types included)."""
    dt = numpy_dtype(dtype)

    def make(shape):
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
        return raw.view(dt).reshape(shape)

    return _build(layout, geom, make)


NAN_DTYPES = ("float8_e4m3fn", "float8_e5m2", "bfloat16", "float16")
"""Element types whose every NaN bit pattern :func:`nan_patterns` lists (16 bits or fewer)."""


def nan_patterns(dtype: str, n: int) -> np.ndarray:
    """``n`` elements cycling through every NaN bit pattern of ``dtype`` (both signs, every payload).

    A float conversion (even to the same dtype) may rewrite a NaN's payload or
    sign; kvlayout copies bytes, so these must come out unchanged.
    """
    if dtype not in NAN_DTYPES:
        raise ValueError(f"NaN patterns are listed for {', '.join(NAN_DTYPES)}, not {dtype}")
    dt = numpy_dtype(dtype)
    every = np.arange(2 ** (8 * dt.itemsize), dtype=np.uint64).astype(f"u{dt.itemsize}")
    nans = every[np.isnan(every.view(dt).astype(np.float32))]
    return np.resize(nans, n).view(dt)


def nan_cache(layout: Layout | str, geom: Geometry, dtype: str) -> object:
    """A physical cache whose every element is a NaN (all payloads, both signs; each tensor shifted)."""
    count = [0]

    def make(shape):
        count[0] += 1
        return np.roll(nan_patterns(dtype, int(np.prod(shape))), count[0]).reshape(shape)

    return _build(layout, geom, make)


SENTINEL_BYTE = 0xA5
"""Byte that fills destinations so untouched elements can be told from copied ones."""


def sentinel_cache(layout: Layout | str, geom: Geometry, dtype: str, byte: int = SENTINEL_BYTE) -> object:
    """A physical cache whose every byte is ``byte``."""
    dt = numpy_dtype(dtype)
    return _build(layout, geom, lambda shape: np.full(int(np.prod(shape)) * dt.itemsize, byte,
                                                      np.uint8).view(dt).reshape(shape))


def arrays_of(layout: Layout | str, physical) -> list[np.ndarray]:
    """Every array of a physical cache as numpy, part by part, layer by layer."""
    layout = get(layout)
    parts = (physical,) if len(layout.parts) == 1 else tuple(physical)
    out = []
    for part, value in zip(layout.parts, parts):
        out.extend([np.asarray(x) for x in value] if part.per_layer else [np.asarray(value)])
    return out


def same_bytes(layout: Layout | str, a, b) -> bool:
    """Whether two physical caches of ``layout`` hold the same shapes and bytes."""
    xs, ys = arrays_of(layout, a), arrays_of(layout, b)
    return len(xs) == len(ys) and all(
        x.shape == y.shape and x.dtype.itemsize == y.dtype.itemsize and np.array_equal(bits(x), bits(y))
        for x, y in zip(xs, ys))


def copy_cache(layout: Layout | str, physical) -> object:
    """A deep numpy copy of a physical cache (same structure)."""
    layout = get(layout)
    parts = (physical,) if len(layout.parts) == 1 else tuple(physical)
    out = [[np.array(x) for x in v] if part.per_layer else np.array(v) for part, v in zip(layout.parts, parts)]
    return out[0] if len(out) == 1 else tuple(out)


# ---------------------------------------------------------------------------------------
# Transfer cases
# ---------------------------------------------------------------------------------------

def geometry_label(g: Geometry) -> str:
    """A geometry in one short token, e.g. ``P2 L4 NB8xBS16 H2 E64`` (column widths when split)."""
    cols = f" cols={list(g.columns)}" if g.columns else ""
    return f"P{g.P} L{g.L} NB{g.NB}xBS{g.BS} H{g.H} E{g.E}{cols}"


@dataclasses.dataclass(frozen=True)
class TransferCase:
    """One transfer: ``dst <- src`` with slots, layers and skip_prefix.

    ``src_slots``/``dst_slots``: tuples of ints, or ``None`` for the chunk
    positions ``0..T-1``.  ``src_layers``/``dst_layers``: tuples paired in
    order, or ``None`` for all layers.  ``seed`` seeds the random source bytes
    (see :meth:`caches`).
    """

    src_layout: str
    src_geom: Geometry
    dst_layout: str
    dst_geom: Geometry
    dtype: str
    src_slots: tuple[int, ...] | None
    dst_slots: tuple[int, ...] | None
    src_layers: tuple[int, ...] | None = None
    dst_layers: tuple[int, ...] | None = None
    skip_prefix: int = 0
    num_tokens: int | None = None
    seed: int = 0

    @property
    def T(self) -> int:
        for s in (self.src_slots, self.dst_slots):
            if s is not None:
                return len(s)
        return self.num_tokens if self.num_tokens is not None else self.src_geom.N

    def slots(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The slot arrays as int64 numpy (or ``None``)."""
        def conv(s):
            return None if s is None else np.asarray(s, np.int64).reshape(-1)
        return conv(self.src_slots), conv(self.dst_slots)

    def caches(self) -> tuple[object, object]:
        """``(src, dst)``: random source bytes, sentinel-filled destination."""
        rng = np.random.default_rng(self.seed)
        return (random_cache(self.src_layout, self.src_geom, self.dtype, rng),
                sentinel_cache(self.dst_layout, self.dst_geom, self.dtype))

    def transfer_kwargs(self) -> dict:
        """Keyword arguments of ``reference.transfer`` besides the caches and slots."""
        kw: dict = {"src_geom": self.src_geom, "dst_geom": self.dst_geom}
        if self.src_layers is not None:
            kw["src_layers"] = list(self.src_layers)
        if self.dst_layers is not None:
            kw["dst_layers"] = list(self.dst_layers)
        if self.skip_prefix:
            kw["skip_prefix"] = self.skip_prefix
        if self.num_tokens is not None:
            kw["num_tokens"] = self.num_tokens
        return kw

    def describe(self) -> str:
        """One line: layouts, geometries, dtype, tokens, layers, skip."""
        layers = "" if self.src_layers is None else f" layers {list(self.src_layers)}->{list(self.dst_layers)}"
        skip = f" skip {self.skip_prefix}" if self.skip_prefix else ""
        return (f"{self.src_layout}[{geometry_label(self.src_geom)}] -> "
                f"{self.dst_layout}[{geometry_label(self.dst_geom)}] {self.dtype} T={self.T}{layers}{skip}")


def _pairable(a: Layout, b: Layout) -> bool:
    return a.planes is None or b.planes is None or a.planes == b.planes


def layout_pairs(kind: str | None = None, *, include_rows: bool = False) -> list[tuple[str, str]]:
    """Every ordered pair of layouts with the same plane count."""
    names = layout_names(kind, include_rows=include_rows)
    return [(a, b) for a in names for b in names if _pairable(get(a), get(b))]


@st.composite
def transfer_cases(draw, src_layout: str | None = None, dst_layout: str | None = None, *,
                   dtype: str | None = None, max_layers: int = 4, max_slots: int = 48,
                   budget: int = DEFAULT_BUDGET // 2, allow_skip: bool = True,
                   allow_positions: bool = True, row_bytes: Sequence[int] | None = None,
                   max_heads: int = 64) -> TransferCase:
    """A source and a destination that can exchange rows, plus layers, slots and skip.

    Both sides have the same plane count and row width ``H * E`` (the head
    split may differ).  Layers are all (when both have the same L) or a subset
    paired in order; a one-layer chunk format takes a single layer.  Slots come
    from :func:`slot_patterns`; chunk layouts may use positions (``None``).
    ``row_bytes``: draw the row ``H * E`` from these byte sizes (those that
    are a whole number of elements and fit ``budget``) and from
    :data:`MLA_ROW_ELEMENTS`, instead of from :data:`ELEMENT_WIDTHS` times a head count.
    """
    if src_layout is None or dst_layout is None:
        pairs = layout_pairs()
        pairs = [(a, b) for a, b in pairs if (src_layout in (None, a)) and (dst_layout in (None, b))]
        src_layout, dst_layout = draw(st.sampled_from(pairs))
    src, dst = get(src_layout), get(dst_layout)
    if not _pairable(src, dst):
        raise ValueError(f"{src.name} has {src.planes} planes, {dst.name} {dst.planes}")
    planes = src.planes or dst.planes or draw(st.sampled_from((1, 2)))
    dtype = dtype or draw(dtypes())

    need_cols = max(column_count(src), column_count(dst))
    if row_bytes is not None:
        itemsize = numpy_dtype(dtype).itemsize
        widths = [b // itemsize for b in row_bytes if b % itemsize == 0] + list(MLA_ROW_ELEMENTS)
        widths = [w for w in widths if w >= max(1, need_cols) and planes * w <= budget] or [max(1, need_cols)]
        width = draw(st.sampled_from(widths))
    else:
        widths = [w for w in ELEMENT_WIDTHS if w >= max(1, need_cols) and planes * w <= budget]
        width = draw(st.sampled_from(widths))
        heads = draw(st.sampled_from([1, 1, 2, 4, 8]))
        if (has_axis(src, "h") or has_axis(dst, "h")) and planes * width * heads <= budget:
            width *= heads
    sg = draw(geometries(src, row_width=width, planes=planes, max_layers=max_layers, max_slots=max_slots,
                         budget=budget, max_heads=max_heads))
    same_l = has_axis(dst, "l") and draw(st.booleans())
    dg = draw(geometries(dst, row_width=width, planes=planes, max_layers=max_layers, max_slots=max_slots,
                         budget=budget, layers=sg.L if same_l else None, max_heads=max_heads))

    # Layers: all (same count) or a subset paired in order.
    if sg.L == dg.L and draw(st.booleans()):
        src_layers = dst_layers = None
    else:
        k = draw(st.integers(1, min(sg.L, dg.L)))
        src_layers = tuple(draw(st.permutations(range(sg.L)))[:k])
        dst_layers = tuple(draw(st.permutations(range(dg.L)))[:k])

    T = draw(st.integers(0, min(sg.N, dg.N, 32)))
    src_slots = dst_slots = None
    num_tokens = None
    use_src_pos = allow_positions and src.chunk and draw(st.booleans())
    use_dst_pos = allow_positions and dst.chunk and draw(st.booleans())
    not_empty = [p for p in SLOT_PATTERNS if p not in ("empty", "one")]
    if not use_src_pos:
        src_slots = draw(slot_patterns(sg.N, sg.BS, T, patterns=not_empty))
        T = len(src_slots)
    if not use_dst_pos:
        dst_slots = draw(slot_patterns(dg.N, dg.BS, T, patterns=not_empty))
        if src_slots is not None:
            # Same length on both sides (a pattern may be shorter when the cache is small).
            T = min(len(src_slots), len(dst_slots))
            src_slots, dst_slots = src_slots[:T], dst_slots[:T]
    if src_slots is None and dst_slots is None:
        num_tokens = T
    skip = draw(st.integers(0, T)) if allow_skip and T and draw(st.booleans()) else 0
    def tup(s):
        return None if s is None else tuple(int(v) for v in s)
    return TransferCase(src.name, sg, dst.name, dg, dtype, tup(src_slots), tup(dst_slots), src_layers,
                        dst_layers, skip, num_tokens, draw(st.integers(0, 2**32 - 1)))


# ---------------------------------------------------------------------------------------
# Move: source/destination slot pairs inside one cache
# ---------------------------------------------------------------------------------------

MOVE_PATTERNS = ("shift", "swap", "rotate", "random", "padded")


@st.composite
def move_slot_pairs(draw, n_slots: int, patterns: Sequence[str] = MOVE_PATTERNS) -> tuple[np.ndarray, np.ndarray]:
    """``(src_slots, dst_slots)`` int64 for a move inside a cache of ``n_slots`` slots.

    Destinations are distinct among the non-negative entries; sources may
    repeat and usually overlap the destinations: ``shift`` (a run moved by
    ``k``, either direction), ``swap`` (two disjoint sets exchanged),
    ``rotate`` (a chain: each slot takes its neighbour's row), ``random``
    (distinct destinations, sources with repeats), ``padded`` (random with
    some pairs -1 on either side).
    """
    kind = draw(st.sampled_from(tuple(patterns)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "shift" and n_slots >= 2:
        k = draw(st.integers(1, n_slots - 1)) * draw(st.sampled_from((1, -1)))
        T = draw(st.integers(1, n_slots - abs(k)))
        start = draw(st.integers(max(0, -k), n_slots - T - max(0, k)))
        src = np.arange(start, start + T)
        return src.astype(np.int64), (src + k).astype(np.int64)
    if kind == "swap" and n_slots >= 2:
        half = draw(st.integers(1, n_slots // 2))
        chosen = rng.choice(n_slots, size=2 * half, replace=False)
        a, b = chosen[:half], chosen[half:]
        return np.concatenate([a, b]).astype(np.int64), np.concatenate([b, a]).astype(np.int64)
    if kind == "rotate" and n_slots >= 2:
        T = draw(st.integers(2, min(n_slots, 32)))
        chain = rng.choice(n_slots, size=T, replace=False)
        return chain.astype(np.int64), np.roll(chain, 1).astype(np.int64)
    T = draw(st.integers(0, min(n_slots, 32)))
    dst = rng.choice(n_slots, size=T, replace=False).astype(np.int64)
    src = rng.integers(0, n_slots, size=T).astype(np.int64)
    if kind == "padded" and T:
        src[rng.random(T) < 0.25] = -1
        dst[rng.random(T) < 0.25] = -1
    return src, dst
