"""Transfers between layouts: transfer, gather, scatter, skip_prefix, move.

Every operation is defined on the logical array ``[P, L, N, H, E]``:

    transfer = for each token t with both slots valid:
                   dst[plane, dst_layer, dst_slots[t], :] = src[plane, src_layer, src_slots[t], :]

with the row ``(h e)`` flattened.  Copies are byte-exact: arrays are bitcast
to unsigned integers of their width first.

The rules these functions decide (negative slots, out-of-range and repeated
slots, empty transfers, ``skip_prefix``, overlap in ``move``, ...) are the
named items of ``kvlayout.reference.semantics``; every check here raises
through its rule.  Slot values are checked whenever they are concrete (not
traced under ``jit``).
"""

from __future__ import annotations

import einops
import jax
import jax.numpy as jnp
import numpy as np

from . import semantics as rules
from .layouts import Geometry, Layout, get
from .logical import Physical, as_bits, dtype_of, from_bits, from_logical, geometry_of, to_logical


def concrete(x) -> np.ndarray | None:
    """The value of ``x`` as numpy when it is known now (not traced under jit)."""
    if x is None or isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def check_slots(name: str, slots, bound: int, *, unique: bool = False) -> None:
    """Check concrete slot values against the rules (nothing to check while traced).

    ``index_shape`` (1-D), ``index_dtype`` (integers), ``slot_out_of_range``
    (every slot ``< bound``) and, with ``unique``,
    ``duplicate_destination_slot``.
    """
    values = concrete(slots)
    if values is None:
        return
    if values.ndim != 1:
        rules.INDEX_SHAPE.fail(f"{name} must be 1-D, got shape {values.shape}")
    if not np.issubdtype(values.dtype, np.integer):
        rules.INDEX_DTYPE.fail(f"{name} must hold integers, got {values.dtype}")
    bad = np.nonzero(values >= bound)[0]
    if bad.size:
        i = int(bad[0])
        rules.SLOT_OUT_OF_RANGE.fail(f"{name}[{i}] = {int(values[i])} is out of range: the cache holds {bound} slots")
    if unique:
        valid = values[values >= 0]
        uniq, counts = np.unique(valid, return_counts=True)
        if (counts > 1).any():
            rules.DUPLICATE_DESTINATION_SLOT.fail(f"{name} repeats slot {int(uniq[counts > 1][0])}")


def skip_prefix(slots, n: int, num_tokens: int | None = None) -> jax.Array:
    """LMCache ``skip_prefix_n_tokens``: the first ``n`` tokens become "no token".

    ``slots [T]`` (``None`` = the positions ``0..T-1`` of a chunk, with
    ``T = num_tokens``) -> ``[T]``: the entries at positions ``0..n-1`` set
    to -1, every later entry kept whatever its value (the positions are
    counted, not the slot values compared with ``n``).  Chunk positions stay
    absolute: token t still pairs with chunk position t.
    """
    if slots is None:
        if num_tokens is None:
            rules.SKIP_PREFIX.fail("skip_prefix needs num_tokens when slots is None")
        num_tokens = _as_int("num_tokens", num_tokens)
        slots = jnp.arange(num_tokens, dtype=jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)
    slots = jnp.asarray(slots)
    n = _as_int("skip_prefix", n)
    if n < 0:
        rules.SKIP_PREFIX.fail(f"skip_prefix = {n} must be >= 0")
    return jnp.where(jnp.arange(slots.shape[0]) < n, -1, slots).astype(slots.dtype)


def _as_int(name: str, value) -> int:
    """``value`` as an int (``integer_argument``: bools and floats are refused, not truncated)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        rules.INTEGER_ARGUMENT.fail(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def _select(count: int, chosen, what: str, *, unique: bool = False) -> np.ndarray:
    """Chosen layers or planes (``None``: all) as an index array, checked against the rules."""
    if chosen is None:
        return np.arange(count)
    items = [chosen] if np.ndim(chosen) == 0 else list(chosen)
    chosen = np.array([_as_int(f"{what}[{i}]", c) for i, c in enumerate(items)], dtype=np.int64)
    if chosen.size and (chosen.min() < 0 or chosen.max() >= count):
        rules.LAYER_PLANE_OUT_OF_RANGE.fail(f"{what} {chosen.tolist()} out of range: there are {count}")
    if unique and np.unique(chosen).size != chosen.size:
        rules.LAYER_PLANE_PAIRING.fail(f"{what} {chosen.tolist()} repeats an index: a destination layer or "
                                       "plane may be written once")
    return chosen


def check_element_types(src_dtype, dst_dtype) -> None:
    """``element_type``: the same element type, or raw integer storage of the same size on one side."""
    src_dtype, dst_dtype = np.dtype(src_dtype), np.dtype(dst_dtype)
    raw = np.issubdtype(src_dtype, np.integer) or np.issubdtype(dst_dtype, np.integer)
    if src_dtype.itemsize != dst_dtype.itemsize or (src_dtype != dst_dtype and not raw):
        rules.ELEMENT_TYPE.fail(f"dtypes differ: source {src_dtype} ({src_dtype.itemsize} B), destination "
                                f"{dst_dtype} ({dst_dtype.itemsize} B) (a copy is byte-exact: the element types "
                                "must match, or one side must be raw integer storage of the same size)")


def transfer(src_layout: Layout | str, src: Physical, dst_layout: Layout | str, dst: Physical,
             src_slots=None, dst_slots=None, *, src_layers=None, dst_layers=None, src_planes=None,
             dst_planes=None, skip_prefix: int = 0, num_tokens: int | None = None,
             src_geom: Geometry | None = None, dst_geom: Geometry | None = None) -> Physical:
    """Copy token rows from one cache into another; returns the new destination.

    ``src_slots``/``dst_slots``: ``[T]`` int slots, or ``None`` for the
    positions ``0..T-1`` (chunk layouts).  ``T`` is the length of the given slot
    array(s), else ``num_tokens``, else the source slot count.
    ``src_layers``/``dst_layers``: the layers to copy, paired in order (default
    all; the two lists must have the same length).  ``src_planes``/``dst_planes``
    likewise for planes.  ``skip_prefix``: the first ``skip_prefix`` tokens are
    neither read nor written (see ``skip_prefix``).

    Rule: for each token t < T that is not skipped and has
    ``src_slots[t] >= 0`` and ``dst_slots[t] >= 0``, each plane pair (ps, pd)
    and layer pair (ls, ld): ``dst[pd, ld, dst_slots[t]] = src[ps, ls, src_slots[t]]``
    (rows of ``H * E`` elements, bit for bit).  Every other destination element
    keeps its value.
    """
    src_layout, dst_layout = get(src_layout), get(dst_layout)
    sg = src_geom or geometry_of(src_layout, src)
    dg = dst_geom or geometry_of(dst_layout, dst)
    src_dtype, dst_dtype = dtype_of(src_layout, src), dtype_of(dst_layout, dst)
    check_element_types(src_dtype, dst_dtype)
    if sg.H * sg.E != dg.H * dg.E:
        rules.ROW_WIDTH.fail(f"row widths differ: source H*E = {sg.H}*{sg.E}, destination H*E = {dg.H}*{dg.E}")
    src_p = _select(sg.P, src_planes, "src_planes")
    dst_p = _select(dg.P, dst_planes, "dst_planes", unique=True)
    if len(src_p) != len(dst_p):
        rules.LAYER_PLANE_PAIRING.fail(f"planes differ: source copies {len(src_p)} planes, "
                                       f"destination {len(dst_p)}")
    src_l = _select(sg.L, src_layers, "src_layers")
    dst_l = _select(dg.L, dst_layers, "dst_layers", unique=True)
    if len(src_l) != len(dst_l):
        rules.LAYER_PLANE_PAIRING.fail(f"src_layers has {len(src_l)} layers, dst_layers {len(dst_l)}")

    lengths = {len(s) for s in (src_slots, dst_slots) if s is not None}
    if len(lengths) > 1:
        rules.INDEX_SHAPE.fail(f"src_slots and dst_slots differ in length: {sorted(lengths)}")
    if num_tokens is not None:
        num_tokens = _as_int("num_tokens", num_tokens)
        if num_tokens < 0:
            rules.ARGUMENT_RANGE.fail(f"num_tokens = {num_tokens} must be >= 0")
    T = lengths.pop() if lengths else (num_tokens if num_tokens is not None else sg.N)
    if num_tokens is not None and num_tokens != T:
        rules.INDEX_SHAPE.fail(f"num_tokens = {num_tokens} but the slots hold {T} tokens")
    skip_prefix = _as_int("skip_prefix", skip_prefix)
    if not 0 <= skip_prefix <= T:
        rules.SKIP_PREFIX.fail(f"skip_prefix = {skip_prefix} must lie in [0, {T}]")
    s = jnp.arange(T) if src_slots is None else jnp.asarray(src_slots)
    d = jnp.arange(T) if dst_slots is None else jnp.asarray(dst_slots)
    check_slots("src_slots", s, sg.N)
    check_slots("dst_slots", d, dg.N, unique=True)
    if T == 0 or len(src_l) == 0 or len(src_p) == 0:
        return dst

    src_rows = einops.rearrange(as_bits(to_logical(src_layout, src, sg)), "p l n h e -> p l n (h e)")
    dst_rows = einops.rearrange(as_bits(to_logical(dst_layout, dst, dg)), "p l n h e -> p l n (h e)")
    valid = (jnp.arange(T) >= skip_prefix) & (s >= 0) & (d >= 0)
    read = jnp.where(valid, s, 0)
    write = jnp.where(valid, d, dg.N)  # one past the end: dropped by mode="drop"
    values = src_rows[src_p[:, None], src_l[None, :]][:, :, read]                # [P', L', T, W]
    block = dst_rows[dst_p[:, None], dst_l[None, :]]                              # [P', L', N, W]
    block = block.at[:, :, write].set(values.astype(block.dtype), mode="drop")
    dst_rows = dst_rows.at[dst_p[:, None], dst_l[None, :]].set(block)
    logical = einops.rearrange(dst_rows, "p l n (h e) -> p l n h e", h=dg.H)
    return from_logical(dst_layout, from_bits(logical, dst_dtype), dg)


def gather(layout: Layout | str, cache: Physical, slots=None, *, out=None, layers=None, planes=None,
           skip_prefix: int = 0, num_tokens: int | None = None) -> jax.Array:
    """Cache -> rows: ``out[i, j, t] = cache[planes[i], layers[j], slots[t]]``.

    Returns ``[P', L', T, H, E]`` (P' chosen planes, L' chosen layers, default
    all) in the cache's dtype.  ``out`` (default zeros) supplies the rows that
    are not written: tokens with a negative slot or inside the skipped prefix.
    """
    layout = get(layout)
    geom = geometry_of(layout, cache)
    P = len(_select(geom.P, planes, "planes"))
    L = len(_select(geom.L, layers, "layers"))
    T = len(slots) if slots is not None else (num_tokens if num_tokens is not None else geom.N)
    if out is None:
        out = jnp.zeros((P, L, T, geom.H, geom.E), dtype_of(layout, cache))
    return transfer(layout, cache, "rows", out, slots, None, src_layers=layers, src_planes=planes,
                    skip_prefix=skip_prefix, num_tokens=T if slots is None else None)


def scatter(layout: Layout | str, cache: Physical, rows: jax.Array, slots=None, *, layers=None, planes=None,
            skip_prefix: int = 0) -> Physical:
    """Rows -> cache: ``cache[planes[i], layers[j], slots[t]] = rows[i, j, t]``; returns the new cache.

    ``rows [P', L', T, H', E']`` with ``H' * E' = H * E``.  Negative slots and
    the skipped prefix write nothing.
    """
    return transfer("rows", rows, layout, cache, None, slots, dst_layers=layers, dst_planes=planes,
                    skip_prefix=skip_prefix)


def move(layout: Layout | str, cache: Physical, src_slots, dst_slots) -> Physical:
    """Within one cache, for all layers and planes: ``cache[dst_slots[t]] = old_cache[src_slots[t]]``.

    Every read sees the cache as it was before the move, so overlapping
    ``src_slots``/``dst_slots`` (shifts, swaps, chains) are well defined.
    Pairs with a negative slot are skipped; repeated destinations raise.
    """
    layout = get(layout)
    geom = geometry_of(layout, cache)
    src_slots, dst_slots = jnp.asarray(src_slots), jnp.asarray(dst_slots)
    if src_slots.shape != dst_slots.shape:
        rules.INDEX_SHAPE.fail(f"src_slots {src_slots.shape} and dst_slots {dst_slots.shape} differ in length")
    check_slots("src_slots", src_slots, geom.N)
    check_slots("dst_slots", dst_slots, geom.N, unique=True)
    dtype = dtype_of(layout, cache)
    logical = as_bits(to_logical(layout, cache, geom))
    valid = (src_slots >= 0) & (dst_slots >= 0)
    values = logical[:, :, jnp.where(valid, src_slots, 0)]
    logical = logical.at[:, :, jnp.where(valid, dst_slots, geom.N)].set(values, mode="drop")
    return from_logical(layout, from_bits(logical, dtype), geom)
