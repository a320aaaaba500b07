"""The routes from a checked transfer to the copy kernel: eager, compiled, copy engine.

Every route runs a copy program (:mod:`kvlayout.ops.programs`); the slot
check is the native op's (``torch_ext/slots.h``), whichever route reached it.

* **eager** (:func:`run_kernel` outside tracing): the first call of a choice
  runs the program through ``_C.run_program`` (its binding cached in C++ by
  the tensors' addresses); from the second call on the choice keeps the
  program bound to its caches (``_C.PreparedCopy``), and a call with plain
  slot tensors is checked and launched by one C++ call
  (:func:`try_direct`).  Tensors that need the dispatcher (fake tensors,
  subclasses, dispatch modes) go through ``torch.ops.kvlayout.copy_program``.
* **compiled** (:func:`run_kernel` while tracing): one
  ``torch.ops.kvlayout.copy_program`` call whose program handle is a constant
  of the graph and whose token count and skip_prefix are symbolic, so one
  graph serves every T.
* **copy engine** (:func:`run_copy_engine`): the program resolved to bytes,
  run by ``kvlayout::copy_runs`` (no SMs; slots read on the host).

The staged engine (:mod:`kvlayout.ops.staged`) is built on :func:`run`.
"""

from __future__ import annotations

import torch

from kvlayout import _C

from . import _native
from .arguments import CheckedChoice, check_disjoint, check_slots, checked_choice, validating
from .planner import cache_spec, tensors_of
from .programs import Launch, compiled_program_handle, pin_registered, program_handle, program_key, unpin
from .views import KVCache


def choice_key(src: KVCache, dst: KVCache, c: CheckedChoice) -> tuple:
    """The program key of a checked choice."""
    return program_key(src, dst, c.src_layers, c.dst_layers, c.src_planes, c.dst_planes)


def check_not_shared(src: KVCache, dst: KVCache, c: CheckedChoice) -> None:
    """No tensor of the chosen rows is both read and written (see :func:`check_disjoint`)."""
    check_disjoint(src, dst, (tensors_of(cache_spec(src), c.src_layers, c.src_planes),
                              tensors_of(cache_spec(dst), c.dst_layers, c.dst_planes)))


def pinned_program(c: CheckedChoice) -> int:
    """The handle of the choice's program, pinned (:func:`~kvlayout.ops.programs.unpin` it after the run: another
    thread may fill the registry meanwhile). The handle is kept on the choice of the caches' shapes, which every
    pair of cache objects of those shapes shares, so a call between caches bound anew finds it without hashing
    the program key."""
    owner = c.shared if c.shared is not None else c
    handle = owner.handle
    if not pin_registered(handle):
        handle = owner.handle = program_handle(c.program, pin=True)
    return handle


def try_direct(c: CheckedChoice, src_slots, dst_slots, skip_prefix, validate) -> bool:
    """A repeated call with plain slot tensors, checked and launched by one C++ call; False: not done."""
    run_checking = c.run_checking
    return run_checking is not None and run_checking(0, src_slots, dst_slots, skip_prefix, c.max_ctas, validate)


def run_first(src: KVCache, dst: KVCache, c: CheckedChoice, src_slots, dst_slots, skip_prefix: int,
              validate: bool) -> bool:
    """The first kernel call between two cache objects (``ops.transfer`` without planes or ``num_tokens``), with
    slots not checked yet: one C++ call checks them (``_C.run_program_checking``) and launches step 0 of the
    choice's program, bound by the tensors' addresses. False: not done (slots other than plain tensors, or
    tensors that need the dispatcher), for the long way, whose errors name the argument."""
    handle = pinned_program(c)
    try:
        done = _C.run_program_checking(handle, src.native_tensors(), dst.native_tensors(), src_slots, dst_slots,
                                       skip_prefix, c.max_ctas, c.status, validate, src.geometry.N, dst.geometry.N)
    finally:
        unpin(handle)
    if done:
        c.kernel_calls = 1   # (a second call of the pair binds: run_kernel)
    return done


def run_kernel(src: KVCache, dst: KVCache, c: CheckedChoice, src_slots, dst_slots, num_tokens, skip_prefix,
               validate: bool) -> None:
    """Runs step 0 of the choice's program with checked slot arguments (T > 0)."""
    if torch.compiler.is_compiling():
        check_not_shared(src, dst, c)   # (no addresses while tracing: the caches' own tensors)
        handle = compiled_program_handle(choice_key(src, dst, c))
        torch.ops.kvlayout.copy_program(handle, list(src.tensors), list(dst.tensors), src_slots, dst_slots, 0,
                                        num_tokens, skip_prefix, c.max_ctas, _native.status_tensor(c.device),
                                        validate)
        return
    if c.bound is not None and c.bound.run_with(0, src_slots, dst_slots, num_tokens, skip_prefix, c.max_ctas,
                                                validate):
        return
    handle = pinned_program(c)
    try:
        c.kernel_calls += 1
        if c.kernel_calls >= 2:
            # a repeated call (memoized choice: same src and dst objects): keep the binding (re-made when a
            # tensor moved); a one-off call leaves it to run_program's cache by address
            c.bind(_C.bind_program(handle, list(src.tensors), list(dst.tensors), c.status, src.geometry.N,
                                   dst.geometry.N))
            if c.bound is not None and c.bound.run_with(0, src_slots, dst_slots, num_tokens, skip_prefix,
                                                        c.max_ctas, validate):
                return
        if not _C.run_program(handle, src.tensors, dst.tensors, src_slots, dst_slots, 0, num_tokens, skip_prefix,
                              c.max_ctas, c.status, validate):
            torch.ops.kvlayout.copy_program(handle, list(src.tensors), list(dst.tensors), src_slots, dst_slots, 0,
                                            num_tokens, skip_prefix, c.max_ctas, c.status, validate)
    finally:
        unpin(handle)


def run_copy_engine(launches: list[Launch], src_slots, dst_slots, num_tokens: int, skip_prefix: int) -> None:
    """Runs resolved launches with the copy engine (``kvlayout::copy_runs``)."""
    for launch in launches:
        _native.copy_runs(launch.src_tensors, launch.dst_tensors, src_slots, dst_slots, num_tokens, skip_prefix,
                          launch.src_segments, launch.dst_segments, launch.src_geometry, launch.dst_geometry,
                          launch.num_pieces, launch.piece_bytes)


def run(src: KVCache, dst: KVCache, src_slots=None, dst_slots=None, *, src_layers=None, dst_layers=None,
        src_planes=None, dst_planes=None, skip_prefix: int = 0, num_tokens: int | None = None, max_ctas: int = 0,
        validate: bool | None = None) -> None:
    """:func:`~kvlayout.ops.transfer` with the copy kernel (``engine="kernel"``)."""
    c = checked_choice(src, dst, src_layers, dst_layers, src_planes, dst_planes, max_ctas, "kernel")
    validate = validating(validate)
    if num_tokens is None and type(skip_prefix) is int and try_direct(c, src_slots, dst_slots, skip_prefix,
                                                                      validate):
        return
    s_slots, d_slots, T, skip_prefix = check_slots(src, dst, c.device, "kernel", src_slots, dst_slots, skip_prefix,
                                                   num_tokens)
    if T == 0 or not c.src_layers or not c.src_planes:
        return
    run_kernel(src, dst, c, s_slots, d_slots, T, skip_prefix, validate)
