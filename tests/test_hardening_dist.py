"""kvlayout.dist under hostile input, in one process: bad slot lists refused before any message goes out,
forged handshake descriptors and messages refused with HandshakeError naming the field, bounded timeouts.

The endpoints here are made without a process group (their wiring set by hand, their messages replaced by
functions that record or answer them); tests/test_dist.py runs the same refusals between real processes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvlayout import dist as kvdist
from kvlayout import ops
from kvlayout.dist.handshake import DESCRIPTOR_MAGIC, VERSION, Descriptor, HandshakeError, dtype_code, mismatches
from kvlayout.reference.resharding import kv_routes

H, D, L, N = 4, 8, 2, 16        # heads, head size, layers, slots of the test caches


def _cache():
    return ops.bind("sglang_mha", ([torch.zeros(N, H, D, dtype=torch.bfloat16) for _ in range(L)],
                                   [torch.zeros(N, H, D, dtype=torch.bfloat16) for _ in range(L)]))


def _endpoint(cls):
    """A 1 -> 1 endpoint of ``cls`` wired by hand (group ranks: sender 0, receiver 1); every message it would
    send or receive is recorded in ``ep.messages`` and fails."""
    ep = object.__new__(cls)
    ep.cache = _cache()
    ep.group, ep.peers, ep.timeout, ep.depth = None, kvdist.Peers.split(1, 1), 5.0, 2
    ep.group_rank = cls.ROLE
    ep.tp_rank, ep.tp_size, ep.peer_tp_size = 0, 1, 1
    ep._peer_ranks = (1 - cls.ROLE,)
    ep.num_kv_heads, ep.heads, ep.head_size = H, (0, H), D
    ep.routes = tuple(kv_routes(H, 1, 1))
    ep.device, ep._cuda = torch.device("cpu"), False
    ep._connected, ep._broken, ep._open = False, None, None
    ep.messages = []

    def no_message(tensor, rank, what):
        ep.messages.append((what, rank))
        raise AssertionError(f"a message was {what} group rank {rank}")

    ep._isend = lambda t, r: no_message(t, r, "sent to")
    ep._irecv = lambda t, r: no_message(t, r, "received from")
    return ep


@pytest.mark.parametrize("cls", [kvdist.Sender, kvdist.Receiver])
@pytest.mark.parametrize("bad, index", [([0, 3, N], 2), ([N + 5], 0), ([1, 2 ** 40, 0], 1)])
def test_out_of_range_slots_are_refused_before_any_message(cls, bad, index):
    ep = _endpoint(cls)
    with pytest.raises(IndexError, match=rf"slots\[{index}\] = {bad[index]} is out of range: this "
                                         rf"{ep.role}'s cache holds {N} slots; nothing was exchanged"):
        ep.start(7, torch.tensor(bad))
    assert ep.messages == [] and ep._broken is None and not ep._connected


def test_repeated_receiver_slots_are_refused_before_any_message():
    ep = _endpoint(kvdist.Receiver)
    with pytest.raises(ValueError, match=r"slots repeats slot 3: a slot of the receiver's cache may be written "
                                         r"once per request; nothing was exchanged"):
        ep.start(7, [3, -1, 5, 3])
    assert ep.messages == [] and ep._broken is None
    # no row (-1) any number of times is fine, and so are repeats on the sending side (rows are only read)
    sender = _endpoint(kvdist.Sender)
    sender.connect = lambda: (_ for _ in ()).throw(AssertionError("checked"))
    with pytest.raises(AssertionError, match="checked"):
        sender.start(7, [3, 3, -1, -1])
    ep.connect = sender.connect
    with pytest.raises(AssertionError, match="checked"):
        ep.start(7, [-1, 2, -1])


MINE = Descriptor(1, 0, 1, 1, H, D, L, 2, dtype_code(torch.bfloat16), 2)
PEER = Descriptor(0, 0, 1, 1, H, D, L, 2, dtype_code(torch.bfloat16), 2)
FORGED = [("role", 7), ("role", -1), ("role", 2), ("tp_rank", 1), ("tp_rank", -1), ("tp_size", 0),
          ("peer_tp_size", -2), ("num_kv_heads", 0), ("head_size", -8), ("num_layers", 0), ("planes", 3),
          ("planes", 0), ("dtype", 12345), ("itemsize", 3), ("itemsize", 0)]


@pytest.mark.parametrize("field, value", FORGED)
def test_a_forged_descriptor_field_is_named_and_never_read(field, value):
    forged = dataclasses.replace(PEER, **{field: value})
    parsed = Descriptor.from_tensor(forged.tensor("cpu"))
    assert isinstance(parsed, str) and f"{field} = {value}" in parsed, parsed
    texts = mismatches(MINE, parsed, 0)       # (role 7 used to index the role names: IndexError)
    assert texts == [parsed]


@pytest.mark.parametrize("field, value", [("role", 7), ("role", -1), ("tp_rank", 3), ("dtype", -1)])
def test_connect_raises_handshake_error_for_a_forged_descriptor(field, value):
    ep = _endpoint(kvdist.Receiver)
    forged = dataclasses.replace(PEER, **{field: value}).tensor("cpu")

    def exchange(outgoing, incoming, what):
        for t in incoming.values():
            t.copy_(forged)

    ep._exchange = exchange
    with pytest.raises(HandshakeError, match=rf"malformed: .*{field} = {value}.*nothing was moved|"
                                             rf"{field} = {value}"):
        ep.connect()
    assert not ep._connected


def test_a_descriptor_of_the_wrong_length_or_magic_is_refused():
    short = torch.tensor([DESCRIPTOR_MAGIC, VERSION, 0, 0], dtype=torch.int64)
    assert "holds 4 values" in Descriptor.from_tensor(short)
    other = PEER.tensor("cpu")
    other[0] = 12
    assert "not a kvlayout.dist descriptor" in Descriptor.from_tensor(other)


def test_a_forged_request_header_is_a_handshake_error():
    ep = _endpoint(kvdist.Sender)

    def exchange(outgoing, incoming, what):
        for t in incoming.values():
            t.copy_(torch.tensor([0x1234, 7, 3]))

    ep._exchange = exchange
    with pytest.raises(HandshakeError, match=r"not a kvlayout.dist request header"):
        ep._request_header(7, 3)


@pytest.mark.parametrize("timeout", [math.inf, math.nan, -1.0, 0.0, 1e300])
@pytest.mark.parametrize("cls", [kvdist.Sender, kvdist.Receiver])
def test_an_unbounded_timeout_is_refused_by_the_constructor(cls, timeout):
    with pytest.raises(ValueError, match=r"timeout = .* (must be a finite number of seconds > 0|is longer than a "
                                         r"wait can be)"):
        cls(_cache(), num_kv_heads=H, peers=kvdist.Peers.split(1, 1), timeout=timeout)
