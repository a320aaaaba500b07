"""transfer / gather / scatter / move / skip_prefix on torch tensors: the API.

Same names and semantics as ``kvlayout.reference.operations``; the caches are
:class:`~kvlayout.ops.views.KVCache` objects (or ``(layout, tensors)`` bound
on the fly).  Every operation is a composition of one transfer, and every
transfer runs one copy program (:mod:`kvlayout.ops.planner` plans it,
:mod:`kvlayout.ops.programs` keeps it, :mod:`kvlayout.ops.routes` runs it):
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

import torch

from . import _native, routes
from . import staged as _staged
from .arguments import CheckedChoice, _slots_tensor, check_slots, checked_choice, validating
from .programs import plan
from .staged import StagedPlan, run_staged, staged_plan
from .views import KVCache, as_index_list, as_int, bind

_is_compiling = torch.compiler.is_compiling


def transfer(src: KVCache, dst: KVCache, src_slots=None, dst_slots=None, *, src_layers=None, dst_layers=None,
             src_planes=None, dst_planes=None, skip_prefix: int = 0, num_tokens: int | None = None,
             max_ctas: int = 0, validate: bool | None = None, engine: str = "auto") -> None:
    """Copy token rows from ``src`` into ``dst`` in place (see ``reference.transfer``).

    ``src_slots``/``dst_slots``: int32/int64 ``[T]`` tensors on the launch
    device (or pinned host), or ``None`` for positions ``0..T-1`` (chunk
    layouts).  For each token t >= ``skip_prefix`` with both slots >= 0, each
    plane pair and each layer pair: ``dst[pd, ld, dst_slots[t]] = src[ps, ls,
    src_slots[t]]`` (rows of H*E elements, byte-exact).  ``max_ctas``: an SM
    budget, 0 = default; n > 0 runs the CUDA kernel as at most n CTAs of 1024
    threads (one SM each).  ``engine``:
    ``"auto"`` (the default: staged where it can be, without an SM budget
    and with a large payload, else the kernel; :func:`explain` says which
    and why), ``"kernel"`` (the copy kernel), ``"copy"`` (the copy engine,
    slots on the host) or ``"staged"`` (between a CUDA cache and a pinned
    host chunk: the kernel works in a bounded staging ring in device memory
    and the copy engine crosses PCIe, see :mod:`kvlayout.ops.staged`;
    ValueError where it cannot).  The plan is made once per
    choice and kept in C++ as a copy program; calling
    :func:`~kvlayout.ops.prepare` instead also keeps the binding and the
    argument checks.
    """
    if (src_planes is None and dst_planes is None and num_tokens is None and type(max_ctas) is int
            and type(skip_prefix) is int and (engine == "auto" or engine == "kernel" or engine == "staged")):
        # the engine's repeated calls (all layers, or one layer each side; plain slot tensors; no SM budget):
        # checked and launched by one C++ call from what its checked choice keeps (checked_choice's memo): the
        # bound copy program where auto keeps the kernel, the staged transfer last run where it stages (or the
        # engine is "staged", all layers). (This path costs about as much as one torch op: every lookup counts.)
        if max_ctas != 0:
            key = None
        elif src_layers is None and dst_layers is None:
            key = id(dst) if engine != "staged" else (id(dst), None, None, None, None, 0, "staged")
        elif (type(src_layers) is list and type(dst_layers) is list and len(src_layers) == 1
              and len(dst_layers) == 1 and type(src_layers[0]) is int and type(dst_layers[0]) is int
              and engine != "staged"):
            key = (id(dst), src_layers[0], dst_layers[0])   # (repeated_call_key inlined: a call costs ~0.1 µs)
        else:
            key = None
        hit = src._checked_choices.get(key) if key is not None else None
        if hit is not None and hit[0]() is dst and not _is_compiling():
            c = hit[1]
            m = c.auto_kernel   # (auto's answer kept for the pair: _auto_keeps_kernel's, checked inline)
            if engine != "staged" and (
                    engine == "kernel" or c.never_staged == _staged.STAGING_BYTES
                    or (m is not None and m[0] is _staged.RULE_STATE
                        and ((dst_slots if m[1] else src_slots) is not None
                             or (type(s := src_slots if m[1] else dst_slots) is torch.Tensor
                                 and s.numel() - skip_prefix <= m[2])))
                    or _auto_keeps_kernel(c.staged_plan, c, src_slots, dst_slots, skip_prefix, 0)):
                run_checking = c.run_checking
                if run_checking is not None and run_checking(0, src_slots, dst_slots, skip_prefix, 0,
                                                             validating(validate)):
                    return
            elif c.staged_kept is not None:
                # staged: the transfer last run for the choice, if its ring is still kept and the call is its to
                # run as it is (no planning, no ring lookup)
                kept = c.staged_kept()
                if kept is not None and kept.run_kept(src_slots, dst_slots, skip_prefix, 0, validating(validate)):
                    return
        elif engine != "staged" and max_ctas >= 0 and not _is_compiling():
            # a pair of cache objects not seen before (an engine that binds its tensors at every call), or a call
            # under an SM budget: the choice (for a new pair, copied from the one of these caches' shapes) says
            # whether the kernel runs the call; if so one C++ call checks the slots and launches, through the
            # pair's binding from its second call on (the long way plans and checks in Python first)
            c = checked_choice(src, dst, src_layers, dst_layers, None, None, max_ctas, engine)
            if c.shared is not None and (engine == "kernel" or _auto_keeps_kernel(
                    c.shared.ring_plan, c, src_slots, dst_slots, skip_prefix, max_ctas)):
                checks = validating(validate)
                if (routes.try_direct(c, src_slots, dst_slots, skip_prefix, checks)
                        or (c.bound is None and c.kernel_calls == 0
                            and routes.run_first(src, dst, c, src_slots, dst_slots, skip_prefix, checks))):
                    return
    if engine == "kernel":
        routes.run(src, dst, src_slots, dst_slots, src_layers=src_layers, dst_layers=dst_layers,
                   src_planes=src_planes, dst_planes=dst_planes, skip_prefix=skip_prefix, num_tokens=num_tokens,
                   max_ctas=max_ctas, validate=validate)
        return
    c = checked_choice(src, dst, src_layers, dst_layers, src_planes, dst_planes, max_ctas, engine)
    validate = validating(validate)
    s_slots, d_slots, T, skip_prefix = check_slots(src, dst, c.device, engine, src_slots, dst_slots, skip_prefix,
                                                   num_tokens)
    if _moves_nothing(c, T):
        return
    if engine in ("staged", "auto"):
        staged = _staging_choice(src, dst, c, s_slots, d_slots, T, skip_prefix, engine)
        if staged.stageable:
            run_staged(src, dst, staged, c, s_slots, d_slots, T, skip_prefix, validate)
            return
    if engine == "copy":
        routes.check_not_shared(src, dst, c)
        routes.run_copy_engine(plan(src, dst, c.src_layers, c.dst_layers, c.src_planes, c.dst_planes),
                               s_slots, d_slots, T, skip_prefix)
        return
    routes.run_kernel(src, dst, c, s_slots, d_slots, T, skip_prefix, validate)


def _moves_nothing(c: CheckedChoice, T: int) -> bool:
    """Whether a checked call has nothing to move (no tokens, layers or planes): no engine is chosen for it."""
    return T == 0 or not c.src_layers or not c.src_planes


def _moved_before(c: CheckedChoice) -> bool:
    """Whether a call of the choice's pair of cache objects ran (auto's rule: ops.staged.auto_stages)."""
    return c.kernel_calls > 0 or c.staged_kept is not None


def _auto_keeps_kernel(kept: tuple | None, c: CheckedChoice, src_slots, dst_slots, skip_prefix: int,
                       max_ctas: int) -> bool:
    """For the paths that skip planning: whether auto keeps the kernel for a call of the choice ``c`` with these
    slot arguments, from a kept staged plan (``(ring size, plan)``: the choice's ``staged_plan``, or the
    ``ring_plan`` of its caches' shapes, which leaves out the host memory's pinning: an unpinned host side is never
    staged, so where that plan keeps the kernel the call's does too). False: not known here, the long way
    decides. Between a pair that moved before, without an SM budget, keeps the rule's answer on the choice
    (``auto_kernel``), which a repeated call checks inline."""
    if kept is None or kept[0] != _staged.STAGING_BYTES:
        return False                     # not known yet: the long way decides (and plans)
    static = kept[1]
    if not static.stageable:
        return True
    if (c.kernel_calls > 0 and max_ctas == 0 and kept is c.staged_plan
            and (c.auto_kernel is None or c.auto_kernel[0] is not _staged.RULE_STATE)):
        # (the state read before the thresholds: one changed meanwhile by another thread leaves this answer stale,
        # never an old threshold's answer under the new state)
        c.auto_kernel = (_staged.RULE_STATE, static.host_is_dst,
                         _staged.auto_kernel_tokens(c.device, static.host_is_dst, static.token_bytes))
    if (dst_slots if static.host_is_dst else src_slots) is not None:
        return True                      # staging copies host rows 0..T-1: a host side with slots is not staged
    slots = src_slots if static.host_is_dst else dst_slots
    if type(slots) is not torch.Tensor or slots.dim() != 1:
        return False
    return not _staged.auto_stages_on(c.device, static.host_is_dst,
                                      static.token_bytes * (slots.numel() - skip_prefix), max_ctas,
                                      c.kernel_calls > 0 or c.staged_kept is not None)   # (_moved_before, inlined)


def _staging_choice(src: KVCache, dst: KVCache, c: CheckedChoice, s_slots, d_slots, T: int, skip_prefix: int,
                    engine: str, allocate: bool = True) -> StagedPlan:
    """The staged plan of ``engine="staged"`` (ValueError naming why it cannot be staged) or ``"auto"``
    (not ``stageable`` where the kernel is the better choice, or where the device has no memory for a
    staging ring: ``allocate`` says whether to allocate the ring now, as a transfer does, or only to ask)."""
    if torch.compiler.is_compiling():
        staged = StagedPlan("compiled code keeps the copy kernel")
    else:
        staged = staged_plan(src, dst, c, s_slots, d_slots, T, skip_prefix)
    if engine == "staged" and not staged.stageable:
        raise ValueError(f"engine='staged' cannot stage this transfer: {staged.reason}")
    if engine == "auto" and staged.stageable:
        declined = _staged.auto_declines(staged, c.max_ctas, c.device, _moved_before(c))
        if declined is not None:
            return StagedPlan(declined)
        refusal = _staged.ring_refusal(c.device, allocate)
        if refusal is not None:
            return StagedPlan(f"{refusal}: the kernel (ops.release_staging() frees the rings)")
    return staged


def explain(src: KVCache, dst: KVCache, src_slots=None, dst_slots=None, *, src_layers=None, dst_layers=None,
            src_planes=None, dst_planes=None, skip_prefix: int = 0, num_tokens: int | None = None,
            max_ctas: int = 0, engine: str = "auto") -> dict:
    """What :func:`transfer` with these arguments would do: ``{"engine": ..., "reason": ...}``.

    ``engine``: the engine asked for; for ``"auto"`` the answer says which one it picks and why. A staged
    answer also gives the call's layer ``groups``, ``chunks``, ``chunk_tokens`` and ``short_chunk_tokens``
    (its one short chunk's, first to the host and last from it; 0: none), ``graph_nodes``: the
    nodes of the graph kept for this call shape on the current stream, which the call replays (unless it
    validates), or 0 where none is kept and the call is issued directly, ``graph_on_device``: whether that
    graph runs as a conditional node's body (:func:`~kvlayout.ops.set_staged_graph_launch`), and
    ``graph_tokens``: the token count of the call it was captured from (0: none; below the call's token count:
    its reuse prefix's graph, the rest moved by the direct kernel, :func:`~kvlayout.ops.set_staged_graph_reuse`).
    """
    c = checked_choice(src, dst, src_layers, dst_layers, src_planes, dst_planes, max_ctas, engine)
    s_slots, d_slots, T, skip_prefix = check_slots(src, dst, c.device, engine, src_slots, dst_slots, skip_prefix,
                                                   num_tokens)
    if _moves_nothing(c, T):
        # transfer returns before any engine is chosen (so engine="staged" refuses nothing here either)
        return {"engine": "none", "reason": "nothing to move: no tokens, layers or planes"}
    if engine in ("kernel", "copy"):
        return {"engine": engine, "reason": "asked for"}
    staged = _staging_choice(src, dst, c, s_slots, d_slots, T, skip_prefix, engine, allocate=False)
    if staged.stageable:
        nodes, on_device, graph_tokens = _staged.kept_graph(c, staged, s_slots, d_slots, T, skip_prefix)
        return {"engine": "staged", "reason": staged.reason, "groups": staged.layer_groups,
                "chunks": staged.chunks(T, skip_prefix, c.max_ctas),
                "chunk_tokens": staged.call_chunk_tokens(T, skip_prefix, c.max_ctas),
                "short_chunk_tokens": staged.short_chunk_tokens(T, skip_prefix, c.max_ctas),
                "graph_nodes": nodes, "graph_on_device": on_device, "graph_tokens": graph_tokens,
                "payload_bytes": staged.payload_bytes, "staging_bytes": _staged.STAGING_BYTES}
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
    P = g.P if planes is None else len(as_index_list(g.P, planes, "planes"))
    L = g.L if layers is None else len(as_index_list(g.L, layers, "layers"))
    if num_tokens is not None:
        num_tokens = as_int("num_tokens", num_tokens, lo=0)
    if slots is not None and not isinstance(slots, torch.Tensor):
        slots = _slots_tensor("slots", slots, cache.device)
    T = slots.shape[0] if slots is not None and slots.dim() == 1 else (
        num_tokens if num_tokens is not None else g.N)
    if out is None:
        out = torch.zeros((P, L, T, g.H, g.E), dtype=cache.dtype, device=cache.device)
    elif not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor [P', L', T, H, E], got {type(out).__name__}")
    elif out.dim() != 5 or (out.shape[0], out.shape[1]) != (P, L) or out.shape[2] < T:
        # (rows of another H x E split with the same width are fine: the transfer checks the row width)
        raise ValueError(f"out has shape {tuple(out.shape)}; it must be [P', L', T, H, E] with "
                         f"P' = {P}, L' = {L} and T >= {T} for {T} tokens")
    # (given slots say T: the transfer then takes its common path, which checks num_tokens only when given)
    transfer(cache, bind("rows", out), slots, None, src_layers=layers, src_planes=planes, skip_prefix=skip_prefix,
             num_tokens=num_tokens if slots is not None else T, max_ctas=max_ctas, validate=validate)
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

