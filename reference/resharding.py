"""KV heads across tensor-parallel sizes: who holds which head, and who sends it to whom.

A model has ``K`` KV heads in total (``K = 1`` for an MLA latent, whose one
"head" is the whole latent row).  An engine running it with tensor
parallelism ``TP`` splits the heads over its ranks the way vLLM
(``QKVParallelLinear``) and SGLang do for grouped-query attention:

* ``TP <= K`` (``K % TP == 0``): rank ``r`` holds the ``K / TP`` heads
  ``[r * K/TP, (r + 1) * K/TP)``;
* ``TP > K`` (``TP % K == 0``): each head is *replicated* on ``TP / K``
  consecutive ranks; rank ``r`` holds the one head ``r // (TP / K)``.

A rank's cache rows are its heads in order: the row ``(h e)`` of a rank
holding ``H_r`` heads of ``D`` elements is ``H_r * D`` elements, whatever the
layout's own ``H x E`` split (a chunk format with ``H = 1`` keeps them in
``E``).

Moving a request's KV from ``m`` sender ranks to ``n`` receiver ranks
(disaggregated prefill -> decode) copies, for every layer and plane and every
token ``t``, each head ``k`` a receiver rank ``d`` holds from one sender rank
that holds ``k``.  When several sender ranks hold ``k`` (replicas), the one
whose replica index is ``d mod replicas`` sends it, so the receivers spread
over the replicas.  Consecutive heads with the same (sender, receiver) form
one ``Route``; every head of every receiver is covered by exactly one
route.  Layers pair in order (layer ``l`` to layer ``l``) and tokens pair by
position in the two slot lists: token ``t`` is read at the sender's
``src_slots[t]`` and written at the receiver's ``dst_slots[t]``, and moves
only when both are ``>= 0`` (the transfer rule of ``operations``).

``kv_heads`` and ``kv_routes`` are plain Python (no jax, no torch):
the torch side reads the same rules.  ``reshard`` is the oracle, a
composition of the reference's ``gather`` and ``scatter``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .layouts import Layout


def kv_heads(tp_rank: int, tp_size: int, num_kv_heads: int) -> tuple[int, int]:
    """The global KV heads ``[start, stop)`` that rank ``tp_rank`` of ``tp_size`` holds.

    Raises ``ValueError`` when ``tp_size`` neither divides nor is a multiple
    of ``num_kv_heads``, or the rank is out of range.
    """
    if num_kv_heads < 1:
        raise ValueError(f"num_kv_heads = {num_kv_heads} must be >= 1")
    if tp_size < 1:
        raise ValueError(f"tp_size = {tp_size} must be >= 1")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank = {tp_rank} is out of range for tp_size = {tp_size}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over tp_size = {tp_size} "
                             "(it must divide the head count)")
        per_rank = num_kv_heads // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    if tp_size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated over tp_size = {tp_size} "
                         "(it must be a multiple of the head count)")
    head = tp_rank // (tp_size // num_kv_heads)
    return head, head + 1


def replicas(tp_size: int, num_kv_heads: int) -> int:
    """How many ranks of a TP group hold each head (1 unless ``tp_size > num_kv_heads``)."""
    return max(1, tp_size // num_kv_heads)


@dataclasses.dataclass(frozen=True)
class Route:
    """Heads ``[head_start, head_stop)`` (global) go from sender ``src_rank`` to receiver ``dst_rank``.

    ``src_head``/``dst_head``: the first of those heads counted within the
    sender's and the receiver's own heads (where they sit in each rank's row).
    """

    src_rank: int
    dst_rank: int
    head_start: int
    head_stop: int
    src_head: int
    dst_head: int

    @property
    def num_heads(self) -> int:
        return self.head_stop - self.head_start


def source_rank(head: int, dst_rank: int, num_kv_heads: int, src_tp: int, dst_tp: int) -> int:
    """The sender rank that sends global head ``head`` to receiver ``dst_rank``."""
    lo, hi = kv_heads(dst_rank, dst_tp, num_kv_heads)
    if not lo <= head < hi:
        raise ValueError(f"receiver rank {dst_rank} of {dst_tp} holds heads [{lo}, {hi}), not {head}")
    if src_tp <= num_kv_heads:
        return head // (num_kv_heads // src_tp)
    copies = replicas(src_tp, num_kv_heads)
    return head * copies + dst_rank % copies


def kv_routes(num_kv_heads: int, src_tp: int, dst_tp: int) -> tuple[Route, ...]:
    """Every route from ``src_tp`` sender ranks to ``dst_tp`` receiver ranks, by receiver then head.

    Each (sender, receiver) pair has at most one route, since both ranks hold
    a contiguous run of heads and replicas are chosen per receiver.
    """
    routes = []
    for d in range(dst_tp):
        lo, hi = kv_heads(d, dst_tp, num_kv_heads)
        start = lo
        for head in range(lo, hi + 1):
            if head == hi or source_rank(head, d, num_kv_heads, src_tp, dst_tp) != \
                    source_rank(start, d, num_kv_heads, src_tp, dst_tp):
                s = source_rank(start, d, num_kv_heads, src_tp, dst_tp)
                routes.append(Route(s, d, start, head, start - kv_heads(s, src_tp, num_kv_heads)[0], start - lo))
                start = head
    return tuple(routes)


def reshard(src_layout: Layout | str, src_caches: Sequence, src_slots, dst_layout: Layout | str,
            dst_caches: Sequence, dst_slots, *, num_kv_heads: int) -> list:
    """Move a request's KV from every sender rank's cache into every receiver rank's cache.

    ``src_caches``: one physical cache per sender rank (TP size ``m =
    len(src_caches)``), all of ``src_layout``; ``dst_caches`` likewise for the
    ``n`` receiver ranks.  ``src_slots``/``dst_slots``: ``[T]`` slots shared
    by the ranks of a side, or one ``[T]`` list per rank.  Every cache has the
    same layer count, plane count and element size; rank ``r``'s row holds
    its ``kv_heads`` of ``D`` elements each (``D`` = row width / heads,
    the same on both sides).

    Returns the receivers' new caches.  Rule: for each route of
    ``kv_routes``, each plane ``p``, layer ``l`` and token ``t`` with
    ``src_slots[s][t] >= 0`` and ``dst_slots[d][t] >= 0``, the route's heads
    of ``dst[d][p, l, dst_slots[d][t]]`` become those of
    ``src[s][p, l, src_slots[s][t]]``, bit for bit; everything else keeps its
    value.  Built from ``gather`` (every rank's rows ``[P, L, T, heads, D]``)
    and ``scatter`` (each receiver's rows, the routed heads replaced), on the
    bits of the elements.
    """
    import einops
    import jax.numpy as jnp

    from .logical import as_bits, geometry_of
    from .operations import gather, scatter

    src_tp, dst_tp = len(src_caches), len(dst_caches)

    def per_rank(slots, count):
        """One ``[T]`` array per rank: ``slots`` is one list per rank (2-D), or one list shared by all."""
        rows = list(slots) if isinstance(slots, (list, tuple)) else None
        if (rows and jnp.ndim(rows[0]) == 1) or jnp.ndim(slots) == 2:
            if len(slots) != count:
                raise ValueError(f"{len(slots)} slot lists for {count} ranks")
            return [jnp.asarray(s) for s in slots]
        return [jnp.asarray(slots)] * count

    def head_rows(layout, cache, slots, rank, tp, side):
        lo, hi = kv_heads(rank, tp, num_kv_heads)
        geom = geometry_of(layout, cache)
        if (geom.H * geom.E) % (hi - lo):
            raise ValueError(f"{side} rank {rank}: a row of {geom.H}*{geom.E} elements does not hold "
                             f"{hi - lo} heads")
        rows = as_bits(gather(layout, cache, slots))                          # [P, L, T, H, E], as bits
        return einops.rearrange(rows, "p l t h e -> p l t (h e)").reshape(
            rows.shape[:3] + (hi - lo, geom.H * geom.E // (hi - lo)))        # [P, L, T, heads, D]

    s_slots, d_slots = per_rank(src_slots, src_tp), per_rank(dst_slots, dst_tp)
    src_rows = [head_rows(src_layout, c, s_slots[r], r, src_tp, "sender") for r, c in enumerate(src_caches)]
    out = list(dst_caches)
    for d, cache in enumerate(dst_caches):
        rows = head_rows(dst_layout, cache, d_slots[d], d, dst_tp, "receiver")  # the receiver's own rows
        for route in kv_routes(num_kv_heads, src_tp, dst_tp):
            if route.dst_rank != d:
                continue
            src = src_rows[route.src_rank]
            if src.shape[-1] != rows.shape[-1] or src.shape[:2] != rows.shape[:2]:
                raise ValueError(f"sender rank {route.src_rank} rows {src.shape} and receiver rank {d} rows "
                                 f"{rows.shape} differ in planes, layers or head size")
            moved = src[:, :, :, route.src_head:route.src_head + route.num_heads]
            valid = (s_slots[route.src_rank] >= 0)[None, None, :, None, None]
            kept = rows[:, :, :, route.dst_head:route.dst_head + route.num_heads]
            rows = rows.at[:, :, :, route.dst_head:route.dst_head + route.num_heads].set(
                jnp.where(valid, moved, kept))
        # a token the senders had no slot for gets its own row back: the scatter writes it unchanged
        flat = einops.rearrange(rows, "p l t k d -> p l t (k d)")[:, :, :, None, :]
        out[d] = scatter(dst_layout, cache, flat, d_slots[d])
    return out
