"""Page helpers on torch tensors (SGLang HiCache): same rules as ``reference.pages``.

A page is the slots ``page*BS .. page*BS + BS - 1`` of every layer and plane.
Its flat data is every element of the page, tensor by tensor (part order,
then layer order) and, inside a tensor, in memory order.  All of it is views
and ``copy_``: a page of a page-first host pool is one or two contiguous
spans, which :func:`page_spans` lists for zero-copy I/O.
"""

from __future__ import annotations

import torch

from kvlayout.reference import semantics as rules

from .views import KVCache, as_int


def _page_views(cache: KVCache, page: int) -> list[torch.Tensor]:
    """Per tensor: a view of the page's elements with dims in memory order (largest stride first)."""
    g = cache.geometry
    page = as_int("page", page)
    if not 0 <= page < g.NB:
        rules.PAGE_OUT_OF_RANGE.fail(f"page = {page} is out of range: the cache holds {g.NB} pages")
    views = []
    for pv in cache.parts:
        toks = pv.part.pattern.split()
        for t in pv.tensors:
            if "n" in toks:
                dim = toks.index("n")
                t = t.unflatten(dim, (g.NB, g.BS))
                names = toks[:dim] + ["nb", "bs"] + toks[dim + 1:]
            else:
                names = toks
            if "nb" in names:
                t = t.select(names.index("nb"), page)
            elif page != 0:
                rules.PAGE_OUT_OF_RANGE.fail(f"page = {page}: {cache.layout.name} has no page axis")
            views.append(t.permute(_memory_order(t)))
    return views


def _memory_order(t: torch.Tensor) -> list[int]:
    """Dims by decreasing stride, ties in dim order (a stable insertion sort: explicit comparisons
    trace with symbolic strides, where sorted() with a key does not)."""
    order = list(range(t.dim()))
    for i in range(1, len(order)):
        j = i
        while j > 0 and t.stride(order[j - 1]) < t.stride(order[j]):
            order[j - 1], order[j] = order[j], order[j - 1]
            j -= 1
    return order


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The same elements as integers of their size: copies of these keep every bit (float copies
    may rewrite NaN payloads, e.g. fp8 on CUDA)."""
    raw = _RAW.get(t.element_size())
    if raw is None:
        raise TypeError(f"cache dtype {t.dtype} has {t.element_size()}-byte elements; get_page/set_page copy "
                        f"raw elements of {', '.join(map(str, _RAW))} bytes")
    return t.view(raw)


def get_page(cache: KVCache, page: int) -> torch.Tensor:
    """The page's flat data ``[P * L * BS * H * E]`` in the layout's byte order (a new tensor)."""
    return torch.cat([_raw(v).reshape(-1) for v in _page_views(cache, page)]).view(cache.dtype)


def set_page(cache: KVCache, page: int, flat: torch.Tensor) -> None:
    """Write ``flat`` (as returned by :func:`get_page`) into the page, in place."""
    views = _page_views(cache, page)
    need = sum(v.numel() for v in views)
    if flat.dim() != 1 or flat.numel() != need:
        rules.FLAT_PAGE_SIZE.fail(f"flat must be 1-D with {need} elements (one page), got shape {tuple(flat.shape)}")
    if flat.element_size() != cache.itemsize:
        rules.ELEMENT_TYPE.fail(f"flat has {flat.dtype}, the cache {cache.dtype}")
    flat = flat.view(cache.dtype) if flat.dtype != cache.dtype else flat
    start = 0
    for v in views:
        _raw(v).copy_(_raw(flat[start:start + v.numel()]).view(v.shape))
        start += v.numel()


def zero_page(cache: KVCache, page: int) -> None:
    """Set every element of the page to zero bits, in place."""
    for v in _page_views(cache, page):
        v.zero_()


def dummy_flat_page(cache: KVCache, device=None) -> torch.Tensor:
    """A zero flat page of the right size and dtype (SGLang ``get_dummy_flat_data_page``)."""
    g = cache.geometry
    return torch.zeros(g.P * g.L * g.BS * g.H * g.E, dtype=cache.dtype, device=device or cache.device)


def page_spans(cache: KVCache, pages) -> list[tuple[int, int, int]]:
    """Contiguous ``(tensor index, byte offset, byte length)`` spans holding the pages.

    Same order and merging rule as ``reference.page_spans``: page by page,
    tensors in order, maximal runs in memory order; offsets from each tensor's
    first element.
    """
    spans = []
    isz = cache.itemsize
    pages = [as_int(f"pages[{i}]", p) for i, p in enumerate(pages)]
    for page in pages:
        first = len(spans)   # runs are merged within a page, never across pages
        for index, (tensor, view) in enumerate(zip(cache.tensors, _page_views(cache, page))):
            base = tensor.storage_offset()
            for start, length in _runs(view):
                offset = (view.storage_offset() - base + start) * isz
                if len(spans) > first and spans[-1][0] == index and spans[-1][1] + spans[-1][2] == offset:
                    index_, off_, len_ = spans.pop()
                    spans.append((index_, off_, len_ + length * isz))
                else:
                    spans.append((index, offset, length * isz))
    return spans


def _runs(view: torch.Tensor) -> list[tuple[int, int]]:
    """(element offset, element count) of the maximal contiguous runs of a view, in memory order."""
    dims = [(s, st) for s, st in zip(view.shape, view.stride()) if s != 1]
    inner, expected = 1, 1
    while dims and dims[-1][1] == expected:
        size, _ = dims.pop()
        inner *= size
        expected *= size
    offsets = [0]
    for size, stride in dims:
        offsets = [o + i * stride for o in offsets for i in range(size)]
    return [(o, inner) for o in offsets]


def page_buffer_meta(cache: KVCache, pages) -> tuple[list[int], list[int]]:
    """SGLang ``get_page_buffer_meta``: (pointers, byte lengths) of the pages' contiguous spans."""
    spans = page_spans(cache, pages)
    return ([cache.tensors[i].data_ptr() + off for i, off, _ in spans], [n for _, _, n in spans])
