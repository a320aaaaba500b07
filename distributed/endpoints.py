"""Sender and receiver: a request's KV from one TP group's caches into another's, layer by layer.

Each side is one rank of a tensor-parallel group with its own bound cache
(any catalog layout, its own page size) holding its share of the KV heads
(:func:`kvlayout.reference.resharding.kv_heads`).  Per request and per layer:

* the sender gathers, for each run of its heads that some receiver needs
  (:func:`~kvlayout.reference.resharding.kv_routes`), the request's rows of
  those heads into a contiguous buffer ``[P, T, heads, D]`` with
  ``ops.transfer`` (a narrowed view of its cache -> the ``rows`` layout), and
  sends the buffer to each receiver of that run with ``isend``;
* the receiver ``irecv``\\ s one buffer per route and scatters it into its own
  cache's heads with ``ops.transfer`` (``rows`` -> a narrowed view).

Buffers form a ring of ``depth`` layers per route, so the sender gathers
layer ``l + 1`` while layer ``l`` is on the wire, and the receiver has the
next layers' receives posted while it scatters one.  On CUDA everything is
ordered on the current stream and the group's NCCL streams (``Work.wait()``
makes the stream wait, the host does not), so no byte goes through host
memory; the host blocks, with the timeout, only for the small control
messages and at the end of a request.

Message order: every rank posts its messages in one global order (per
request: headers sender -> receiver, headers receiver -> sender, slot masks,
layer by layer, acknowledgements; within a phase by sender rank, then
receiver rank), so even a backend that runs one rank's point-to-point
operations one after another cannot deadlock.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Callable, Iterator

import torch
import torch.distributed as tdist

from kvlayout import ops
from kvlayout.ops import KVCache, bind
from kvlayout.reference.resharding import Route, kv_heads, kv_routes

from .handshake import (
    ACK_MAGIC,
    REQUEST_MAGIC,
    ROLES,
    Descriptor,
    HandshakeError,
    PeerError,
    TransferError,
    ack,
    check_message,
    dtype_code,
    mismatches,
    request_header,
)
from .heads import head_size_of, head_view


@dataclasses.dataclass(frozen=True)
class Peers:
    """Where the two TP groups sit in the process group.

    ``senders[k]`` is the group rank of sender TP rank ``k``; ``receivers[k]``
    the group rank of receiver TP rank ``k``.
    """

    senders: tuple[int, ...]
    receivers: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "senders", tuple(int(r) for r in self.senders))
        object.__setattr__(self, "receivers", tuple(int(r) for r in self.receivers))
        ranks = self.senders + self.receivers
        if not self.senders or not self.receivers:
            raise ValueError(f"Peers needs at least one sender and one receiver, got {self}")
        if len(set(ranks)) != len(ranks) or min(ranks) < 0:
            raise ValueError(f"Peers: every group rank must be >= 0 and appear once, got {self}")

    @classmethod
    def split(cls, num_senders: int, num_receivers: int, first: int = 0) -> "Peers":
        """Senders on group ranks ``first .. first+m-1``, receivers on the next ``n`` ranks."""
        return cls(tuple(range(first, first + num_senders)),
                   tuple(range(first + num_senders, first + num_senders + num_receivers)))


class _Endpoint:
    """What a sender and a receiver share: the cache, the group, the handshake, the waits."""

    ROLE = 0

    def __init__(self, cache, *, num_kv_heads: int, peers: Peers, group=None, timeout: float = 60.0,
                 depth: int = 2):
        self.cache: KVCache = cache if isinstance(cache, KVCache) else bind(*cache)
        self.group = group
        self.peers = peers
        self.timeout = float(timeout)
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError(f"timeout = {timeout} must be a finite number of seconds > 0 (every wait is bounded)")
        try:
            datetime.timedelta(seconds=self.timeout)
        except OverflowError:
            raise ValueError(f"timeout = {timeout} seconds is longer than a wait can be") from None
        self.depth = int(depth)
        if self.depth < 1:
            raise ValueError(f"depth = {depth} must be >= 1 (layers in flight per route)")
        mine, theirs = (peers.senders, peers.receivers) if self.ROLE == 0 else (peers.receivers, peers.senders)
        group_size = tdist.get_world_size(group)
        if max(peers.senders + peers.receivers) >= group_size:
            raise ValueError(f"{peers} names ranks beyond the group's {group_size}")
        self.group_rank = tdist.get_rank(group)
        if self.group_rank not in mine:
            raise ValueError(f"group rank {self.group_rank} is not among the {self.role}s {list(mine)} of {peers}")
        self.tp_rank, self.tp_size, self.peer_tp_size = mine.index(self.group_rank), len(mine), len(theirs)
        self._peer_ranks = theirs
        self.num_kv_heads = int(num_kv_heads)
        lo, hi = kv_heads(self.tp_rank, self.tp_size, self.num_kv_heads)
        self.heads = (lo, hi)
        self.head_size = head_size_of(self.cache, hi - lo)
        src_tp, dst_tp = (self.tp_size, self.peer_tp_size) if self.ROLE == 0 else (self.peer_tp_size, self.tp_size)
        # routes are checked against the peers' TP size in the handshake; a bad split raises here already
        self.routes: tuple[Route, ...] = tuple(
            r for r in kv_routes(self.num_kv_heads, src_tp, dst_tp)
            if (r.src_rank if self.ROLE == 0 else r.dst_rank) == self.tp_rank)
        self.device = self.cache.device
        self._cuda = self.device.type == "cuda"
        backend = str(tdist.get_backend(group)).lower()
        if self._cuda and "nccl" not in backend:
            raise ValueError(f"the cache is on {self.device} but the group's backend is {backend!r}: CUDA caches "
                             "need an NCCL group (another backend would stage the KV through host memory)")
        if not self._cuda and self.device.type == "cpu" and "gloo" not in backend:
            raise ValueError(f"the cache is on the CPU but the group's backend is {backend!r}: use a gloo group")
        self._connected = False
        self._broken: TransferError | None = None
        self._open = None       # the request in progress (messages are ordered: one at a time)

    @property
    def role(self) -> str:
        return ROLES[self.ROLE]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.cache.layout.name}, TP rank {self.tp_rank} of {self.tp_size} -> "
                f"{self.peer_tp_size}, heads [{self.heads[0]}, {self.heads[1]}) of {self.num_kv_heads}, "
                f"D = {self.head_size}, group rank {self.group_rank})")

    # -- point to point, with bounded waits ----------------------------------------------
    def _isend(self, tensor: torch.Tensor, group_rank: int):
        try:
            return tdist.isend(tensor, group=self.group, group_dst=group_rank)
        except Exception as e:       # posting fails at once when the connection is already gone
            raise self._fail(PeerError(f"{self.role} TP rank {self.tp_rank}: sending to group rank {group_rank} "
                                       f"failed: {e}")) from e

    def _irecv(self, tensor: torch.Tensor, group_rank: int):
        try:
            return tdist.irecv(tensor, group=self.group, group_src=group_rank)
        except Exception as e:
            raise self._fail(PeerError(f"{self.role} TP rank {self.tp_rank}: receiving from group rank "
                                       f"{group_rank} failed: {e}")) from e

    def _fail(self, error: TransferError) -> TransferError:
        """Mark the endpoint unusable (the group may hold stray messages now) and return the error."""
        self._broken = error
        return error

    def _wait(self, work, what: str) -> None:
        """Block the host until ``work`` is done, at most ``timeout`` seconds; a failure raises :class:`PeerError`."""
        try:
            done = work.wait(datetime.timedelta(seconds=self.timeout))
        except Exception as e:       # the backends raise RuntimeError subclasses of their own
            raise self._fail(PeerError(f"{self.role} TP rank {self.tp_rank}: {what} failed or did not finish "
                                       f"within {self.timeout:g} s: {e}")) from e
        if done is False:
            raise self._fail(PeerError(f"{self.role} TP rank {self.tp_rank}: {what} did not finish within "
                                       f"{self.timeout:g} s"))

    def _order(self, work, what: str) -> None:
        """Order later work after ``work``: the stream waits on CUDA; the host waits (bounded) on the CPU."""
        if not self._cuda:
            self._wait(work, what)
            return
        try:
            work.wait()
        except Exception as e:
            raise self._fail(PeerError(f"{self.role} TP rank {self.tp_rank}: {what} failed: {e}")) from e

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise TransferError(f"this {self.role} failed earlier and cannot be used again (its process group may "
                                f"hold unfinished messages; make a new group): {self._broken}")
        if self._open is not None and self._open.state == "open":
            raise TransferError(f"this {self.role} is still moving request {self._open.request_id}: finish it first")

    # -- handshake ------------------------------------------------------------------------
    def descriptor(self) -> Descriptor:
        g = self.cache.geometry
        return Descriptor(self.ROLE, self.tp_rank, self.tp_size, self.peer_tp_size, self.num_kv_heads,
                          self.head_size, g.L, g.P, dtype_code(self.cache.dtype), self.cache.itemsize)

    def _exchange(self, outgoing: dict[int, torch.Tensor], incoming: dict[int, torch.Tensor], what: str) -> None:
        """Send ``outgoing[rank]`` and receive ``incoming[rank]`` (group ranks), in the global message order."""
        sends = lambda: [(r, self._isend(t, r), "sending") for r, t in sorted(outgoing.items())]   # noqa: E731
        recvs = lambda: [(r, self._irecv(t, r), "receiving") for r, t in sorted(incoming.items())]  # noqa: E731
        works = sends() + recvs() if self.ROLE == 0 else recvs() + sends()
        for rank, work, verb in works:
            self._wait(work, f"{verb} the {what} {'to' if verb == 'sending' else 'from'} group rank {rank}")

    def connect(self) -> None:
        """The handshake with every peer (called by the first request): raises :class:`HandshakeError` on both
        sides when they disagree on heads, head size, layers, planes, element type or TP sizes."""
        if self._connected:
            return
        self._check_usable()
        mine = self.descriptor()
        out = {r: mine.tensor(self.device) for r in self._peer_ranks}
        inbox = {r: torch.zeros(Descriptor.FIELDS, dtype=torch.int64, device=self.device) for r in self._peer_ranks}
        self._exchange(out, inbox, "handshake")
        problems = []
        for k, rank in enumerate(self._peer_ranks):
            for text in mismatches(mine, Descriptor.from_tensor(inbox[rank]), k):
                problems.append(f"{ROLES[1 - self.ROLE]} TP rank {k} (group rank {rank}): {text}")
        if problems:
            raise self._fail(HandshakeError(
                f"kvlayout.dist handshake failed on {self.role} TP rank {self.tp_rank} (group rank "
                f"{self.group_rank}, {self.cache.layout.name}, {self.cache.dtype}); nothing was moved:\n  "
                + "\n  ".join(problems)))
        self._connected = True

    def _routed_peers(self) -> list[int]:
        """Group ranks this endpoint exchanges request messages with, in rank order."""
        if self.ROLE == 0:
            return sorted({self.peers.receivers[r.dst_rank] for r in self.routes})
        return sorted({self.peers.senders[r.src_rank] for r in self.routes})

    def _request_header(self, request_id: int, num_tokens: int) -> None:
        """Both ways between routed pairs: a different request id or token count raises on both sides."""
        peers = self._routed_peers()
        out = {r: request_header(request_id, num_tokens, self.device) for r in peers}
        inbox = {r: torch.zeros(3, dtype=torch.int64, device=self.device) for r in peers}
        self._exchange(out, inbox, f"header of request {request_id}")
        problems = []
        for rank in peers:
            values = inbox[rank].tolist()
            check_message(values, REQUEST_MAGIC, "request header", f"group rank {rank}")
            _, their_id, their_tokens = values
            if (their_id, their_tokens) != (request_id, num_tokens):
                problems.append(f"group rank {rank} moves request {their_id} of {their_tokens} tokens")
        if problems:   # every header was exchanged, so the group holds no stray message: stay usable
            raise HandshakeError(
                f"{self.role} TP rank {self.tp_rank} moves request {request_id} of {num_tokens} tokens, but "
                + "; ".join(problems) + "; nothing was moved")

    def _slots(self, slots, what: str) -> torch.Tensor:
        """``slots`` as an int64 tensor on the cache's device, checked in full before any message goes out (a
        bad list found while a layer is written would leave both endpoints unusable): every slot below the
        cache's slot count (negative: no row for that token), and, where they are written (the receiver), no
        slot twice."""
        if slots is None:
            raise TypeError(f"{what}: the request's slots are needed (a 1-D int tensor or a list of ints)")
        t = torch.as_tensor(slots, device=self.device)
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{what} must be a 1-D int32/int64 tensor or a list of ints, "
                            f"got {t.dtype} {tuple(t.shape)}")
        t = t.to(torch.int64)
        values = t.cpu()
        bound = self.cache.geometry.N
        bad = torch.nonzero(values >= bound)
        if bad.numel():
            i = int(bad[0, 0])
            raise IndexError(f"{what}[{i}] = {int(values[i])} is out of range: this {self.role}'s cache holds "
                             f"{bound} slots; nothing was exchanged")
        if self.ROLE == 1:
            valid = values[values >= 0]
            uniq, counts = torch.unique(valid, return_counts=True)
            if (counts > 1).any():
                raise ValueError(f"{what} repeats slot {int(uniq[counts > 1][0])}: a slot of the receiver's "
                                 "cache may be written once per request; nothing was exchanged")
        return t


@dataclasses.dataclass
class _Ring:
    """``depth`` contiguous layer buffers of one run of heads: raw bytes to send, typed ``rows`` caches to copy.

    ``raw[j]``: ``[P * T * heads * D * itemsize]`` uint8; ``rows[j]``: the same
    memory bound as ``rows`` ``[P, 1, T, heads, D]``.
    """

    raw: torch.Tensor
    rows: list
    works: list                     # per ring slot: the works that still use it

    @classmethod
    def make(cls, cache: KVCache, num_tokens: int, heads: int, head_size: int, depth: int) -> "_Ring":
        P = cache.geometry.P
        nbytes = P * num_tokens * heads * head_size * cache.itemsize
        raw = torch.empty((depth, nbytes), dtype=torch.uint8, device=cache.device)
        rows = [bind("rows", raw[j].view(cache.dtype).view(P, 1, num_tokens, heads, head_size)) for j in range(depth)]
        return cls(raw, rows, [[] for _ in range(depth)])


class _RequestStream:
    """What a request's stream on either side shares: its request, its state, and failing it (and its
    endpoint) at the first error of a step."""

    NOTHING_LEFT = "nothing left"

    def __init__(self, endpoint: "_Endpoint", request_id: int, slots: torch.Tensor):
        self.endpoint, self.request_id, self.slots = endpoint, request_id, slots
        self.num_tokens = int(slots.shape[0])
        self.num_layers = endpoint.cache.geometry.L
        self.state = "open"
        self.error: BaseException | None = None

    @property
    def complete(self) -> bool:
        return self.state == "complete"

    def _ring(self, heads: int) -> "_Ring | None":
        """The staging ring of one run of ``heads`` heads of this request (None: no tokens to move)."""
        e = self.endpoint
        return _Ring.make(e.cache, self.num_tokens, heads, e.head_size, e.depth) if self.num_tokens else None

    def _guard(self, fn, *args):
        if self.state != "open":
            raise TransferError(f"request {self.request_id} is {self.state}: {self.error or self.NOTHING_LEFT}")
        try:
            return fn(*args)
        except BaseException as e:
            self.state, self.error = "failed", e
            self.endpoint._fail(e if isinstance(e, TransferError) else TransferError(str(e)))
            raise


class SendStream(_RequestStream):
    """One request on its way out: ``send_layer(l)`` for ``l = 0 .. L-1`` in order, then :meth:`finish`.

    ``state``: ``"open"``, ``"complete"`` (every receiver acknowledged every
    layer) or ``"failed"``; ``error`` holds the exception of a failure.
    """

    NOTHING_LEFT = "nothing left to send"

    def __init__(self, sender: "Sender", request_id: int, slots: torch.Tensor):
        super().__init__(sender, request_id, slots)
        self.sender = sender
        self.layers_sent = 0
        s = sender
        # one ring per distinct run of this rank's heads; each may go to several receivers (replicas)
        self._runs = []
        for (start, count), dsts in s._runs.items():
            self._runs.append((s._views[(start, count)], self._ring(count), dsts))

    def send_layer(self, layer: int | None = None) -> None:
        """Gather layer ``layer`` (default: the next) for every route and send it; layers go in order."""
        if layer is not None and layer != self.layers_sent:   # refused before anything moves: the stream stays open
            raise ValueError(f"request {self.request_id}: layer {layer} sent out of order "
                             f"(next is {self.layers_sent})")
        if self.state == "open" and self.layers_sent >= self.num_layers:
            raise ValueError(f"request {self.request_id}: all {self.num_layers} layers are sent already")
        self._guard(self._send_layer)

    def _send_layer(self):
        expected = self.layers_sent
        s = self.sender
        if self.num_tokens:
            j = expected % s.depth
            outgoing = []
            for view, ring, dsts in self._runs:
                for work in ring.works[j]:          # the buffer's previous layer must be on the wire first
                    s._order(work, f"sending layer {expected - s.depth} of request {self.request_id}")
                ops.transfer(view, ring.rows[j], self.slots, None, src_layers=[expected], dst_layers=[0])
                ring.works[j] = []
                outgoing += [(d, ring, j) for d in dsts]
            for d, ring, j in sorted(outgoing, key=lambda x: x[0]):
                ring.works[j].append(s._isend(ring.raw[j], d))
        self.layers_sent += 1

    def finish(self) -> None:
        """Send the layers not sent yet, wait (bounded) for every send and every receiver's acknowledgement."""
        self._guard(self._finish)

    def _finish(self):
        while self.layers_sent < self.num_layers:
            self._send_layer()
        s = self.sender
        for _, ring, dsts in self._runs:
            for works in (ring.works if ring is not None else []):
                for work in works:
                    s._wait(work, f"sending request {self.request_id}")
        peers = s._routed_peers()
        inbox = {r: torch.zeros(3, dtype=torch.int64, device=s.device) for r in peers}
        for r in peers:
            s._wait(s._irecv(inbox[r], r), f"waiting for group rank {r} to acknowledge request {self.request_id}")
        for r in peers:
            values = inbox[r].tolist()
            if values[0] != ACK_MAGIC:
                raise PeerError(f"group rank {r} sent a message that is not an acknowledgement (its first word is "
                                f"{values[0]:#x}) for request {self.request_id}")
            _, rid, status = values
            if rid != self.request_id or status != 0:
                raise PeerError(f"group rank {r} acknowledged request {rid} with status {status}, "
                                f"expected request {self.request_id} with status 0")
        self.state = "complete"

    def __repr__(self) -> str:
        return (f"SendStream(request {self.request_id}, {self.num_tokens} tokens, "
                f"{self.layers_sent}/{self.num_layers} layers sent, {self.state})")


class Sender(_Endpoint):
    """A prefill-side TP rank: sends requests' KV from ``cache`` to the receiver ranks.

    ``cache``: a :class:`~kvlayout.ops.KVCache` (or ``(layout, tensors)``)
    holding this rank's heads ``kv_heads(tp_rank, len(peers.senders),
    num_kv_heads)``, on the CPU (gloo group) or a CUDA device (NCCL group).
    ``num_kv_heads``: the model's total KV heads (1 for MLA).  ``peers``: the
    group ranks of both TP groups; this rank's position among ``peers.senders``
    is its TP rank.  ``group``: the process group (default: the world).
    ``timeout``: seconds any one wait may take before :class:`PeerError`.
    ``depth``: layer buffers in flight per run of heads.
    """

    ROLE = 0

    def __init__(self, cache, *, num_kv_heads: int, peers: Peers, group=None, timeout: float = 60.0,
                 depth: int = 2):
        super().__init__(cache, num_kv_heads=num_kv_heads, peers=peers, group=group, timeout=timeout, depth=depth)
        self._runs: dict[tuple[int, int], list[int]] = {}
        for r in self.routes:
            self._runs.setdefault((r.src_head, r.num_heads), []).append(self.peers.receivers[r.dst_rank])
        self._views = {(start, count): head_view(self.cache, start, start + count, self.head_size)
                       for start, count in self._runs}

    def start(self, request_id: int, slots) -> SendStream:
        """Open request ``request_id`` (its tokens at ``slots [T]`` of this cache): the handshake on first use,
        the request header both ways, each receiver's mask of the tokens this side has.  Then send layers."""
        self._check_usable()
        slots = self._slots(slots, "slots")
        request_id = int(request_id)
        self.connect()
        self._request_header(request_id, int(slots.shape[0]))
        stream = self._open = SendStream(self, request_id, slots)
        if stream.num_tokens:
            stream._guard(self._send_mask, stream)
        return stream

    def _send_mask(self, stream: SendStream) -> None:
        """A token without a slot here must not be written there: each receiver gets the mask of valid tokens."""
        mask = (stream.slots >= 0).to(torch.uint8)
        works = [(r, self._isend(mask, r)) for r in self._routed_peers()]
        for r, work in works:
            self._order(work, f"sending the token mask of request {stream.request_id} to group rank {r}")

    def send(self, request_id: int, slots) -> SendStream:
        """Send the whole request (layer ``l`` on the wire while ``l + 1`` is gathered); returns the finished
        stream (``complete`` is True) or raises."""
        stream = self.start(request_id, slots)
        stream.finish()
        return stream


class ReceiveStream(_RequestStream):
    """One request on its way in: iterate to get each layer index as the layer lands in the cache.

    On CUDA a yielded layer is ordered on the current stream (work queued
    after the yield sees it); on the CPU it is in memory.  ``state``:
    ``"open"``, ``"complete"`` (every layer of every route has landed and the
    senders were told) or ``"failed"`` (``error`` says why; the cache may hold
    part of the request and must not be used for it).
    """

    def __init__(self, receiver: "Receiver", request_id: int, slots: torch.Tensor):
        super().__init__(receiver, request_id, slots)
        self.receiver = receiver
        self.layers_received = 0
        r = receiver
        # per route, by sender rank: (group rank, view of my heads, ring, slots to write)
        self._routes = []
        for route in sorted(r.routes, key=lambda x: x.src_rank):
            self._routes.append([r.peers.senders[route.src_rank], r._views[route], self._ring(route.num_heads), slots])
        self._done_works = []

    def _post(self, layer: int) -> None:
        j = layer % self.receiver.depth
        for entry in self._routes:
            rank, _, ring, _ = entry
            ring.works[j] = [self.receiver._irecv(ring.raw[j], rank)]

    def _begin(self) -> None:
        """Receive each sender's token mask, then post the first ``depth`` layers' receives."""
        r = self.receiver
        if not self.num_tokens:
            return
        masks = [torch.empty(self.num_tokens, dtype=torch.uint8, device=r.device) for _ in self._routes]
        works = [r._irecv(m, entry[0]) for m, entry in zip(masks, self._routes)]
        for mask, work, entry in zip(masks, works, self._routes):
            r._order(work, f"receiving the token mask of request {self.request_id} from group rank {entry[0]}")
            entry[3] = torch.where(mask != 0, self.slots, torch.full_like(self.slots, -1))
        for layer in range(min(r.depth, self.num_layers)):
            self._post(layer)

    def _next_layer(self) -> int:
        r = self.receiver
        layer = self.layers_received
        if self.num_tokens:
            j = layer % r.depth
            for entry in self._routes:
                rank, view, ring, slots = entry
                for work in ring.works[j]:
                    r._order(work, f"receiving layer {layer} of request {self.request_id} from group rank {rank}")
                    self._done_works.append((rank, work))
                ops.transfer(ring.rows[j], view, None, slots, src_layers=[0], dst_layers=[layer])
            if layer + r.depth < self.num_layers:   # the buffer is free again once its scatter is queued
                self._post(layer + r.depth)
        self.layers_received += 1
        if self.layers_received == self.num_layers:
            self._complete()
        return layer

    def _complete(self) -> None:
        r = self.receiver
        if r._cuda:          # the host has not waited yet: every receive must have finished (bounded)
            for rank, work in self._done_works:
                r._wait(work, f"receiving request {self.request_id} from group rank {rank}")
        self._done_works = []
        # Every byte is in the cache; the request counts as complete once the senders were told, so that
        # both sides agree: a sender that misses the acknowledgement fails the request, and so does this side.
        peers = r._routed_peers()
        try:
            works = [(p, r._isend(ack(self.request_id, 0, r.device), p)) for p in peers]
            for p, work in works:
                r._wait(work, f"acknowledging request {self.request_id} to group rank {p}")
        except PeerError as e:
            raise PeerError(f"request {self.request_id}: every layer landed, but a sender did not take the "
                            f"acknowledgement, so the request failed on both sides: {e}") from e
        self.state = "complete"

    def __iter__(self) -> Iterator[int]:
        while self.state == "open" and self.layers_received < self.num_layers:
            yield self._guard(self._next_layer)

    def wait(self) -> "ReceiveStream":
        """Receive every layer not received yet; returns ``self`` (``complete``) or raises."""
        for _ in self:
            pass
        if self.state != "complete":
            raise TransferError(f"request {self.request_id} is {self.state}: {self.error}")
        return self

    def __repr__(self) -> str:
        return (f"ReceiveStream(request {self.request_id}, {self.num_tokens} tokens, "
                f"{self.layers_received}/{self.num_layers} layers in, {self.state})")


class Receiver(_Endpoint):
    """A decode-side TP rank: receives requests' KV into ``cache`` from the sender ranks.

    Arguments as for :class:`Sender`; ``cache`` holds this rank's heads
    ``kv_heads(tp_rank, len(peers.receivers), num_kv_heads)``.
    """

    ROLE = 1

    def __init__(self, cache, *, num_kv_heads: int, peers: Peers, group=None, timeout: float = 60.0,
                 depth: int = 2):
        super().__init__(cache, num_kv_heads=num_kv_heads, peers=peers, group=group, timeout=timeout, depth=depth)
        self._views = {r: head_view(self.cache, r.dst_head, r.dst_head + r.num_heads, self.head_size)
                       for r in self.routes}

    def start(self, request_id: int, slots) -> ReceiveStream:
        """Open request ``request_id`` (its tokens go to ``slots [T]`` of this cache; −1 = keep this token's
        row): the handshake on first use, the request header both ways, the senders' token masks, and the
        first layers' receives posted.  Iterate the returned stream to receive the layers."""
        self._check_usable()
        slots = self._slots(slots, "slots")
        request_id = int(request_id)
        self.connect()
        self._request_header(request_id, int(slots.shape[0]))
        stream = self._open = ReceiveStream(self, request_id, slots)
        stream._guard(stream._begin)
        return stream

    def recv(self, request_id: int, slots, on_layer: Callable[[int], None] | None = None) -> ReceiveStream:
        """Receive the whole request, calling ``on_layer(l)`` as each layer lands; returns the complete stream."""
        stream = self.start(request_id, slots)
        for layer in stream:
            if on_layer is not None:
                on_layer(layer)
        return stream.wait()

