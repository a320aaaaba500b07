"""Every KV-cache layout as data, and its bijection with the logical space.

The logical KV of one model is one array ``[P, L, N, H, E]``:

* ``P`` planes: 2 (K then V) for multi-head attention, 1 for an MLA latent;
* ``L`` layers;
* ``N`` slots: token positions in a cache (vLLM ``slot_mapping`` value, SGLang
  ``loc``, HiCache host index, position inside an LMCache chunk);
* ``H`` heads and ``E`` elements per head.

A layout says which physical tensors hold that array and where each element
lives.  It is written as einops patterns over six axis names:

    p   plane            l   layer            h   head           e   element
    nb  page (block)     bs  slot inside a page
    n   shorthand for the flat slot axis ``(nb bs)``

A physical tensor's pattern lists its axes in memory order (outermost first).
An axis a layout does not have has size 1 (an MLA cache has no ``p`` and no
``h``; a one-layer chunk has no ``l``).  Slot ``s`` is ``nb * BS + bs``, so the
logical view of any part is ``rearrange(x, "<pattern> -> p l (nb bs) h e")``.

A layout is one or more *parts*.  A part is one tensor, or a Python list of
per-layer tensors (``per_layer=True``: the list index is ``l``).  A part may
hold only one plane (SGLang keeps K and V in separate lists) or only a column
range of the row (HiCache ``page_first_kv_split`` keeps the MLA latent's nope
and rope columns in two tensors); the logical array is the parts stacked along
``p`` and concatenated along ``e``.

Nothing here imports torch: the ops layer reads the same catalog.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Mapping, Sequence

from . import semantics as rules

AXES = ("p", "l", "nb", "bs", "h", "e")
"""The canonical axis order of one part: ``[P, L, NB, BS, H, E_part]``."""


@dataclasses.dataclass(frozen=True)
class Part:
    """One physical component of a layout.

    ``pattern``: the axes of one physical tensor, outermost first, e.g.
    ``"2 nb bs h e"`` is written ``"p nb bs h e"``.  ``per_layer``: the part is a
    list of ``L`` such tensors.  ``plane``: the part holds only this plane.
    ``column``: the part holds the ``column``-th column block of the row (parts
    with columns are concatenated along ``e`` in column order).
    """

    name: str
    pattern: str
    per_layer: bool = False
    plane: int | None = None
    column: int | None = None

    @property
    def axes(self) -> tuple[str, ...]:
        """Axis names of one physical tensor, with ``n`` expanded to ``nb bs``."""
        return tuple(a for tok in self.pattern.split() for a in (("nb", "bs") if tok == "n" else (tok,)))

    @property
    def einops_pattern(self) -> str:
        """The pattern as einops reads it (``n`` becomes the group ``(nb bs)``)."""
        return " ".join("(nb bs)" if tok == "n" else tok for tok in self.pattern.split())

    @property
    def full_axes(self) -> tuple[str, ...]:
        """Axes of the part as one array (a per-layer list stacked on a leading ``l``)."""
        return (("l",) if self.per_layer else ()) + self.axes

    @property
    def full_einops_pattern(self) -> str:
        return ("l " if self.per_layer else "") + self.einops_pattern


@dataclasses.dataclass(frozen=True)
class Layout:
    """A named layout: its parts, plane count, paging and origin.

    ``planes``: 2 (K, V) or 1 (MLA); ``None`` when it follows the tensor.
    ``paged``: slot numbers are page-structured in the physical tensors
    (``nb`` and ``bs`` are separate axes); otherwise the slot axis is flat and
    the page size only matters to page helpers.  ``chunk``: the layout is a
    contiguous chunk of T tokens where slot = position (no slot tensor needed).
    ``engine_name``: what the source engine calls the layout where it names
    it by a string (SGLang HiCache's ``layout=`` argument), so adapters look
    layouts up here instead of keeping tables of their own.
    """

    name: str
    origin: str
    planes: int | None
    parts: tuple[Part, ...]
    family: str
    chunk: bool = False
    notes: str = ""
    engine_name: str = ""

    @property
    def is_mla(self) -> bool:
        return self.planes == 1

    @property
    def paged(self) -> bool:
        return any(("nb" in p.pattern.split()) for p in self.parts)

    @property
    def single_part(self) -> bool:
        return len(self.parts) == 1

    def structure(self) -> str:
        """Human-readable physical structure, e.g. ``list[L] of [2, NB, BS, H, D]``."""
        out = []
        for part in self.parts:
            names = dict(_DIM_NAMES, p=str(self.planes) if self.planes else "P")
            dims = ", ".join(names.get(tok, tok) for tok in part.pattern.split())
            if part.column is not None:
                dims = dims.replace("E", f"E{part.column}")
            shape = f"[{dims}]"
            if part.per_layer:
                shape = f"list[L] of {shape}"
            label = f"{part.name}: " if len(self.parts) > 1 else ""
            out.append(label + shape)
        return " + ".join(out)


_DIM_NAMES = {"p": "P", "l": "L", "nb": "NB", "bs": "BS", "h": "H", "e": "E", "n": "N"}


def _mha(name, origin, pattern, family, per_layer=False, chunk=False, notes=""):
    return Layout(name, origin, 2, (Part("kv", pattern, per_layer),), family, chunk, notes)


def _mla(name, origin, pattern, family, per_layer=False, chunk=False, notes=""):
    return Layout(name, origin, 1, (Part("latent", pattern, per_layer),), family, chunk, notes)


def _hicache(name, engine_name, pattern, planes=2, notes=""):
    """A SGLang HiCache host pool layout: one tensor, named ``engine_name`` by SGLang."""
    kind = "MHA" if planes == 2 else "MLA"
    part = Part("kv" if planes == 2 else "latent", pattern)
    return Layout(name, f"SGLang HiCache host pool, {engine_name} ({kind})", planes, (part,), "hicache",
                  notes=notes, engine_name=engine_name)


def kv_halves(layout: Layout) -> Layout:
    """``layout`` (one MHA tensor with a plane axis) given as two tensors, its K and V halves.

    SGLang's transfer kernels take a host buffer's halves (``kv_buffer[0]``,
    ``kv_buffer[1]``) as separate tensors, as ``sglang_mha`` keeps K and V in
    separate lists: the same pattern without ``p``, one single-plane part per
    plane.
    """
    (part,) = layout.parts
    if layout.planes != 2 or part.per_layer or part.pattern.split()[0] != "p":
        raise ValueError(f"{layout.name}: only one MHA tensor with a leading plane axis splits into K and V halves")
    pattern = " ".join(part.pattern.split()[1:])
    return Layout(f"{layout.name}_kv_halves", f"{layout.origin}, given as separate K and V halves", 2,
                  (Part("k", pattern, plane=0), Part("v", pattern, plane=1)), layout.family,
                  notes=f"The two halves of a `{layout.name}` buffer (`kv_buffer[0]`, `kv_buffer[1]`) as two "
                        "tensors, the form SGLang's transfer kernels take them in.")


CATALOG: dict[str, Layout] = {}


def register(layout: Layout) -> Layout:
    """Add a layout to the catalog (names are unique)."""
    if layout.name in CATALOG:
        raise ValueError(f"layout {layout.name!r} is already registered")
    _check_layout(layout)
    CATALOG[layout.name] = layout
    return layout


def _check_layout(layout: Layout) -> None:
    for part in layout.parts:
        axes = part.full_axes
        unknown = set(axes) - set(AXES)
        if unknown:
            raise ValueError(f"{layout.name}: unknown axes {sorted(unknown)} in {part.pattern!r}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"{layout.name}: repeated axis in {part.pattern!r}")
        if "e" not in axes:
            raise ValueError(f"{layout.name}: every part needs an element axis e")
        if ("nb" in axes) != ("bs" in axes):
            raise ValueError(f"{layout.name}: nb and bs come together")
        if part.plane is not None and "p" in axes:
            raise ValueError(f"{layout.name}: a single-plane part has no p axis")


for _layout in (
    # ---- engine device caches (vLLM) -------------------------------------------------
    _mha("vllm_flash_attn_nhd", "vLLM FlashAttention backend, NHD (LMCache GPUKVFormat 1)",
         "p nb bs h e", "vllm", per_layer=True),
    _mha("vllm_flash_attn_hnd", "vLLM FlashAttention backend, HND (LMCache GPUKVFormat 6)",
         "p nb h bs e", "vllm", per_layer=True),
    _mha("vllm_flashinfer_nhd", "vLLM FlashInfer/Triton backend, NHD (LMCache GPUKVFormat 2)",
         "nb p bs h e", "vllm", per_layer=True),
    _mha("vllm_flashinfer_hnd", "vLLM FlashInfer backend, HND (LMCache GPUKVFormat 7)",
         "nb p h bs e", "vllm", per_layer=True),
    _mla("vllm_mla", "vLLM MLA latent cache, D = kv_lora_rank + rope dim (LMCache GPUKVFormat 3)",
         "nb bs e", "vllm", per_layer=True),
    _mha("vllm_cross_layer", "vLLM cross-layer (blocks-first) cache, one tensor (LMCache GPUKVFormat 0)",
         "nb l p bs h e", "vllm"),
    _mha("trtllm_cross_layer_hnd", "TensorRT-LLM cross-layer cache, HND (LMCache GPUKVFormat 8)",
         "nb l p h bs e", "vllm"),
    _mha("vllm_packed_nhd", "vLLM packed K/V (K and V interleaved per head), NHD (LMCache format 11)",
         "nb bs h p e", "vllm", per_layer=True),
    _mha("vllm_packed_hnd", "vLLM packed K/V (K and V interleaved per head), HND (LMCache format 10)",
         "nb h bs p e", "vllm", per_layer=True),
    # ---- engine device pools (SGLang) ------------------------------------------------
    Layout("sglang_mha", "SGLang MHATokenToKVPool: K and V lists (LMCache GPUKVFormat 4)", 2,
           (Part("k", "n h e", per_layer=True, plane=0), Part("v", "n h e", per_layer=True, plane=1)),
           "sglang",
           notes="Each tensor has N = size + page_size rows; rows 0..page_size-1 are the padding page "
                 "the allocator never hands out. Slots are rows."),
    _mla("sglang_mla", "SGLang MLATokenToKVPool (LMCache GPUKVFormat 5)", "n h e", "sglang", per_layer=True,
         notes="H = 1; N = size + page_size rows with the first page as padding, as in sglang_mha."),
    # ---- LMCache memory-object (chunk) formats --------------------------------------
    _mha("lmcache_kv_2ltd", "LMCache MemoryFormat.KV_2LTD: [2, L, T, H*D] chunk",
         "p l n e", "lmcache", chunk=True, notes="A row is the H*D hidden vector (H = 1, E = H*D)."),
    _mha("lmcache_kv_t2d", "LMCache MemoryFormat.KV_T2D: one layer, token-major [T, 2, H*D]",
         "n p e", "lmcache", chunk=True),
    _mha("lmcache_kv_2td", "LMCache MemoryFormat.KV_2TD: one layer, K/V-major [2, T, H*D]",
         "p n e", "lmcache", chunk=True),
    _mla("lmcache_kv_mla", "LMCache MemoryFormat.KV_MLA_FMT: [1, L, T, D] chunk",
         "p l n e", "lmcache", chunk=True),
    _mla("lmcache_kv_mla_layer", "LMCache MemoryFormat.KV_MLA_FMT, layer-wise form: [T, D]",
         "n e", "lmcache", chunk=True),
    # ---- SGLang HiCache host pools --------------------------------------------------
    _hicache("hicache_layer_first", "layer_first", "p l n h e"),
    _hicache("hicache_page_first", "page_first", "p n l h e"),
    _hicache("hicache_page_first_direct", "page_first_direct", "p nb l bs h e"),
    _hicache("hicache_page_head", "page_head", "p nb h bs l e"),
    _hicache("hicache_mla_layer_first", "layer_first", "l n h e", planes=1),
    _hicache("hicache_mla_page_first", "page_first", "n l h e", planes=1),
    _hicache("hicache_mla_page_first_direct", "page_first_direct", "nb l bs h e", planes=1),
    Layout("hicache_mla_page_first_kv_split",
           "SGLang HiCache host pool, page_first_kv_split (MLA nope and rope parts apart)", 1,
           (Part("nope", "nb l bs h e", column=0), Part("rope", "nb l bs h e", column=1)), "hicache",
           notes="The latent row is nope columns then rope columns; each part holds one block.",
           engine_name="page_first_kv_split"),
):
    register(_layout)

# The host buffers SGLang's transfer kernels take as K and V halves.
for _name in ("hicache_page_first", "hicache_page_first_direct", "hicache_page_head"):
    register(kv_halves(CATALOG[_name]))

# ---- kvlayout's own row buffer ----------------------------------------------------------
register(Layout("rows", "kvlayout logical rows [P, L, T, H, E] (what gather returns)", None,
                (Part("rows", "p l n h e"),), "kvlayout", chunk=True,
                notes="Plane count follows the tensor: P = 1 or 2."))


def get(name: str | Layout) -> Layout:
    """Look a layout up by name (a ``Layout`` is returned as is)."""
    if isinstance(name, Layout):
        return name
    try:
        return CATALOG[name]
    except KeyError:
        pass
    close = difflib.get_close_matches(str(name), CATALOG, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise KeyError(f"unknown layout {name!r}; {hint}known: {', '.join(sorted(CATALOG))}")


# ---------------------------------------------------------------------------------------
# Geometry
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Geometry:
    """Sizes of one cache bound to a layout.

    ``columns`` holds the width of each column part (empty when the layout has
    none); ``E`` is then their sum.
    """

    P: int
    L: int
    NB: int
    BS: int
    H: int
    E: int
    columns: tuple[int, ...] = ()

    @property
    def N(self) -> int:
        """Slots per layer and plane."""
        return self.NB * self.BS

    def part_sizes(self, part: Part) -> dict[str, int]:
        """Size of every canonical axis of ``part``."""
        e = self.columns[part.column] if part.column is not None else self.E
        p = 1 if part.plane is not None else self.P
        return {"p": p, "l": self.L, "nb": self.NB, "bs": self.BS, "h": self.H, "e": e}

    def part_shape(self, part: Part) -> tuple[int, ...]:
        """Shape of one physical tensor of ``part``."""
        sizes = self.part_sizes(part)
        shape = []
        for tok in part.pattern.split():
            shape.append(sizes["nb"] * sizes["bs"] if tok == "n" else sizes[tok])
        return tuple(shape)


def infer_geometry(layout: Layout | str, shapes: Sequence[Sequence[int]] | Sequence[Sequence[Sequence[int]]],
                   *, page_size: int | None = None, num_layers: int | None = None,
                   planes: int | None = None) -> Geometry:
    """Geometry from the physical shapes of a cache.

    ``shapes`` has one entry per part: the shape of the tensor, or for a
    per-layer part the list of per-layer shapes (all equal).  ``page_size`` is
    needed only when the slot axis is flat and pages matter (SGLang pools,
    HiCache page_first); it defaults to 1 there.  A shape that contradicts the
    layout breaks rule ``layout_shape``.
    """
    layout = get(layout)
    if len(shapes) != len(layout.parts):
        rules.LAYOUT_SHAPE.fail(f"{layout.name}: expected {len(layout.parts)} parts, got {len(shapes)}")
    found: dict[str, int] = {}
    columns: dict[int, int] = {}

    def bind(axis: str, size: int, where: str) -> None:
        if axis in found and found[axis] != size:
            rules.LAYOUT_SHAPE.fail(f"{layout.name}: {where} has {axis} = {size}, elsewhere {found[axis]}")
        found[axis] = size

    for part, shape in zip(layout.parts, shapes):
        if part.per_layer:
            layer_shapes = [tuple(s) for s in shape]
            if not layer_shapes:
                rules.LAYOUT_SHAPE.fail(f"{layout.name}: part {part.name!r} is an empty list of layers")
            if any(s != layer_shapes[0] for s in layer_shapes):
                rules.LAYOUT_SHAPE.fail(f"{layout.name}: part {part.name!r} has layers of different shapes "
                                        f"{layer_shapes}")
            bind("l", len(layer_shapes), f"part {part.name!r} list length")
            shape = layer_shapes[0]
        shape = tuple(shape)
        toks = part.pattern.split()
        if len(shape) != len(toks):
            rules.LAYOUT_SHAPE.fail(f"{layout.name}: part {part.name!r} must have {len(toks)} dims "
                                    f"[{', '.join(_DIM_NAMES.get(t, t) for t in toks)}], got shape {list(shape)}")
        for tok, size in zip(toks, shape):
            where = f"part {part.name!r} shape {list(shape)}"
            if tok == "n":
                bs = page_size or 1
                if size % bs:
                    rules.LAYOUT_SHAPE.fail(f"{layout.name}: {size} slots is not a multiple of page_size {bs}")
                bind("bs", bs, where)
                bind("nb", size // bs, where)
            elif tok == "e" and part.column is not None:
                columns[part.column] = size
            else:
                bind(tok, size, where)
    if page_size is not None and found.get("bs", page_size) != page_size:
        rules.LAYOUT_SHAPE.fail(f"{layout.name}: page_size={page_size} but the tensors have pages of "
                                f"{found['bs']}")
    P = found.get("p", layout.planes or 1)
    if any(p.plane is not None for p in layout.parts):
        P = layout.planes
    if planes is not None and P != planes:
        rules.LAYOUT_SHAPE.fail(f"{layout.name}: has {P} planes, expected {planes}")
    if layout.planes is not None and P != layout.planes:
        rules.LAYOUT_SHAPE.fail(f"{layout.name}: the plane axis must have size {layout.planes}, got {P}")
    L = found.get("l", 1)
    if num_layers is not None and L != num_layers:
        rules.LAYOUT_SHAPE.fail(f"{layout.name}: has {L} layers, expected {num_layers}")
    cols = tuple(columns[i] for i in sorted(columns))
    E = sum(cols) if cols else found["e"]
    return Geometry(P=P, L=L, NB=found.get("nb", 1), BS=found.get("bs", 1), H=found.get("h", 1), E=E,
                    columns=cols)


def make_geometry(layout: Layout | str, *, L: int, N: int, H: int, E: int, page_size: int = 1,
                  columns: Sequence[int] = (), P: int | None = None) -> Geometry:
    """Geometry from logical sizes (N must be a multiple of page_size).

    Axes a layout does not have must have size 1 (a one-layer chunk has L = 1,
    an MLA cache H = 1, a chunk page_size = 1).
    """
    layout = get(layout)
    if N % page_size:
        rules.LAYOUT_SHAPE.fail(f"N = {N} is not a multiple of page_size = {page_size}")
    axes = {a for part in layout.parts for a in part.full_axes}
    for axis, size in (("l", L), ("h", H)):
        if axis not in axes and size != 1:
            rules.LAYOUT_SHAPE.fail(f"{layout.name} has no {axis!r} axis, so its size must be 1 (got {size})")
    if not ({"nb", "bs"} & axes or any("n" in p.pattern.split() for p in layout.parts)) and N != 1:
        rules.LAYOUT_SHAPE.fail(f"{layout.name} has no slot axis")
    n_cols = len({p.column for p in layout.parts if p.column is not None})
    if n_cols and len(columns) != n_cols:
        rules.LAYOUT_SHAPE.fail(f"{layout.name} needs {n_cols} column widths, got {list(columns)}")
    if columns and sum(columns) != E:
        rules.LAYOUT_SHAPE.fail(f"column widths {list(columns)} do not add up to E = {E}")
    planes = P if P is not None else (layout.planes or 2)
    if layout.planes is not None and planes != layout.planes:
        rules.LAYOUT_SHAPE.fail(f"{layout.name} has {layout.planes} planes, not {planes}")
    return Geometry(P=planes, L=L, NB=N // page_size, BS=page_size, H=H, E=E, columns=tuple(columns))


# ---------------------------------------------------------------------------------------
# Patterns between one part and the logical space
# ---------------------------------------------------------------------------------------

def part_to_logical_pattern(part: Part) -> str:
    """einops pattern taking one part (stacked over layers) to ``[P, L, N, H, E]``.

    Axes the part lacks become unit axes on the logical side.
    """
    have = set(part.full_axes)
    rhs = []
    for axis in ("p", "l", "slot", "h", "e"):
        if axis == "slot":
            rhs.append("(nb bs)" if "nb" in have else "1")
        else:
            rhs.append(axis if axis in have else "1")
    return f"{part.full_einops_pattern} -> {' '.join(rhs)}"


def part_from_logical_pattern(part: Part) -> str:
    """The inverse of ``part_to_logical_pattern``."""
    lhs, rhs = part_to_logical_pattern(part).split(" -> ")
    return f"{rhs} -> {lhs}"


def part_axis_lengths(part: Part, geom: Geometry) -> dict[str, int]:
    """The axis lengths einops needs to split ``(nb bs)`` for this part."""
    sizes = geom.part_sizes(part)
    have = set(part.full_axes)
    return {a: sizes[a] for a in ("nb", "bs") if a in have}


def element_location(layout: Layout | str, geom: Geometry, plane: int, layer: int, slot: int, head: int,
                     e: int) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """Where logical element ``(plane, layer, slot, head, e)`` lives.

    Returns ``(part name, list index or (), index inside the tensor)``: a worked
    example for the rendered spec and for readers.
    """
    layout = get(layout)
    coords = {"p": plane, "l": layer, "nb": slot // geom.BS, "bs": slot % geom.BS, "h": head}
    col_start = 0
    for part in layout.parts:
        sizes = geom.part_sizes(part)
        if part.plane is not None and part.plane != plane:
            continue
        if part.column is not None:
            if not (col_start <= e < col_start + sizes["e"]):
                col_start += sizes["e"]
                continue
        local = dict(coords, e=e - col_start)
        if part.plane is not None:
            local["p"] = 0
        outer = (local["l"],) if part.per_layer else ()
        inner = []
        for tok in part.pattern.split():
            inner.append(local["nb"] * geom.BS + local["bs"] if tok == "n" else local[tok])
        return part.name, outer, tuple(inner)
    raise ValueError("coordinates outside the layout")


def describe_pattern(layout: Layout | str) -> list[str]:
    """One line per part: ``name: <physical> <-> [P, L, N, H, E]`` as einops writes it."""
    layout = get(layout)
    lines = []
    for part in layout.parts:
        extra = []
        if part.plane is not None:
            extra.append(f"holds plane {part.plane} only")
        if part.column is not None:
            extra.append(f"holds column block {part.column} of E")
        suffix = f"  ({'; '.join(extra)})" if extra else ""
        lines.append(f"{part.name}: {part_to_logical_pattern(part)}{suffix}")
    return lines


_IDENT = re.compile(r"^[a-z_][a-z0-9_]*$")
assert all(_IDENT.match(n) for n in CATALOG)


def catalog_table() -> list[Mapping[str, str]]:
    """The catalog as plain records (name, family, planes, structure, origin, patterns)."""
    return [
        {"name": lay.name, "family": lay.family, "planes": lay.planes, "structure": lay.structure(),
         "origin": lay.origin, "chunk": lay.chunk, "patterns": describe_pattern(lay), "notes": lay.notes}
        for lay in CATALOG.values()
    ]
