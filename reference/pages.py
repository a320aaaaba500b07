"""Page helpers (SGLang HiCache): a page as flat data, and its byte spans.

A *page* is the ``BS`` consecutive slots ``page*BS .. page*BS + BS - 1`` of
every layer and plane.  Its *flat data* is every physical element whose slot
lies in the page, taken tensor by tensor (part order, then layer order) and,
inside a tensor, in memory (row-major) order: exactly the bytes an engine
would write to storage for that page.

The rule is computed from a *slot map*: the physical cache filled with the
slot number of each element (``from_logical`` of an array whose every element
is its own slot), so it holds for any layout without a per-layout formula.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from . import semantics as rules
from .layouts import Geometry, Layout, get
from .logical import Physical, flat_arrays, from_logical, from_parts, geometry_of, parts_of
from .operations import as_bits, from_bits


def slot_map(layout: Layout | str, geom: Geometry) -> list[np.ndarray]:
    """For every physical array (in ``flat_arrays`` order): the slot of each element."""
    slots = np.broadcast_to(np.arange(geom.N).reshape(1, 1, geom.N, 1, 1), (geom.P, geom.L, geom.N, geom.H, geom.E))
    physical = from_logical(layout, jnp.asarray(slots, dtype=jnp.int32), geom)
    return [np.asarray(x) for x in flat_arrays(layout, physical)]


def _check_page(page, geom: Geometry) -> int:
    """``page`` as an int in ``[0, NB)`` (rules ``integer_argument`` and ``page_out_of_range``)."""
    if isinstance(page, (bool, np.bool_)) or not isinstance(page, (int, np.integer)):
        rules.INTEGER_ARGUMENT.fail(f"page must be an integer, got {type(page).__name__} {page!r}")
    if not 0 <= page < geom.NB:
        rules.PAGE_OUT_OF_RANGE.fail(f"page = {page} is out of range: the cache holds {geom.NB} pages")
    return int(page)


def _page_masks(layout, geom: Geometry, page: int) -> list[np.ndarray]:
    page = _check_page(page, geom)
    return [(m // geom.BS) == page for m in slot_map(layout, geom)]


def get_page(layout: Layout | str, cache: Physical, page: int, *, page_size: int | None = None) -> jnp.ndarray:
    """The page's flat data, ``[P * L * BS * H * E]`` in the layout's byte order."""
    geom = geometry_of(layout, cache, page_size)
    masks = _page_masks(layout, geom, page)
    arrays = flat_arrays(layout, cache)
    dtype = jnp.asarray(arrays[0]).dtype
    return from_bits(jnp.concatenate([as_bits(x).reshape(-1)[np.flatnonzero(m)] for x, m in zip(arrays, masks)]),
                     dtype)


def set_page(layout: Layout | str, cache: Physical, page: int, flat, *, page_size: int | None = None) -> Physical:
    """Cache with the page replaced by ``flat`` (as returned by ``get_page``)."""
    layout = get(layout)
    geom = geometry_of(layout, cache, page_size)
    masks = _page_masks(layout, geom, page)
    # Only bits are sliced and scattered: a float conversion (even to the same
    # dtype) may rewrite NaN payloads, and the page's bytes must land as given.
    flat_bits = as_bits(flat).reshape(-1)
    need = sum(int(m.sum()) for m in masks)
    if jnp.ndim(flat) != 1 or flat_bits.shape[0] != need:
        rules.FLAT_PAGE_SIZE.fail(f"flat must be 1-D with {need} elements (one page), got shape {jnp.shape(flat)}")
    out, start = [], 0
    for x, m in zip(flat_arrays(layout, cache), masks):
        x = jnp.asarray(x)
        if jnp.dtype(flat_bits.dtype).itemsize != x.dtype.itemsize:
            rules.ELEMENT_TYPE.fail(f"flat has {flat_bits.dtype.itemsize}-byte elements, the cache {x.dtype}")
        idx = np.flatnonzero(m)
        bits = as_bits(x).reshape(-1).at[idx].set(flat_bits[start:start + idx.size])
        out.append(from_bits(bits, x.dtype).reshape(x.shape))
        start += idx.size
    return _rebuild(layout, cache, out)


def zero_page(layout: Layout | str, cache: Physical, page: int, *, page_size: int | None = None) -> Physical:
    """Cache with every element of the page set to zero bits."""
    geom = geometry_of(layout, cache, page_size)
    dtype = flat_arrays(layout, cache)[0].dtype
    size = sum(int(m.sum()) for m in _page_masks(layout, geom, page))
    return set_page(layout, cache, page, jnp.zeros(size, dtype), page_size=page_size)


def page_spans(layout: Layout | str, geom: Geometry, pages, itemsize: int) -> list[tuple[int, int, int]]:
    """SGLang ``get_page_buffer_meta``: contiguous byte spans holding the pages.

    Returns ``(array index, byte offset, byte length)`` per maximal run of
    consecutive elements that belong to the page, page by page in the order
    given, arrays in ``flat_arrays`` order, runs in memory order (runs are
    not merged across pages).  Offsets are from the start of each (contiguous)
    array.
    """
    maps = slot_map(layout, geom)
    spans = []
    for page in pages:
        page = _check_page(page, geom)
        for index, m in enumerate(maps):
            inside = np.concatenate([[False], (m.reshape(-1) // geom.BS) == page, [False]])
            edges = np.flatnonzero(np.diff(inside.astype(np.int8)))
            for begin, end in zip(edges[::2], edges[1::2]):
                spans.append((index, int(begin) * itemsize, int(end - begin) * itemsize))
    return spans


def _rebuild(layout, cache, arrays: list) -> Physical:
    """Physical value with the same structure as ``cache`` holding ``arrays``."""
    layout = get(layout)
    it = iter(arrays)
    out = []
    for part, value in zip(layout.parts, parts_of(layout, cache)):
        out.append([next(it) for _ in value] if part.per_layer else next(it))
    return from_parts(layout, out)
