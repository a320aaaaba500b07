"""Conformance cases: one op call on one device, compared with ``kvlayout.reference``.

A case is a small frozen dataclass drawn by a hypothesis strategy.  It renders
itself as a self-contained Python script (:meth:`to_python`) that builds the
inputs from numpy (random bytes for sources, a sentinel byte or random bytes
for destinations), runs ``kvlayout.ops`` on the device, runs the reference on
the same initial content and compares every output tensor in full, as
unsigned integers (so untouched rows must keep their initial bytes).  The
runner checks a case by executing that script: the reproducer in a report is
exactly the code that failed.

Operation families (:data:`FAMILIES`):

* ``transfer`` - every layout pair of the catalog, every dtype, slot patterns,
  layer subsets, ``skip_prefix`` (as the argument or through
  ``ops.skip_prefix``), placements (CUDA: both on the device, pinned source,
  pinned destination);
* ``gather`` / ``scatter`` - cache <-> rows, plane and layer subsets;
* ``move`` - within one cache, overlapping sources and destinations;
* ``pages`` - ``get_page``, ``set_page``, ``zero_page``, ``page_spans`` /
  ``page_buffer_meta``;
* ``rope`` - key repositioning, NeoX and GPT-J, packed K/V views; compared
  with :data:`ROPE_TOLERANCE` (dims past the rotary part and tokens with a
  negative position bit for bit);
* ``fuzz_index`` - transfers whose slots carry huge negative values ("no
  token") and out-of-range values: an out-of-range slot of a token that would
  be copied raises ``IndexError`` (CPU: before anything is written; CUDA: from
  ``ops.check_errors()`` after the default path, with that token's rows
  untouched, or before launching with ``validate=True``);
* ``bad_input`` - every class of invalid argument of every op raises the
  documented exception, naming the argument, with the destination unchanged.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the reference runs on the host CPU

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np
import torch
from hypothesis import strategies as st

from kvlayout.reference.layouts import Geometry, get

from . import strategies as S

# ---------------------------------------------------------------------------------------
# Helpers used by the generated scripts
# ---------------------------------------------------------------------------------------

_INT_OF_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

ROPE_TOLERANCE = {"float32": 1e-5, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
"""RoPE: ``|got - want| <= tol * (1 + |want|)`` per element, in fp32 (about one unit in the
last place of the keys' dtype; fp32 allows for a different order of the fp32 operations)."""


def tensor(array, device: str = "cpu", pinned: bool = False) -> torch.Tensor:
    """A torch copy of a numpy array (ml_dtypes included), bit for bit; pinned host memory if asked."""
    a = np.ascontiguousarray(array)
    t = torch.from_numpy(a.view(_INT_OF_SIZE[a.dtype.itemsize]).copy())
    t = t.view(getattr(torch, a.dtype.name))
    if pinned:
        return t.pin_memory()
    return t.to(device)


def to_torch(layout, physical, device: str = "cpu", pinned: bool = False):
    """A numpy physical cache (reference convention) as torch tensors of the same structure."""
    layout = get(layout)
    parts = (physical,) if layout.single_part else tuple(physical)
    out = [[tensor(x, device, pinned) for x in value] if part.per_layer else tensor(value, device, pinned)
           for part, value in zip(layout.parts, parts)]
    return out[0] if layout.single_part else tuple(out)


def slots_tensor(values, dtype: str = "int64", device: str = "cpu"):
    """A slot (or position) tensor, or ``None``."""
    if values is None:
        return None
    return torch.tensor(list(values), dtype=getattr(torch, dtype), device=device)


def bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's elements as unsigned integers of its element size, on the host."""
    t = t.detach().cpu().contiguous()
    return t.view(_TORCH_INT_OF_SIZE[t.element_size()]).numpy().view(f"u{t.element_size()}")


def random_array(shape, dtype: str, seed: int) -> np.ndarray:
    """An array of random bytes (NaN/Inf patterns included)."""
    dt = S.numpy_dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def rows_geometry(P: int, L: int, T: int, H: int, E: int) -> Geometry:
    """Geometry of a ``rows`` buffer ``[P, L, T, H, E]``."""
    return Geometry(P=P, L=L, NB=T, BS=1, H=H, E=E)


def assert_same(got: Sequence[torch.Tensor], want: Sequence, what: str = "tensor") -> None:
    """Every tensor of ``got`` holds exactly the bytes of the matching array of ``want``."""
    got, want = list(got), [np.asarray(w) for w in want]
    assert len(got) == len(want), f"{what}: {len(got)} tensors, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert tuple(g.shape) == w.shape, f"{what} {i}: shape {tuple(g.shape)}, expected {w.shape}"
        gb, wb = bits(g), S.bits(w)
        wrong = np.argwhere(gb != wb)
        if wrong.size:
            first = tuple(int(v) for v in wrong[0])
            raise AssertionError(
                f"{what} {i} (shape {w.shape}): {len(wrong)} of {w.size} elements differ; first at {list(first)}: "
                f"got 0x{int(gb[first]):x}, expected 0x{int(wb[first]):x}")


def assert_rope(keys: torch.Tensor, original: np.ndarray, want, old, new, rot: int, dtype: str) -> None:
    """RoPE output: rotary dims within :data:`ROPE_TOLERANCE`; the rest, and skipped tokens, bit for bit."""
    want = np.asarray(want)
    got_bits, orig_bits = bits(keys), S.bits(original)
    skipped = (np.asarray(old) < 0) | (np.asarray(new) < 0)
    same = np.ones(got_bits.shape, bool)
    same[~skipped, :, :rot] = False                       # what may change
    wrong = np.argwhere(same & (got_bits != orig_bits))
    if wrong.size:
        raise AssertionError(f"keys: {len(wrong)} elements that must not change did, first at {wrong[0].tolist()}")
    got = keys.detach().cpu().float().numpy()[~skipped, :, :rot]
    exp = want.astype(np.float32)[~skipped, :, :rot]
    tol = ROPE_TOLERANCE[dtype]
    err = np.abs(got - exp) - tol * (1 + np.abs(exp))
    bad = ~(err <= 0)
    if bad.any():
        i = np.argwhere(bad)[0]
        raise AssertionError(f"keys: {int(bad.sum())} rotated elements outside tolerance {tol}; first at "
                             f"{i.tolist()}: got {got[tuple(i)]!r}, expected {exp[tuple(i)]!r}")


def rope_cache(max_pos: int, rot: int, dtype: str = "float32", base: float = 10000.0) -> np.ndarray:
    """A ``[max_pos, rot]`` cos/sin cache (cos in the first half, sin in the second)."""
    inv = base ** (-np.arange(0, rot, 2, dtype=np.float64) / rot)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(S.numpy_dtype(dtype))


def expect_raises(fn: Callable, exc: type, names: Sequence[str]) -> BaseException:
    """Call ``fn``; it must raise ``exc`` with one of ``names`` in the message."""
    try:
        fn()
    except exc as e:  # noqa: PERF203
        text = str(e)
        assert any(n in text for n in names), f"{type(e).__name__} does not name {' or '.join(names)}: {text}"
        return e
    except Exception as e:
        raise AssertionError(f"expected {exc.__name__}, got {type(e).__name__}: {e}") from None
    raise AssertionError(f"expected {exc.__name__} naming {' or '.join(names)}; nothing was raised")


# ---------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------

HEADER = [
    "import numpy as np",
    "import torch",
    "from kvlayout import ops",
    "from kvlayout import reference as R",
    "from kvlayout.reference import Geometry",
    "from kvlayout.conformance.strategies import TransferCase, arrays_of, random_cache, sentinel_cache",
    "from kvlayout.conformance.checks import (assert_rope, assert_same, expect_raises, random_array,",
    "                                         rope_cache, rows_geometry, slots_tensor, tensor, to_torch)",
]


def _list(values):
    return None if values is None else list(values)


def _sync(device: str) -> list[str]:
    return [] if device == "cpu" else [f"ops.check_errors({device!r})   # no out-of-range index expected"]


def _family_of(layout: str) -> str:
    return get(layout).family


def _pin(pinned: bool) -> str:
    return ", pinned=True" if pinned else ""


# ---------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------

PLACEMENTS = ("device", "pinned src", "pinned dst")
"""Where the two sides of a transfer live on a CUDA run (on CPU everything is host memory)."""


@dataclasses.dataclass(frozen=True)
class TransferOp:
    """``ops.transfer`` on a :class:`~kvlayout.conformance.strategies.TransferCase`."""

    case: S.TransferCase
    placement: str = "device"
    slot_dtype: str = "int64"
    skip_via: str = "argument"      # or "ops.skip_prefix": the slots carry the skipped prefix as -1
    validate: bool = False
    family = "transfer"

    def group(self) -> str:
        return f"{_family_of(self.case.src_layout)}->{_family_of(self.case.dst_layout)}"

    def describe(self) -> str:
        extra = [self.slot_dtype]
        if self.placement != "device":
            extra.append(self.placement)
        if self.case.skip_prefix and self.skip_via != "argument":
            extra.append("skip via ops.skip_prefix")
        if self.validate:
            extra.append("validate")
        return f"{self.case.describe()} ({', '.join(extra)})"

    def to_python(self, device: str) -> str:
        c = self.case
        cuda = device != "cpu"
        T = c.T
        kw = []
        if c.src_layers is not None:
            kw += [f"src_layers={list(c.src_layers)}", f"dst_layers={list(c.dst_layers)}"]
        lines = HEADER + [
            f"case = {c!r}",
            "src_np, dst_np = case.caches()   # random source bytes, sentinel-filled destination",
            f"src = ops.bind(case.src_layout, to_torch(case.src_layout, src_np, {device!r}"
            f"{_pin(cuda and self.placement == 'pinned src')}), page_size={c.src_geom.BS})",
            f"dst = ops.bind(case.dst_layout, to_torch(case.dst_layout, dst_np, {device!r}"
            f"{_pin(cuda and self.placement == 'pinned dst')}), page_size={c.dst_geom.BS})",
            f"src_slots = slots_tensor({_list(c.src_slots)}, {self.slot_dtype!r}, {device!r})",
            f"dst_slots = slots_tensor({_list(c.dst_slots)}, {self.slot_dtype!r}, {device!r})",
        ]
        if c.skip_prefix and self.skip_via != "argument":
            lines.append(f"src_slots = ops.skip_prefix(src_slots, {c.skip_prefix}, num_tokens={T})"
                         f".to({device!r}, getattr(torch, {self.slot_dtype!r}))")
        elif c.skip_prefix:
            kw.append(f"skip_prefix={c.skip_prefix}")
        if c.num_tokens is not None and not (c.skip_prefix and self.skip_via != "argument"):
            kw.append(f"num_tokens={c.num_tokens}")
        if self.validate:
            kw.append("validate=True")
        lines += [f"ops.transfer(src, dst, src_slots, dst_slots{''.join(', ' + k for k in kw)})"]
        lines += _sync(device)
        lines += [
            "expected = R.transfer(case.src_layout, src_np, case.dst_layout, dst_np, *case.slots(),",
            "                      **case.transfer_kwargs())",
            "assert_same(dst.tensors, arrays_of(case.dst_layout, expected), 'destination')",
            "assert_same(src.tensors, arrays_of(case.src_layout, src_np), 'source (must not change)')",
        ]
        return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class GatherOp:
    """``ops.gather``: cache -> rows ``[P', L', T, H, E]`` (``out`` sentinel-filled, or allocated by the op)."""

    layout: str
    geom: Geometry
    dtype: str
    slots: tuple[int, ...] | None
    layers: tuple[int, ...] | None = None
    planes: tuple[int, ...] | None = None
    skip_prefix: int = 0
    out_given: bool = True
    pinned_out: bool = False
    slot_dtype: str = "int64"
    seed: int = 0
    family = "gather"

    @property
    def T(self) -> int:
        return len(self.slots) if self.slots is not None else self.geom.N

    def group(self) -> str:
        return _family_of(self.layout)

    def describe(self) -> str:
        g = self.geom
        return (f"gather {self.layout}[{S.geometry_label(g)}] {self.dtype} T={self.T}"
                f" layers={_list(self.layers)} planes={_list(self.planes)} skip={self.skip_prefix}"
                f"{' pinned out' if self.pinned_out else ''}{'' if self.out_given else ' (out allocated)'}")

    def to_python(self, device: str) -> str:
        g = self.geom
        P = len(self.planes) if self.planes is not None else g.P
        L = len(self.layers) if self.layers is not None else g.L
        kw = []
        if self.layers is not None:
            kw.append(f"layers={list(self.layers)}")
        if self.planes is not None:
            kw.append(f"planes={list(self.planes)}")
        if self.skip_prefix:
            kw.append(f"skip_prefix={self.skip_prefix}")
        kws = "".join(", " + k for k in kw)
        lines = HEADER + [
            f"layout, geom, dtype = {self.layout!r}, {g!r}, {self.dtype!r}",
            f"cache_np = random_cache(layout, geom, dtype, np.random.default_rng({self.seed}))",
            f"cache = ops.bind(layout, to_torch(layout, cache_np, {device!r}), page_size={g.BS})",
            f"slots = slots_tensor({_list(self.slots)}, {self.slot_dtype!r}, {device!r})",
            f"slots_np = None if slots is None else np.array({_list(self.slots)}, np.int64)",
        ]
        if self.out_given:
            lines += [
                f"out_np = sentinel_cache('rows', rows_geometry({P}, {L}, {self.T}, {g.H}, {g.E}), dtype)",
                f"out = to_torch('rows', out_np, {device!r}{_pin(device != 'cpu' and self.pinned_out)})",
                f"result = ops.gather(cache, slots, out=out{kws})",
                "assert result is out, 'gather must return out'",
            ]
        else:
            lines += ["out_np = None", f"result = ops.gather(cache, slots{kws})"]
        lines += _sync(device)
        lines += [
            f"expected = R.gather(layout, cache_np, slots_np, out=out_np{kws})",
            "assert_same([result], [expected], 'gathered rows')",
            "assert_same(cache.tensors, arrays_of(layout, cache_np), 'cache (must not change)')",
        ]
        return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class ScatterOp:
    """``ops.scatter``: rows ``[P', L', T, H', E']`` -> a cache holding random bytes."""

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

    def group(self) -> str:
        return _family_of(self.layout)

    def describe(self) -> str:
        g = self.geom
        return (f"scatter {self.layout}[{S.geometry_label(g)}] {self.dtype} T={self.T}"
                f" rows H'={self.rows_heads} layers={_list(self.layers)} planes={_list(self.planes)}"
                f" skip={self.skip_prefix}{' pinned rows' if self.pinned_rows else ''}")

    def to_python(self, device: str) -> str:
        g = self.geom
        P = len(self.planes) if self.planes is not None else g.P
        L = len(self.layers) if self.layers is not None else g.L
        H = self.rows_heads
        E = g.H * g.E // H
        kw = []
        if self.layers is not None:
            kw.append(f"layers={list(self.layers)}")
        if self.planes is not None:
            kw.append(f"planes={list(self.planes)}")
        if self.skip_prefix:
            kw.append(f"skip_prefix={self.skip_prefix}")
        kws = "".join(", " + k for k in kw)
        lines = HEADER + [
            f"layout, geom, dtype = {self.layout!r}, {g!r}, {self.dtype!r}",
            f"rng = np.random.default_rng({self.seed})",
            "cache_np = random_cache(layout, geom, dtype, rng)   # random bytes: untouched rows must keep them",
            f"rows_np = random_cache('rows', rows_geometry({P}, {L}, {self.T}, {H}, {E}), dtype, rng)",
            f"cache = ops.bind(layout, to_torch(layout, cache_np, {device!r}), page_size={g.BS})",
            f"rows = to_torch('rows', rows_np, {device!r}{_pin(device != 'cpu' and self.pinned_rows)})",
            f"slots = slots_tensor({_list(self.slots)}, {self.slot_dtype!r}, {device!r})",
            f"slots_np = None if slots is None else np.array({_list(self.slots)}, np.int64)",
            f"ops.scatter(cache, rows, slots{kws})",
        ]
        lines += _sync(device)
        lines += [
            f"expected = R.scatter(layout, cache_np, rows_np, slots_np{kws})",
            "assert_same(cache.tensors, arrays_of(layout, expected), 'cache')",
            "assert_same([rows], [rows_np], 'rows (must not change)')",
        ]
        return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class MoveOp:
    """``ops.move`` within one cache, sources and destinations overlapping."""

    layout: str
    geom: Geometry
    dtype: str
    src_slots: tuple[int, ...]
    dst_slots: tuple[int, ...]
    slot_dtype: str = "int64"
    seed: int = 0
    family = "move"

    def group(self) -> str:
        return _family_of(self.layout)

    def describe(self) -> str:
        g = self.geom
        return (f"move {self.layout}[{S.geometry_label(g)}] {self.dtype} "
                f"T={len(self.src_slots)}")

    def to_python(self, device: str) -> str:
        g = self.geom
        lines = HEADER + [
            f"layout, geom, dtype = {self.layout!r}, {g!r}, {self.dtype!r}",
            f"cache_np = random_cache(layout, geom, dtype, np.random.default_rng({self.seed}))",
            f"cache = ops.bind(layout, to_torch(layout, cache_np, {device!r}), page_size={g.BS})",
            f"src_slots = {list(self.src_slots)}",
            f"dst_slots = {list(self.dst_slots)}",
            f"ops.move(cache, slots_tensor(src_slots, {self.slot_dtype!r}, {device!r}), "
            f"slots_tensor(dst_slots, {self.slot_dtype!r}, {device!r}))",
        ]
        lines += _sync(device)
        lines += [
            "expected = R.move(layout, cache_np, np.array(src_slots, np.int64), np.array(dst_slots, np.int64))",
            "assert_same(cache.tensors, arrays_of(layout, expected), 'cache')",
        ]
        return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class PageOp:
    """A page helper: ``get_page``, ``set_page``, ``zero_page`` or ``page_spans`` + ``page_buffer_meta``."""

    layout: str
    geom: Geometry
    dtype: str
    op: str
    pages: tuple[int, ...]
    seed: int = 0
    family = "pages"

    def group(self) -> str:
        return _family_of(self.layout)

    def describe(self) -> str:
        g = self.geom
        return (f"{self.op} {self.layout}[{S.geometry_label(g)}] {self.dtype} "
                f"pages={list(self.pages)}")

    def to_python(self, device: str) -> str:
        g = self.geom
        lines = HEADER + [
            f"layout, geom, dtype = {self.layout!r}, {g!r}, {self.dtype!r}",
            f"cache_np = random_cache(layout, geom, dtype, np.random.default_rng({self.seed}))",
            f"cache = ops.bind(layout, to_torch(layout, cache_np, {device!r}), page_size={g.BS})",
        ]
        p = self.pages[0]
        if self.op == "get_page":
            lines += [f"got = ops.get_page(cache, {p})",
                      f"expected = R.get_page(layout, cache_np, {p}, page_size={g.BS})",
                      "assert_same([got], [expected], 'page data')"]
        elif self.op == "set_page":
            size = g.P * g.L * g.BS * g.H * g.E
            lines += [f"flat_np = random_array(({size},), dtype, {self.seed + 1})",
                      f"ops.set_page(cache, {p}, tensor(flat_np, {device!r}))",
                      f"expected = R.set_page(layout, cache_np, {p}, flat_np, page_size={g.BS})",
                      "assert_same(cache.tensors, arrays_of(layout, expected), 'cache')"]
        elif self.op == "zero_page":
            lines += [f"ops.zero_page(cache, {p})",
                      f"expected = R.zero_page(layout, cache_np, {p}, page_size={g.BS})",
                      "assert_same(cache.tensors, arrays_of(layout, expected), 'cache')"]
        else:
            lines += [f"pages = {list(self.pages)}",
                      "got = ops.page_spans(cache, pages)",
                      "expected = [tuple(int(v) for v in s) for s in R.page_spans(layout, geom, pages, "
                      "cache.itemsize)]",
                      "assert got == expected, f'page_spans: got {got}, expected {expected}'",
                      "pointers, lengths = ops.page_buffer_meta(cache, pages)",
                      "assert pointers == [cache.tensors[i].data_ptr() + o for i, o, _ in expected], 'pointers'",
                      "assert lengths == [n for _, _, n in expected], 'lengths'"]
        return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class RopeOp:
    """``ops.rope_reposition`` on keys ``[T, H, D]`` (or the K half of a packed ``[T, H, 2, D]`` buffer)."""

    T: int
    H: int
    D: int
    rot: int
    max_pos: int
    dtype: str
    cache_dtype: str
    is_neox: bool
    old: tuple[int, ...]
    new: tuple[int, ...]
    packed: bool = False
    seed: int = 0
    family = "rope"

    def group(self) -> str:
        return ("neox" if self.is_neox else "gptj") + (" packed" if self.packed else "")

    def describe(self) -> str:
        return (f"rope {'NeoX' if self.is_neox else 'GPT-J'} keys [{self.T}, {self.H}, {self.D}] {self.dtype} "
                f"rot={self.rot} max_pos={self.max_pos} cache {self.cache_dtype}{' packed' if self.packed else ''}")

    def to_python(self, device: str) -> str:
        shape = (self.T, self.H, 2, self.D) if self.packed else (self.T, self.H, self.D)
        lines = HEADER + [
            f"rng = np.random.default_rng({self.seed})",
            f"buf_np = rng.standard_normal({shape}).astype(np.float32).astype({S.numpy_dtype(self.dtype).name!r}"
            if self.dtype != "bfloat16" else
            f"buf_np = rng.standard_normal({shape}).astype(np.float32).astype(__import__('ml_dtypes').bfloat16)",
        ]
        lines[-1] += ")" if self.dtype != "bfloat16" else ""
        lines += [
            f"cs_np = rope_cache({self.max_pos}, {self.rot}, {self.cache_dtype!r})",
            f"old, new = {list(self.old)}, {list(self.new)}",
            f"buf = tensor(buf_np, {device!r})",
            f"keys = buf{'[:, :, 0]' if self.packed else ''}",
            f"keys_np = buf_np{'[:, :, 0]' if self.packed else ''}",
            f"ops.rope_reposition(keys, slots_tensor(old, 'int64', {device!r}), slots_tensor(new, 'int64', "
            f"{device!r}), tensor(cs_np, {device!r}), is_neox={self.is_neox})",
        ]
        lines += _sync(device)
        lines += [
            f"expected = R.rope_reposition(keys_np, np.array(old), np.array(new), cs_np, is_neox={self.is_neox})",
            f"assert_rope(keys, keys_np, expected, old, new, {self.rot}, {self.dtype!r})",
        ]
        if self.packed:
            lines.append("assert_same([buf[:, :, 1]], [buf_np[:, :, 1]], 'V half (must not change)')")
        return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class FuzzIndexOp:
    """A transfer whose slots carry fuzzed values: huge negatives ("no token") and out-of-range ones.

    ``path``: ``"default"`` (CUDA: no host check, the kernel skips and
    records; CPU: checked before writing) or ``"validate"``.
    """

    case: S.TransferCase
    path: str = "default"
    slot_dtype: str = "int64"
    family = "fuzz_index"

    def bad_tokens(self) -> list[int]:
        s, d = self.case.slots()
        return [t for t in range(self.case.T)
                if (s is not None and s[t] >= self.case.src_geom.N) or (d is not None and d[t] >= self.case.dst_geom.N)]

    def group(self) -> str:
        return f"{_family_of(self.case.src_layout)}->{_family_of(self.case.dst_layout)}"

    def describe(self) -> str:
        return f"{self.case.describe()} ({self.slot_dtype}, {self.path} path, out of range at tokens {self.bad_tokens()})"

    def to_python(self, device: str) -> str:
        c = self.case
        bad = self.bad_tokens()
        lines = HEADER + [
            f"case = {c!r}",
            "src_np, dst_np = case.caches()",
            f"src = ops.bind(case.src_layout, to_torch(case.src_layout, src_np, {device!r}), page_size={c.src_geom.BS})",
            f"dst = ops.bind(case.dst_layout, to_torch(case.dst_layout, dst_np, {device!r}), page_size={c.dst_geom.BS})",
            f"src_slots = slots_tensor({_list(c.src_slots)}, {self.slot_dtype!r}, {device!r})",
            f"dst_slots = slots_tensor({_list(c.dst_slots)}, {self.slot_dtype!r}, {device!r})",
        ]
        kw = ""
        if c.src_layers is not None:
            kw += f", src_layers={list(c.src_layers)}, dst_layers={list(c.dst_layers)}"
        if c.num_tokens is not None:
            kw += f", num_tokens={c.num_tokens}"
        if self.path == "validate":
            kw += ", validate=True"
        call = f"ops.transfer(src, dst, src_slots, dst_slots{kw})"
        deferred = device != "cpu" and self.path == "default"
        if not bad:
            lines += [call] + _sync(device) + [
                "expected = R.transfer(case.src_layout, src_np, case.dst_layout, dst_np, *case.slots(),",
                "                      **case.transfer_kwargs())"]
        elif deferred:
            lines += [
                call,
                f"# out-of-range slots at tokens {bad}: skipped on the device, reported by check_errors",
                f"expect_raises(lambda: ops.check_errors({device!r}), IndexError, ['src_slots', 'dst_slots'])",
                f"ops.check_errors({device!r})   # reported once",
                "s, d = case.slots()",
                f"s, d = s.copy(), d.copy()",
                f"s[{bad}] = -1",
                f"d[{bad}] = -1",
                "expected = R.transfer(case.src_layout, src_np, case.dst_layout, dst_np, s, d,",
                "                      **case.transfer_kwargs())",
            ]
        else:
            lines += [
                f"# out-of-range slots at tokens {bad}: rejected before anything is written",
                f"expect_raises(lambda: {call}, IndexError, ['src_slots', 'dst_slots'])",
            ] + _sync(device) + ["expected = dst_np"]
        lines += ["assert_same(dst.tensors, arrays_of(case.dst_layout, expected), 'destination')"]
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# Bad input: every class of invalid argument
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BadInputOp:
    """One invalid call: ``kind`` (see :data:`BAD_KINDS`) applied to a valid transfer case.

    ``token`` picks the token the bad value goes to; ``path`` is ``"validate"``
    or ``"check_errors"`` for out-of-range slots and positions on CUDA.
    """

    kind: str
    case: S.TransferCase
    token: int = 0
    offset: int = 0
    path: str = "validate"
    family = "bad_input"

    def group(self) -> str:
        return self.kind

    def describe(self) -> str:
        path = f" ({self.path})" if self.kind in _DEFERRABLE else ""
        return f"{self.kind}{path}: {self.case.describe()} token={self.token} offset={self.offset}"

    def to_python(self, device: str) -> str:
        return "\n".join(HEADER + _bad_lines(self, device)) + "\n"


def _bad_setup(c: S.TransferCase, device: str, src_host: str | None = None) -> list[str]:
    return [
        f"case = {c!r}",
        "src_np, dst_np = case.caches()",
        f"src = ops.bind(case.src_layout, to_torch(case.src_layout, src_np, {src_host or device!r}), "
        f"page_size={c.src_geom.BS})",
        f"dst = ops.bind(case.dst_layout, to_torch(case.dst_layout, dst_np, {device!r}), page_size={c.dst_geom.BS})",
        f"src_slots, dst_slots = {list(c.src_slots)}, {list(c.dst_slots)}",
    ]


def _valid_token(c: S.TransferCase, token: int) -> int:
    """A token whose pair is copied (both slots >= 0), near ``token``; -1 if there is none."""
    valid = [t for t in range(c.T) if c.src_slots[t] >= 0 and c.dst_slots[t] >= 0 and t >= c.skip_prefix]
    return valid[token % len(valid)] if valid else -1


_DEFERRABLE = {"transfer: src_slots out of range", "transfer: dst_slots out of range",
               "gather: slots out of range", "scatter: slots out of range",
               "move: src_slots out of range", "move: dst_slots out of range",
               "rope: old_positions out of range", "rope: new_positions out of range"}


def _bad_lines(b: BadInputOp, device: str) -> list[str]:
    c, kind, dev = b.case, b.kind, repr(device)
    cuda = device != "cpu"
    deferred = cuda and kind in _DEFERRABLE and (b.path == "check_errors" or kind.startswith("rope"))
    validate = ", validate=True" if cuda and not deferred else ""
    sg, dg = c.src_geom, c.dst_geom
    op, _, what = kind.partition(": ")
    unchanged = ["assert_same(dst.tensors, arrays_of(case.dst_layout, dst_np), 'destination (must not change)')"]
    lines = _bad_setup(c, device, "cpu" if kind.endswith("unpinned host source") else None)
    t = _valid_token(c, b.token)
    lk = "" if c.src_layers is None else f", src_layers={list(c.src_layers)}, dst_layers={list(c.dst_layers)}"
    tensors = (f"src_s = slots_tensor(src_slots, 'int64', {dev})",
               f"dst_s = slots_tensor(dst_slots, 'int64', {dev})")

    def raises(call: str, exc: str, names: Sequence[str]) -> list[str]:
        return [f"expect_raises(lambda: {call}, {exc}, {list(names)})"]

    def deferred_check(expected_lines: list[str], names: Sequence[str], target: str, layout: str) -> list[str]:
        return [f"expect_raises(lambda: ops.check_errors({dev}), IndexError, {list(names)})"] + expected_lines + [
            f"assert_same({target}, arrays_of({layout}, expected), 'destination (the bad token untouched)')"]

    if op == "transfer":
        if what in ("src_slots out of range", "dst_slots out of range"):
            side = what.split()[0]
            bound = sg.N if side == "src_slots" else dg.N
            lines += [f"{side}[{t}] = {bound + b.offset}   # bound {bound}", *tensors]
            call = f"ops.transfer(src, dst, src_s, dst_s{lk}{validate})"
            if deferred:
                lines += [call] + deferred_check([
                    f"s, d = np.array(src_slots), np.array(dst_slots)", f"s[{t}] = d[{t}] = -1",
                    "expected = R.transfer(case.src_layout, src_np, case.dst_layout, dst_np, s, d, "
                    "**case.transfer_kwargs())"], [side], "dst.tensors", "case.dst_layout")
                return lines
            return lines + raises(call, "IndexError", [side]) + _sync(device) + unchanged
        if what == "element sizes differ":
            other = "float32" if S.numpy_dtype(c.dtype).itemsize != 4 else "float16"
            lines += [f"dst_np = sentinel_cache(case.dst_layout, case.dst_geom, {other!r})",
                      f"dst = ops.bind(case.dst_layout, to_torch(case.dst_layout, dst_np, {dev}), "
                      f"page_size={dg.BS})", *tensors]
            return lines + raises(f"ops.transfer(src, dst, src_s, dst_s{lk}{validate})", "TypeError", ["dtype"]) + unchanged
        if what == "dtypes differ, same size":
            other = {"bfloat16": "float16", "float16": "bfloat16", "float8_e4m3fn": "float8_e5m2",
                     "float8_e5m2": "float8_e4m3fn", "float32": None}.get(c.dtype, "bfloat16")
            other = other or "float16"
            if S.numpy_dtype(other).itemsize != S.numpy_dtype(c.dtype).itemsize:
                lines += ["src_np = random_cache(case.src_layout, case.src_geom, 'bfloat16', np.random.default_rng(0))",
                          f"src = ops.bind(case.src_layout, to_torch(case.src_layout, src_np, {dev}), "
                          f"page_size={sg.BS})"]
                other = "float16"
            lines += [f"dst_np = sentinel_cache(case.dst_layout, case.dst_geom, {other!r})",
                      f"dst = ops.bind(case.dst_layout, to_torch(case.dst_layout, dst_np, {dev}), "
                      f"page_size={dg.BS})", *tensors]
            return lines + raises(f"ops.transfer(src, dst, src_s, dst_s{lk}{validate})", "TypeError", ["dtype"]) + unchanged
        if what == "row widths differ":
            cols = f", columns=({dg.columns[0] + 1}, {dg.columns[1]})" if dg.columns else ""
            lines += [f"geom = Geometry(P={dg.P}, L={dg.L}, NB={dg.NB}, BS={dg.BS}, H={dg.H}, E={dg.E + 1}{cols})",
                      "dst_np = sentinel_cache(case.dst_layout, geom, case.dtype)",
                      f"dst = ops.bind(case.dst_layout, to_torch(case.dst_layout, dst_np, {dev}), "
                      f"page_size={dg.BS})", *tensors]
            return lines + raises(f"ops.transfer(src, dst, src_s, dst_s{lk}{validate})", "ValueError",
                                  ["row width"]) + unchanged
        if what == "slot lengths differ":
            lines += ["dst_slots = dst_slots[:-1]", *tensors]
            return lines + raises(f"ops.transfer(src, dst, src_s, dst_s{lk}{validate})", "ValueError",
                                  ["src_slots", "dst_slots"]) + unchanged
        if what == "duplicate dst_slots":
            lines += [f"dst_slots[1] = dst_slots[0] = {b.offset % dg.N}", *tensors]
            return lines + raises(f"ops.transfer(src, dst, src_s, dst_s{lk}{validate})", "ValueError",
                                  ["dst_slots"]) + unchanged
        if what == "overlapping buffers":
            # the destination is the source's own memory
            lines += [f"s = slots_tensor(src_slots, 'int64', {dev})",
                      f"d = slots_tensor(list(reversed(src_slots)), 'int64', {dev})"]
            return lines + raises(f"ops.transfer(src, src, s, d{validate})", "ValueError", ["overlap"]) + [
                "assert_same(src.tensors, arrays_of(case.src_layout, src_np), 'source (must not change)')"]
        if what == "unpinned host source":
            lines += [*tensors]
            return lines + raises(f"ops.transfer(src, dst, src_s, dst_s{lk})", "RuntimeError", ["pinned"]) + unchanged
        if what in ("src_layers out of range", "dst_layers out of range"):
            L = sg.L if what.startswith("src") else dg.L
            arg = "src_layers" if what.startswith("src") else "dst_layers"
            other = "dst_layers" if arg == "src_layers" else "src_layers"
            lines += [*tensors]
            return lines + raises(f"ops.transfer(src, dst, src_s, dst_s, {arg}=[{L + b.offset}], {other}=[0]"
                                  f"{validate})", "IndexError", [arg]) + unchanged
        if what == "src_planes out of range":
            lines += [*tensors]
            return lines + raises(f"ops.transfer(src, dst, src_s, dst_s, src_planes=[{sg.P + b.offset}], "
                                  f"dst_planes=[0]{lk}{validate})", "IndexError", ["src_planes"]) + unchanged
        if what == "layer lists differ in length":
            lines += [*tensors]
            return lines + raises(f"ops.transfer(src, dst, src_s, dst_s, src_layers=[0], dst_layers=[0, 0]"
                                  f"{validate})", "ValueError", ["layers"]) + unchanged
        if what == "slots not integers":
            lines += [f"src_s = torch.tensor(src_slots, dtype=torch.float32, device={dev})",
                      f"dst_s = slots_tensor(dst_slots, 'int64', {dev})"]
            return lines + raises(f"ops.transfer(src, dst, src_s, dst_s{lk}{validate})", "TypeError",
                                  ["src_slots"]) + unchanged
        if what == "skip_prefix out of range":
            lines += [*tensors]
            return lines + raises(f"ops.transfer(src, dst, src_s, dst_s, skip_prefix={c.T + 1 + b.offset}"
                                  f"{lk}{validate})", "ValueError", ["skip_prefix"]) + unchanged
    if op == "gather":
        base = [f"out_np = sentinel_cache('rows', rows_geometry({sg.P}, {sg.L}, {c.T}, {sg.H}, {sg.E}), case.dtype)",
                f"out = to_torch('rows', out_np, {dev})"]
        out_unchanged = ["assert_same([out], [out_np], 'out (must not change)')"]
        if what == "slots out of range":
            lines += [f"src_slots[{t}] = {sg.N + b.offset}   # bound {sg.N}", *base,
                      f"s = slots_tensor(src_slots, 'int64', {dev})"]
            call = f"ops.gather(src, s, out=out{validate})"
            if deferred:
                return lines + [call, f"expect_raises(lambda: ops.check_errors({dev}), IndexError, ['slots'])",
                                "s_np = np.array(src_slots)", f"s_np[{t}] = -1",
                                "expected = R.gather(case.src_layout, src_np, s_np, out=out_np)",
                                "assert_same([out], [expected], 'out (the bad token untouched)')"]
            return lines + raises(call, "IndexError", ["slots"]) + _sync(device) + out_unchanged
        if what == "layers out of range":
            lines += [*base, f"s = slots_tensor(src_slots, 'int64', {dev})"]
            return lines + raises(f"ops.gather(src, s, out=out, layers=[{sg.L + b.offset}]{validate})",
                                  "IndexError", ["layers"]) + out_unchanged
        if what == "out row width differs":
            lines += [f"out_np = sentinel_cache('rows', rows_geometry({sg.P}, {sg.L}, {c.T}, 1, {sg.H * sg.E + 1}), "
                      "case.dtype)", f"out = to_torch('rows', out_np, {dev})",
                      f"s = slots_tensor(src_slots, 'int64', {dev})"]
            return lines + raises(f"ops.gather(src, s, out=out{validate})", "ValueError", ["row width"]) + out_unchanged
    if op == "scatter":
        rows = (f"rows = tensor(random_array((case.dst_geom.P, case.dst_geom.L, len(dst_slots), 1, "
                f"case.dst_geom.H * case.dst_geom.E), case.dtype, 1), {dev})")
        if what == "slots out of range":
            lines += [f"dst_slots[{t}] = {dg.N + b.offset}", rows, f"d = slots_tensor(dst_slots, 'int64', {dev})"]
            call = f"ops.scatter(dst, rows, d{validate})"
            if deferred:
                return lines + [call] + deferred_check([
                    "d_np = np.array(dst_slots)", f"d_np[{t}] = -1",
                    "rows_np = random_array((case.dst_geom.P, case.dst_geom.L, len(dst_slots), 1, "
                    "case.dst_geom.H * case.dst_geom.E), case.dtype, 1)",
                    "expected = R.scatter(case.dst_layout, dst_np, rows_np, d_np)"],
                    ["dst_slots"], "dst.tensors", "case.dst_layout")
            return lines + raises(call, "IndexError", ["slots"]) + _sync(device) + unchanged
        if what == "duplicate slots":
            lines += [f"dst_slots[1] = dst_slots[0] = {b.offset % dg.N}", rows,
                      f"d = slots_tensor(dst_slots, 'int64', {dev})"]
            return lines + raises(f"ops.scatter(dst, rows, d{validate})", "ValueError", ["dst_slots"]) + unchanged
        if what == "rows dtype differs":
            other = "float32" if S.numpy_dtype(c.dtype).itemsize != 4 else "float16"
            lines += [f"rows = tensor(random_array((case.dst_geom.P, case.dst_geom.L, len(dst_slots), 1, "
                      f"case.dst_geom.H * case.dst_geom.E), {other!r}, 1), {dev})",
                      f"d = slots_tensor(dst_slots, 'int64', {dev})"]
            return lines + raises(f"ops.scatter(dst, rows, d{validate})", "TypeError", ["dtype"]) + unchanged
    if op == "move":
        move_setup = [f"m_src, m_dst = list(range(min(4, case.dst_geom.N))), "
                      f"list(reversed(range(min(4, case.dst_geom.N))))"]
        if what in ("src_slots out of range", "dst_slots out of range"):
            side = "m_src" if what.startswith("src") else "m_dst"
            lines += move_setup + [f"{side}[{b.token % min(4, dg.N)}] = {dg.N + b.offset}"]
            call = (f"ops.move(dst, slots_tensor(m_src, 'int64', {dev}), slots_tensor(m_dst, 'int64', {dev})"
                    f"{validate})")
            name = what.split()[0]
            if deferred:
                return lines + [call] + deferred_check([
                    "ms, md = np.array(m_src), np.array(m_dst)", f"bad = (ms >= {dg.N}) | (md >= {dg.N})",
                    "ms[bad] = -1", "md[bad] = -1", "expected = R.move(case.dst_layout, dst_np, ms, md)"],
                    [name], "dst.tensors", "case.dst_layout")
            return lines + raises(call, "IndexError", [name]) + _sync(device) + unchanged
        if what == "duplicate dst_slots":
            lines += move_setup + ["m_dst = [0] * len(m_dst)" if dg.N >= 2 else "m_dst, m_src = [0, 0], [0, 0]"]
            return lines + raises(f"ops.move(dst, slots_tensor(m_src, 'int64', {dev}), "
                                  f"slots_tensor(m_dst, 'int64', {dev}){validate})", "ValueError",
                                  ["dst_slots"]) + unchanged
        if what == "slot lengths differ":
            lines += move_setup + ["m_dst = m_dst + [0]"]
            return lines + raises(f"ops.move(dst, slots_tensor(m_src, 'int64', {dev}), "
                                  f"slots_tensor(m_dst, 'int64', {dev}){validate})", "ValueError",
                                  ["src_slots", "dst_slots"]) + unchanged
    if op == "pages":
        if what == "page out of range":
            fn = ("ops.get_page(dst, {p})", "ops.zero_page(dst, {p})",
                  "ops.set_page(dst, {p}, ops.dummy_flat_page(dst))")[b.token % 3]
            return lines + raises(fn.format(p=dg.NB + b.offset), "IndexError", ["page"]) + unchanged
        if what == "flat page of the wrong size":
            return lines + [f"flat = torch.zeros(ops.dummy_flat_page(dst).numel() + {1 + b.offset}, dtype=dst.dtype, "
                            f"device={dev})"] + raises("ops.set_page(dst, 0, flat)", "ValueError", ["flat"]) + unchanged
        if what == "flat page of another element size":
            other = "float32" if S.numpy_dtype(c.dtype).itemsize != 4 else "float16"
            return lines + [f"flat = torch.zeros(ops.dummy_flat_page(dst).numel(), dtype=torch.{other}, device={dev})"] \
                + raises("ops.set_page(dst, 0, flat)", "TypeError", ["flat", "dtype"]) + unchanged
    if op == "rope":
        T = max(1, min(c.T, 8))
        lines = [f"keys_np = random_array(({T}, 2, 8), 'float32', 3) % 3.0",
                 "keys_np[~np.isfinite(keys_np)] = 0.5",
                 f"keys = tensor(keys_np, {dev})",
                 "cs = tensor(rope_cache(16, 8), " + dev + ")",
                 f"old, new = list(range({T})), [({T} - 1 - i) for i in range({T})]"]
        unchanged_k = ["assert_same([keys], [keys_np], 'keys (must not change)')"]
        if what in ("old_positions out of range", "new_positions out of range"):
            side = what.split()[0].split("_")[0]
            tok = b.token % T
            lines += [f"{side}[{tok}] = {16 + b.offset}"]
            call = (f"ops.rope_reposition(keys, slots_tensor(old, 'int64', {dev}), slots_tensor(new, 'int64', {dev}), "
                    "cs, is_neox=True)")
            name = what.split()[0]
            if deferred:
                return lines + [call, f"expect_raises(lambda: ops.check_errors({dev}), IndexError, [{name!r}])",
                                f"old[{tok}] = new[{tok}] = -1   # that token must be untouched",
                                "expected = R.rope_reposition(keys_np, np.array(old), np.array(new), "
                                "rope_cache(16, 8), is_neox=True)",
                                "assert_rope(keys, keys_np, expected, old, new, 8, 'float32')"]
            return lines + raises(call, "IndexError", [name]) + unchanged_k
        if what == "keys not floating point":
            lines += [f"ikeys = torch.zeros(({T}, 2, 8), dtype=torch.int32, device={dev})"]
            return lines + raises(f"ops.rope_reposition(ikeys, slots_tensor(old, 'int64', {dev}), "
                                  f"slots_tensor(new, 'int64', {dev}), cs, is_neox=False)", "TypeError", ["keys"])
        if what == "rotary dim larger than the head":
            lines += [f"cs = tensor(rope_cache(16, 10), {dev})"]
            return lines + raises(f"ops.rope_reposition(keys, slots_tensor(old, 'int64', {dev}), "
                                  f"slots_tensor(new, 'int64', {dev}), cs, is_neox=False)", "ValueError",
                                  ["cos_sin_cache"]) + unchanged_k
        if what == "positions of the wrong length":
            lines += ["old = old + [0]"]
            return lines + raises(f"ops.rope_reposition(keys, slots_tensor(old, 'int64', {dev}), "
                                  f"slots_tensor(new, 'int64', {dev}), cs, is_neox=False)", "ValueError",
                                  ["old_positions"]) + unchanged_k
    raise ValueError(f"unknown bad-input kind {kind!r}")


BAD_KINDS = (
    "transfer: src_slots out of range", "transfer: dst_slots out of range", "transfer: element sizes differ",
    "transfer: dtypes differ, same size", "transfer: row widths differ", "transfer: slot lengths differ",
    "transfer: duplicate dst_slots", "transfer: overlapping buffers", "transfer: unpinned host source",
    "transfer: src_layers out of range", "transfer: dst_layers out of range", "transfer: src_planes out of range",
    "transfer: layer lists differ in length", "transfer: slots not integers", "transfer: skip_prefix out of range",
    "gather: slots out of range", "gather: layers out of range", "gather: out row width differs",
    "scatter: slots out of range", "scatter: duplicate slots", "scatter: rows dtype differs",
    "move: src_slots out of range", "move: dst_slots out of range", "move: duplicate dst_slots",
    "move: slot lengths differ",
    "pages: page out of range", "pages: flat page of the wrong size", "pages: flat page of another element size",
    "rope: old_positions out of range", "rope: new_positions out of range", "rope: keys not floating point",
    "rope: rotary dim larger than the head", "rope: positions of the wrong length",
)
"""Classes of invalid arguments; ``transfer: unpinned host source`` needs a CUDA device."""

CUDA_ONLY_KINDS = ("transfer: unpinned host source",)


# ---------------------------------------------------------------------------------------
# Strategies: one per family, optionally restricted to one group (layout family or kind)
# ---------------------------------------------------------------------------------------

SLOT_DTYPES = ("int64", "int32")
LAYOUTS = S.layout_names()
LAYOUT_FAMILIES = tuple(dict.fromkeys(get(n).family for n in LAYOUTS))


def _pairs(group: str | None) -> list[tuple[str, str]]:
    pairs = S.layout_pairs()
    if group is not None:
        a, b = group.split("->")
        pairs = [(x, y) for x, y in pairs if get(x).family == a and get(y).family == b]
    return pairs


def _names(group: str | None) -> list[str]:
    return [n for n in LAYOUTS if group is None or get(n).family == group]


def _transfer_base(pair, *, allow_positions=True, allow_skip=True):
    src, dst = pair
    return st.one_of(
        S.transfer_cases(src, dst, max_layers=8, max_slots=64, budget=1 << 14,
                         allow_positions=allow_positions, allow_skip=allow_skip),
        S.transfer_cases(src, dst, max_layers=80, max_slots=256, budget=1 << 16, row_bytes=S.ROW_BYTES,
                         allow_positions=allow_positions, allow_skip=allow_skip))


def transfer_ops(device: str, group: str | None = None):
    cuda = device == "cuda"
    cases = st.sampled_from(_pairs(group)).flatmap(_transfer_base)
    return st.builds(TransferOp, cases, st.sampled_from(PLACEMENTS if cuda else ("device",)),
                     st.sampled_from(SLOT_DTYPES), st.sampled_from(("argument", "ops.skip_prefix")),
                     st.booleans() if cuda else st.just(False))


def _subset(draw, count: int):
    """``None`` (all) or a non-empty ordered subset of ``range(count)``."""
    if draw(st.booleans()):
        return None
    k = draw(st.integers(1, count))
    return tuple(draw(st.permutations(range(count)))[:k])


@st.composite
def gather_ops(draw, device: str, group: str | None = None):
    layout = draw(st.sampled_from(_names(group)))
    geom = draw(S.geometries(layout, max_layers=8, max_slots=64, budget=1 << 14))
    slots = None if get(layout).chunk and draw(st.booleans()) else tuple(
        int(v) for v in draw(S.slot_patterns(geom.N, geom.BS)))
    T = len(slots) if slots is not None else geom.N
    skip = draw(st.integers(0, T)) if T and draw(st.booleans()) else 0
    return GatherOp(layout, geom, draw(S.dtypes()), slots, _subset(draw, geom.L), _subset(draw, geom.P), skip,
                    draw(st.sampled_from((True, True, False))), device == "cuda" and draw(st.booleans()),
                    draw(st.sampled_from(SLOT_DTYPES)), draw(st.integers(0, 2**32 - 1)))


@st.composite
def scatter_ops(draw, device: str, group: str | None = None):
    layout = draw(st.sampled_from(_names(group)))
    geom = draw(S.geometries(layout, max_layers=8, max_slots=64, budget=1 << 14))
    slots = None if get(layout).chunk and draw(st.booleans()) else tuple(
        int(v) for v in draw(S.slot_patterns(geom.N, geom.BS)))
    T = len(slots) if slots is not None else geom.N
    skip = draw(st.integers(0, T)) if T and draw(st.booleans()) else 0
    width = geom.H * geom.E
    heads = draw(st.sampled_from([d for d in range(1, min(64, width) + 1) if width % d == 0]))
    return ScatterOp(layout, geom, draw(S.dtypes()), slots, heads, _subset(draw, geom.L), _subset(draw, geom.P),
                     skip, device == "cuda" and draw(st.booleans()), draw(st.sampled_from(SLOT_DTYPES)),
                     draw(st.integers(0, 2**32 - 1)))


@st.composite
def move_ops(draw, device: str, group: str | None = None):
    layout = draw(st.sampled_from(_names(group)))
    geom = draw(S.geometries(layout, max_layers=8, max_slots=64, budget=1 << 14))
    src, dst = draw(S.move_slot_pairs(geom.N))
    return MoveOp(layout, geom, draw(S.dtypes()), tuple(int(v) for v in src), tuple(int(v) for v in dst),
                  draw(st.sampled_from(SLOT_DTYPES)), draw(st.integers(0, 2**32 - 1)))


@st.composite
def page_ops(draw, device: str, group: str | None = None):
    layout = draw(st.sampled_from(_names(group)))
    geom = draw(S.geometries(layout, max_layers=8, max_slots=64, budget=1 << 13))
    op = draw(st.sampled_from(("get_page", "set_page", "zero_page", "page_spans")))
    if op == "page_spans":
        pages = tuple(draw(st.lists(st.integers(0, geom.NB - 1), min_size=1, max_size=3, unique=True)))
    else:
        pages = (draw(st.integers(0, geom.NB - 1)),)
    return PageOp(layout, geom, draw(S.dtypes()), op, pages, draw(st.integers(0, 2**32 - 1)))


@st.composite
def rope_ops(draw, device: str, group: str | None = None):
    is_neox = draw(st.booleans()) if group is None else group.startswith("neox")
    packed = draw(st.booleans()) if group is None else group.endswith("packed")
    T = draw(st.integers(1, 32))
    H = draw(st.integers(1, 8))
    D = draw(st.sampled_from((2, 8, 16, 32, 64, 80, 128)))
    rot = draw(st.sampled_from(sorted({D, max(2, D // 2), 2})))
    max_pos = draw(st.integers(1, 4096))
    dtype = draw(st.sampled_from(("float32", "float16", "bfloat16")))
    cache_dtype = draw(st.sampled_from(("float32", dtype)))
    position = st.one_of(st.integers(0, max_pos - 1), st.integers(0, max_pos - 1),
                         st.sampled_from((-1, -2, -(2**31), -(2**62))))
    old = tuple(draw(st.lists(position, min_size=T, max_size=T)))
    new = tuple(draw(st.lists(position, min_size=T, max_size=T)))
    return RopeOp(T, H, D, rot, max_pos, dtype, cache_dtype, is_neox, old, new, packed,
                  draw(st.integers(0, 2**32 - 1)))


@st.composite
def fuzz_index_ops(draw, device: str, group: str | None = None):
    pair = draw(st.sampled_from(_pairs(group)))
    case = draw(_transfer_base(pair, allow_positions=False, allow_skip=False))
    slot_dtype = draw(st.sampled_from(SLOT_DTYPES))
    wide = slot_dtype == "int64"
    s, d = list(case.src_slots), list(case.dst_slots)
    for t in range(len(s)):
        action = draw(st.sampled_from(("keep", "keep", "keep", "negative", "oob src", "oob dst")))
        if action == "negative":
            side = s if draw(st.booleans()) else d
            side[t] = draw(st.sampled_from((-1, -2, -(2**31)) + ((-(2**62),) if wide else ())))
        elif action.startswith("oob") and s[t] >= 0 and d[t] >= 0:
            side, g = (s, case.src_geom) if action == "oob src" else (d, case.dst_geom)
            side[t] = draw(st.sampled_from((g.N, g.N + 1, g.N + g.BS, 2 * g.N + 7, 2**31 - 1)
                                           + ((2**40, 2**62) if wide else ())))
    case = dataclasses.replace(case, src_slots=tuple(s), dst_slots=tuple(d))
    return FuzzIndexOp(case, draw(st.sampled_from(("default", "validate"))) if device == "cuda" else "default",
                       slot_dtype)


def _bad_base_ok(c: S.TransferCase) -> bool:
    return c.T >= 2 and c.dst_geom.N >= 2 and _valid_token(c, 0) >= 0


@st.composite
def bad_input_ops(draw, device: str, group: str | None = None):
    kind = group or draw(st.sampled_from(bad_kinds(device)))
    pair = draw(st.sampled_from(_pairs(None)))
    case = draw(S.transfer_cases(pair[0], pair[1], max_layers=3, max_slots=16, budget=1 << 11,
                                 allow_positions=False, allow_skip=False).filter(_bad_base_ok))
    return BadInputOp(kind, case, draw(st.integers(0, 31)), draw(st.integers(0, 5)),
                      draw(st.sampled_from(("validate", "check_errors"))) if device == "cuda" else "validate")


def bad_kinds(device: str) -> tuple[str, ...]:
    return tuple(k for k in BAD_KINDS if device == "cuda" or k not in CUDA_ONLY_KINDS)


@dataclasses.dataclass(frozen=True)
class Family:
    """An operation family: its strategy, and whether each group gets its own share of the budget."""

    name: str
    strategy: Callable
    doc: str
    per_group: Callable | None = None     # device -> groups, each run with its own examples

    def groups(self, device: str):
        return self.per_group(device) if self.per_group else None


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("transfer", transfer_ops, "ops.transfer between every pair of catalog layouts"),
    Family("gather", gather_ops, "ops.gather: cache -> rows, layer and plane subsets"),
    Family("scatter", scatter_ops, "ops.scatter: rows -> cache, layer and plane subsets"),
    Family("move", move_ops, "ops.move within one cache, overlapping slots"),
    Family("pages", page_ops, "page helpers: get_page, set_page, zero_page, page_spans/page_buffer_meta"),
    Family("rope", rope_ops, "ops.rope_reposition, NeoX and GPT-J, packed K/V views"),
    Family("fuzz_index", fuzz_index_ops, "transfers with fuzzed slot values: huge negatives and out-of-range"),
    Family("bad_input", bad_input_ops, "every class of invalid argument raises the documented exception",
           per_group=bad_kinds),
)}

from .hostile import hostile_kinds, hostile_ops  # noqa: E402  (hostile.py renders with this module's HEADER)

FAMILIES["hostile"] = Family("hostile", hostile_ops, "hostile inputs: slot tensors aliasing destinations, slots "
                             "rewritten by another thread, two storages over one buffer, expanded destinations, "
                             "repeated destination layers, host allocator abuse, adapter shape lies; nothing "
                             "outside the tensors may change", per_group=hostile_kinds)
