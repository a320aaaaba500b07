"""The copy-program registry: planned once per layout pair and choice, bounded, pinned while in use.

A program (:mod:`kvlayout.ops.planner`) depends on both caches'
:class:`~kvlayout.ops.planner.CacheSpec` and the chosen layers and planes, never
on the token count, so an engine needs a handful.  The registry is still a
least-recently-used cache of at most :func:`program_cache_capacity` programs
(``KVLAYOUT_PROGRAM_CACHE``, default 512): a process that calls transfers with
arbitrary layer subsets runs for weeks in bounded memory.  A program in use is
*pinned* and never evicted: by a prepared transfer while it lives, and by a
compiled graph (which keeps the handle as a constant) for the life of the
process.  An evicted handle is dropped from the native registry; handles are
never reused, so a stale one raises instead of running another program.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Sequence

from kvlayout import _C

from . import compiler_marks
from .locks import fork_safe
from .planner import cache_spec, program_steps
from .settings import environment_capacity
from .views import KVCache

# reentrant: a prepared transfer's finalizer unpins its program, and the garbage collector may run it on this
# thread while the lock is held (an allocation inside program_handle or _evict)
_lock = fork_safe(threading.RLock())
_handles: dict = {}                                              # program key -> handle
_order: collections.OrderedDict = collections.OrderedDict()      # handle -> program key, least recent first
_pins: dict[int, int] = {}                                       # handle -> pin count
_capacity = environment_capacity("KVLAYOUT_PROGRAM_CACHE", 512)


def program_key(src: KVCache, dst: KVCache, src_layers, dst_layers, src_planes, dst_planes) -> tuple:
    """What a program depends on: both caches' specs and the choice (hashable, free of T)."""
    return (cache_spec(src), cache_spec(dst), tuple(src_layers), tuple(dst_layers), tuple(src_planes),
            tuple(dst_planes))


def _register(key: tuple) -> int:
    src, dst, *choice = key
    steps = program_steps(src, dst, *choice)
    return _C.register_program(steps, src.tensor_axes(), dst.tensor_axes())


def _evict() -> None:
    """Drops the least recently used unpinned programs beyond the capacity (lock held)."""
    excess = len(_order) - _capacity
    if excess <= 0:
        return
    for handle in list(_order):
        if excess <= 0:
            break
        key = _order.get(handle)
        if key is None:             # evicted by a finalizer's unpin that ran inside this loop
            continue
        if handle not in _pins:
            del _order[handle], _handles[key]
            _C.drop_program(handle)
            excess -= 1


def program_handle(key: tuple, *, pin: bool = False) -> int:
    """The handle of the program for ``key`` (:func:`program_key`), registered on first use.

    ``pin``: keep it registered until :func:`unpin` (a prepared transfer, a compiled graph).
    """
    with _lock:
        handle = _handles.get(key)
        if handle is None:
            handle = _handles[key] = _register(key)
            _order[handle] = key
        else:
            _order.move_to_end(handle)
        if pin:
            _pins[handle] = _pins.get(handle, 0) + 1
        _evict()
        return handle


def pin_registered(handle: int | None) -> bool:
    """Pins a handle :func:`program_handle` returned earlier, if its program is still registered (False: it was
    evicted, or ``handle`` is None; the key's :func:`program_handle` registers it again).

    The repeated call's way to its program: a key is a tuple of both caches' specs, hashed at every lookup
    (0.6 µs on the CPU), a handle an int.
    """
    with _lock:
        if handle not in _order:
            return False
        _order.move_to_end(handle)
        _pins[handle] = _pins.get(handle, 0) + 1
        return True


def unpin(handle: int) -> None:
    """Releases one pin of :func:`program_handle` (the program may then be evicted)."""
    with _lock:
        count = _pins.get(handle, 0) - 1
        if count > 0:
            _pins[handle] = count
        else:
            _pins.pop(handle, None)
            _evict()


@compiler_marks.assume_constant_result
def compiled_program_handle(key: tuple) -> int:
    """:func:`program_handle` for compiled code: evaluated while tracing, kept in the graph as a constant,
    so the program stays pinned for the life of the process."""
    return program_handle(key, pin=True)


def clear_unpinned() -> None:
    """Drops every program nothing pins (the next call of a choice plans it again)."""
    global _capacity
    with _lock:
        saved, _capacity = _capacity, 0
        try:
            _evict()
        finally:
            _capacity = saved


def set_program_cache_capacity(capacity: int) -> None:
    """How many programs the registry keeps (pinned ones are never evicted)."""
    global _capacity
    if type(capacity) is not int or capacity < 1:
        raise ValueError(f"the program cache capacity must be a positive int, got {capacity!r}")
    with _lock:
        _capacity = capacity
        _evict()


def program_cache_capacity() -> int:
    return _capacity


def cache_sizes() -> dict:
    """Entries of the registry and the native binding cache (for monitoring a long-running process)."""
    with _lock:
        programs, pinned = len(_order), len(_pins)
    return {"programs": programs, "pinned_programs": pinned, "native_programs": _C.program_count(),
            "bindings": _C.binding_cache_size()}


@dataclasses.dataclass
class Launch:
    """One launch of a program resolved against two caches' tensors, in bytes.

    Segments are flat ``[tensor index, byte offset, ...]`` lists into
    ``src_tensors``/``dst_tensors``; geometries are ``(num_slots, page_size,
    stride_page, stride_in_page, stride_piece)`` in bytes: exactly the
    arguments of one ``kvlayout::copy_rows`` (or ``copy_runs``) call.
    """

    src_tensors: list = dataclasses.field(repr=False)
    dst_tensors: list = dataclasses.field(repr=False)
    src_segments: list
    dst_segments: list
    src_geometry: list
    dst_geometry: list
    num_pieces: int
    piece_bytes: int


def resolve(handle: int, step: int, src: KVCache, dst: KVCache) -> list[Launch]:
    """Step ``step`` of a program resolved against these caches' tensors (the native resolution)."""
    out = []
    for s_geom, d_geom, pieces, piece_bytes, s_segs, d_segs in _C.resolve_program(
            handle, step, list(src.tensors), list(dst.tensors)):
        out.append(Launch(list(src.tensors), list(dst.tensors), [v for seg in s_segs for v in seg],
                          [v for seg in d_segs for v in seg], list(s_geom), list(d_geom), pieces, piece_bytes))
    return out


def plan(src: KVCache, dst: KVCache, src_layers: Sequence[int], dst_layers: Sequence[int],
         src_planes: Sequence[int], dst_planes: Sequence[int]) -> list[Launch]:
    """The launches copying the chosen (plane, layer) rows of ``src`` into ``dst``, resolved to bytes."""
    handle = program_handle(program_key(src, dst, src_layers, dst_layers, src_planes, dst_planes), pin=True)
    try:
        return resolve(handle, 0, src, dst)
    finally:
        unpin(handle)
