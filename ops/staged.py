"""The staged host path: the kernel works in device memory, the copy engine crosses PCIe.

A kernel that reads or writes pinned host memory itself (zero-copy) stops
near 93-95 % of the pinned-copy ceiling on an H200; the copy engine reaches
the ceiling.  For a transfer between a CUDA cache and a pinned host cache
whose chosen rows lie back to back in token order (a chunk: host slots
``None``, each (layer, plane) a run of rows in slot order),
``engine="staged"`` moves the rows through a bounded **staging ring** in
device memory: ``RING_SLOTS`` slots of ``STAGING_BYTES / RING_SLOTS`` bytes
each (``KVLAYOUT_STAGING_BYTES``, default 64 MiB), reused by every staged call
on one stream.

Each ring slot holds a *mini cache*: the host cache's layout with
``chunk_layers`` layers and ``chunk_tokens`` slots (as many as fit the slot).
The transfer is cut into chunks (a group of ``chunk_layers`` chosen layers,
up to ``chunk_tokens`` tokens: fewer where that gives a call about 8
chunks of at least 8 MiB (of 16 MiB where it still has 4 of them), 16 of
at least 2 MiB under an SM budget, so that the pipeline's start and end,
where one stage waits for the other, stay short and small calls pay one
chunk's fixed cost; :meth:`StagedPlan.call_chunk_tokens`; without a budget,
where a layer group has more than one, the call has one chunk of a quarter
of that at the end where the pipeline idles, its first to the host and its
last from it: ``_C.staged_cut``),
chunk c through ring slot c % RING_SLOTS:

* device -> host: the copy kernel moves the chunk's rows from the device
  cache into the slot (a token to the ring row of its index in its chunk)
  on the caller's stream; the copy engine moves the slot's rows to the host
  chunk on a side stream.  Host rows the transfer must leave unchanged
  (tokens whose device slot is negative or out of range) are first copied
  from the host into the slot by the kernel, reading only those rows, so the
  bytes copied back are the host's own.
* host -> device: the copy engine fills the slot from the host chunk on the
  side stream; the kernel moves the rows into the device cache.

So one chunk's kernel runs while the copy engine moves another.  Every row
moves through the one copy kernel, so slots, skip_prefix and recorded
out-of-range slots behave as with ``engine="kernel"``.  Everything is
stream-ordered (events, no host synchronization): a staged transfer can be
captured in a CUDA graph.

The per-call loop is one C++ call (``_C.StagedTransfer``, ``torch_ext/staged.h``);
Python plans each pair of cache shapes once per ring (chunk shape, mini
caches, the copy programs, the host byte spans: :class:`_RingShapes`) and each
transfer once (those programs bound to its caches and every ring slot:
:class:`_Transfer`), and keeps both with the ring. The C++
engine captures the second call of a shape (token count, skip_prefix, SM
budget, slot dtype) into a CUDA graph and replays it for later calls of that
shape (a slot copy and a graph launch instead of some 25 µs of driver calls
per chunk; :func:`set_staged_graph_launch` says whether the host's launch
issues the graph's nodes or the device starts them, as a conditional node's
body); :func:`kvlayout.ops.transfer`'s repeated-call path reaches the
kept plan without planning or looking the ring up (:meth:`_Transfer.run_kept`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref

import torch

from kvlayout import _C
from kvlayout.reference.layouts import make_geometry

from . import _native, calibration
from .locks import fork_safe
from .programs import plan, program_handle, program_key, unpin
from .settings import NativeChoice, environment_capacity
from .views import KVCache

RULE_STATE = object()       # replaced whenever an input of auto's rule changes: answers kept per choice
#                             (CheckedChoice.auto_kernel, auto_kernel_tokens) hold the state they were read under


def rule_changed() -> None:
    """Marks the answers of auto's rule kept per choice stale (a threshold table or a device's calibration
    changed)."""
    global RULE_STATE
    RULE_STATE = object()


calibration.when_changed(rule_changed)


class _RuleTable(dict):
    """A threshold table of auto's rule (bytes by direction): any change to it calls :func:`rule_changed`."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        rule_changed()

    def __delitem__(self, key):
        super().__delitem__(key)
        rule_changed()

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        rule_changed()

    def pop(self, *args):
        try:
            return super().pop(*args)
        finally:
            rule_changed()

    def popitem(self):
        try:
            return super().popitem()
        finally:
            rule_changed()

    def setdefault(self, key, default=None):
        try:
            return super().setdefault(key, default)
        finally:
            rule_changed()

    def __ior__(self, other):
        self.update(other)
        return self

    def clear(self):
        super().clear()
        rule_changed()


STAGING_BYTES = environment_capacity("KVLAYOUT_STAGING_BYTES", 64 << 20)   # one ring: all its slots
CHUNKS = 8                  # the default of set_staged_chunks (the C++ engine's kStagedChunks)
RING_SLOTS = 2              # chunks in flight: one in the kernel, one in the copy engine
# engine="auto" (the default) stages a stageable transfer from AUTO_MIN_BYTES on (both directions), without an
# SM budget or, from the host, under a budget of at most AUTO_MAX_BUDGET_FROM_HOST SMs; every other call runs
# the direct kernel. From the staged group against the kernel rows of the same cases, both timings, staged calls
# replayed from their captured graphs, in the H200 record of 8f0a720 (bench/results/h200_8f0a720/h200.jsonl) and the
# H100 record (bench/results/h100.jsonl, tree of ecd86ed): without a budget staging was at least as fast from
# 144 MiB on in both directions (1.03-1.19x) and slower to the host at 80 MiB and below (L80 H8 T=256, 80 MiB:
# 0.96-0.98x end to end; L32 H1 T=4096, 64 MiB: 0.97-1.00x), so auto stages from 128 MiB on. From the host it
# was faster from 32 MiB on, kernel only (L32 H8 T=256, 32 MiB: 1.01x / 1.04x, H200 / H100; L32 H1 T=4096,
# 64 MiB: 1.03x / 1.03x; L80 H8 T=256, 80 MiB: 1.02x / 1.04x), but those rows repeat one pair of cache objects,
# whose staged plan is kept and whose call shape replays a captured graph: a call between caches bound anew
# (an adapter binding a fresh host chunk per call) plans a staged transfer every time, and the staged group's
# "bind-per-call" rows (H100 record of 0d38bb0) show that costing 872-1,647 us of host work per call, end to
# end 24.0-31.7 GB/s against the kernel's 46.8-48.5: loads keep the threshold. Under a budget of 1, 2 or 4
# SMs it was 1.29-3.41x as fast from the host in that H200 record (the copy engine crosses PCIe, the budget's
# SMs only move rows inside device memory); at 8 SMs slower for 256-byte rows (0.95x). To the host under a
# budget it was slower end to end for rows under 2 KiB at every budget (0.73-0.98x), and for 2 KiB rows at 1 SM.
# Where a device's SMs move host memory slowly beside its copy engine (calibration.py; the H100 record of b1ed027:
# the kernel's loads at 54-63 % of the pinned ceiling, staged loads of 9 MiB and more at 82-99 % where their
# graph is launched by the host, caches bound anew at every call included), auto stages that way from
# calibration.SLOW_SM_AUTO_MIN_BYTES on.
# A load between a pair of cache objects that moved before (the planning above is paid: an engine's own caches)
# stages from AUTO_MIN_BYTES_MOVED_BEFORE on without an SM budget. The loads of 32, 64 and 80 MiB (L32 H8 T=256,
# L32 H1 T=4096, L80 H8 T=256) between kept caches were faster staged than by the kernel in every record, both
# timings: the H200 of b8f11a3 (8 MiB chunks then) 1.009-1.028x, the H100 of 00c04b3 (16 MiB chunks; its SMs
# read the host at 0.92x the copy engine: bench/results/h100_00c04b3/) 1.031-1.050x, the H100 of dbc67bc
# 1.036-1.065x, the H100 of 4af85c4 1.039-1.063x, the H100 of adb7620 97.3 % of the pinned ceiling end to end
# against the kernel's 90.8-92.9 % (bench/results/h100_adb7620/). Below 32 MiB it is not so in every record: the
# 17 MiB load (L61 MLA T=256, 3 chunks) 1.014-1.028x end to end but 0.994x kernel only on the H200, the 9 MiB
# one (L32 MLA T=256, one chunk) 0.90-0.98x. Between caches bound anew at every call the same loads were slower staged
# (0.957-0.994x end to end on the H100 of 00c04b3: 191-313 us of host work against the kernel's 45-65;
# 0.902-0.934x on that of dbc67bc), so a pair's first call keeps AUTO_MIN_BYTES. Stores of 80 MiB were
# 0.980-1.007x staged (every record): they keep it too, as do loads under a budget (L32 H1 T=4096 under 4 SMs:
# 0.992x end to end on the H100 of 00c04b3).
AUTO_MIN_BYTES = _RuleTable({"from_host": 128 << 20, "to_host": 128 << 20})
AUTO_MIN_BYTES_MOVED_BEFORE = _RuleTable({"from_host": 32 << 20, "to_host": 128 << 20})
AUTO_MAX_BUDGET_FROM_HOST = 4
KEPT_RINGS = 2              # rings kept (one per stream that ran a staged transfer; least recently used goes)
PLANS_PER_RING = 64         # planned transfers a ring keeps (least recently used goes)
SHAPES_PER_RING = 16        # plans of shapes a ring keeps (_RingShapes; least recently used goes)
_ALIGN = 256                # bytes: every mini-cache tensor starts at a multiple


def set_staged_chunks(chunks: int) -> None:
    """The chunks a staged call aims at without an SM budget, twice as many under one (``CHUNKS`` unless set,
    or ``KVLAYOUT_STAGED_CHUNKS``): each still at least 8 MiB (16 MiB where a call still has 4 of them; 2 MiB
    under a budget) and at most a ring slot.
    More chunks overlap the kernel and the copy engine better at a call's start and end; fewer cost less host
    time (driver calls issued directly, nodes of a captured graph). 1: chunks of a ring slot's capacity.
    Process-wide (in :func:`~kvlayout.ops.cache_info`); a call reads it once, and a repeated call shape is
    captured again under a new count."""
    if type(chunks) is not int or not 1 <= chunks <= 1024:
        raise ValueError(f"a staged call's chunks must be an int in [1, 1024], got {chunks!r}")
    _C.set_staged_chunks(chunks)


set_staged_chunks(environment_capacity("KVLAYOUT_STAGED_CHUNKS", CHUNKS))

GRAPH_LAUNCHES = ("host", "device")   # set_staged_graph_launch's choices, the default first


def set_staged_graph_launch(where: str) -> None:
    """How a repeated staged call's kept graph is launched: ``"host"`` (the default,
    ``KVLAYOUT_STAGED_GRAPH_LAUNCH``): the captured graph itself, whose every node (two or three per chunk) the
    host's ``cudaGraphLaunch`` issues, or ``"device"``: the captured graph as the body of an always-true
    conditional node, which the device starts, so that the host's launch carries one node whatever the chunk
    count. Where the runtime refuses such a graph the captured one is kept (``ops.explain``'s
    ``graph_on_device`` says which a call replays). Process-wide; a call reads it once, and a call shape kept
    under the other setting is captured again. Results are the same bytes either way."""
    _GRAPH_LAUNCH.set(where)


def staged_graph_launch() -> str:
    """The setting of :func:`set_staged_graph_launch`."""
    return _GRAPH_LAUNCH.get()


_GRAPH_LAUNCH = NativeChoice("a staged graph's launch", GRAPH_LAUNCHES,
                             lambda index: _C.set_staged_graph_on_device(bool(index)), _C.staged_graph_on_device,
                             "KVLAYOUT_STAGED_GRAPH_LAUNCH")

GRAPH_REUSES = ("exact", "prefix")   # set_staged_graph_reuse's choices, the default first


def set_staged_graph_reuse(reuse: str) -> None:
    """Which kept graph a staged call of a token count not run before replays: ``"exact"`` (the default,
    ``KVLAYOUT_STAGED_GRAPH_REUSE``): only its own, so a new length is issued directly, chunk by chunk (its
    second call is captured); ``"prefix"``: also the graph of a shorter call, its reuse prefix (the call of
    ``P`` tokens: ``skip_prefix`` plus its ``n = T - skip_prefix`` tokens rounded down to a multiple of the
    largest power of two ``<= n / 8``, ``_C.staged_reuse_prefix``; captured the second time any call's prefix
    is ``P``), then tokens ``P..T-1`` (at most an eighth of them) moved by one launch of the direct kernel, so
    that an engine whose calls vary in length shares a few graphs (at most 8 for the lengths between two powers
    of two). A length run before still gets its own graph. ``ops.explain``'s
    ``graph_tokens`` says which graph a call replays. Process-wide; a call reads it once. Results are the same
    bytes either way."""
    _GRAPH_REUSE.set(reuse)


def staged_graph_reuse() -> str:
    """The setting of :func:`set_staged_graph_reuse`."""
    return _GRAPH_REUSE.get()


_GRAPH_REUSE = NativeChoice("a staged graph's reuse", GRAPH_REUSES,
                            lambda index: _C.set_staged_graph_prefixes(bool(index)), _C.staged_graph_prefixes,
                            "KVLAYOUT_STAGED_GRAPH_REUSE")


@dataclasses.dataclass
class StagedPlan:
    """Why (or why not) a transfer can be staged, and its shape."""

    reason: str                        # why staged, or why not
    chunk_layers: int = 0              # 0: not stageable
    chunk_tokens: int = 0              # a ring slot's capacity in tokens
    layer_groups: int = 0
    host_is_dst: bool = False
    payload_bytes: int = 0             # of the call (0 in a static plan, which knows no call)
    token_bytes: int = 0               # of one token, all layer groups

    @property
    def stageable(self) -> bool:
        return self.chunk_layers > 0

    def call_chunk_tokens(self, num_tokens: int, skip_prefix: int, max_ctas: int) -> int:
        """Tokens per chunk of a call (the C++ engine's rule, ``staged_chunk_tokens``)."""
        return _C.staged_chunk_tokens(self.chunk_tokens, self.layer_groups, num_tokens - skip_prefix,
                                      self.token_bytes, max_ctas)

    def short_chunk_tokens(self, num_tokens: int, skip_prefix: int, max_ctas: int) -> int:
        """Tokens of a call's short chunk, its first to the host and its last from it (the C++ engine's cut,
        ``staged_cut``); 0 where it has none."""
        return self._cut(num_tokens, skip_prefix, max_ctas)[2]

    def chunks(self, num_tokens: int, skip_prefix: int, max_ctas: int) -> int:
        """Chunks of a call in all layer groups (the C++ engine's cut, ``staged_cut``)."""
        return self._cut(num_tokens, skip_prefix, max_ctas)[3]

    def _cut(self, num_tokens: int, skip_prefix: int, max_ctas: int) -> tuple[int, int, int, int]:
        per_chunk = self.call_chunk_tokens(num_tokens, skip_prefix, max_ctas)
        return _C.staged_cut(num_tokens - skip_prefix, self.layer_groups, per_chunk, self.host_is_dst, max_ctas)


def _host_side(src: KVCache, dst: KVCache) -> str | None:
    kinds = {src.device.type, dst.device.type}
    if kinds != {"cpu", "cuda"}:
        return None
    return "dst" if dst.device.type == "cpu" else "src"


def _rows_back_to_back(geometry, num_pieces: int, piece_bytes: int) -> bool:
    """Whether a segment's slots 0, 1, ... are rows of ``num_pieces * piece_bytes`` bytes back to back."""
    n, page, stride_page, stride_in_page, stride_piece = geometry
    row = num_pieces * piece_bytes
    if num_pieces > 1 and stride_piece != piece_bytes:
        return False
    return (page == 1 and (stride_page == row or n <= 1)) or \
        (stride_in_page == row and (stride_page == page * row or n <= page))


def _cache_bytes(layout, geometry, itemsize: int, align: int = _ALIGN) -> int:
    """Device bytes of a mini cache of ``geometry`` (every tensor starting at a multiple of ``align``)."""
    total = 0
    for part in layout.parts:
        shape = geometry.part_shape(part)
        numel = 1
        for s in shape:
            numel *= s
        per_tensor = -(-numel * itemsize // align) * align
        total += per_tensor * (geometry.L if part.per_layer else 1)
    return total


def _mini_geometry(host: KVCache, layers: int, tokens: int):
    g = host.geometry
    return make_geometry(host.layout, L=layers, N=tokens, H=g.H, E=g.E, page_size=g.BS, columns=g.columns, P=g.P)


def chunk_shape(host: KVCache, chosen_layers: int, slot_bytes: int) -> tuple[int, int] | None:
    """(layers, tokens) of the mini cache one ring slot holds: as many tokens as the host has (in whole
    pages) and fit with one layer, then as many of the chosen layers as fit; None when one page of one
    layer does not fit."""
    g = host.geometry
    per_page = _cache_bytes(host.layout, _mini_geometry(host, 1, g.BS), host.itemsize, align=1)
    pages = min(g.NB, slot_bytes // per_page)   # (an upper bound: alignment only adds)
    while pages > 0 and _cache_bytes(host.layout, _mini_geometry(host, 1, pages * g.BS), host.itemsize) > slot_bytes:
        pages -= 1
    if pages == 0:
        return None
    tokens = pages * g.BS
    per_layer = _cache_bytes(host.layout, _mini_geometry(host, 1, tokens), host.itemsize, align=1)
    layers = max(1, min(chosen_layers, slot_bytes // per_layer))
    while layers > 1 and _cache_bytes(host.layout, _mini_geometry(host, layers, tokens), host.itemsize) > slot_bytes:
        layers -= 1
    return layers, tokens


def mini_cache(host: KVCache, layers: int, tokens: int, slot: torch.Tensor) -> KVCache:
    """A cache of the host's layout with ``layers`` layers and ``tokens`` slots carved out of ``slot`` (uint8
    device memory), each tensor's dimensions in the order of the host tensor's strides (so a row's bytes are
    in the host's order)."""
    geometry = _mini_geometry(host, layers, tokens)
    offset = 0

    def carve(shape, like: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        order = sorted(range(len(shape)), key=lambda d: (-like.stride(d), d))   # outermost first
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * host.itemsize
        flat = slot[offset:offset + nbytes].view(host.dtype)
        offset += -(-nbytes // _ALIGN) * _ALIGN
        dense = flat.view([shape[d] for d in order])
        return dense.permute([order.index(d) for d in range(len(shape))])

    parts = []
    for pv in host.parts:
        shape = geometry.part_shape(pv.part)
        if pv.part.per_layer:
            parts.append([carve(shape, pv.tensors[0]) for _ in range(layers)])
        else:
            parts.append(carve(shape, pv.tensors[0]))
    if offset > slot.numel():
        raise AssertionError(f"mini cache of {offset} bytes in a ring slot of {slot.numel()}")
    return KVCache(host.layout, parts[0] if host.layout.single_part else tuple(parts), page_size=host.geometry.BS)


@dataclasses.dataclass
class _Sides:
    """The chosen layers and planes of the device side and the host side of a transfer."""

    host_is_dst: bool
    device: KVCache
    host: KVCache
    device_layers: list
    host_layers: list
    device_planes: list
    host_planes: list

    @classmethod
    def of(cls, src: KVCache, dst: KVCache, choice, host_is_dst: bool) -> "_Sides":
        if host_is_dst:
            return cls(True, src, dst, choice.src_layers, choice.dst_layers, choice.src_planes, choice.dst_planes)
        return cls(False, dst, src, choice.dst_layers, choice.src_layers, choice.dst_planes, choice.src_planes)

    def transfer(self) -> tuple:
        """The transfer these sides were taken from (:meth:`of` undone): ``(src, dst, src_layers, dst_layers,
        src_planes, dst_planes)``."""
        device = (self.device, self.device_layers, self.device_planes)
        host = (self.host, self.host_layers, self.host_planes)
        (src, src_layers, src_planes), (dst, dst_layers, dst_planes) = \
            (device, host) if self.host_is_dst else (host, device)
        return src, dst, src_layers, dst_layers, src_planes, dst_planes


def host_segments(host: KVCache, mini: KVCache, slot: torch.Tensor, host_layers: list, host_planes: list) \
        -> list[tuple[int, int, int, int]] | str:
    """Per (layer, plane, row part) of ``host_layers`` (mini layers 0, 1, ...): ``(host tensor, host byte offset,
    ring byte offset, row bytes)`` of slot 0's row, from the copy program host -> mini; a reason string where
    rows do not lie back to back on both sides."""
    out = []
    base = slot.storage_offset()           # (byte offsets within the ring's storage: meta tensors have no address)
    for launch in plan(host, mini, host_layers, list(range(len(host_layers))), host_planes, host_planes):
        if not (_rows_back_to_back(launch.src_geometry, launch.num_pieces, launch.piece_bytes)
                and _rows_back_to_back(launch.dst_geometry, launch.num_pieces, launch.piece_bytes)):
            return f"the host layout {host.layout.name}'s rows are not back to back in slot order"
        row = launch.num_pieces * launch.piece_bytes
        for k in range(0, len(launch.src_segments), 2):
            h_tensor, h_offset = launch.src_segments[k], launch.src_segments[k + 1]
            m_tensor, m_offset = launch.dst_segments[k], launch.dst_segments[k + 1]
            ring_offset = mini.tensors[m_tensor].storage_offset() * mini.itemsize - base + m_offset
            out.append((h_tensor, h_offset, ring_offset, row))
    return out


def static_plan(src: KVCache, dst: KVCache, choice) -> StagedPlan:
    """What about a transfer's stageability does not change from call to call (pinned memory, layout,
    chunk shape): a :class:`StagedPlan` with ``token_bytes``, no call's ``payload_bytes``."""
    # all but the host memory's pinning depends on the caches' shapes and the choice alone: planned once for
    # all pairs of these shapes (an engine that binds fresh views call after call plans it once)
    shapes = choice.shared if choice.shared is not None else choice
    kept = shapes.ring_plan
    if kept is None or kept[0] != STAGING_BYTES:
        kept = shapes.ring_plan = (STAGING_BYTES, _shapes_plan(src, dst, choice))
    plan = kept[1]
    if plan.stageable and not all(t.is_pinned() for t in (dst if plan.host_is_dst else src).tensors):
        return StagedPlan("the host cache is not pinned (page-locked) memory")
    return plan


def _shapes_plan(src: KVCache, dst: KVCache, choice) -> StagedPlan:
    """:func:`static_plan` but for the host memory's pinning: which side is the host, and how its rows go through
    a ring's slots in chunks."""
    side = _host_side(src, dst)
    if side is None:
        return StagedPlan("one side must be a CUDA cache and the other a pinned host cache")
    return _ring_plan(_Sides.of(src, dst, choice, side == "dst"))


def _ring_plan(sides: _Sides) -> StagedPlan:
    """:func:`static_plan` of a pinned host side: how its rows go through a ring's slots in chunks."""
    slot_bytes = STAGING_BYTES // RING_SLOTS // _ALIGN * _ALIGN
    shape = chunk_shape(sides.host, len(sides.host_layers), slot_bytes)
    if shape is None:
        return StagedPlan(f"one page of one layer of the host cache does not fit a ring slot of {slot_bytes} bytes "
                          "(KVLAYOUT_STAGING_BYTES)")
    layers, tokens = shape
    probe = torch.empty(slot_bytes, dtype=torch.uint8, device="meta")
    mini = mini_cache(sides.host, layers, tokens, probe)
    per_token = 0
    for g0 in range(0, len(sides.host_layers), layers):
        segs = host_segments(sides.host, mini, probe, sides.host_layers[g0:g0 + layers], sides.host_planes)
        if isinstance(segs, str):
            return StagedPlan(segs)
        per_token += sum(row for *_, row in segs)
    groups = -(-len(sides.host_layers) // layers)
    return StagedPlan(f"{groups} group(s) of up to {layers} layer(s), chunks of up to {tokens} tokens through a "
                      f"{STAGING_BYTES}-byte staging ring; copy engine for the host side",
                      layers, tokens, groups, sides.host_is_dst, token_bytes=per_token)


def auto_stages(host_is_dst: bool, payload_bytes: int, max_ctas: int, sm_slow: bool = False,
                moved_before: bool = False) -> bool:
    """The rule of ``engine="auto"`` for a stageable transfer: from :data:`AUTO_MIN_BYTES` on; without an SM
    budget, from :data:`AUTO_MIN_BYTES_MOVED_BEFORE` between a pair of cache objects that ``moved_before`` (a
    call of theirs ran); from :data:`~kvlayout.ops.calibration.SLOW_SM_AUTO_MIN_BYTES` where the device's SMs
    move host memory that way slowly beside its copy engine (``sm_slow``,
    :func:`~kvlayout.ops.calibration.calibrate`)."""
    if payload_bytes < _auto_min_bytes(host_is_dst, sm_slow, moved_before, max_ctas):
        return False
    return max_ctas == 0 or (not host_is_dst and max_ctas <= AUTO_MAX_BUDGET_FROM_HOST)


def auto_stages_on(device: torch.device, host_is_dst: bool, payload_bytes: int, max_ctas: int,
                   moved_before: bool = False) -> bool:
    """:func:`auto_stages` for a call on ``device``, whose calibration is asked for only where the choice depends
    on it. A repeated call's path: the same rule in one function, every threshold read once."""
    direction = "to_host" if host_is_dst else "from_host"
    if (payload_bytes < AUTO_MIN_BYTES[direction]
            and (not moved_before or max_ctas or payload_bytes < AUTO_MIN_BYTES_MOVED_BEFORE[direction])
            and (payload_bytes < calibration.SLOW_SM_AUTO_MIN_BYTES
                 or not calibration.sm_is_slow(device, host_is_dst))):
        return False      # (below _auto_min_bytes's threshold for the call)
    return not max_ctas or (not host_is_dst and max_ctas <= AUTO_MAX_BUDGET_FROM_HOST)


def auto_kernel_tokens(device: torch.device, host_is_dst: bool, token_bytes: int) -> int:
    """The most payload tokens (of ``token_bytes`` each) for which auto keeps the kernel between a pair of cache
    objects that moved before, without an SM budget, as the rule stands now (:data:`RULE_STATE`). Asks for no
    calibration: on a device not calibrated yet only the part of the rule that holds either way counts (below
    :data:`~kvlayout.ops.calibration.SLOW_SM_AUTO_MIN_BYTES`)."""
    unknown_or_slow = calibration.known_sm_slow(device, host_is_dst) is not False
    return (_auto_min_bytes(host_is_dst, unknown_or_slow, True, 0) - 1) // token_bytes


def auto_declines(plan: StagedPlan, max_ctas: int, device: torch.device, moved_before: bool = False) -> str | None:
    """Why ``engine="auto"`` runs a stageable transfer (``plan``, with its payload) on ``device``'s kernel;
    ``None``: it stages it. ``moved_before``: the pair of cache objects moved before (:func:`auto_stages`)."""
    if auto_stages_on(device, plan.host_is_dst, plan.payload_bytes, max_ctas, moved_before):
        return None
    direction = "to_host" if plan.host_is_dst else "from_host"
    # (as calibrated so far: a small call that asked for no calibration is told the device's threshold if known)
    known_slow = calibration.sm_is_slow(device, plan.host_is_dst, probe=False)
    least = _auto_min_bytes(plan.host_is_dst, known_slow, moved_before, max_ctas)
    if max_ctas and plan.payload_bytes >= least:
        return (f"max_ctas = {max_ctas}: under an SM budget auto stages only transfers from the host under at most "
                f"{AUTO_MAX_BUDGET_FROM_HOST} SMs (engine='staged' stages it)")
    reason = f"{plan.payload_bytes} bytes {direction.replace('_', ' ')}: below {least} the kernel's direct path is "
    reason += "as fast"
    later = _auto_min_bytes(plan.host_is_dst, known_slow, True, max_ctas)
    if not moved_before and later <= plan.payload_bytes:
        reason += (f" for a first call between these caches (staging plans the pair first); from their second "
                   f"call on, auto stages from {later}")
    return reason


def _auto_min_bytes(host_is_dst: bool, sm_slow: bool, moved_before: bool, max_ctas: int) -> int:
    direction = "to_host" if host_is_dst else "from_host"
    least = AUTO_MIN_BYTES[direction]
    if moved_before and max_ctas == 0:   # (never above the first call's: either table may be set alone)
        least = min(least, AUTO_MIN_BYTES_MOVED_BEFORE[direction])
    return min(least, calibration.SLOW_SM_AUTO_MIN_BYTES) if sm_slow else least


def staged_plan(src: KVCache, dst: KVCache, choice, src_slots, dst_slots, num_tokens: int,
                skip_prefix: int) -> StagedPlan:
    """The staged plan of one call (``stageable`` False with the reason where it cannot be staged)."""
    kept = choice.staged_plan
    if kept is None or kept[0] != STAGING_BYTES:
        kept = choice.staged_plan = (STAGING_BYTES, static_plan(src, dst, choice))
        choice.never_staged = 0 if kept[1].stageable else STAGING_BYTES
    static = kept[1]
    if not static.stageable:
        return static
    side = "dst" if static.host_is_dst else "src"
    host = dst if static.host_is_dst else src
    if (dst_slots if static.host_is_dst else src_slots) is not None:
        return StagedPlan(f"the host side's slots ({side}_slots) must be None: staging copies the host rows "
                          "of tokens 0..T-1 back to back (a chunk)")
    if num_tokens > host.geometry.N:
        return StagedPlan(f"{num_tokens} tokens do not fit the host cache's {host.geometry.N} slots")
    return dataclasses.replace(static, payload_bytes=static.token_bytes * (num_tokens - skip_prefix))


class _RingTable:
    """Plans a ring keeps, each for one object (its owner: a choice, or a choice of shapes) and found by it, at most
    ``bound``, least recently used first; a plan leaves as soon as its owner or any other object it watches is
    gone (:meth:`watch`), so that the table never keeps a freed cache's plan or memory alive.

    A plan holds the weak reference to its owner as ``plan.owner``; the table holds the only strong reference to
    a plan."""

    def __init__(self, bound: int):
        self.bound = bound
        self._plans: collections.OrderedDict = collections.OrderedDict()   # id(owner) -> plan

    def __len__(self) -> int:
        return len(self._plans)

    def values(self) -> list:
        with _RINGS_LOCK:
            return list(self._plans.values())

    def find(self, owner, *, use: bool = True):
        """The plan kept for ``owner``, or None; ``use``: it is now the most recently used (a look that only
        inspects it, as :func:`kept_graph`'s, leaves the order as it is)."""
        with _RINGS_LOCK:
            plan = self._plans.get(id(owner))
            if plan is None or plan.owner() is not owner:
                return None
            if use:
                self._plans.move_to_end(id(owner))
            return plan

    def keep(self, plan) -> None:
        """Keeps ``plan`` for its owner (the least recently used plan goes past the bound)."""
        if self.bound <= 0:
            return
        with _RINGS_LOCK:
            self._plans[id(plan.owner())] = plan
            while len(self._plans) > self.bound:
                self._plans.popitem(last=False)

    def watch(self, plan, owner, *others) -> list:
        """Weak references to ``owner`` and ``others`` that drop ``plan`` from the table when any goes (the
        first is the plan's ``owner``)."""
        table, me, key = weakref.ref(self), weakref.ref(plan), id(owner)

        def forget(_):
            t, p = table(), me()
            with _RINGS_LOCK:
                if t is not None and p is not None and t._plans.get(key) is p:
                    del t._plans[key]

        return [weakref.ref(o, forget) for o in (owner, *others)]


class _Ring:
    """One stream's staging ring and the transfers planned on it."""

    def __init__(self, device: torch.device, stream: int | None):
        slot_bytes = STAGING_BYTES // RING_SLOTS // _ALIGN * _ALIGN
        self.buffer = torch.empty(slot_bytes * RING_SLOTS, dtype=torch.uint8, device=device)
        self.slots = [self.buffer[r * slot_bytes:(r + 1) * slot_bytes] for r in range(RING_SLOTS)]
        # the stream's handle (0 is the default stream's); None: a ring of one graph capture (not kept, and
        # neither are its plans)
        self.stream = stream
        kept = stream is not None
        self.transfers = _RingTable(PLANS_PER_RING if kept else 0)     # a choice's _Transfer
        self.shapes = _RingTable(SHAPES_PER_RING if kept else 0)       # a shapes' choice's _RingShapes

    @property
    def capturing(self) -> bool:
        return self.stream is None


_RINGS: collections.OrderedDict = collections.OrderedDict()   # _ring_key -> _Ring, least recent first
# around every change of _RINGS and of a ring's transfers: threads on streams of their own take rings at once, and
# a check-then-insert between them would keep more rings than KEPT_RINGS (reentrant: a weak reference's callback
# may drop a transfer from inside an allocation made while it is held)
_RINGS_LOCK = fork_safe(threading.RLock())


def _ring_key(device: torch.device, stream: torch.cuda.Stream) -> tuple:
    """The key of ``stream``'s kept ring in ``_RINGS`` (a ring of another staging size is another ring)."""
    return device, stream.cuda_stream, STAGING_BYTES


def _ring_for(device: torch.device, stream: torch.cuda.Stream) -> _Ring:
    """The ring of a call on ``stream``: the kept one, or a new one (kept, except under graph capture, whose
    memory comes from the graph's own pool)."""
    if torch.cuda.is_current_stream_capturing():
        return _Ring(device, stream=None)
    key = _ring_key(device, stream)
    with _RINGS_LOCK:
        ring = _RINGS.pop(key, None)
        if ring is None:
            while len(_RINGS) >= KEPT_RINGS:
                _RINGS.pop(next(iter(_RINGS)))
            ring = _Ring(device, stream=stream.cuda_stream)
        _RINGS[key] = ring                   # (re)inserted last: the most recently used
        return ring


_RING_REFUSED: set = set()   # devices whose memory could not hold a ring: engine="auto" keeps the kernel there


def ring_refusal(device: torch.device, allocate: bool = True) -> str | None:
    """For ``engine="auto"``: why the current stream cannot have a staging ring, or None when it has one
    (allocated now if needed and ``allocate``).

    * The ring's memory cannot be had (an engine's cache may fill the device): auto runs the kernel instead of
      failing, and keeps doing so on that device (no allocation attempt per call) until
      :func:`release_staging`.
    * The kept rings belong to other streams: auto does not take one away (a new ring and new plans on every
      call of streams taking turns would cost more than staging saves); ``engine="staged"`` does.

    Under graph capture (a ring per call, from the graph's pool) only the memory answer is given."""
    if device in _RING_REFUSED:
        return f"no device memory for a {STAGING_BYTES}-byte staging ring on {device}"
    if torch.cuda.is_current_stream_capturing():
        return None
    stream = torch.cuda.current_stream(device)
    if _ring_key(device, stream) not in _RINGS and len(_RINGS) >= KEPT_RINGS:
        return f"the {KEPT_RINGS} staging rings kept belong to other streams"
    if not allocate:
        return None
    try:
        _ring_for(device, stream)
    except torch.cuda.OutOfMemoryError:
        _RING_REFUSED.add(device)
        return f"no device memory for a {STAGING_BYTES}-byte staging ring on {device}"
    return None


def release_staging() -> None:
    """Frees the staging rings (their memory returns to torch's caching allocator) and the transfers planned
    on them; ``engine="auto"`` tries to stage again on devices where a ring did not fit."""
    with _RINGS_LOCK:
        _RINGS.clear()
        _RING_REFUSED.clear()


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


class _RingShapes:
    """What a ring's staged transfers between caches of two shapes (one choice of layers and planes) share, made
    once: the mini caches carved in the ring's slots, each layer group's host byte spans (relative to the host
    tensors, so those of any host cache of the shape) and the handles of the copy programs between the device
    cache and each ring slot, (to the host) from the host cache into it and between the caches themselves (the
    direct kernel, which moves the tokens past a replayed prefix), registered and pinned while it lives.
    It holds no cache's tensors: a transfer binds the programs to its caches' tensors, and binding the same
    tensors again (an engine's device cache, bound anew at each call beside a fresh host chunk) is a lookup in
    the native binding cache. So a transfer between caches bound anew plans only its bindings.

    Kept on the ring (``ring.shapes``) while the shapes' choice lives; a transfer planned with it holds it."""

    def __init__(self, sides: _Sides, staged: StagedPlan, ring: _Ring, shapes):
        (self.owner,) = ring.shapes.watch(self, shapes)
        self.host_is_dst = sides.host_is_dst
        self.minis = [mini_cache(sides.host, staged.chunk_layers, staged.chunk_tokens, slot) for slot in ring.slots]
        # per layer group: the host spans; per (group, ring slot): the program handles
        self.groups, self.kernels, self.keeps, handles = [], [], [], []

        def program(a: KVCache, b: KVCache, a_layers, b_layers, a_planes, b_planes) -> int:
            handle = program_handle(program_key(a, b, a_layers, b_layers, a_planes, b_planes), pin=True)
            handles.append(handle)
            return handle

        try:
            # the kernel engine's program between the caches themselves: the tokens past a replayed prefix
            self.direct = program(*sides.transfer())
            for g0 in range(0, len(sides.host_layers), staged.chunk_layers):
                host_layers = sides.host_layers[g0:g0 + staged.chunk_layers]
                device_layers = sides.device_layers[g0:g0 + staged.chunk_layers]
                ring_layers = list(range(len(host_layers)))
                segs = host_segments(sides.host, self.minis[0], ring.slots[0], host_layers, sides.host_planes)
                assert not isinstance(segs, str), segs    # (static_plan checked the same layout)
                self.groups.append(sorted(segs))    # in host memory order: adjacent spans merge into one copy
                for mini in self.minis:
                    if sides.host_is_dst:
                        self.kernels.append(program(sides.device, mini, device_layers, ring_layers,
                                                    sides.device_planes, sides.host_planes))
                        self.keeps.append(program(sides.host, mini, host_layers, ring_layers, sides.host_planes,
                                                  sides.host_planes))
                    else:
                        self.kernels.append(program(mini, sides.device, ring_layers, device_layers,
                                                    sides.host_planes, sides.device_planes))
        except BaseException:
            for handle in handles:
                unpin(handle)
            raise
        weakref.finalize(self, lambda hs=tuple(handles): [unpin(h) for h in hs])

    def bind(self, sides: _Sides, status: torch.Tensor) -> tuple[list, list, object]:
        """The programs bound to ``sides``' caches and the ring slots: (kernels, keeps), per (group, ring slot),
        and the direct program bound to the caches themselves."""
        def bound(handle, a: KVCache, b: KVCache):
            program = _C.bind_program(handle, list(a.tensors), list(b.tensors), status)
            if program is None:
                raise RuntimeError("kvlayout: a staged transfer's tensors need the dispatcher")
            return program

        slots = len(self.minis)
        minis = [self.minis[i % slots] for i in range(len(self.kernels))]
        src, dst = sides.transfer()[:2]
        direct = bound(self.direct, src, dst)
        if self.host_is_dst:
            return ([bound(h, sides.device, m) for h, m in zip(self.kernels, minis)],
                    [bound(h, sides.host, m) for h, m in zip(self.keeps, minis)], direct)
        return [bound(h, m, sides.device) for h, m in zip(self.kernels, minis)], [], direct

    @classmethod
    def of(cls, sides: _Sides, staged: StagedPlan, ring: _Ring, choice) -> "_RingShapes":
        """The ring's plan for ``choice``'s shapes: the kept one, or a new one (kept, except on a ring of one
        graph capture)."""
        shapes = choice.shared if choice.shared is not None else choice
        kept = ring.shapes.find(shapes)
        if kept is None:
            kept = cls(sides, staged, ring, shapes)    # (made outside the lock)
            ring.shapes.keep(kept)
        return kept


class _Transfer:
    """A staged transfer planned on one ring: its shapes' copy programs (:class:`_RingShapes`) bound to its caches
    and each ring slot, and the native run loop.

    The choice it was planned for keeps a weak reference to it (``choice.staged_kept``), so that
    :func:`kvlayout.ops.transfer` can repeat the call without planning or looking the ring up
    (:meth:`run_kept`); the ring holds the only strong one, so a ring let go of takes its plans along."""

    def __init__(self, src: KVCache, dst: KVCache, choice, staged: StagedPlan, ring: _Ring):
        # the plan holds the caches' tensors (its bindings): it leaves the ring as soon as the choice or either
        # cache object is gone, so a ring never keeps freed caches' memory alive
        self.owner, *self._caches = ring.transfers.watch(self, choice, src, dst)
        self.host_is_dst = staged.host_is_dst
        sides = _Sides.of(src, dst, choice, staged.host_is_dst)
        status = _native.status_tensor(choice.device)
        # the plan of these shapes through the ring (mini caches, host spans, program handles): shared
        self.ring_shapes = _RingShapes.of(sides, staged, ring, choice)
        kernels, keeps, direct = self.ring_shapes.bind(sides, status)
        written = list(sides.host.tensors if sides.host_is_dst else sides.device.tensors)
        self.native = _C.StagedTransfer(sides.host_is_dst, kernels, keeps, list(ring.slots), list(sides.host.tensors),
                                        self.ring_shapes.groups, staged.chunk_tokens, sides.device.geometry.N,
                                        sides.host.geometry.N, _side_stream(choice.device).cuda_stream,
                                        -1 if ring.capturing else ring.stream, written, direct)

    def run_kept(self, src_slots, dst_slots, skip_prefix: int, max_ctas: int, validate: bool) -> bool:
        """The call again, from :func:`kvlayout.ops.transfer`'s repeated-call path: False (nothing done) where
        it is not this plan's to run as it is (the host side has slots, the device side's slots are not a
        plain tensor of the ring's device, another stream is current, a capture is under way, a bound tensor
        changed); the long way then decides."""
        host_slots, slots = (dst_slots, src_slots) if self.host_is_dst else (src_slots, dst_slots)
        if host_slots is not None or type(slots) is not torch.Tensor:
            return False
        return self.native.run_kept(slots, skip_prefix, max_ctas, validate)


def kept_graph(choice, staged: StagedPlan, src_slots, dst_slots, num_tokens: int,
               skip_prefix: int) -> tuple[int, bool, int]:
    """``(nodes, on_device, tokens)`` of the graph that the current stream's ring keeps for this call's shape,
    which the call replays unless it validates: its captured nodes (a launch that issues them from the host
    takes time that grows with them), whether it runs as a conditional node's body
    (:func:`set_staged_graph_launch`) and the token count of the call it was captured from (fewer than
    ``num_tokens``: the call's reuse prefix, :func:`set_staged_graph_reuse`, the rest moved by the direct kernel);
    ``(0, False, 0)`` where none is kept: the call is issued directly (a shape's first two calls are, and every
    call under graph capture)."""
    if torch.cuda.is_current_stream_capturing():
        return 0, False, 0
    device = choice.device
    ring = _RINGS.get(_ring_key(device, torch.cuda.current_stream(device)))
    transfer = ring.transfers.find(choice, use=False) if ring is not None else None
    if transfer is None:
        return 0, False, 0
    device_slots = src_slots if staged.host_is_dst else dst_slots
    slot_bytes = 0 if device_slots is None else device_slots.element_size()
    return transfer.native.kept_graph(num_tokens, skip_prefix, choice.max_ctas, slot_bytes)


def run_staged(src: KVCache, dst: KVCache, staged: StagedPlan, choice, src_slots, dst_slots, num_tokens: int,
               skip_prefix: int, validate: bool) -> None:
    """Runs a staged transfer (``staged.stageable``) in stream order on the current stream."""
    device = choice.device
    ring = _ring_for(device, torch.cuda.current_stream(device))
    device_slots = src_slots if staged.host_is_dst else dst_slots
    if device_slots is not None and device_slots.device != device:
        device_slots = device_slots.to(device, non_blocking=True)
    for attempt in range(2):
        transfer = ring.transfers.find(choice) if not attempt else None
        if transfer is None:
            transfer = _Transfer(src, dst, choice, staged, ring)   # (planned outside the lock)
            ring.transfers.keep(transfer)
        if transfer.native.run(device_slots, num_tokens, skip_prefix, choice.max_ctas, validate):
            if not ring.capturing:
                choice.staged_kept = weakref.ref(transfer)
            return
    raise RuntimeError("kvlayout: a staged transfer's tensors changed while it was planned")
