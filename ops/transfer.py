"""transfer / gather / scatter / move / skip_prefix on torch tensors.

Same names and semantics as ``kvlayout.reference.operations``; the caches are
:class:`~kvlayout.ops.views.KVCache` objects (or ``(layout, tensors)`` bound
on the fly).  Every operation is a composition of one native op,
``kvlayout::copy_rows``: the Python side turns two bound caches into launches
(segments = per-(layer, plane) base offsets, one row geometry per side) and
the kernel applies the one address formula.

Where a device boundary is crossed is decided by where the tensors live: a
CUDA tensor facing a pinned host tensor is read/written directly by the kernel
(zero-copy); an unpinned host tensor facing a CUDA tensor is an error.

Checking: on CPU the native op reads every slot once, checks it (range, and
no destination slot twice) and copies with the values it checked, before
anything is written.  On CUDA the fast path never synchronizes with the host:
the kernel skips rows whose slot is out of range and records the first one in
a per-device status tensor, which :func:`check_errors` reads (and raises on).
``validate=True`` (or the environment variable ``KVLAYOUT_VALIDATE=1``) makes
the op check every slot on the host before launching, at the price of a
synchronization.  The checks live in the op, so compiled code keeps them.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from typing import Sequence

import torch

from kvlayout import _C

from . import _native
from . import staged as _staged
from .staged import StagedPlan, run_staged, staged_plan
from .views import INTEGER_STORAGE, KVCache, PartView, as_index_list, as_int, bind

SLOT_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass
class Launch:
    """Arguments of one ``copy_rows`` call (all rows share one geometry per side)."""

    src_tensors: list
    dst_tensors: list
    src_segments: list
    dst_segments: list
    src_geometry: list
    dst_geometry: list
    num_pieces: int
    piece_bytes: int
    src_keys: list = dataclasses.field(default_factory=list)   # (part name, layer or None) of each tensor
    dst_keys: list = dataclasses.field(default_factory=list)

    def bound_to(self, src: KVCache, dst: KVCache) -> "Launch":
        """The same launch on other caches of the same layouts, geometry and strides."""
        return dataclasses.replace(self, src_tensors=[src.tensor_for(k) for k in self.src_keys],
                                   dst_tensors=[dst.tensor_for(k) for k in self.dst_keys])

    def unbound(self) -> "Launch":
        """The launch without its tensors (``src_keys``/``dst_keys`` say which they are)."""
        return dataclasses.replace(self, src_tensors=[], dst_tensors=[])


def _side_geometry(cache: KVCache, view: PartView, stride_piece: int) -> tuple[int, ...]:
    g, isz = cache.geometry, cache.itemsize
    return (g.N, g.BS, view.strides["nb"] * isz, view.strides["bs"] * isz, stride_piece * isz)


def _pieces(src: PartView, dst: PartView, width: int) -> tuple[int, int, int, int]:
    """How a row of ``width`` elements splits into pieces on both sides.

    Returns ``(num_pieces, piece_elems, src_stride_piece, dst_stride_piece)``:
    one piece when both rows are contiguous; else one piece per head of the
    side whose heads are apart (a contiguous row can be cut anywhere).
    """
    if src.heads_contiguous and dst.heads_contiguous:
        return 1, width, 0, 0
    if not src.heads_contiguous and not dst.heads_contiguous:
        if (src.heads, src.head_width) != (dst.heads, dst.head_width):   # plan() cuts such rows at heads
            raise ValueError(f"row structures differ: source {src.heads} heads x {src.head_width}, "
                             f"destination {dst.heads} heads x {dst.head_width}, both strided")
        return src.heads, src.head_width, src.strides["h"], dst.strides["h"]
    apart = dst if src.heads_contiguous else src
    piece = apart.head_width
    if src.heads_contiguous:
        return apart.heads, piece, piece, dst.strides["h"]
    return apart.heads, piece, src.strides["h"], piece


def _column_blocks(cache: KVCache, plane: int) -> list[tuple[int, int, PartView]]:
    """``(start, width, part)`` blocks of the flattened row ``(h e)`` for one plane."""
    views = cache.part_for(plane)
    if len(views) == 1:
        return [(0, cache.row_width, views[0])]
    for v in views:
        if not v.heads_contiguous:
            raise ValueError(f"{cache.layout.name}: column parts need contiguous rows")
    return [(v.column_start * v.heads, v.heads * v.head_width, v) for v in views]


def _head_cuts(src: PartView, dst: PartView, width: int) -> set[int]:
    """Head boundaries of both rows when both have their heads apart with different splits.

    Such rows have no common piece stride; cut at every head boundary of
    either side, each block then lies inside one head on both sides.
    """
    if src.heads_contiguous or dst.heads_contiguous or (src.heads, src.head_width) == (dst.heads, dst.head_width):
        return set()
    return set(range(0, width, src.head_width)) | set(range(0, width, dst.head_width))


def _column_offset(view: PartView, column: int) -> int:
    """Element offset of a column of the part's row ``(h e)`` from its head 0."""
    head, e = column // view.head_width, column % view.head_width   # (divmod does not trace with symbolic sizes)
    return head * view.strides["h"] + e


def plan(src: KVCache, dst: KVCache, src_layers: Sequence[int], dst_layers: Sequence[int],
         src_planes: Sequence[int], dst_planes: Sequence[int]) -> list[Launch]:
    """Launches copying the chosen (plane, layer) rows of ``src`` into ``dst``."""
    groups: dict[tuple, Launch] = {}
    src_ids: dict[tuple, dict] = {}
    dst_ids: dict[tuple, dict] = {}
    isz = src.itemsize
    for ps, pd in zip(src_planes, dst_planes):
        src_blocks, dst_blocks = _column_blocks(src, ps), _column_blocks(dst, pd)
        cuts = {b[0] for b in src_blocks} | {b[0] for b in dst_blocks} | {src.row_width}
        if len(src_blocks) == len(dst_blocks) == 1:
            cuts |= _head_cuts(src_blocks[0][2], dst_blocks[0][2], src.row_width)
        cuts = sorted(cuts)
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            s_start, _, s_view = next(b for b in src_blocks if b[0] <= lo < b[0] + b[1])
            d_start, _, d_view = next(b for b in dst_blocks if b[0] <= lo < b[0] + b[1])
            if len(cuts) > 2:   # a split row: each block is contiguous on both sides
                pieces, piece, s_sp, d_sp = 1, hi - lo, 0, 0
            else:
                pieces, piece, s_sp, d_sp = _pieces(s_view, d_view, hi - lo)
            key = (_side_geometry(src, s_view, s_sp), _side_geometry(dst, d_view, d_sp), pieces, piece * isz)
            launch = groups.get(key)
            if launch is None:
                launch = groups[key] = Launch([], [], [], [], list(key[0]), list(key[1]), pieces, piece * isz)
                src_ids[key], dst_ids[key] = {}, {}
            for ls, ld in zip(src_layers, dst_layers):
                for view, start, plane, layer, tensors, keys, segments, ids in (
                        (s_view, s_start, ps, ls, launch.src_tensors, launch.src_keys, launch.src_segments,
                         src_ids[key]),
                        (d_view, d_start, pd, ld, launch.dst_tensors, launch.dst_keys, launch.dst_segments,
                         dst_ids[key])):
                    tensor, offset = view.tensor_and_offset(plane, layer)
                    # which tensor of the cache this is (no id(): tensors made inside a compiled graph have none)
                    tensor_key = (view.part.name, layer if view.part.per_layer else None)
                    index = ids.setdefault(tensor_key, len(tensors))
                    if index == len(tensors):
                        tensors.append(tensor)
                        keys.append(tensor_key)
                    segments += [index, (offset + _column_offset(view, lo - start)) * isz]
    return list(groups.values())


_PLANS: dict[tuple, list[Launch]] = {}


def cached_plan(src: KVCache, dst: KVCache, *choice) -> list[Launch]:
    """:func:`plan`, remembered per (layout, geometry, strides) of both caches and choice of layers/planes.

    A layer-wise pipeline calls transfer L times per step on the same caches:
    planning once keeps the per-call host cost to argument checks and the
    launch.  Remembered plans hold no tensors (only which part and layer each
    tensor is), so they keep no cache alive.  Not used while compiling: the
    graph holds the launches instead.
    """
    planner = plan
    if torch.compiler.is_compiling():
        return planner(src, dst, *choice)
    key = (planner, src.signature, dst.signature, *(tuple(c) for c in choice))
    launches = _PLANS.get(key)
    if launches is None:
        if len(_PLANS) >= 1024:
            _PLANS.clear()
        # stored unbound: a remembered plan must not keep the tensors of the call that made it alive
        launches = _PLANS[key] = [launch.unbound() for launch in planner(src, dst, *choice)]
    return [launch.bound_to(src, dst) for launch in launches]


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


def _check_slots_on_host(name: str, slots: torch.Tensor | None, bound: int, unique: bool) -> None:
    """Full check (synchronizes): every slot < bound, no repeated destination."""
    if slots is None or slots.numel() == 0:
        return
    values = slots.detach().to("cpu", torch.int64)
    bad = torch.nonzero(values >= bound)
    if bad.numel():
        i = int(bad[0, 0])
        side = "source" if name.startswith("src") else "destination"
        raise IndexError(f"{name}[{i}] = {int(values[i])} is out of range: the {side} holds {bound} slots")
    if unique:
        valid = values[values >= 0]
        uniq, counts = torch.unique(valid, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"{name} repeats slot {int(uniq[counts > 1][0])}")


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


def _check_disjoint(src: KVCache, dst: KVCache, launches: list[Launch]) -> None:
    """One tensor on both sides of a launch (within one cache, move() is the way).

    The cheap, common case, with the caches' tensor numbers in the message; it also works while
    compiling, where tensors have no addresses.  Every other overlap (views of one buffer, two
    storages over one buffer) the native op finds by comparing address ranges.
    """
    for launch in launches:
        for a in launch.src_tensors:
            for b in launch.dst_tensors:
                if a is b:
                    i = next(k for k, t in enumerate(src.tensors) if t is a)
                    j = next(k for k, t in enumerate(dst.tensors) if t is b)
                    raise ValueError(f"source tensor {i} and destination tensor {j} overlap in memory; "
                                     "use move() within one cache")


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
    raw = _environ_value()
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
    if len(_VALIDATE_READS) < 64:
        _VALIDATE_READS[raw] = flag in _ON
    return flag in _ON


# os.environ.get runs Mapping.get and the key's encoding in Python (about 0.8 µs, a tenth of a
# layer call's host budget); CPython's os.environ keeps the encoded variables in a dict that
# every change of os.environ updates, so the variable is looked up there.
_ENV_KEY = (os.environ.encodekey("KVLAYOUT_VALIDATE")
            if isinstance(getattr(os.environ, "_data", None), dict) and hasattr(os.environ, "encodekey") else None)
_VALIDATE_READS: dict = {}    # raw value of the variable -> its reading


def _environ_value():
    """The raw value of KVLAYOUT_VALIDATE in os.environ (None when unset)."""
    if _ENV_KEY is not None:
        return os.environ._data.get(_ENV_KEY)
    return os.environ.get("KVLAYOUT_VALIDATE")


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
        raise ValueError(f"src_layers has {len(s_layers)} layers, dst_layers {len(d_layers)}")
    s_planes = as_index_list(g_src.P, src_planes, "src_planes")
    d_planes = as_index_list(g_dst.P, dst_planes, "dst_planes", unique=True)
    if len(s_planes) != len(d_planes):
        raise ValueError(f"source copies {len(s_planes)} planes, destination {len(d_planes)}")
    return s_layers, d_layers, s_planes, d_planes


def check_slots(src: KVCache, dst: KVCache, device: torch.device, engine: str, src_slots, dst_slots,
                skip_prefix, num_tokens) -> tuple:
    """``(src_slots, dst_slots, num_tokens, skip_prefix)`` checked for a transfer from ``src`` to ``dst``."""
    if engine != "copy" and num_tokens is None and type(skip_prefix) is int and skip_prefix >= 0:
        # the common call (slot tensors on the launch device, or None), checked in fewer steps
        s_ok = src_slots is None or _slot_tensor_ok(src_slots, device)
        if s_ok and (dst_slots is None or _slot_tensor_ok(dst_slots, device)):
            if src_slots is not None:
                T = int(src_slots.shape[0])
                fits = dst_slots is None or int(dst_slots.shape[0]) == T
            elif dst_slots is not None:
                T = int(dst_slots.shape[0])
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
    lengths = {int(s.shape[0]) for s in (s_slots, d_slots) if s is not None}
    if len(lengths) > 1:
        raise ValueError(f"src_slots and dst_slots differ in length: {sorted(lengths)}")
    T = lengths.pop() if lengths else (num_tokens if num_tokens is not None else src.geometry.N)
    if num_tokens is not None and num_tokens != T:
        raise ValueError(f"num_tokens = {num_tokens} but the slots hold {T} tokens")
    for name, arg, slots, geom in (("source", "src_slots", s_slots, src.geometry),
                                   ("destination", "dst_slots", d_slots, dst.geometry)):
        if slots is None and T > geom.N:
            raise IndexError(f"{T} positions exceed the {name}'s {geom.N} slots ({arg} is None, so token t "
                             f"uses position t; num_tokens = {T} must be <= {geom.N})")
    if not 0 <= skip_prefix <= T:
        raise ValueError(f"skip_prefix = {skip_prefix} must lie in [0, {T}]")
    if engine == "copy" and device.type != "cpu" and not torch.compiler.is_compiling():
        # the kernel op checks every slot itself (CPU always, devices with validate=True, inside the
        # op so compiled code keeps it); the copy engine reads the slots on the host but does not
        # look for repeats
        _check_slots_on_host("dst_slots", d_slots, dst.geometry.N, unique=True)
    return s_slots, d_slots, T, skip_prefix


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

    ``handle`` and ``status`` (the copy program and the device's status word)
    are filled in by the first kernel call that uses the choice; ``bound``
    (the program bound to the caches' tensors, ``_C.PreparedCopy``) by the
    second, so a repeated call skips the lookup of its binding (and the
    passing of every cache tensor) in C++.
    """

    src_layers: list
    dst_layers: list
    src_planes: list
    dst_planes: list
    max_ctas: int
    device: torch.device
    handle: int | None = None
    status: torch.Tensor | None = None
    bound: object = None
    kernel_calls: int = 0


def _pair_choice(src: KVCache, dst: KVCache, src_layers, dst_layers, src_planes, dst_planes, max_ctas,
                 engine) -> CheckedChoice:
    """The checked slot-independent arguments of a transfer from ``src`` to ``dst``.

    Remembered on the source cache per (destination, choice), since a layer-wise
    pipeline makes the same call many times; an entry is used only for the
    very destination object it was made for.
    """
    try:
        if torch.compiler.is_compiling():
            raise TypeError   # traced code checks every call (and keeps no memo)
        key = (id(dst), _choice_key(src_layers), _choice_key(dst_layers), _choice_key(src_planes),
               _choice_key(dst_planes), max_ctas if type(max_ctas) is int else None, engine)
    except TypeError:
        key = None
    if key is not None and key[5] is not None:
        hit = src._checked_choices.get(key)
        if hit is not None and hit[0]() is dst:
            return hit[1]
    _check_pair(src, dst)
    layers_planes = check_layers_and_planes(src, dst, src_layers, dst_layers, src_planes, dst_planes)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}")
    max_ctas = as_int("max_ctas", max_ctas, lo=0, hi=2 ** 31 - 1)
    out = CheckedChoice(*layers_planes, max_ctas, _launch_device(src, dst))
    if key is not None and key[5] is not None:
        if len(src._checked_choices) >= 256:
            src._checked_choices.clear()
        # the binding holds the destination's tensors: released with the destination cache
        src._checked_choices[key] = (weakref.ref(dst, lambda _: setattr(out, "bound", None)), out)
    return out


def transfer_args(src: KVCache, dst: KVCache, src_slots=None, dst_slots=None, *, src_layers=None,
                  dst_layers=None, src_planes=None, dst_planes=None, skip_prefix: int = 0,
                  num_tokens: int | None = None, max_ctas: int = 0, validate: bool | None = None,
                  engine: str = "kernel") -> TransferArgs:
    """Checks and normalizes :func:`transfer`'s arguments (errors name the argument)."""
    c = _pair_choice(src, dst, src_layers, dst_layers, src_planes, dst_planes, max_ctas, engine)
    validate = validating(validate)
    s_slots, d_slots, T, skip_prefix = check_slots(src, dst, c.device, engine, src_slots, dst_slots, skip_prefix,
                                                   num_tokens)
    return TransferArgs(c.src_layers, c.dst_layers, c.src_planes, c.dst_planes, c.device, s_slots, d_slots, T,
                        skip_prefix, c.max_ctas, validate, engine)


def copy_engine_run(launches: list[Launch], args: TransferArgs) -> None:
    """Runs launches with the copy engine (``kvlayout::copy_runs``)."""
    for launch in launches:
        _native.copy_runs(launch.src_tensors, launch.dst_tensors, args.src_slots, args.dst_slots, args.num_tokens,
                          args.skip_prefix, launch.src_segments, launch.dst_segments, launch.src_geometry,
                          launch.dst_geometry, launch.num_pieces, launch.piece_bytes)


def transfer(src: KVCache, dst: KVCache, src_slots=None, dst_slots=None, *, src_layers=None, dst_layers=None,
             src_planes=None, dst_planes=None, skip_prefix: int = 0, num_tokens: int | None = None,
             max_ctas: int = 0, validate: bool | None = None, engine: str = "kernel") -> None:
    """Copy token rows from ``src`` into ``dst`` in place (see ``reference.transfer``).

    ``src_slots``/``dst_slots``: int32/int64 ``[T]`` tensors on the launch
    device (or pinned host), or ``None`` for positions ``0..T-1`` (chunk
    layouts).  For each token t >= ``skip_prefix`` with both slots >= 0, each
    plane pair and each layer pair: ``dst[pd, ld, dst_slots[t]] = src[ps, ls,
    src_slots[t]]`` (rows of H*E elements, byte-exact).  ``max_ctas``: how many
    CTAs (SMs) the CUDA kernel may occupy, 0 = default.  ``engine``:
    ``"kernel"`` (the copy kernel), ``"copy"`` (the copy engine, slots on the
    host), ``"staged"`` (between a CUDA cache and a pinned host chunk: the
    kernel works in a device copy of the chunk and the copy engine crosses
    PCIe, see :mod:`kvlayout.ops.staged`; ValueError where it cannot) or
    ``"auto"`` (staged where it can and the payload is large, else the
    kernel; :func:`explain` says which and why).  The plan is made once per
    choice and kept in C++ as a copy program; calling
    :func:`~kvlayout.ops.prepare` instead also keeps the binding and the
    argument checks.
    """
    c = _pair_choice(src, dst, src_layers, dst_layers, src_planes, dst_planes, max_ctas, engine)
    validate = validating(validate)
    if (c.bound is not None and engine == "kernel" and num_tokens is None and type(skip_prefix) is int
            and c.bound.run_checking(0, src_slots, dst_slots, skip_prefix, c.max_ctas, validate)):
        return      # a repeated call with plain slots: checked and run in C++
    s_slots, d_slots, T, skip_prefix = check_slots(src, dst, c.device, engine, src_slots, dst_slots, skip_prefix,
                                                   num_tokens)
    if T == 0 or not c.src_layers or not c.src_planes:
        return
    if engine in ("staged", "auto"):
        staged = _staging_choice(src, dst, c, s_slots, d_slots, T, skip_prefix, engine)
        if staged.groups is not None:
            run_staged(src, dst, staged, c, s_slots, d_slots, T, skip_prefix, validate)
            return
    if engine == "copy":
        launches = cached_plan(src, dst, c.src_layers, c.dst_layers, c.src_planes, c.dst_planes)
        _check_disjoint(src, dst, launches)
        copy_engine_run(launches, TransferArgs(c.src_layers, c.dst_layers, c.src_planes, c.dst_planes, c.device,
                                               s_slots, d_slots, T, skip_prefix, c.max_ctas, validate, engine))
        return
    if torch.compiler.is_compiling():
        # The graph keeps the launches themselves (registering a program is not traceable);
        # tensors have no addresses while tracing, so the identity check names the caches' tensors.
        status = _native.status_tensor(c.device)
        launches = plan(src, dst, c.src_layers, c.dst_layers, c.src_planes, c.dst_planes)
        _check_disjoint(src, dst, launches)
        for launch in launches:
            _native.copy_rows(launch.src_tensors, launch.dst_tensors, s_slots, d_slots, T, skip_prefix,
                              launch.src_segments, launch.dst_segments, launch.src_geometry, launch.dst_geometry,
                              launch.num_pieces, launch.piece_bytes, c.max_ctas, status, validate)
        return
    if c.bound is not None and c.bound.run_with(0, s_slots, d_slots, T, skip_prefix, c.max_ctas, validate):
        return
    if c.handle is None:
        from .program import program_for  # (program imports this module)
        c.handle = program_for(src, dst, c.src_layers, c.dst_layers, c.src_planes, c.dst_planes)
        c.status = _native.status_tensor(c.device)
    c.kernel_calls += 1
    if c.kernel_calls >= 2:
        # a repeated call (memoized choice: same src and dst objects): keep the binding (re-made when a
        # tensor moved); a one-off call leaves it to run_program's cache by address
        c.bound = _C.bind_program(c.handle, list(src.tensors), list(dst.tensors), c.status, src.geometry.N,
                                  dst.geometry.N)
        if c.bound is not None and c.bound.run_with(0, s_slots, d_slots, T, skip_prefix, c.max_ctas, validate):
            return
    if not _C.run_program(c.handle, src.tensors, dst.tensors, s_slots, d_slots, 0, T, skip_prefix, c.max_ctas,
                          c.status, validate):
        torch.ops.kvlayout.copy_program(c.handle, list(src.tensors), list(dst.tensors), s_slots, d_slots, 0, T,
                                        skip_prefix, c.max_ctas, c.status, validate)


def _staging_choice(src: KVCache, dst: KVCache, c: CheckedChoice, s_slots, d_slots, T: int, skip_prefix: int,
                    engine: str) -> StagedPlan:
    """The staged plan of ``engine="staged"`` (ValueError naming why it cannot be staged) or ``"auto"``
    (``groups`` None where the kernel is the better choice)."""
    if torch.compiler.is_compiling():
        staged = StagedPlan("compiled code keeps the copy kernel")
    else:
        staged = staged_plan(src, dst, c, s_slots, d_slots, T, skip_prefix)
    if engine == "staged" and staged.groups is None:
        raise ValueError(f"engine='staged' cannot stage this transfer: {staged.reason}")
    if engine == "auto" and staged.groups is not None and staged.payload_bytes < _staged.AUTO_MIN_BYTES:
        return StagedPlan(f"{staged.payload_bytes} bytes: below {_staged.AUTO_MIN_BYTES} the kernel's direct "
                          "path wins")
    return staged


def explain(src: KVCache, dst: KVCache, src_slots=None, dst_slots=None, *, src_layers=None, dst_layers=None,
            src_planes=None, dst_planes=None, skip_prefix: int = 0, num_tokens: int | None = None,
            max_ctas: int = 0, engine: str = "auto") -> dict:
    """What :func:`transfer` with these arguments would do: ``{"engine": ..., "reason": ...}``.

    ``engine``: the engine asked for; for ``"auto"`` the answer says which one it picks and why.
    """
    c = _pair_choice(src, dst, src_layers, dst_layers, src_planes, dst_planes, max_ctas, engine)
    s_slots, d_slots, T, skip_prefix = check_slots(src, dst, c.device, engine, src_slots, dst_slots, skip_prefix,
                                                   num_tokens)
    if engine in ("kernel", "copy"):
        return {"engine": engine, "reason": "asked for"}
    staged = _staging_choice(src, dst, c, s_slots, d_slots, T, skip_prefix, engine)
    if staged.groups is not None:
        return {"engine": "staged", "reason": staged.reason, "groups": len(staged.groups),
                "payload_bytes": staged.payload_bytes}
    return {"engine": "kernel", "reason": staged.reason}


def gather(cache: KVCache, slots=None, *, out: torch.Tensor | None = None, layers=None, planes=None,
           skip_prefix: int = 0, num_tokens: int | None = None, max_ctas: int = 0,
           validate: bool | None = None) -> torch.Tensor:
    """Cache -> rows ``[P', L', T, H, E]``: ``out[i, j, t] = cache[planes[i], layers[j], slots[t]]``.

    ``out`` may live on the cache's device or in pinned host memory (gather to
    host); it defaults to a new zero tensor on the cache's device.  Rows of
    negative slots and of the skipped prefix are left as they are in ``out``.
    """
    g = cache.geometry
    P = len(as_index_list(g.P, planes, "planes"))
    L = len(as_index_list(g.L, layers, "layers"))
    if num_tokens is not None:
        num_tokens = as_int("num_tokens", num_tokens, lo=0)
    if slots is not None and not isinstance(slots, torch.Tensor):
        slots = _slots_tensor("slots", slots, cache.device)
    T = int(slots.shape[0]) if slots is not None and slots.dim() == 1 else (
        num_tokens if num_tokens is not None else g.N)
    if out is None:
        out = torch.zeros((P, L, T, g.H, g.E), dtype=cache.dtype, device=cache.device)
    elif not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor [P', L', T, H, E], got {type(out).__name__}")
    elif out.dim() != 5 or (out.shape[0], out.shape[1]) != (P, L) or out.shape[2] < T:
        # (rows of another H x E split with the same width are fine: the transfer checks the row width)
        raise ValueError(f"out has shape {tuple(out.shape)}; it must be [P', L', T, H, E] with "
                         f"P' = {P}, L' = {L} and T >= {T} for {T} tokens")
    transfer(cache, bind("rows", out), slots, None, src_layers=layers, src_planes=planes, skip_prefix=skip_prefix,
             num_tokens=T, max_ctas=max_ctas, validate=validate)
    return out


def scatter(cache: KVCache, rows: torch.Tensor, slots=None, *, layers=None, planes=None, skip_prefix: int = 0,
            max_ctas: int = 0, validate: bool | None = None) -> None:
    """Rows ``[P', L', T, H', E']`` -> cache in place: ``cache[planes[i], layers[j], slots[t]] = rows[i, j, t]``."""
    transfer(bind("rows", rows), cache, None, slots, dst_layers=layers, dst_planes=planes, skip_prefix=skip_prefix,
             max_ctas=max_ctas, validate=validate)


def move(cache: KVCache, src_slots, dst_slots, *, max_ctas: int = 0, validate: bool | None = None) -> None:
    """Within one cache, all layers and planes: ``cache[dst_slots[t]] = old_cache[src_slots[t]]``.

    Overlap-safe at any size: the rows are gathered into a buffer first, then
    scattered.  Pairs with a negative slot are skipped.
    """
    device = cache.device
    for name, value in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if value is None:
            raise TypeError(f"move needs {name}: a 1-D int32/int64 tensor of slots of the cache, got None")
    s = _slots_tensor("src_slots", src_slots, device)
    d = _slots_tensor("dst_slots", dst_slots, device)
    if s.shape != d.shape:
        raise ValueError(f"src_slots {tuple(s.shape)} and dst_slots {tuple(d.shape)} differ in length")
    # a pair is skipped when either slot is negative: mark the source too so the gather skips it
    s = torch.where(d < 0, torch.full_like(s, -1), s)
    rows = gather(cache, s, max_ctas=max_ctas, validate=validate)
    # a source the gather did not read (negative, or out of range and recorded by the
    # kernel) must not be written: its row in `rows` holds no data
    unread = (s < 0) | (s >= cache.geometry.N)
    scatter(cache, rows, torch.where(unread, torch.full_like(d, -1), d), max_ctas=max_ctas, validate=validate)


def skip_prefix(slots: torch.Tensor | None, n: int, num_tokens: int | None = None) -> torch.Tensor:
    """LMCache ``skip_prefix_n_tokens`` as slots: a copy with the first ``n`` entries set to -1.

    ``slots=None`` stands for the chunk positions ``0..num_tokens-1``.
    """
    n = as_int("skip_prefix", n, lo=0)
    if slots is None:
        if num_tokens is None:
            raise ValueError("skip_prefix needs num_tokens when slots is None")
        num_tokens = as_int("num_tokens", num_tokens, lo=0)
        slots = torch.arange(num_tokens, dtype=torch.int64)
    out = slots.clone()
    out[:n] = -1
    return out


def check_errors(device=None) -> None:
    """Raise ``IndexError`` if a CUDA kernel skipped an out-of-range slot since the last check.

    Synchronizes with the device (``None``: every device used so far).  CPU
    operations raise immediately instead.
    """
    _native.raise_on_device_errors(torch.device(device) if device is not None else None)
