"""Physical caches <-> the logical array ``[P, L, N, H, E]`` (jax + einops).

A *physical value* is what an engine holds: for a one-part layout the part
itself (one array, or a list of per-layer arrays); for a layout of several
parts a tuple with one entry per part, in the layout's part order (SGLang MHA:
``(k_list, v_list)``; page_first_kv_split: ``(nope, rope)``).
"""

from __future__ import annotations

from typing import Any, Sequence

import einops
import jax
import jax.numpy as jnp
import numpy as np

from . import semantics as rules
from .layouts import (
    Geometry,
    Layout,
    get,
    infer_geometry,
    part_axis_lengths,
    part_from_logical_pattern,
    part_to_logical_pattern,
)

# Slots, byte offsets and uint64 elements need 64-bit integers.
jax.config.update("jax_enable_x64", True)

Physical = Any


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def as_bits(x: jax.Array) -> jax.Array:
    """Bitcast to the unsigned integer of the same width (no value changes).

    Layout changes run on these bits: XLA may rewrite NaN payloads when it
    stacks or concatenates float arrays, and copies must be byte-exact.
    """
    if isinstance(x, np.ndarray):          # numpy views bits without any computation
        return jnp.asarray(x.view(_UINT[x.dtype.itemsize]))
    x = jnp.asarray(x)
    return jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]) if x.dtype.kind != "u" else x


def from_bits(x: jax.Array, dtype) -> jax.Array:
    """Inverse of ``as_bits``."""
    dtype = jnp.dtype(dtype)
    return x if dtype == x.dtype else jax.lax.bitcast_convert_type(x, dtype)


def parts_of(layout: Layout | str, physical: Physical) -> tuple:
    """The physical value as a tuple with one entry per part."""
    layout = get(layout)
    if layout.single_part:
        return (physical,)
    if not isinstance(physical, (tuple, list)) or len(physical) != len(layout.parts):
        rules.LAYOUT_SHAPE.fail(f"{layout.name}: expected {len(layout.parts)} parts "
                         f"({', '.join(p.name for p in layout.parts)})")
    return tuple(physical)


def from_parts(layout: Layout | str, parts: Sequence) -> Physical:
    """Inverse of ``parts_of``."""
    layout = get(layout)
    return parts[0] if layout.single_part else tuple(parts)


def shapes_of(layout: Layout | str, physical: Physical) -> list:
    """Per part: the array's shape, or the list of per-layer shapes."""
    layout = get(layout)
    out = []
    for part, value in zip(layout.parts, parts_of(layout, physical)):
        out.append([tuple(np.shape(x)) for x in value] if part.per_layer else tuple(np.shape(value)))
    return out


def geometry_of(layout: Layout | str, physical: Physical, page_size: int | None = None) -> Geometry:
    """Geometry inferred from the physical shapes (see ``layouts.infer_geometry``)."""
    return infer_geometry(layout, shapes_of(layout, physical), page_size=page_size)


def dtype_of(layout: Layout | str, physical: Physical):
    """The element type of the cache (every tensor of a cache shares it)."""
    first = parts_of(layout, physical)[0]
    first = first[0] if get(layout).parts[0].per_layer else first
    return jnp.asarray(first).dtype


def to_logical(layout: Layout | str, physical: Physical, geom: Geometry | None = None) -> jax.Array:
    """``[P, L, N, H, E]`` view of a physical cache.

    Each part is rearranged with ``<pattern> -> p l (nb bs) h e``; single-plane
    parts are stacked along ``p`` in plane order and column parts are
    concatenated along ``e`` in column order.
    """
    layout = get(layout)
    geom = geom or geometry_of(layout, physical)
    dtype = dtype_of(layout, physical)
    pieces = []
    for part, value in zip(layout.parts, parts_of(layout, physical)):
        array = jnp.stack([as_bits(x) for x in value]) if part.per_layer else as_bits(value)
        pieces.append((part, einops.rearrange(array, part_to_logical_pattern(part),
                                              **part_axis_lengths(part, geom))))
    by_plane = [x for part, x in sorted(pieces, key=lambda pc: pc[0].plane or 0) if part.plane is not None]
    if by_plane:
        return from_bits(jnp.concatenate(by_plane, axis=0), dtype)
    by_column = [x for part, x in sorted(pieces, key=lambda pc: pc[0].column or 0) if part.column is not None]
    if by_column:
        return from_bits(jnp.concatenate(by_column, axis=-1), dtype)
    return from_bits(pieces[0][1], dtype)


def from_logical(layout: Layout | str, logical: jax.Array, geom: Geometry) -> Physical:
    """Physical cache holding ``logical`` ``[P, L, N, H, E]`` (inverse of ``to_logical``)."""
    layout = get(layout)
    expected = (geom.P, geom.L, geom.N, geom.H, geom.E)
    if tuple(logical.shape) != expected:
        rules.LAYOUT_SHAPE.fail(f"{layout.name}: logical array has shape {tuple(logical.shape)}, expected {expected}")
    dtype = logical.dtype
    bits = as_bits(logical)
    parts = []
    column_start = 0
    for part in sorted(layout.parts, key=lambda p: p.column or 0):
        x = bits
        if part.plane is not None:
            x = x[part.plane:part.plane + 1]
        if part.column is not None:
            width = geom.columns[part.column]
            x = x[..., column_start:column_start + width]
            column_start += width
        array = einops.rearrange(x, part_from_logical_pattern(part), **part_axis_lengths(part, geom))
        parts.append((part, [from_bits(x, dtype) for x in array] if part.per_layer else from_bits(array, dtype)))
    order = {id(p): i for i, p in enumerate(layout.parts)}
    parts.sort(key=lambda pc: order[id(pc[0])])
    return from_parts(layout, [value for _, value in parts])


def map_arrays(layout: Layout | str, physical: Physical, fn) -> Physical:
    """Apply ``fn`` to every array of a physical cache, keeping its structure."""
    layout = get(layout)
    out = []
    for part, value in zip(layout.parts, parts_of(layout, physical)):
        out.append([fn(x) for x in value] if part.per_layer else fn(value))
    return from_parts(layout, out)


def flat_arrays(layout: Layout | str, physical: Physical) -> list:
    """Every array of a physical cache in order: part by part, layer by layer."""
    layout = get(layout)
    out = []
    for part, value in zip(layout.parts, parts_of(layout, physical)):
        out.extend(value if part.per_layer else [value])
    return out
