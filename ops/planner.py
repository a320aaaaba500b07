"""The planner: two caches' layouts and a choice of layers and planes -> a copy program.

A copy program (``torch_ext/program.h``) is the one form that crosses from
Python to C++.  It is free of the token count and of every size and stride:

* each tensor of a cache is described by *where* its canonical axes are
  (:class:`CacheSpec.tensor_axes`: the dimension of its plane, layer, page,
  slot-in-page and head axes), so the native side reads the slot count,
  the page size and every stride from the tensor it is bound to;
* every byte quantity of a launch (a segment's base, the stride between a
  row's pieces) is a :data:`StrideSum`: element counts of the tensor's plane,
  layer and head strides plus a constant.

So a chunk of any length T (whose strides follow from T) runs the same program,
a program is registered once per layout pair and choice, and compiled code
keeps one graph for every T.  The planner itself needs only a
:class:`CacheSpec` of each side: layout, P, L, H, E and which parts' heads are
apart, all hashable, none of them T.

Steps: step 0 moves every chosen layer; step ``1 + i`` only the ``i``-th.
A launch is ``(num_pieces, piece_elems, src_side, dst_side)`` and a side is
``(piece_stride, [(tensor index, offset), ...])``, the tensor index counting
in the cache's flat tensor list (:attr:`KVCache.tensors`).
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Sequence

import torch

from .views import KVCache

# (plane, layer, head, constant): plane * stride(p) + layer * stride(l) + head * stride(h) + constant elements
StrideSum = tuple
ZERO: StrideSum = (0, 0, 0, 0)
HEAD_STRIDE: StrideSum = (0, 0, 1, 0)

# Where a tensor keeps its axes: tensor dimensions of (plane, layer, page, in_page, head), -1 when absent;
# in_page is the flat slot axis when page is -1.
_AXIS_SLOT = {"p": 0, "l": 1, "nb": 2, "bs": 3, "n": 3, "h": 4}


class PartSpec(NamedTuple):
    """What the planner needs of one part of a cache (hashable, free of T)."""

    name: str
    per_layer: bool
    plane: int | None         # the part holds only this plane
    column_start: int         # first logical column (of E) the part holds
    heads: int
    head_width: int           # elements of one head this part holds
    heads_contiguous: bool    # the row's heads follow each other in memory
    stride_class: int         # parts of one class share slot and head strides (one launch may mix them)
    axes: tuple               # tensor dimensions of (plane, layer, page, in_page, head)
    first_tensor: int         # index of the part's first tensor in the cache's flat tensor list
    num_tensors: int


class CacheSpec(NamedTuple):
    """A bound cache as the planner sees it: layout, P, L, H, E and its parts (no T, no strides)."""

    layout: str
    P: int
    L: int
    row_width: int            # H * E
    parts: tuple

    def part_for(self, plane: int) -> list:
        """The parts holding ``plane`` (several when the row is split into column parts)."""
        return [p for p in self.parts if p.plane in (None, plane)]

    def tensor_axes(self) -> list:
        """The axes of every tensor of the cache's flat tensor list."""
        return [p.axes for p in self.parts for _ in range(p.num_tensors)]


def _static(value) -> int:
    """A size the program may depend on, as a plain int (compiled code specializes on it; never T)."""
    return operator.index(value)


def _same(a, b) -> bool:
    # (written so that compiled code turns a symbolic comparison into a guard and a constant)
    return True if a == b else False


def cache_spec(cache: KVCache) -> CacheSpec:
    """The :class:`CacheSpec` of a bound cache (made once per :class:`~kvlayout.ops.views.CacheShape`)."""
    if torch.compiler.is_compiling():
        return _cache_spec(cache)   # (a memo filled while tracing would be a change the graph's guards see)
    shape = cache._shape
    if shape.spec is None:
        shape.spec = _cache_spec(cache)
    return shape.spec


def _cache_spec(cache: KVCache) -> CacheSpec:
    g = cache.geometry
    parts, first = [], 0
    slot_strides = []
    for pv in cache.parts:
        axes = [-1] * 5
        for dim, tok in enumerate(pv.part.pattern.split()):
            if tok in _AXIS_SLOT:
                axes[_AXIS_SLOT[tok]] = dim
        strides = (pv.strides["nb"], pv.strides["bs"], pv.strides["h"])
        stride_class = next((i for i, other in enumerate(slot_strides)
                             if all(_same(x, y) for x, y in zip(other, strides))), len(slot_strides))
        slot_strides.append(strides)
        heads = _static(pv.heads)
        width = _static(pv.head_width)
        contiguous = True if heads == 1 or pv.strides["h"] == width else False
        count = len(pv.tensors)
        parts.append(PartSpec(pv.part.name, pv.part.per_layer, pv.part.plane, _static(pv.column_start), heads,
                              width, contiguous, stride_class, tuple(axes), first, count))
        first += count
    return CacheSpec(cache.layout.name, _static(g.P), _static(g.L), _static(cache.row_width), tuple(parts))


def _pieces(src: PartSpec, dst: PartSpec, width: int) -> tuple[int, int, StrideSum, StrideSum]:
    """How a row of ``width`` elements splits into pieces on both sides.

    Returns ``(num_pieces, piece_elems, src_piece_stride, dst_piece_stride)``:
    one piece when both rows are contiguous; else one piece per head of the
    side whose heads are apart (a contiguous row can be cut anywhere).
    """
    if src.heads_contiguous and dst.heads_contiguous:
        return 1, width, ZERO, ZERO
    if not src.heads_contiguous and not dst.heads_contiguous:
        if (src.heads, src.head_width) != (dst.heads, dst.head_width):   # _head_cuts cuts such rows at heads
            raise ValueError(f"row structures differ: source {src.heads} heads x {src.head_width}, "
                             f"destination {dst.heads} heads x {dst.head_width}, both strided")
        return src.heads, src.head_width, HEAD_STRIDE, HEAD_STRIDE
    apart = dst if src.heads_contiguous else src
    piece = apart.head_width
    packed = (0, 0, 0, piece)
    if src.heads_contiguous:
        return apart.heads, piece, packed, HEAD_STRIDE
    return apart.heads, piece, HEAD_STRIDE, packed


def _column_blocks(cache: CacheSpec, plane: int) -> list[tuple[int, int, PartSpec]]:
    """``(start, width, part)`` blocks of the flattened row ``(h e)`` for one plane."""
    parts = cache.part_for(plane)
    if len(parts) == 1:
        return [(0, cache.row_width, parts[0])]
    for p in parts:
        if not p.heads_contiguous:
            raise ValueError(f"{cache.layout}: column parts need contiguous rows")
    return [(p.column_start * p.heads, p.heads * p.head_width, p) for p in parts]


def _head_cuts(src: PartSpec, dst: PartSpec, width: int) -> set[int]:
    """Head boundaries of both rows when both have their heads apart with different splits.

    Such rows have no common piece stride; cut at every head boundary of
    either side, each block then lies inside one head on both sides.
    """
    if src.heads_contiguous or dst.heads_contiguous or (src.heads, src.head_width) == (dst.heads, dst.head_width):
        return set()
    return set(range(0, width, src.head_width)) | set(range(0, width, dst.head_width))


def _segment(part: PartSpec, plane: int, layer: int, column: int) -> tuple[int, StrideSum]:
    """``(tensor index, offset)`` of the rows of (plane, layer) of ``part``, from column ``column`` of its row."""
    head, e = divmod(column, part.head_width)
    tensor = part.first_tensor + (layer if part.per_layer else 0)
    return tensor, (plane if part.plane is None else 0, 0 if part.per_layer else layer, head, e)


def launches(src: CacheSpec, dst: CacheSpec, src_layers: Sequence[int], dst_layers: Sequence[int],
             src_planes: Sequence[int], dst_planes: Sequence[int]) -> list[tuple]:
    """The launches copying the chosen (plane, layer) rows of ``src`` into ``dst``: one per row geometry."""
    groups: dict[tuple, tuple] = {}
    for ps, pd in zip(src_planes, dst_planes):
        src_blocks, dst_blocks = _column_blocks(src, ps), _column_blocks(dst, pd)
        cuts = {b[0] for b in src_blocks} | {b[0] for b in dst_blocks} | {src.row_width}
        if len(src_blocks) == len(dst_blocks) == 1:
            cuts |= _head_cuts(src_blocks[0][2], dst_blocks[0][2], src.row_width)
        cuts = sorted(cuts)
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            s_start, _, s_part = next(b for b in src_blocks if b[0] <= lo < b[0] + b[1])
            d_start, _, d_part = next(b for b in dst_blocks if b[0] <= lo < b[0] + b[1])
            if len(cuts) > 2:   # a split row: each block is contiguous on both sides
                pieces, piece, s_stride, d_stride = 1, hi - lo, ZERO, ZERO
            else:
                pieces, piece, s_stride, d_stride = _pieces(s_part, d_part, hi - lo)
            key = (s_part.stride_class, s_stride, d_part.stride_class, d_stride, pieces, piece)
            launch = groups.get(key)
            if launch is None:
                launch = groups[key] = (pieces, piece, (s_stride, []), (d_stride, []))
            for ls, ld in zip(src_layers, dst_layers):
                launch[2][1].append(_segment(s_part, ps, ls, lo - s_start))
                launch[3][1].append(_segment(d_part, pd, ld, lo - d_start))
    return list(groups.values())


def program_steps(src: CacheSpec, dst: CacheSpec, src_layers: Sequence[int], dst_layers: Sequence[int],
                  src_planes: Sequence[int], dst_planes: Sequence[int]) -> list[list[tuple]]:
    """The program's steps: all chosen layers, then one step per chosen layer."""
    steps = [launches(src, dst, src_layers, dst_layers, src_planes, dst_planes)]
    steps += [launches(src, dst, [ls], [ld], src_planes, dst_planes) for ls, ld in zip(src_layers, dst_layers)]
    return steps


def tensors_of(cache: CacheSpec, layers: Sequence[int], planes: Sequence[int]) -> set[int]:
    """Indices (in the cache's flat tensor list) of the tensors holding these layers and planes."""
    return {p.first_tensor + (layer if p.per_layer else 0)
            for p in cache.parts if p.plane is None or p.plane in planes for layer in layers}
