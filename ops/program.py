"""Copy programs: :func:`~kvlayout.ops.transfer.plan`'s launches, registered once in C++.

A copy program (``torch_ext/program.h``) is the planner's answer for one
choice of (source binding, destination binding, layers, planes), in the form
the native side keeps: a list of *steps*, each a list of
``kvlayout._C.LaunchSpec``.  Step 0 copies every chosen layer; step
``1 + i`` copies only the ``i``-th chosen layer.  A ``LaunchSpec`` is one
``copy_rows`` launch: a row geometry per side (``(num_slots, page_size,
stride_page, stride_in_page, stride_piece)`` in bytes), ``num_pieces`` and
``piece_bytes`` per row, and its segments as ``(tensor index, byte
offset)`` pairs, the tensor index counting in the cache's flat tensor list
(:attr:`KVCache.tensors`).  Programs hold no tensors and are registered
once per distinct choice; the integer handle is what a call (and a compiled
graph) refers to.
"""

from __future__ import annotations

import importlib

from kvlayout import _C

from .transfer import Launch
from .views import KVCache

# the module (the package's name ``transfer`` is the function)
_transfer = importlib.import_module(__package__ + ".transfer")

_HANDLES: dict[tuple, int] = {}


def _tensor_index(cache: KVCache, key: tuple) -> int:
    """Index in ``cache.tensors`` of the tensor named by a plan key ``(part name, layer or None)``."""
    name, layer = key
    index = 0
    for pv in cache.parts:
        if pv.part.name == name:
            return index + (layer if layer is not None else 0)
        index += len(pv.tensors)
    raise KeyError(name)


def _launch_spec(src: KVCache, dst: KVCache, launch: Launch) -> "_C.LaunchSpec":
    def segments(cache, keys, flat):
        return [(_tensor_index(cache, keys[flat[2 * i]]), flat[2 * i + 1]) for i in range(len(flat) // 2)]
    return _C.LaunchSpec(tuple(launch.src_geometry), tuple(launch.dst_geometry), launch.num_pieces,
                         launch.piece_bytes, segments(src, launch.src_keys, launch.src_segments),
                         segments(dst, launch.dst_keys, launch.dst_segments))


def program_steps(src: KVCache, dst: KVCache, src_layers, dst_layers, src_planes, dst_planes) -> list[list[Launch]]:
    """The program's steps as :class:`Launch` lists: all chosen layers, then one step per layer."""
    plan = _transfer.plan   # looked up per call: a test may put a faulty planner in its place
    steps = [plan(src, dst, src_layers, dst_layers, src_planes, dst_planes)]
    steps += [plan(src, dst, [ls], [ld], src_planes, dst_planes) for ls, ld in zip(src_layers, dst_layers)]
    return steps


def program_for(src: KVCache, dst: KVCache, src_layers, dst_layers, src_planes, dst_planes) -> int:
    """The handle of the program for this choice (planned and registered on first use).

    Keyed by both caches' signatures (layout, geometry, element size,
    strides: what a plan depends on) and the chosen layers and planes.
    """
    key = (_transfer.plan, src.signature, dst.signature, tuple(src_layers), tuple(dst_layers), tuple(src_planes),
           tuple(dst_planes))
    handle = _HANDLES.get(key)
    if handle is None:
        steps = [[_launch_spec(src, dst, launch) for launch in step]
                 for step in program_steps(src, dst, src_layers, dst_layers, src_planes, dst_planes)]
        handle = _HANDLES.setdefault(key, _C.register_program(steps, len(src.tensors), len(dst.tensors)))
    return handle
