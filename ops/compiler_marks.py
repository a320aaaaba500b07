"""The marks ``torch.compile`` reads off kvlayout's objects, set without importing ``torch._dynamo``.

torch loads ``torch._dynamo`` (the compiler's front end) only when something
touches it, and its import takes about as long as torch's own. kvlayout marks
a few objects for the compiler: the compiled program handle (a constant
result) and each device's status tensor (static sizes and address). Through
``torch._dynamo``'s functions, that would load the compiler into every process
that imports kvlayout or makes its first cache, compiling or not: seconds
spent at an engine worker's first call, inside whatever deadline it runs
under. Those functions only set attributes that dynamo reads later, so where
dynamo is not loaded yet, the same attributes are set here, as they set them
(``tests/test_import_cost.py`` compares the two under the installed torch);
where it is loaded, its own functions are used.
"""

from __future__ import annotations

import sys

import torch


def _compiler_loaded() -> bool:
    return "torch._dynamo" in sys.modules


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)``: compiled code calls ``fn`` while tracing and keeps its
    result in the graph as a constant."""
    if _compiler_loaded():
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


def mark_static(t: torch.Tensor) -> None:
    """``torch._dynamo.mark_static(t)`` and ``torch._dynamo.mark_static_address(t)``: every size of ``t`` and its
    address are constants to compiled code (no size of it becomes a symbol, and inductor's CUDA graphs may
    write it in place)."""
    if _compiler_loaded():
        torch._dynamo.mark_static(t)
        torch._dynamo.mark_static_address(t)
        return
    t._dynamo_static_indices = set(range(t.dim()))
    t._has_dynamo_dim_marking = True
    t._dynamo_static_input_type = "unguarded"
