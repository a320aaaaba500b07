"""Every cache kvlayout keeps, its bound, and how to change it.

A serving process calls transfers for weeks with ever new token counts,
tensors and layer subsets; nothing kvlayout remembers may grow without bound.

=====================  ==========================================  ==============================
cache                  holds                                       bound (setting / environment)
=====================  ==========================================  ==============================
``programs``           copy programs, per layout pair and choice   ``programs`` /
                       (never per token count)                     ``KVLAYOUT_PROGRAM_CACHE`` (512);
                                                                   pinned ones (prepared transfers,
                                                                   compiled graphs) are never evicted
``bindings``           programs bound to tensor addresses (C++;    ``bindings`` /
                       data pointers and checked plans, no         ``KVLAYOUT_BINDING_CACHE`` (256)
                       tensors)
``shapes``             what binding derived from tensors of one    ``shapes`` /
                       structure (sizes, strides, element type,    ``KVLAYOUT_SHAPE_CACHE`` (256)
                       device), with the checked arguments and
                       program key per (destination shape,
                       choice): no tensors
``choices``            checked arguments per (source cache,        256 per source cache, released
                       destination cache, choice)                  with the caches; 256 per shape
                                                                   for pairs of shapes, released
                                                                   with the shape
``staging``            staging rings of ``engine="staged"``, one   ``ops.staged.KEPT_RINGS`` (2) of
                       per stream, each with the transfers         ``KVLAYOUT_STAGING_BYTES`` (64 MiB)
                       planned on it                               each; 64 transfers per ring
``staged_graphs``      per staged transfer, the CUDA graphs of     ``staged_graphs`` /
                       repeated call shapes (C++; each with        ``KVLAYOUT_STAGED_GRAPHS`` (8);
                       buffers of a few bytes per token)           0: every call issued directly
``thread_scratch``     per thread, the host's slot checks, its     1 MiB per vector
                       copies of the slots, the copy engine's      (``thread_scratch_kept_bytes``);
                       run list (C++), reused call after call      a larger call's given back at its
                                                                   end
=====================  ==========================================  ==============================

Least recently used entries go first (``choices`` are cleared when full).
"""

from __future__ import annotations

from kvlayout import _C

from . import calibration, programs, staged, views
from .settings import environment_capacity


def cache_info() -> dict:
    """Entries and bounds of every cache, e.g. ``{"programs": 3, "programs_capacity": 512, ...}``."""
    info = programs.cache_sizes()
    info["programs_capacity"] = programs.program_cache_capacity()
    info["bindings_capacity"] = _C.binding_cache_capacity()
    info["shapes"] = len(views.SHAPES.entries)
    info["shapes_capacity"] = views.SHAPES.capacity
    with staged._RINGS_LOCK:   # (other threads take rings and plan transfers meanwhile)
        transfers = [ring.transfers.values() for ring in staged._RINGS.values()]   # per ring
    info["staging"] = len(transfers)
    info["staging_capacity"] = staged.KEPT_RINGS
    info["staging_bytes"] = staged.STAGING_BYTES
    info["staged_chunks"] = _C.staged_chunks()
    info["staged_transfers"] = sum(len(planned) for planned in transfers)
    info["staged_graphs"] = sum(t.native.kept_graphs for planned in transfers for t in planned)
    info["staged_graphs_capacity"] = _C.staged_graph_capacity()
    info["thread_scratch_bytes"] = _C.thread_scratch_bytes()   # the calling thread's
    info["thread_scratch_kept_bytes"] = _C.thread_scratch_kept_bytes
    info["calibrations"] = calibration.calibrated_devices()   # (each device's result: ops.calibrate(device))
    return info


def set_cache_capacity(*, programs: int | None = None, bindings: int | None = None, shapes: int | None = None,
                       staged_graphs: int | None = None) -> None:
    """Bound the program registry, the native binding cache and the binding shapes (entries beyond the bound are
    evicted now), and the graphs each staged transfer keeps (0: none, every staged call issued directly; each
    transfer lets go of its graphs beyond the bound at its next call)."""
    from . import programs as registry  # (the argument shadows the module's name)
    if programs is not None:
        registry.set_program_cache_capacity(programs)
    if shapes is not None:
        views.SHAPES.set_capacity(shapes)
    if bindings is not None:
        if type(bindings) is not int or bindings < 1:
            raise ValueError(f"the binding cache capacity must be a positive int, got {bindings!r}")
        _C.set_binding_cache_capacity(bindings)
    if staged_graphs is not None:
        if type(staged_graphs) is not int or staged_graphs < 0:
            raise ValueError(f"the staged graph capacity must be an int >= 0, got {staged_graphs!r}")
        _C.set_staged_graph_capacity(staged_graphs)


_C.set_binding_cache_capacity(environment_capacity("KVLAYOUT_BINDING_CACHE", 256))
_C.set_staged_graph_capacity(environment_capacity("KVLAYOUT_STAGED_GRAPHS", 8, minimum=0))
