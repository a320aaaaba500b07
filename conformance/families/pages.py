"""The ``pages`` family: a page as flat data, and its contiguous spans for zero-copy I/O.

``get_page`` (and ``dummy_flat_page``), ``set_page`` from random flat bytes,
``zero_page``, and ``page_spans`` / ``page_buffer_meta``: the spans name
exactly the bytes of the pages in the layout's byte order (read back through
the tensors' storage, and through the raw pointer on the CPU).

References: ``kvlayout.reference.get_page`` / ``set_page`` / ``zero_page`` /
``page_spans``.
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import torch
from hypothesis import strategies as st

from kvlayout import ops
from kvlayout.reference.layouts import Geometry, get

from .. import strategies as S
from . import core
from .core import OnOneCache, OpFamily, assert_same, bind, flat, random_array, reference, sync, tensor
from .rows import layouts_of

PAGE_OPS = ("get_page", "set_page", "zero_page", "page_spans")


def storage_bytes(t: torch.Tensor, offset: int, length: int) -> np.ndarray:
    """``length`` bytes at ``offset`` from ``t.data_ptr()``, read through the storage (any device)."""
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    start = t.data_ptr() - t.untyped_storage().data_ptr() + offset
    return raw[start:start + length].cpu().numpy()


@dataclasses.dataclass(frozen=True)
class PageSample(OnOneCache):
    """One page helper (``op``) on a cache holding random bytes; ``pages`` has one page except for spans."""

    layout: str
    geom: Geometry
    dtype: str
    op: str
    pages: tuple[int, ...]
    seed: int = 0
    fill: str = "random"       # or "nan": the cache, and set_page's flat data, every NaN pattern (S.NAN_DTYPES)
    family = "pages"

    def describe(self) -> str:
        fill = " NaN patterns" if self.fill == "nan" else ""
        return f"{self.op} {self.layout}[{S.geometry_label(self.geom)}] {self.dtype}{fill} pages={list(self.pages)}"

    def run(self, device: str) -> None:
        g, layout = self.geom, self.layout
        page_size = None if get(layout).paged else g.BS
        cache_np = (S.nan_cache(layout, g, self.dtype) if self.fill == "nan"
                    else S.random_cache(layout, g, self.dtype, np.random.default_rng(self.seed)))
        cache = bind(layout, cache_np, g, device)
        p = self.pages[0]
        if self.op == "get_page":
            want = reference.get_page(layout, cache_np, p, page_size=page_size)
            assert_same(ops.get_page(cache, p), want, "page data")
            dummy = ops.dummy_flat_page(cache)
            assert dummy.shape == (want.size,) and dummy.dtype == cache.dtype and not dummy.view(torch.uint8).any()
        elif self.op == "set_page":
            size = g.P * g.L * g.BS * g.H * g.E
            flat_np = (S.nan_patterns(self.dtype, size)[::-1].copy() if self.fill == "nan"
                       else random_array((size,), self.dtype, self.seed + 1))
            ops.set_page(cache, p, tensor(flat_np, device))
            sync(device)
            want = reference.set_page(layout, cache_np, p, flat_np, page_size=page_size)
            assert_same(cache.tensors, flat(layout, want), "cache")
        elif self.op == "zero_page":
            ops.zero_page(cache, p)
            sync(device)
            assert_same(cache.tensors, flat(layout, reference.zero_page(layout, cache_np, p, page_size=page_size)),
                        "cache")
        else:
            self._check_spans(cache, cache_np, page_size)

    def _check_spans(self, cache, cache_np, page_size) -> None:
        got = ops.page_spans(cache, list(self.pages))
        want = [tuple(int(v) for v in s) for s in reference.page_spans(self.layout, self.geom, list(self.pages),
                                                                       cache.itemsize)]
        assert got == want, f"page_spans: got {got}, expected {want}"
        pointers, lengths = ops.page_buffer_meta(cache, list(self.pages))
        assert pointers == [cache.tensors[i].data_ptr() + o for i, o, _ in want], "page_buffer_meta pointers"
        assert lengths == [n for _, _, n in want], "page_buffer_meta lengths"
        # the spans hold exactly the pages' bytes, in order
        spans = [storage_bytes(cache.tensors[i], o, n) for i, o, n in want]
        for (i, o, n), ptr, data in zip(want, pointers, spans):
            if cache.tensors[i].device.type == "cpu":
                assert ctypes.string_at(ptr, n) == data.tobytes(), "bytes at the span's pointer"
        pages = b"".join(np.ascontiguousarray(reference.get_page(self.layout, cache_np, q, page_size=page_size))
                         .tobytes() for q in self.pages)
        assert b"".join(d.tobytes() for d in spans) == pages, "the spans do not hold the pages' bytes"


@st.composite
def page_samples(draw, device: str, group: str | None = None, *, layout: str | None = None, op: str | None = None):
    """Page samples: any layout (of ``group``) and helper, or the given ``layout`` and ``op``."""
    layout = layout or draw(st.sampled_from(layouts_of(group)))
    geom = draw(S.geometries(layout, max_layers=8, max_slots=64, budget=1 << 13))
    op = op or draw(st.sampled_from(PAGE_OPS))
    if op == "page_spans":
        pages = tuple(draw(st.lists(st.integers(0, geom.NB - 1), min_size=1, max_size=3)))
    else:
        pages = (draw(st.integers(0, geom.NB - 1)),)
    dtype = draw(S.dtypes())
    fill = draw(st.sampled_from(("random", "random", "nan"))) if dtype in S.NAN_DTYPES else "random"
    return PageSample(layout, geom, dtype, op, pages, draw(st.integers(0, 2**32 - 1)), fill)


PAGES = OpFamily("pages", "page helpers: get_page, set_page, zero_page, page_spans/page_buffer_meta",
                 page_samples, "get_page, set_page, zero_page, page_spans")
SAMPLES = (PageSample,)


# ---------------------------------------------------------------------------------------
# Error inputs, as data (on the destination of a valid transfer case)
# ---------------------------------------------------------------------------------------

def _page_call(make_call):
    """A page helper on the case's destination: ``make_call(dst, sample, device)`` returns the invalid call and
    what the message must say."""
    def build(b, device, validate):
        s = core.BadSetup.of(b.case, device, validate)
        call, values = make_call(s.dst, b, device)
        return core.Invalid(call, s.dst_unchanged(), values=values)
    return build


PAGE_HELPERS = {
    "get_page": lambda dst, page: ops.get_page(dst, page),
    "zero_page": lambda dst, page: ops.zero_page(dst, page),
    "set_page": lambda dst, page: ops.set_page(dst, page, ops.dummy_flat_page(dst)),
    "page_spans": lambda dst, page: ops.page_spans(dst, [0, page]),
}
"""Every helper that takes a page index, as a call of (cache, page)."""


def _page_out_of_range(helper: str, past_the_end: bool):
    def make(dst, b, device):
        count = b.case.dst_geom.NB
        page = count + b.offset if past_the_end else -1 - b.offset
        return (lambda: PAGE_HELPERS[helper](dst, page)), {"value": page, "count": count}
    return make


def _flat_page(size_change: int = 0, shape=None, other_dtype: bool = False):
    """``set_page`` from a flat page ``size_change`` elements longer, of ``shape``, or of another element size."""
    def make(dst, b, device):
        n = ops.dummy_flat_page(dst).numel()
        dtype = (torch.float32 if dst.itemsize != 4 else torch.float16) if other_dtype else dst.dtype
        flat_page = torch.zeros(n + size_change, dtype=dtype, device=device)
        if shape is not None:
            flat_page = flat_page.view(*shape, -1)
        return (lambda: ops.set_page(dst, 0, flat_page)), {"n": n, "shape": tuple(flat_page.shape),
                                                          "flat": flat_page.dtype, "cache": dst.dtype}
    return make


FLAT_PAGE_MESSAGE = r"flat must be 1-D with {n} elements \(one page\), got shape {shape}"

PAGES = dataclasses.replace(PAGES, errors=(
    *(core.ErrorKind(f"pages: {helper} of a page {where}", "page_out_of_range",
                     r"page = {value} is out of range: the cache holds {count} pages",
                     _page_call(_page_out_of_range(helper, where == "past the end")))
      for helper in PAGE_HELPERS for where in ("past the end", "below 0")),
    core.ErrorKind("pages: flat page of the wrong size", "flat_page_size", FLAT_PAGE_MESSAGE,
                   _page_call(_flat_page(size_change=1))),
    core.ErrorKind("pages: flat page not 1-D", "flat_page_size", FLAT_PAGE_MESSAGE, _page_call(_flat_page(shape=(1,)))),
    core.ErrorKind("pages: flat page of another element size", "element_type", r"flat has {flat}, the cache {cache}",
                   _page_call(_flat_page(other_dtype=True))),
))
