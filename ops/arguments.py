"""A transfer's arguments: checked once, with errors that name the argument.

What :func:`~kvlayout.ops.transfer` and :func:`~kvlayout.ops.prepare` share:
the pair of caches (element type, row width, launch device), the chosen
layers and planes, the slot tensors and token count, the CTA budget, the
validation switch and the engine.  The slot *values* are checked by the
native op itself (``torch_ext/slots.h``): on the CPU always, on devices in the
kernel (recorded in the status word) and, with ``validate=True``, on the host
before launching; the checks live in the op, so compiled code keeps them.
"""

from __future__ import annotations

import dataclasses
import os
import weakref

import torch

from . import _native
from .programs import program_key
from .views import INTEGER_STORAGE, KVCache, as_index_list, as_int

SLOT_DTYPES = (torch.int32, torch.int64)


def _slots_tensor(name: str, slots, device: torch.device) -> torch.Tensor | None:
    if slots is None:
        return None
    if not isinstance(slots, torch.Tensor):
        dtype = getattr(slots, "dtype", None)   # a NumPy array: integer dtypes only
        if dtype is not None and getattr(dtype, "kind", "i") not in "iu":
            raise TypeError(f"{name} must hold integers, got an array of {dtype}")
        if getattr(slots, "ndim", 1) == 0 or not hasattr(slots, "__iter__"):
            raise TypeError(f"{name} must be a 1-D int32/int64 tensor or a sequence of ints, "
                            f"got {type(slots).__name__}")
        values = [as_int(f"{name}[{i}]", v) for i, v in enumerate(slots)]   # no float/bool truncation
        slots = torch.tensor(values, dtype=torch.int64, device=device)
    if slots.dtype not in SLOT_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {slots.dtype}")
    if slots.device.type != "cpu" and slots.device != device:
        raise ValueError(f"{name} is on {slots.device} but the operation runs on {device}")
    if slots.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(slots.shape)}")
    return slots


def _slot_tensor_ok(slots, device: torch.device) -> bool:
    """Whether ``slots`` passes :func:`_slots_tensor` as it is (a 1-D int32/int64 tensor the launch can read)."""
    return (isinstance(slots, torch.Tensor) and slots.dtype in SLOT_DTYPES and slots.dim() == 1
            and (slots.is_cpu or slots.device == device))


def _launch_device(src: KVCache, dst: KVCache) -> torch.device:
    devices = {src.device, dst.device}
    if len(devices) > 1 and any(d.type == "meta" for d in devices):
        raise ValueError(f"source on {src.device} and destination on {dst.device}: meta tensors hold no data, "
                         "so a transfer between a meta and a real tensor would do nothing")
    accel = [d for d in devices if d.type != "cpu"]
    if len(accel) > 1:
        raise ValueError(f"source on {src.device} and destination on {dst.device}: "
                         "a transfer runs on one device (the other side may be pinned host memory)")
    return accel[0] if accel else torch.device("cpu")


def _check_pair(src: KVCache, dst: KVCache) -> None:
    if src.itemsize != dst.itemsize or (src.dtype != dst.dtype and not (
            src.dtype in INTEGER_STORAGE or dst.dtype in INTEGER_STORAGE)):
        raise TypeError(f"dtypes differ: source {src.dtype}, destination {dst.dtype} (a copy is byte-exact: "
                        "the element types must match, or one side must be raw integer storage of the same size)")
    if src.row_width != dst.row_width:
        g, h = src.geometry, dst.geometry
        raise ValueError(f"row widths differ: source H*E = {g.H}*{g.E}, destination H*E = {h.H}*{h.E}")




_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def validating(validate: bool | None) -> bool:
    """``validate`` if given, else the ``KVLAYOUT_VALIDATE`` environment variable.

    The variable reads 1/true/yes/on as on and 0/false/no/off (or empty) as
    off, in any case; anything else is an error rather than a guess.
    """
    if validate is not None:
        if not isinstance(validate, bool):
            raise TypeError(f"validate must be True, False or None, got {validate!r}")
        return validate
    raw = os.environ._data.get(_ENV_KEY) if _ENV_KEY is not None else os.environ.get("KVLAYOUT_VALIDATE")
    known = _VALIDATE_READS.get(raw)
    if known is not None:
        return known
    if raw is None:
        value = ""
    else:
        value = os.environ.decodevalue(raw) if _ENV_KEY is not None else raw
    flag = value.strip().lower()
    if flag not in _ON and flag not in _OFF:
        raise ValueError(f"KVLAYOUT_VALIDATE = {value!r} is not understood: use 1/true/yes/on or 0/false/no/off")
    if len(_VALIDATE_READS) < 64 and not torch.compiler.is_compiling():   # (a graph guards on what it reads:
        _VALIDATE_READS[raw] = flag in _ON                                 # a memo it fills would recompile it)
    return flag in _ON


# os.environ.get runs Mapping.get and the key's encoding in Python (about 0.8 µs, a tenth of a
# layer call's host budget); CPython's os.environ keeps the encoded variables in a dict that
# every change of os.environ updates, so the variable is looked up there.
_ENV_KEY = (os.environ.encodekey("KVLAYOUT_VALIDATE")
            if isinstance(getattr(os.environ, "_data", None), dict) and hasattr(os.environ, "encodekey") else None)
_VALIDATE_READS: dict = {}    # raw value of the variable -> its reading


@dataclasses.dataclass
class TransferArgs:
    """A transfer's arguments, checked and normalized (what :func:`transfer` and ``prepare`` share)."""

    src_layers: list
    dst_layers: list
    src_planes: list
    dst_planes: list
    device: torch.device          # where the copy runs
    src_slots: torch.Tensor | None
    dst_slots: torch.Tensor | None
    num_tokens: int
    skip_prefix: int
    max_ctas: int
    validate: bool
    engine: str


ENGINES = ("kernel", "copy", "staged", "auto")


def check_layers_and_planes(src: KVCache, dst: KVCache, src_layers, dst_layers, src_planes, dst_planes):
    """The chosen layers and planes of both sides as index lists (same counts, no destination twice)."""
    g_src, g_dst = src.geometry, dst.geometry
    s_layers = as_index_list(g_src.L, src_layers, "src_layers")
    d_layers = as_index_list(g_dst.L, dst_layers, "dst_layers", unique=True)
    if len(s_layers) != len(d_layers):
        raise ValueError(f"the source gives {_chosen(len(s_layers), src_layers, 'src_layers', 'layer')} but the "
                         f"destination takes {_chosen(len(d_layers), dst_layers, 'dst_layers', 'layer')}")
    s_planes = as_index_list(g_src.P, src_planes, "src_planes")
    d_planes = as_index_list(g_dst.P, dst_planes, "dst_planes", unique=True)
    if len(s_planes) != len(d_planes):
        raise ValueError(f"the source gives {_chosen(len(s_planes), src_planes, 'src_planes', 'plane')} but the "
                         f"destination takes {_chosen(len(d_planes), dst_planes, 'dst_planes', 'plane')}")
    return s_layers, d_layers, s_planes, d_planes


def _chosen(count: int, given, name: str, what: str) -> str:
    """``"2 layers (src_layers)"`` or, where the argument was left out, ``"4 layers (all of its layers)"``."""
    return f"{count} {what}{'s' if count != 1 else ''} ({name if given is not None else f'all of its {what}s'})"


def check_slots(src: KVCache, dst: KVCache, device: torch.device, engine: str, src_slots, dst_slots,
                skip_prefix, num_tokens) -> tuple:
    """``(src_slots, dst_slots, num_tokens, skip_prefix)`` checked for a transfer from ``src`` to ``dst``."""
    if engine != "copy" and num_tokens is None and type(skip_prefix) is int and skip_prefix >= 0:
        # the common call (slot tensors on the launch device, or None), checked in fewer steps
        s_ok = src_slots is None or _slot_tensor_ok(src_slots, device)
        if s_ok and (dst_slots is None or _slot_tensor_ok(dst_slots, device)):
            if src_slots is not None:
                T = src_slots.shape[0]
                fits = dst_slots is None or dst_slots.shape[0] == T
            elif dst_slots is not None:
                T = dst_slots.shape[0]
                fits = T <= src.geometry.N
            else:
                T = src.geometry.N
                fits = False    # (None on both sides: the full check below says what T is)
            if fits and skip_prefix <= T and (dst_slots is not None or T <= dst.geometry.N):
                return src_slots, dst_slots, T, skip_prefix
    skip_prefix = as_int("skip_prefix", skip_prefix, lo=0)
    num_tokens = None if num_tokens is None else as_int("num_tokens", num_tokens, lo=0)
    slot_device = torch.device("cpu") if engine == "copy" else device
    s_slots = _slots_tensor("src_slots", src_slots, slot_device)
    d_slots = _slots_tensor("dst_slots", dst_slots, slot_device)
    if engine == "copy":
        for name, slots in (("src_slots", s_slots), ("dst_slots", d_slots)):
            if slots is not None and slots.device.type != "cpu":
                raise ValueError(f"{name} is on {slots.device}: engine='copy' reads the slots on the host")
    lengths = [s.shape[0] for s in (s_slots, d_slots) if s is not None]
    if len(lengths) == 2 and lengths[0] != lengths[1]:
        raise ValueError(f"src_slots and dst_slots differ in length: {sorted(lengths)}")
    T = lengths[0] if lengths else (num_tokens if num_tokens is not None else src.geometry.N)
    if num_tokens is not None and num_tokens != T:
        raise ValueError(f"num_tokens = {num_tokens} but the slots hold {T} tokens")
    for name, arg, slots, geom in (("source", "src_slots", s_slots, src.geometry),
                                   ("destination", "dst_slots", d_slots, dst.geometry)):
        if slots is None and T > geom.N:
            raise IndexError(f"{T} positions exceed the {name}'s {geom.N} slots ({arg} is None, so token t "
                             f"uses position t; num_tokens = {T} must be <= {geom.N})")
    if not 0 <= skip_prefix <= T:
        raise ValueError(f"skip_prefix = {skip_prefix} must lie in [0, {T}]")
    # (every slot is checked by the native op that reads it: the CPU kernel and the copy engine always,
    # device kernels with validate=True)
    return s_slots, d_slots, T, skip_prefix


def repeated_call_key(dst: KVCache, src_layers, dst_layers):
    """The memo key of the two calls an engine repeats in its step loop, or None for any other call.

    All layers (``id(dst)``), or one layer on each side given as one-int lists
    (``(id(dst), src_layer, dst_layer)``), with planes and CTA budget left at
    their defaults and the engine ``"auto"`` (the default) or ``"kernel"``.
    :func:`~kvlayout.ops.transfer` reads the memo with this key before any
    other work, so it must stay this cheap.
    """
    if src_layers is None and dst_layers is None:
        return id(dst)
    if (type(src_layers) is list and type(dst_layers) is list and len(src_layers) == 1 and len(dst_layers) == 1
            and type(src_layers[0]) is int and type(dst_layers[0]) is int):
        return (id(dst), src_layers[0], dst_layers[0])
    return None


def _choice_key(chosen):
    """A layer/plane choice as a memo key: ``None`` or a tuple of exact ints (anything else: not memoized)."""
    if chosen is None:
        return None
    if type(chosen) in (list, tuple):
        key = tuple(chosen)
        if (len(key) == 1 and type(key[0]) is int) or set(map(type, key)) <= _INT_ONLY:   # (one layer: the
            return key                                                                     # common call)
    raise TypeError   # checked the long way (it may be an error worth its message)


_INT_ONLY = frozenset((int,))


@dataclasses.dataclass
class CheckedChoice:
    """The slot-independent arguments of a transfer, checked: layers, planes, CTA budget, launch device.

    ``program`` and ``status`` (the copy program's key and the device's
    status word) are filled in when the choice is checked (outside tracing);
    ``bound`` (the program bound to the caches' tensors, ``_C.PreparedCopy``)
    by the second kernel call (:meth:`bind`), with ``run_checking``, its
    ``run_checking`` as a builtin function (no pybind11 dispatch), so a
    repeated call goes straight to C++, which checks its slots and launches.
    """

    src_layers: list
    dst_layers: list
    src_planes: list
    dst_planes: list
    max_ctas: int
    device: torch.device
    program: tuple | None = None
    status: torch.Tensor | None = None
    bound: object = None
    run_checking: object = None        # bound.checker(): run_checking(step, src_slots, dst_slots, skip_prefix,
    #                                    max_ctas, validate), positional
    kernel_calls: int = 0
    staged_plan: tuple | None = None   # (ring size, what engine="staged" found: ops.staged.static_plan)
    never_staged: int = 0              # the ring size for which that plan says the pair cannot be staged (auto
    #                                    then always runs the kernel); 0: not known, or it can be
    auto_kernel: tuple | None = None   # (ops.staged.RULE_STATE, host_is_dst, n): auto keeps the kernel for a
    #                                    repeated call of this pair moving at most n tokens, the host side without
    #                                    slots (ops.staged.auto_kernel_tokens), while the rule's state is that one
    staged_kept: object = None         # weak reference to the staged transfer last run for the choice
    #                                    (ops.staged._Transfer; its ring owns it)
    shared: "CheckedChoice | None" = None   # the choice of these caches' shapes this one was copied from (see
    #                                         checked_choice): it keeps what depends on the shapes alone
    ring_plan: tuple | None = None     # (ring size, the staged plan of these shapes through a ring:
    #                                    ops.staged.static_plan, past its checks of the tensors' memory)
    handle: int | None = None          # the program's handle once registered (kept on the shared choice, see
    #                                    routes.pinned_program)

    def bind(self, bound) -> None:
        """Keep ``bound`` (a ``_C.PreparedCopy``, or None) and its checked run for the repeated calls."""
        self.run_checking = bound.checker() if bound is not None else None
        self.bound = bound


def checked_choice(src: KVCache, dst: KVCache, src_layers, dst_layers, src_planes, dst_planes, max_ctas,
                 engine) -> CheckedChoice:
    """The checked slot-independent arguments of a transfer from ``src`` to ``dst``.

    Remembered on the source cache per (destination, choice), since a layer-wise
    pipeline makes the same call many times; an entry is used only for the
    very destination object it was made for.
    """
    if (src_planes is None and dst_planes is None and max_ctas == 0 and type(max_ctas) is int
            and engine in ("auto", "kernel")):
        key = repeated_call_key(dst, src_layers, dst_layers)   # one choice for both: auto mostly runs the kernel
    else:
        key = None
    if key is None:
        try:
            key = (id(dst), _choice_key(src_layers), _choice_key(dst_layers), _choice_key(src_planes),
                   _choice_key(dst_planes), max_ctas if type(max_ctas) is int else None, engine)
        except TypeError:
            key = None
    if key is not None and torch.compiler.is_compiling():
        key = None    # traced code checks every call (and keeps no memo)
    memoized = key is not None and (type(key) is not tuple or len(key) == 3 or key[5] is not None)
    if memoized:
        hit = src._checked_choices.get(key)
        if hit is not None and hit[0]() is dst:
            return hit[1]
        # the same choice between caches of these shapes was checked before (an engine's fresh views of its
        # buffers): its arguments and program key hold for this pair too
        shared_key = (dst._shape.serial, key[1:] if type(key) is tuple else ())
        checked = src._shape.choices.get(shared_key)
        if checked is None:
            checked = _check_choice(src, dst, src_layers, dst_layers, src_planes, dst_planes, max_ctas, engine)
            _remember(src._shape.choices, shared_key, checked)
        out = CheckedChoice(checked.src_layers, checked.dst_layers, checked.src_planes, checked.dst_planes,
                            checked.max_ctas, checked.device, checked.program, checked.status, shared=checked)
        # the binding holds the destination's tensors: released with the destination cache
        _remember(src._checked_choices, key, (weakref.ref(dst, lambda _: out.bind(None)), out))
        return out
    return _check_choice(src, dst, src_layers, dst_layers, src_planes, dst_planes, max_ctas, engine)


CHOICES_KEPT = 256   # checked choices a memo keeps (per source cache; per shape for pairs of shapes)


def _remember(memo: dict, key, value) -> None:
    """``memo[key] = value``, the memo emptied first when it holds :data:`CHOICES_KEPT` entries."""
    if len(memo) >= CHOICES_KEPT:
        memo.clear()
    memo[key] = value


def _check_choice(src: KVCache, dst: KVCache, src_layers, dst_layers, src_planes, dst_planes, max_ctas,
                  engine) -> CheckedChoice:
    """:func:`checked_choice`'s checks, with the copy program's key and the status word outside tracing."""
    _check_pair(src, dst)
    layers_planes = check_layers_and_planes(src, dst, src_layers, dst_layers, src_planes, dst_planes)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}")
    max_ctas = as_int("max_ctas", max_ctas, lo=0, hi=2 ** 31 - 1)
    out = CheckedChoice(*layers_planes, max_ctas, _launch_device(src, dst))
    if not torch.compiler.is_compiling():
        out.program = program_key(src, dst, out.src_layers, out.dst_layers, out.src_planes, out.dst_planes)
        out.status = _native.status_tensor(out.device)
    return out


def transfer_args(src: KVCache, dst: KVCache, src_slots=None, dst_slots=None, *, src_layers=None,
                  dst_layers=None, src_planes=None, dst_planes=None, skip_prefix: int = 0,
                  num_tokens: int | None = None, max_ctas: int = 0, validate: bool | None = None,
                  engine: str = "kernel") -> TransferArgs:
    """Checks and normalizes :func:`transfer`'s arguments (errors name the argument)."""
    c = checked_choice(src, dst, src_layers, dst_layers, src_planes, dst_planes, max_ctas, engine)
    validate = validating(validate)
    s_slots, d_slots, T, skip_prefix = check_slots(src, dst, c.device, engine, src_slots, dst_slots, skip_prefix,
                                                   num_tokens)
    return TransferArgs(c.src_layers, c.dst_layers, c.src_planes, c.dst_planes, c.device, s_slots, d_slots, T,
                        skip_prefix, c.max_ctas, validate, engine)


def check_disjoint(src: KVCache, dst: KVCache, used: tuple[set, set]) -> None:
    """One tensor on both sides of a transfer (within one cache, move() is the way).

    ``used``: the indices of the source and destination tensors the transfer
    reads and writes (:func:`~kvlayout.ops.planner.tensors_used`).  The cheap,
    common case, with the caches' tensor numbers in the message; it also works
    while compiling, where tensors have no addresses.  Every other overlap
    (views of one buffer, two storages over one buffer) the native op finds by
    comparing address ranges.
    """
    for i in used[0]:
        for j in used[1]:
            if src.tensors[i] is dst.tensors[j]:
                raise ValueError(f"source tensor {i} and destination tensor {j} overlap in memory; "
                                 "use move() within one cache")
