"""kvlayout.dist: a request's KV from one tensor-parallel group's caches into another's, over torch.distributed.

Disaggregated serving computes a request's KV on prefill ranks and decodes on
other ranks, often with another engine, layout, page size and TP split.  A
:class:`Sender` (one per prefill TP rank) and a :class:`Receiver` (one per
decode TP rank) each bind their own cache; per request each side gives its
own slot list.  The sender gathers, layer by layer, the heads each receiver
rank holds into contiguous buffers (``kvlayout.ops``), sends them point to
point on the group's backend (NCCL on GPUs, gloo on CPUs), and the receiver
scatters them into its layout::

    from kvlayout import dist as kvdist, ops

    peers = kvdist.Peers.split(4, 2)                 # group ranks 0-3 prefill TP 4, ranks 4-5 decode TP 2
    # prefill rank (its 2 of 8 KV heads in a vLLM FlashAttention cache)
    sender = kvdist.Sender(ops.bind("vllm_flash_attn_nhd", kv_caches), num_kv_heads=8, peers=peers)
    sender.send(request_id, slot_mapping)            # returns once every receiver acknowledged
    # decode rank (its 4 of 8 heads in an SGLang pool)
    receiver = kvdist.Receiver(ops.bind("sglang_mha", (k_buffers, v_buffers), page_size=16), num_kv_heads=8,
                               peers=peers)
    for layer in receiver.start(request_id, locs):  # each layer as it lands
        ...

Which heads go from which sender rank to which receiver rank is the
reference's rule, :func:`kvlayout.reference.kv_routes` (heads split, or
replicated when the TP size exceeds the KV heads, as vLLM and SGLang do).
Errors: :class:`HandshakeError` (geometry, TP sizes or the request disagree;
raised on both sides before any data moves), :class:`PeerError` (a peer died
or did not answer within ``timeout``).  A request's stream is ``complete``
only once every layer has landed.
"""

from kvlayout.reference.resharding import Route, kv_heads, kv_routes

from .endpoints import Peers, Receiver, ReceiveStream, Sender, SendStream
from .handshake import HandshakeError, PeerError, TransferError
from .heads import head_view

__all__ = ["Peers", "Sender", "Receiver", "SendStream", "ReceiveStream", "TransferError", "HandshakeError",
           "PeerError", "head_view", "kv_heads", "kv_routes", "Route"]
