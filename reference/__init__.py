"""kvlayout's executable specification: every KV-cache layout and transfer, in JAX + einops.

Read top to bottom: ``layouts`` (the catalog, as data), ``logical`` (physical
caches <-> ``[P, L, N, H, E]``), ``operations`` (transfer, gather, scatter,
skip_prefix, move), ``pages`` (page helpers), ``rope`` (key repositioning).
This package never imports torch: it is the oracle the kernels are checked
against.
"""

import jax

# Slots, byte offsets and uint64 elements need 64-bit integers.
jax.config.update("jax_enable_x64", True)

from .layouts import CATALOG, AXES, Geometry, Layout, Part, get, infer_geometry, make_geometry, \
    element_location, describe_pattern, catalog_table, register  # noqa: E402
from .logical import to_logical, from_logical, geometry_of, parts_of, from_parts, flat_arrays, \
    map_arrays, dtype_of, shapes_of  # noqa: E402
from .operations import transfer, gather, scatter, move, skip_prefix, check_slots, as_bits, \
    from_bits  # noqa: E402
from .pages import get_page, set_page, zero_page, page_spans, slot_map  # noqa: E402
from .rope import rope_reposition  # noqa: E402

__all__ = [
    "CATALOG", "AXES", "Geometry", "Layout", "Part", "get", "infer_geometry", "make_geometry",
    "element_location", "describe_pattern", "catalog_table", "register",
    "to_logical", "from_logical", "geometry_of", "parts_of", "from_parts", "flat_arrays", "map_arrays",
    "dtype_of", "shapes_of",
    "transfer", "gather", "scatter", "move", "skip_prefix", "check_slots", "as_bits", "from_bits",
    "get_page", "set_page", "zero_page", "page_spans", "slot_map", "rope_reposition",
]
