"""kvlayout's executable specification: every KV-cache layout and transfer, in JAX + einops.

Read top to bottom: ``semantics`` (the decided rules, each named once, with
the exception it raises), ``layouts`` (the catalog, as data), ``logical`` (physical
caches <-> ``[P, L, N, H, E]``), ``operations`` (transfer, gather, scatter,
skip_prefix, move), ``pages`` (page helpers), ``rope`` (key repositioning),
``resharding`` (KV heads across tensor-parallel sizes: who sends which head
to whom).
This package never imports torch: it is the oracle the kernels are checked
against.  ``semantics`` and ``layouts`` do not import jax either, so the op
library can read the rules and the catalog without it; the other modules load
on first use.
"""

import importlib

from . import semantics
from .layouts import (
    AXES,
    CATALOG,
    Geometry,
    Layout,
    Part,
    catalog_table,
    describe_pattern,
    element_location,
    get,
    infer_geometry,
    make_geometry,
    register,
)
from .semantics import RULES, Rule

_LAZY = {
    "logical": ("to_logical", "from_logical", "geometry_of", "parts_of", "from_parts", "flat_arrays",
                "map_arrays", "dtype_of", "shapes_of"),
    "operations": ("transfer", "gather", "scatter", "move", "skip_prefix", "check_slots", "as_bits",
                   "from_bits", "concrete"),
    "pages": ("get_page", "set_page", "zero_page", "page_spans", "slot_map"),
    "rope": ("rope_reposition",),
    "resharding": ("kv_heads", "kv_routes", "source_rank", "replicas", "Route", "reshard"),
}
_OWNER = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name):
    module = _OWNER.get(name)
    if module is None:
        raise AttributeError(f"module 'kvlayout.reference' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


__all__ = ["AXES", "CATALOG", "Geometry", "Layout", "Part", "RULES", "Rule", "catalog_table", "describe_pattern",
           "element_location", "get", "infer_geometry", "make_geometry", "register", "semantics", *_OWNER]
