"""The staged host path: the kernel works in device memory, the copy engine crosses PCIe.

A kernel that reads or writes pinned host memory itself (zero-copy) stops
near 93-95 % of the pinned-copy ceiling on an H200; the copy engine reaches
the ceiling.  For a transfer between a CUDA cache and a pinned host cache
whose chosen rows lie back to back in token order (a chunk: host slots
``None``, rows contiguous), ``engine="staged"`` keeps a device copy of the
host cache (*staging*: same layout, sizes and strides, so the same copy
program) and splits the chosen layers into groups of at least
``GROUP_BYTES``:

* host -> device: per group, the copy engine moves the group's host bytes
  into staging on a side stream; the kernel then moves the rows from staging
  into the destination on the caller's stream, waiting for that group only,
  so group g's kernel runs while group g+1 crosses PCIe.
* device -> host: per group, the kernel gathers the rows into staging on the
  caller's stream and the copy engine moves the group's bytes to the host on
  the side stream.  Rows the transfer must leave unchanged (tokens whose
  device slot is negative or out of range) are first copied from the host
  into staging by the kernel, reading only those rows, so the bytes copied
  back are the host's own.

Everything is stream-ordered (events, no host synchronization), so a staged
transfer can be captured in a CUDA graph.  Every row still moves through the
one copy kernel, so the semantics (slots, skip_prefix, recorded out-of-range
slots) are the kernel's.

Cost: device memory for staging, the host cache's size.  Outside graph
capture the staging cache is kept for the next staged call on the same
stream with host caches of the same layout, sizes, strides and dtype (an
engine moving chunks of one shape reuses one buffer, and the per-layer-group
kernel calls on it run from kept bindings); the ``KEPT_STAGING`` most
recently used are kept, :func:`release_staging` frees them.  Calls on one
stream are ordered, so a kept buffer is never used by two calls at once.
"""

from __future__ import annotations

import dataclasses

import torch

from .programs import plan
from .routes import run
from .views import KVCache

GROUP_BYTES = 32 << 20      # layers per group: at least this much payload (large copies reach the ceiling)
AUTO_MIN_BYTES = 64 << 20   # engine="auto" stages payloads from this size on (below, its host work shows)


@dataclasses.dataclass
class Group:
    """Layers moved together, and the host bytes they cover: ``(tensor index, begin, end)`` per span."""

    src_layers: list
    dst_layers: list
    spans: list


@dataclasses.dataclass
class StagedPlan:
    """Why (or why not) a transfer can be staged, and how."""

    reason: str                   # why staged, or why not
    groups: list | None = None    # None: not stageable
    host_is_dst: bool = False
    payload_bytes: int = 0


def _host_side(src: KVCache, dst: KVCache) -> str | None:
    kinds = {src.device.type, dst.device.type}
    if kinds != {"cpu", "cuda"}:
        return None
    return "dst" if dst.device.type == "cpu" else "src"


def _dense_span(geometry, num_pieces: int, piece_bytes: int, first: int, end: int) -> tuple[int, int] | None:
    """Byte range of slots ``first..end-1`` of one segment when their rows lie back to back, else None."""
    n, page, stride_page, stride_in_page, stride_piece = geometry
    row = num_pieces * piece_bytes
    if num_pieces > 1 and stride_piece != piece_bytes:
        return None
    slots_adjacent = (page == 1 and (stride_page == row or n <= 1)) or \
        (stride_in_page == row and (stride_page == page * row or n <= page))
    if not slots_adjacent:
        return None
    return first * row, end * row


def _merged(spans: list) -> list:
    out: list = []
    for tensor, begin, end in sorted(spans):
        if out and out[-1][0] == tensor and out[-1][2] >= begin:
            out[-1] = (tensor, out[-1][1], max(out[-1][2], end))
        else:
            out.append((tensor, begin, end))
    return out


def staged_plan(src: KVCache, dst: KVCache, choice, src_slots, dst_slots, num_tokens: int,
                skip_prefix: int) -> StagedPlan:
    """The groups of a staged transfer, or the reason it cannot be staged (``groups`` None)."""
    side = _host_side(src, dst)
    if side is None:
        return StagedPlan("one side must be a CUDA cache and the other a pinned host cache")
    host = dst if side == "dst" else src
    if (dst_slots if side == "dst" else src_slots) is not None:
        return StagedPlan(f"the host side's slots ({side}_slots) must be None: staging copies the host rows "
                          "of tokens 0..T-1 back to back (a chunk)")
    if num_tokens > host.geometry.N:
        return StagedPlan(f"{num_tokens} tokens do not fit the host cache's {host.geometry.N} slots")
    if not all(t.is_pinned() for t in host.tensors):
        return StagedPlan("the host cache is not pinned (page-locked) memory")
    groups = host_groups(src, dst, choice, side == "dst", num_tokens, skip_prefix)
    if isinstance(groups, str):
        return StagedPlan(groups)
    payload = sum(end - begin for g in groups for _, begin, end in g.spans)
    return StagedPlan(f"{len(groups)} group(s) of layers, copy engine for the host side", groups,
                      side == "dst", payload)


_GROUPS: dict = {}


def host_groups(src: KVCache, dst: KVCache, choice, host_is_dst: bool, num_tokens: int,
                skip_prefix: int) -> list[Group] | str:
    """The chosen layers in groups of at least GROUP_BYTES, each with the host bytes its rows of tokens
    ``skip_prefix..num_tokens-1`` occupy (host slot t for token t); a reason string where those rows do
    not lie back to back.

    Remembered per (layouts, geometry and strides of both caches, choice, token range): the groups name
    tensors by index and hold byte offsets only, so they keep no cache alive, and an engine repeating a
    transfer does not plan it again."""
    key = (src.signature, dst.signature, tuple(choice.src_layers), tuple(choice.dst_layers),
           tuple(choice.src_planes), tuple(choice.dst_planes), host_is_dst, num_tokens, skip_prefix, GROUP_BYTES)
    groups = _GROUPS.get(key)
    if groups is None:
        if len(_GROUPS) >= 256:
            _GROUPS.clear()
        groups = _GROUPS[key] = _plan_groups(src, dst, choice, host_is_dst, num_tokens, skip_prefix)
    return groups


def _plan_groups(src: KVCache, dst: KVCache, choice, host_is_dst: bool, num_tokens: int,
                 skip_prefix: int) -> list[Group] | str:
    host = dst if host_is_dst else src
    groups: list[Group] = []
    group_bytes = 0
    for ls, ld in zip(choice.src_layers, choice.dst_layers):
        spans = []
        for launch in plan(src, dst, [ls], [ld], choice.src_planes, choice.dst_planes):
            segments = launch.dst_segments if host_is_dst else launch.src_segments
            geometry = launch.dst_geometry if host_is_dst else launch.src_geometry
            span = _dense_span(geometry, launch.num_pieces, launch.piece_bytes, skip_prefix, num_tokens)
            if span is None:
                return f"the host layout {host.layout.name}'s rows are not back to back in slot order"
            for k in range(0, len(segments), 2):
                tensor, offset = segments[k], segments[k + 1]
                spans.append((tensor, offset + span[0], offset + span[1]))
        if not groups or group_bytes >= GROUP_BYTES:
            groups.append(Group([], [], []))
            group_bytes = 0
        groups[-1].src_layers.append(ls)
        groups[-1].dst_layers.append(ld)
        groups[-1].spans += spans
        group_bytes += sum(end - begin for _, begin, end in spans)
    for g in groups:
        g.spans = _merged(g.spans)
    return groups


def _staging_like(host: KVCache, device: torch.device) -> KVCache:
    """A device cache with the host cache's layout, sizes and strides (uninitialized)."""
    made = {id(t): torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device) for t in host.tensors}
    parts = tuple([made[id(t)] for t in pv.tensors] if pv.part.per_layer else made[id(pv.tensors[0])]
                  for pv in host.parts)
    return KVCache(host.layout, parts[0] if host.layout.single_part else parts,
                   page_size=host.geometry.BS)


KEPT_STAGING = 2         # staging caches kept for reuse (the least recently used goes first)
_KEPT: dict = {}          # (device, stream, host signature, dtype) -> staging KVCache, oldest first


def _staging_for(host: KVCache, device: torch.device, stream: torch.cuda.Stream) -> KVCache:
    """The staging cache of a call on ``stream``: a kept one of the same shape, or a new one (kept)."""
    if torch.cuda.is_current_stream_capturing():
        return _staging_like(host, device)   # a graph's memory comes from its own pool: not kept
    key = (device, stream.cuda_stream, host.signature, host.dtype)
    staging = _KEPT.pop(key, None)
    if staging is None:
        while len(_KEPT) >= KEPT_STAGING:
            _KEPT.pop(next(iter(_KEPT)))
        staging = _staging_like(host, device)
    _KEPT[key] = staging                     # (re)inserted last: the most recently used
    return staging


def release_staging() -> None:
    """Frees the staging caches kept for reuse (their memory returns to torch's caching allocator)."""
    _KEPT.clear()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s storage from its first element on, as a flat uint8 tensor."""
    start = t.storage_offset() * t.element_size()
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, start, (storage.nbytes() - start,))


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def run_staged(src: KVCache, dst: KVCache, staged: StagedPlan, choice, src_slots, dst_slots, num_tokens: int,
               skip_prefix: int, validate: bool) -> None:
    """Runs a staged transfer (``staged.groups`` set) in stream order on the current stream."""
    device = choice.device
    host = dst if staged.host_is_dst else src
    main = torch.cuda.current_stream(device)
    staging = _staging_for(host, device, main)
    side = _side_stream(device)
    side.wait_stream(main)   # what the caller queued before (the host data, the caches) comes first
    host_bytes = [_bytes(t) for t in host.tensors]
    stage_bytes = [_bytes(t) for t in staging.tensors]
    common = dict(skip_prefix=skip_prefix, num_tokens=num_tokens, max_ctas=choice.max_ctas, validate=validate)
    planes = dict(src_planes=choice.src_planes, dst_planes=choice.dst_planes)
    if staged.host_is_dst:
        # Host rows this transfer leaves alone (tokens whose device slot has no row) are copied into
        # staging first, so that the copy back writes the host's own bytes there.
        tokens = torch.arange(num_tokens, device=device)
        slots = tokens if src_slots is None else src_slots.to(device, torch.int64)
        keep = torch.where((slots < 0) | (slots >= src.geometry.N), tokens, torch.full_like(tokens, -1))
        run(host, staging, keep, keep, src_layers=choice.dst_layers, dst_layers=choice.dst_layers,
                 src_planes=choice.dst_planes, dst_planes=choice.dst_planes, **common)
        for g in staged.groups:
            run(src, staging, src_slots, None, src_layers=g.src_layers, dst_layers=g.dst_layers, **planes,
                     **common)
            ready = torch.cuda.Event()
            ready.record(main)
            side.wait_event(ready)
            with torch.cuda.stream(side):
                for tensor, begin, end in g.spans:
                    host_bytes[tensor][begin:end].copy_(stage_bytes[tensor][begin:end], non_blocking=True)
    else:
        for g in staged.groups:
            with torch.cuda.stream(side):
                for tensor, begin, end in g.spans:
                    stage_bytes[tensor][begin:end].copy_(host_bytes[tensor][begin:end], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(side)
            main.wait_event(ready)
            run(staging, dst, None, dst_slots, src_layers=g.src_layers, dst_layers=g.dst_layers, **planes,
                     **common)
    for t in staging.tensors:
        t.record_stream(side)   # the allocator must not reuse staging before the side stream is done
    main.wait_stream(side)
