"""Prepared transfers: check and plan once, then run a layer (or all) per call.

An engine calls a transfer once per layer per step on the same caches, and
the host time of each call is what it feels.  :func:`prepare` does once what
:func:`~kvlayout.ops.transfer` does per call (argument checks, planning,
storage bounds and overlap checks, host-pointer lookups, kernel parameters)
and returns a :class:`PreparedTransfer` whose calls go straight to C++::

    t = ops.prepare(vllm, host, slot_mapping, host_slots)     # once per step (or once)
    for i in range(num_layers):
        t.layer(i)                                            # one launch, a few µs of host time
    t.set_slots(next_slot_mapping, next_host_slots)           # next step, no re-planning

The prepared transfer keeps its caches' tensors alive; if one of them is
resized or re-set meanwhile, the next call raises instead of writing where
the memory used to be.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from kvlayout import _C
from kvlayout.reference import semantics as rules

from . import _native, routes
from .arguments import TransferArgs, check_slots, transfer_args
from .programs import program_handle, program_key, resolve, unpin
from .views import KVCache, as_int, bind

_is_compiling = torch.compiler.is_compiling


class _Pin:
    """A prepared transfer's pin of its program: released with the transfer, unless a compiled graph keeps
    the handle (then for the life of the process)."""

    def __init__(self, handle: int):
        self.handle = handle
        self.by_graph = False

    def release(self) -> None:
        if not self.by_graph:
            unpin(self.handle)


class PreparedTransfer:
    """A transfer from ``src`` to ``dst`` planned and checked once (see :func:`prepare`).

    ``t()`` copies every chosen layer; ``t.layer(i)`` the ``i``-th chosen
    layer only (``0 <= i < t.num_layers``); ``t.set_slots(...)`` swaps the
    slot tensors (and token count) for the next step.
    """

    def __init__(self, src: KVCache, dst: KVCache, args: TransferArgs, dependent_launch: bool,
                 early_loads: bool = False):
        self.src, self.dst = src, dst
        self._args = args
        self._dependent = bool(dependent_launch)
        self._early_loads = bool(early_loads)
        self._num_layers = len(args.src_layers)
        self._status = _native.status_tensor(args.device)
        self._key = program_key(src, dst, args.src_layers, args.dst_layers, args.src_planes, args.dst_planes)
        # pinned while this transfer lives: its program stays registered (see kvlayout.ops.programs)
        self._handle = program_handle(self._key, pin=True)
        self._pin = _Pin(self._handle)
        weakref.finalize(self, self._pin.release)
        if args.engine == "copy":
            routes.check_not_shared(src, dst, args)
            # (launches without segments, of an empty layer or plane choice, move nothing)
            self._steps = [[launch for launch in resolve(self._handle, k, src, dst) if len(launch.src_segments)]
                           for k in range(1 + self._num_layers)]
            self._views = self._view_words(src, dst)   # what the resolved byte offsets depend on
            self._native = self._run_native = None
            return
        self._steps = None
        # bound now: storage bounds, overlaps and kernel parameters are checked and made once
        self._native = _C.PreparedCopy(self._handle, list(src.tensors), list(dst.tensors), self._status)
        self._run_native = self._native.runner()   # the calls' hot path: run(step) as a builtin function
        self._set_call()

    def __copy__(self) -> "PreparedTransfer":
        """An independent transfer over the same caches, prepared anew with this one's current arguments: its
        ``set_slots`` never changes this one's slots (a shallow copy would share the native binding)."""
        return PreparedTransfer(self.src, self.dst, self._args, self._dependent, self._early_loads)

    def __deepcopy__(self, memo) -> "PreparedTransfer":
        raise TypeError("a PreparedTransfer cannot be deep-copied: it is bound to its caches' memory. "
                        "copy.copy(t) prepares an independent transfer over the same caches; for copied caches, "
                        "prepare a transfer over them")

    def __reduce_ex__(self, protocol):
        raise TypeError("a PreparedTransfer cannot be pickled: prepared transfers are process-local (they hold "
                        "a native binding to this process's memory); send the caches and the arguments and "
                        "call kvlayout.ops.prepare in the other process")

    @property
    def num_layers(self) -> int:
        """How many layers the transfer copies (``t.layer(i)`` takes ``0 <= i < num_layers``)."""
        return len(self._args.src_layers)

    @property
    def num_tokens(self) -> int:
        return self._args.num_tokens

    def __call__(self) -> None:
        """Copy every chosen layer (one launch per row geometry)."""
        run = self._run_native
        if not _is_compiling() and run is not None:
            run(0)                     # (nothing to move: C++ returns before launching)
        else:
            self._run(0)

    def layer(self, i: int) -> None:
        """Copy the ``i``-th chosen layer only (one launch); ``IndexError`` outside ``[0, num_layers)``."""
        if type(i) is not int or not 0 <= i < self._num_layers:
            i = self._layer_index(i)
        run = self._run_native
        if not _is_compiling() and run is not None:
            run(1 + i)                 # the hot path of a layer-wise pipeline: straight to C++
        else:
            self._run(1 + i)

    def _layer_index(self, i) -> int:
        """``i`` checked as an index of the chosen layers (an integer, else ``TypeError``; in range, else
        ``IndexError`` as for any chosen layer out of range)."""
        i = as_int("layer", i)
        if self._num_layers == 0:
            rules.LAYER_PLANE_OUT_OF_RANGE.fail(f"layer = {i}: this transfer copies no layers (it was prepared "
                                                "with an empty layer choice), so it has no layer to call")
        if not 0 <= i < self._num_layers:
            rules.LAYER_PLANE_OUT_OF_RANGE.fail(f"layer = {i} is out of range: the transfer copies "
                                                f"{self._num_layers} layers, so 0 <= layer < {self._num_layers}")
        return i

    def set_slots(self, src_slots=None, dst_slots=None, *, skip_prefix: int = 0, num_tokens: int | None = None):
        """Use these slots (and token count) from the next call on; the plan and the checks are kept.

        Eager only: inside compiled code it raises (call it before the compiled function, which then reads
        the new slots), since the new arguments live in the native binding, outside any graph."""
        if torch.compiler.is_compiling():
            raise RuntimeError("PreparedTransfer.set_slots is eager-only: call it outside the compiled function "
                               "(the compiled layer calls then use the new slots)")
        a = self._args
        s, d, T, skip = check_slots(self.src, self.dst, a.device, a.engine, src_slots, dst_slots, skip_prefix,
                                    num_tokens)
        # one new object: a call on another thread sees the old arguments or the new ones, never a mix
        self._args = dataclasses.replace(a, src_slots=s, dst_slots=d, num_tokens=T, skip_prefix=skip)
        self._set_call()
        return self

    def _set_call(self) -> None:
        a = self._args
        if self._native is not None:
            if a.src_planes:
                self._native.set_call(a.src_slots, a.dst_slots, a.num_tokens, a.skip_prefix, a.max_ctas, a.validate,
                                      self._dependent, self._early_loads)
            else:   # no planes chosen: nothing to move, a run with no tokens launches nothing
                self._native.set_call(None, None, 0, 0, a.max_ctas, a.validate, self._dependent, self._early_loads)

    @staticmethod
    def _view_words(src: KVCache, dst: KVCache) -> list:
        """Where each cache tensor's data is and how it is viewed (data pointer, sizes, strides)."""
        return [(t.data_ptr(), t.shape, t.stride()) for t in (*src.tensors, *dst.tensors)]

    def _run(self, step: int) -> None:
        """The calls that do not go straight to C++: the copy engine's, and traced ones (through the op)."""
        a = self._args
        if not a.src_planes:
            return
        if self._native is None:
            if self._view_words(self.src, self.dst) != self._views:
                raise RuntimeError("kvlayout: prepared transfer: a cache tensor was resized, re-strided, re-set or "
                                   "freed since the transfer was prepared; prepare the transfer again")
            if a.num_tokens:
                routes.run_copy_engine(self._steps[step], a.src_slots, a.dst_slots, a.num_tokens, a.skip_prefix)
            return
        if torch.compiler.is_compiling():
            # one graph for every T: the token count comes from the slot tensors' (symbolic) length, and the
            # program's handle is a constant of the graph, pinned for the life of the process
            slots = a.src_slots if a.src_slots is not None else a.dst_slots
            num_tokens = slots.shape[0] if slots is not None else a.num_tokens
            self._pin.by_graph = True   # the graph keeps the handle: the program stays registered
        else:
            num_tokens = a.num_tokens
        torch.ops.kvlayout.copy_program(self._handle, list(self.src.tensors), list(self.dst.tensors), a.src_slots,
                                        a.dst_slots, step, num_tokens, a.skip_prefix, a.max_ctas, self._status,
                                        a.validate)

    def __repr__(self) -> str:
        a = self._args
        return (f"PreparedTransfer({self.src.layout.name} -> {self.dst.layout.name}, {self.num_layers} layers, "
                f"{a.num_tokens} tokens, {a.device}, engine={a.engine!r})")


def prepare(src, dst, src_slots=None, dst_slots=None, *, src_layers=None, dst_layers=None, src_planes=None,
            dst_planes=None, skip_prefix: int = 0, num_tokens: int | None = None, max_ctas: int = 0,
            validate: bool | None = None, engine: str = "kernel", dependent_launch: bool = True,
            early_loads: bool = False) -> PreparedTransfer:
    """A :class:`PreparedTransfer`: :func:`~kvlayout.ops.transfer`'s arguments, checked and planned once.

    Same arguments and rules as :func:`~kvlayout.ops.transfer` (``src`` and
    ``dst`` may also be ``(layout, tensors)`` pairs).  ``dependent_launch``
    (CUDA, compute capability 9.0+): each launch may start while the previous
    kernel of the stream finishes (programmatic dependent launch); it still
    waits for that kernel's writes before it reads or writes anything.
    Captured in a CUDA graph, a layer call whose stream's only dependency is
    the previous kvlayout launch issues its loads before that wait (its writes
    still wait) when none of the launches that may still run writes what it
    reads, and lets the next layer call start at once: the layers' PCIe round
    trips then overlap, as many at a time as the SMs hold.
    ``early_loads=True`` does the same outside capture, on the caller's
    promise that between two calls the stream runs only kvlayout calls,
    kernels that never let their successor start early (programmatic
    dependent launch: a kernel that triggers it, as some libraries' kernels
    do, could still be writing what an early load reads), copies, and event
    records and waits (a dedicated load stream).
    ``engine``: ``"kernel"`` or ``"copy"``; ``"auto"`` prepares the kernel
    (layer calls are small, where the kernel's direct path wins); ``"staged"``
    is refused (it allocates staging per call: use ``ops.transfer``).
    """
    if engine == "staged":
        raise ValueError("prepare: engine='staged' is not supported (a staged transfer allocates its staging "
                         "memory per call); use ops.transfer(..., engine='staged')")
    if early_loads and not dependent_launch:
        raise ValueError("prepare: early_loads=True needs dependent_launch=True (a launch loads early only while "
                         "the previous kernel of its stream may still run)")
    engine = "kernel" if engine == "auto" else engine
    src = src if isinstance(src, KVCache) else bind(*src)
    dst = dst if isinstance(dst, KVCache) else bind(*dst)
    args = transfer_args(src, dst, src_slots, dst_slots, src_layers=src_layers, dst_layers=dst_layers,
                         src_planes=src_planes, dst_planes=dst_planes, skip_prefix=skip_prefix,
                         num_tokens=num_tokens, max_ctas=max_ctas, validate=validate, engine=engine)
    return PreparedTransfer(src, dst, args, dependent_launch, early_loads)
