"""What the two sides tell each other before any KV moves, and the errors of a distributed transfer.

Every message of the control path is a small int64 tensor (it travels on the
group's backend like the data, so NCCL groups need no second transport):

* the *descriptor* (once per sender/receiver pair, at connection): role, TP
  rank and size on both sides, total KV heads, head size, layers, planes,
  element type and size.  Each side compares the other's with its own and
  raises :class:`HandshakeError` naming every difference, so a mismatch is
  reported on both sides before any data moves;
* the *request header* (per request, both ways between the pairs that have a
  route): request id and token count;
* the *acknowledgement* (per request, receiver to sender, after every layer
  has landed): request id and status.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import torch

DESCRIPTOR_MAGIC = 0x6B764C61796F7574      # "kvLayout"
REQUEST_MAGIC = 0x6B764C5265717374         # "kvLReqst"
ACK_MAGIC = 0x6B764C41636B6564             # "kvLAcked"
VERSION = 1
ROLES = ("sender", "receiver")


class TransferError(RuntimeError):
    """A distributed KV transfer failed."""


class HandshakeError(TransferError):
    """The two sides disagree on the model's geometry, the TP split or the request: nothing was moved."""


class PeerError(TransferError):
    """A peer failed, vanished or did not answer within the timeout; the transfer did not complete."""


@functools.cache
def _dtype_names() -> dict[int, str]:
    names = {}
    for name in dir(torch):
        value = getattr(torch, name)
        if isinstance(value, torch.dtype):
            names[dtype_code(value)] = str(value).removeprefix("torch.")
    return names


def dtype_code(dtype: torch.dtype) -> int:
    """A stable number for an element type (both sides may run different torch builds)."""
    return zlib.crc32(str(dtype).encode())


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """One endpoint as its peers see it (what must agree, and who it is)."""

    role: int                  # index into ROLES
    tp_rank: int
    tp_size: int
    peer_tp_size: int          # the TP size it expects on the other side
    num_kv_heads: int          # total over its TP group
    head_size: int             # elements per head (D)
    num_layers: int
    planes: int                # 2 (K, V) or 1 (MLA)
    dtype: int                 # dtype_code
    itemsize: int

    FIELDS = 12

    def tensor(self, device) -> torch.Tensor:
        """``[FIELDS]`` int64: magic, version, then the fields in order."""
        values = [DESCRIPTOR_MAGIC, VERSION, *dataclasses.astuple(self)]
        return torch.tensor(values, dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Descriptor | str":
        """The descriptor in ``t``, or a text saying why ``t`` holds none (a field out of its range included:
        every field is checked before anything reads it)."""
        values = t.tolist()
        if len(values) != cls.FIELDS:
            return f"its descriptor holds {len(values)} values, expected {cls.FIELDS}"
        if values[0] != DESCRIPTOR_MAGIC:
            return "its first message is not a kvlayout.dist descriptor (is it running kvlayout.dist?)"
        if values[1] != VERSION:
            return f"it speaks protocol version {values[1]}, this side {VERSION}"
        descriptor = cls(*values[2:])
        problems = descriptor.invalid_fields()
        if problems:
            return "its descriptor is malformed: " + "; ".join(problems)
        return descriptor

    def invalid_fields(self) -> list[str]:
        """Every field outside the values a real endpoint sends (empty: all plausible)."""
        out = []
        if self.role not in (0, 1):
            out.append(f"role = {self.role} (0 = sender, 1 = receiver)")
        for name in ("tp_size", "peer_tp_size", "num_kv_heads", "head_size", "num_layers", "itemsize"):
            if getattr(self, name) < 1:
                out.append(f"{name} = {getattr(self, name)} (must be >= 1)")
        if self.tp_size >= 1 and not 0 <= self.tp_rank < self.tp_size:
            out.append(f"tp_rank = {self.tp_rank} (must lie in [0, tp_size = {self.tp_size}))")
        if self.planes not in (1, 2):
            out.append(f"planes = {self.planes} (1 = MLA latent, 2 = K and V)")
        if self.itemsize >= 1 and self.itemsize not in (1, 2, 4, 8):
            out.append(f"itemsize = {self.itemsize} (an element is 1, 2, 4 or 8 bytes)")
        if self.dtype not in _dtype_names():
            out.append(f"dtype = {self.dtype} (no element type of this torch has that code)")
        return out


def mismatches(mine: Descriptor, theirs: Descriptor | str, peer_tp_rank: int) -> list[str]:
    """Every way ``theirs`` (the peer expected at TP rank ``peer_tp_rank``) disagrees with ``mine``."""
    if isinstance(theirs, str):
        return [theirs]
    out = []
    peer_role = ROLES[1 - mine.role]
    if theirs.role != 1 - mine.role:
        out.append(f"it is a {ROLES[theirs.role]} too (expected a {peer_role})")
    if theirs.tp_rank != peer_tp_rank:
        out.append(f"it is {peer_role} TP rank {theirs.tp_rank}, this side expected TP rank {peer_tp_rank} there")
    if theirs.tp_size != mine.peer_tp_size or theirs.peer_tp_size != mine.tp_size:
        out.append(f"TP sizes differ: this {ROLES[mine.role]} group has {mine.tp_size} ranks and expects "
                   f"{mine.peer_tp_size} {peer_role}s; the {peer_role} group has {theirs.tp_size} ranks and "
                   f"expects {theirs.peer_tp_size} {ROLES[mine.role]}s")
    for label, a, b in (("total KV heads", mine.num_kv_heads, theirs.num_kv_heads),
                        ("head size (elements per head)", mine.head_size, theirs.head_size),
                        ("layer count", mine.num_layers, theirs.num_layers),
                        ("plane count (2 = K and V, 1 = MLA latent)", mine.planes, theirs.planes)):
        if a != b:
            out.append(f"{label} differs: this side {a}, the {peer_role} {b}")
    if mine.dtype != theirs.dtype or mine.itemsize != theirs.itemsize:
        names = _dtype_names()
        out.append(f"element type differs: this side {names.get(mine.dtype, mine.dtype)} ({mine.itemsize} B), "
                   f"the {peer_role} {names.get(theirs.dtype, theirs.dtype)} ({theirs.itemsize} B)")
    return out


def check_message(values: list[int], magic: int, what: str, sender: str) -> None:
    """Raise :class:`HandshakeError` unless ``values`` (a received request header or acknowledgement) starts
    with ``magic``."""
    if values[0] != magic:
        raise HandshakeError(f"{sender} sent a message that is not a kvlayout.dist {what} (its first word is "
                             f"{values[0]:#x}, expected {magic:#x}); nothing more is read from it")


def request_header(request_id: int, num_tokens: int, device) -> torch.Tensor:
    """``[3]`` int64: magic, request id, token count."""
    return torch.tensor([REQUEST_MAGIC, request_id, num_tokens], dtype=torch.int64, device=device)


def ack(request_id: int, status: int, device) -> torch.Tensor:
    """``[3]`` int64: magic, request id, status (0 = every layer landed)."""
    return torch.tensor([ACK_MAGIC, request_id, status], dtype=torch.int64, device=device)
