"""Bind an engine's tensors to a catalog layout: geometry and byte strides, no copy.

A :class:`KVCache` is the engine's own tensors (a list of per-layer tensors, K
and V lists, one cross-layer tensor, a chunk, a host pool) plus the layout
they follow.  Binding reads shapes and strides only: a permuted view (vLLM
hands out NHD-shaped views of HND memory) binds as is, because every address
is computed from its strides.

Each part of a layout is reduced to the canonical axes ``p l nb bs h e``; the
address of a row piece is then, for every layout,

    base(part, layer, plane) + (slot // BS) * stride[nb] + (slot % BS) * stride[bs] + head * stride[h]

which is the formula of ``torch_ext/include/kvlayout/address.h``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
import threading

import torch

from kvlayout import _C
from kvlayout.reference import semantics as rules
from kvlayout.reference.layouts import AXES, Geometry, Layout, Part, get, infer_geometry

from . import _native
from .locks import fork_safe
from .settings import environment_capacity

INTEGER_STORAGE = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}


@dataclasses.dataclass(frozen=True)
class PartView:
    """One part of a bound cache: its tensors and element strides per canonical axis."""

    part: Part
    tensors: tuple[torch.Tensor, ...]        # one, or one per layer
    strides: dict                            # canonical axis -> stride in elements (0 for absent axes)
    heads: int                               # H
    head_width: int                          # elements of one head this part holds (E, or a column block)
    column_start: int                        # first logical column (of E) the part holds

    def tensor_and_offset(self, plane: int, layer: int) -> tuple[torch.Tensor, int]:
        """The tensor holding (plane, layer) and the element offset of its slot 0, head 0."""
        if self.part.per_layer:
            tensor, offset = self.tensors[layer], 0
        else:
            tensor, offset = self.tensors[0], layer * self.strides["l"]
        if self.part.plane is None:
            offset += plane * self.strides["p"]
        return tensor, offset

    @property
    def heads_contiguous(self) -> bool:
        """The row's heads follow each other in memory (one run of ``H * E`` elements)."""
        return self.heads == 1 or self.strides["h"] == self.head_width


@dataclasses.dataclass(frozen=True)
class PartShape:
    """What binding finds of one part, apart from its tensors (see :class:`PartView`)."""

    part: Part
    strides: dict
    heads: int
    head_width: int
    column_start: int


class CacheShape:
    """What binding derives from a cache's tensors: layout, geometry, element type, device, part strides.

    It depends on the tensors' sizes, strides, element type and device only, never on their data, so
    every cache bound to tensors of one structure shares it (:data:`SHAPES`): an engine that binds fresh
    views of its buffers call after call (``ops.gather(cache, slots, out=buf)``, the compat entry points)
    finds its shape by one lookup, and the transfers of a known pair of shapes find their checked
    arguments and copy program by another (``choices``, see ``ops.arguments.checked_choice``).  Holds no
    tensor.
    """

    __slots__ = ("layout", "geometry", "dtype", "device", "itemsize", "parts", "spec", "choices", "serial")
    _serials = itertools.count(1)

    def __init__(self, layout: Layout, parts: list, flat: list, page_size: int | None):
        shapes = [[tuple(t.shape) for t in value] if part.per_layer else tuple(value.shape)
                  for part, value in zip(layout.parts, parts)]
        self.layout = layout
        self.geometry: Geometry = infer_geometry(layout, shapes, page_size=page_size)
        for i, t in enumerate(flat):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{layout.name}: tensor {i} is a {type(t).__name__}, not a torch.Tensor")
        first = flat[0]
        for i, t in enumerate(flat):
            if t.dtype != first.dtype:
                rules.ELEMENT_TYPE.fail(f"{layout.name}: tensor {i} has dtype {t.dtype}, tensor 0 has {first.dtype}")
            if t.device != first.device:
                rules.DEVICES.fail(f"{layout.name}: tensor {i} is on {t.device}, tensor 0 on {first.device}")
        self.dtype: torch.dtype = first.dtype
        self.device: torch.device = first.device
        self.itemsize: int = first.element_size()
        self.parts: tuple[PartShape, ...] = tuple(self._part_shape(p, v) for p, v in zip(layout.parts, parts))
        self.spec = None        # the planner's CacheSpec, made on first use (ops.planner.cache_spec)
        self.choices: dict = {}  # (destination shape's serial, choice) -> checked arguments (arguments.py)
        # a key that outlives no shape (serials are never reused); none for a shape bound while tracing, which
        # nothing remembers (and whose count the graph's guards would see)
        self.serial = 0 if torch.compiler.is_compiling() else next(self._serials)

    def _part_shape(self, part: Part, value) -> PartShape:
        tensors = tuple(value) if part.per_layer else (value,)
        geom = self.geometry
        sizes = geom.part_sizes(part)
        ref = tensors[0]
        strides = {axis: 0 for axis in AXES}
        for dim, tok in enumerate(part.pattern.split()):
            if tok == "n":
                strides["bs"] = ref.stride(dim)
                strides["nb"] = ref.stride(dim) * geom.BS
            else:
                strides[tok] = ref.stride(dim)
        for i, t in enumerate(tensors):
            if t.stride() != ref.stride():
                rules.LAYOUT_SHAPE.fail(f"{self.layout.name}: part {part.name!r} layer {i} has strides "
                                        f"{t.stride()}, layer 0 has {ref.stride()}")
        if sizes["e"] > 1 and strides["e"] != 1 and ref.numel():   # (an empty tensor has no layout)
            rules.LAYOUT_SHAPE.fail(f"{self.layout.name}: part {part.name!r} needs contiguous elements "
                                    f"(stride 1 on the last axis), got strides {ref.stride()}")
        start = sum(geom.columns[:part.column]) if part.column is not None else 0
        if part.column is not None and sizes["h"] != 1:
            rules.LAYOUT_SHAPE.fail(f"{self.layout.name}: a row split into column parts must have one head, "
                                    f"got H = {sizes['h']}")
        return PartShape(part, strides, sizes["h"], sizes["e"], start)


class _ShapeCache:
    """The shapes of recent bindings by their exact structure (least recently used first out; threads bind at
    once)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = fork_safe(threading.Lock())

    def get(self, key) -> CacheShape | None:
        with self._lock:
            shape = self.entries.get(key)
            if shape is not None:
                self.entries.move_to_end(key)
            return shape

    def put(self, key, shape: CacheShape) -> None:
        with self._lock:
            self.entries[key] = shape
            self._trim()

    def set_capacity(self, capacity: int) -> None:
        if type(capacity) is not int or capacity < 1:
            raise ValueError(f"the shape cache capacity must be a positive int, got {capacity!r}")
        with self._lock:
            self.capacity = capacity
            self._trim()

    def _trim(self) -> None:
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)


SHAPES = _ShapeCache(environment_capacity("KVLAYOUT_SHAPE_CACHE", 256))


class KVCache:
    """Tensors bound to a layout.

    ``layout``: a catalog name or :class:`~kvlayout.reference.layouts.Layout`.
    ``tensors``: the physical value in the reference's convention: the part
    itself for one-part layouts (a tensor, or a list of per-layer tensors), a
    tuple of parts otherwise (SGLang MHA: ``(k_list, v_list)``).
    ``page_size``: only for layouts whose slot axis is flat (SGLang pools,
    HiCache ``layer_first``/``page_first``), where the shape cannot tell it;
    it matters to page helpers only.

    Attributes: ``geometry`` (P, L, NB, BS, H, E), ``dtype``, ``device``,
    ``tensors`` (every tensor, part by part and layer by layer), ``parts``
    (:class:`PartView` per part), ``value`` (the tensors as bound).

    Binding tensors of a structure bound before (sizes, strides, element
    type, device, page size) reuses that binding's :class:`CacheShape`.
    """

    def __init__(self, layout: Layout | str, tensors, *, page_size: int | None = None):
        layout = get(layout)
        if page_size is not None:
            page_size = as_int("page_size", page_size, lo=1)
        parts = self._split_parts(layout, tensors)
        flat, counts = [], []
        for part, value in zip(layout.parts, parts):
            if part.per_layer:
                flat += value
                counts.append(len(value))
            else:
                flat.append(value)
                counts.append(0)
        tracing = torch.compiler.is_compiling()
        # (traced code binds symbolic sizes: each binding the long way; the id of the layout is not reused while
        # the cached shape holds the layout)
        structure = None if tracing else _C.tensors_structure(flat)
        key = None if structure is None else (id(layout), page_size, tuple(counts), structure)
        shape = SHAPES.get(key) if key is not None else None
        if shape is None:
            shape = CacheShape(layout, parts, flat, page_size)
            if shape.device.type != "meta" and not tracing:
                # the device's status word exists before any compiled code uses the cache: made while tracing,
                # it would be a change the first graph's guards see, and the graph would be traced again
                _native.status_tensor(shape.device)
            if key is not None:
                SHAPES.put(key, shape)
        self._shape = shape
        self.layout: Layout = layout
        self.geometry: Geometry = shape.geometry
        self.dtype: torch.dtype = shape.dtype
        self.device: torch.device = shape.device
        self.itemsize: int = shape.itemsize
        self.tensors: tuple[torch.Tensor, ...] = tuple(flat)
        self._part_tensors = parts
        self._parts = None
        # (destination, choice) -> checked transfer arguments (ops.transfer's memo; see checked_choice)
        self._checked_choices: dict = {}
        self._native = None     # native_tensors(): None, then False after the first call, then the group

    @staticmethod
    def _split_parts(layout: Layout, tensors) -> tuple:
        if layout.single_part:
            return (list(tensors) if layout.parts[0].per_layer else tensors,)
        if not isinstance(tensors, (tuple, list)) or len(tensors) != len(layout.parts):
            names = ", ".join(p.name for p in layout.parts)
            rules.LAYOUT_SHAPE.fail(f"{layout.name}: expected {len(layout.parts)} parts ({names})")
        return tuple(list(v) if p.per_layer else v for p, v in zip(layout.parts, tensors))

    # -- queries ------------------------------------------------------------------------
    @property
    def value(self):
        """The tensors as bound, in the reference's convention (what ``bind(self.layout, ...)`` takes)."""
        parts = tuple(list(v) if p.per_layer else v for p, v in zip(self.layout.parts, self._part_tensors))
        return parts[0] if self.layout.single_part else parts

    @property
    def parts(self) -> tuple[PartView, ...]:
        """Each part's :class:`PartView`: its tensors and strides."""
        if self._parts is None:
            self._parts = tuple(PartView(ps.part, tuple(value) if ps.part.per_layer else (value,), ps.strides,
                                         ps.heads, ps.head_width, ps.column_start)
                                for ps, value in zip(self._shape.parts, self._part_tensors))
        return self._parts

    def part_for(self, plane: int) -> list[PartView]:
        """The parts holding ``plane`` (several when the row is split into column parts)."""
        return [pv for pv in self.parts if pv.part.plane in (None, plane)]

    def tensor_for(self, key: tuple[str, int | None]) -> torch.Tensor:
        """The tensor of part ``key[0]`` (layer ``key[1]`` of a per-layer part)."""
        name, layer = key
        pv = next(pv for pv in self.parts if pv.part.name == name)
        return pv.tensors[layer if layer is not None else 0]

    def native_tensors(self):
        """The tensors as a first call between this cache and another hands them to C++: the tuple itself the
        first time (a cache bound for one call makes nothing more), from the second on one ``_C.TensorGroup``
        made then, whose binding lookup reads the structure the group recorded instead of every tensor's again
        (an engine's cache, bound once, meeting a chunk bound anew at every call)."""
        group = self._native
        if group is None:
            self._native = False
            return self.tensors
        if group is False:
            group = self._native = _C.TensorGroup(self.tensors)   # (two threads may both make one: either serves)
        return group

    @property
    def row_width(self) -> int:
        """Elements per (plane, layer, slot) row: ``H * E``."""
        return self.geometry.H * self.geometry.E

    def __repr__(self) -> str:
        g = self.geometry
        return (f"KVCache({self.layout.name}, P={g.P}, L={g.L}, NB={g.NB}, BS={g.BS}, H={g.H}, E={g.E}, "
                f"{self.dtype}, {self.device})")


def bind(layout: Layout | str, tensors, *, page_size: int | None = None) -> KVCache:
    """Bind tensors to a layout (see :class:`KVCache`)."""
    return tensors if isinstance(tensors, KVCache) else KVCache(layout, tensors, page_size=page_size)


INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def as_int(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as a Python int in ``[lo, hi]`` (each bound optional, always within int64).

    Accepts ints and integer scalars (NumPy, 0-d integer tensors); refuses
    bools, floats and anything else instead of truncating it.  Errors name
    the argument, the value and the bound.
    """
    if type(value) is int and (lo if lo is not None else INT64_MIN) <= value <= (hi if hi is not None else INT64_MAX):
        return value   # the common case, kept cheap: this runs several times per layer-wise call
    if isinstance(value, torch.SymInt):
        # a symbolic size of compiled code (a token count): checked by guards, kept symbolic
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            rules.ARGUMENT_RANGE.fail(f"{name} = {value} must lie in [{lo}, {hi}]")
        return value
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        rules.INTEGER_ARGUMENT.fail(f"{name} must be an integer, got the bool {value!r}")
    if isinstance(value, torch.Tensor) and (value.dim() != 0 or value.is_floating_point()
                                            or value.is_complex()):
        rules.INTEGER_ARGUMENT.fail(f"{name} must be an integer, got a tensor of {value.dtype} and shape "
                                    f"{tuple(value.shape)}")
    try:
        out = operator.index(value)
    except TypeError:
        out = None   # raised below, outside the handler: the message says all there is
    if out is None:
        rules.INTEGER_ARGUMENT.fail(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    low = INT64_MIN if lo is None else lo
    high = INT64_MAX if hi is None else hi
    if out < low:
        rules.ARGUMENT_RANGE.fail(f"{name} = {out} must be >= {low}" + (" (it must fit in int64)" * (lo is None)))
    if out > high:
        rules.ARGUMENT_RANGE.fail(f"{name} = {out} must be <= {high}" + (" (it must fit in int64)" * (hi is None)))
    return out


def as_index_list(count: int, chosen, name: str, *, unique: bool = False) -> list[int]:
    """``None`` -> ``range(count)``; an int -> ``[int]``; a sequence -> its ints, range-checked.

    ``unique``: refuse an index chosen twice (a destination written twice).
    """
    if chosen is None:
        return list(range(count))
    if getattr(chosen, "ndim", 1) == 0 or not hasattr(chosen, "__iter__"):   # one index (int, np.int64, 0-d)
        chosen = [chosen]
    out = []
    for i, c in enumerate(chosen):
        v = as_int(f"{name}[{i}]", c)
        if not 0 <= v < count:
            rules.LAYER_PLANE_OUT_OF_RANGE.fail(f"{name} contains {v}, out of range: there are {count}")
        out.append(v)
    if unique and len(set(out)) != len(out):
        v = next(v for i, v in enumerate(out) if v in out[:i])
        rules.LAYER_PLANE_PAIRING.fail(f"{name} repeats {v}: a destination layer or plane may be written once")
    return out
