"""The ``staged`` family: ``ops.transfer(..., engine="staged")`` and ``engine="auto"`` with a host chunk.

A staged transfer (``kvlayout.ops.staged``) moves the rows through a device
copy of a pinned host chunk, the copy engine crossing PCIe.  It must end
exactly where the copy kernel (and the reference) ends: the whole
destination as ``kvlayout.reference.transfer`` says, the source unchanged,
for every chunk layout, layer subset and ``skip_prefix``, on a call issued
directly and on the repeated calls of one shape that the engine captures
into a graph and replays (launched from the host, or as a conditional
node's body the device starts: ``ops.set_staged_graph_launch``).  The host side is
a chunk addressed by position (its slots ``None``); the device side any
layout, with slot patterns that include ``-1``.  On CUDA the staged path
runs; on the CPU there is nothing to stage, and ``engine="staged"`` is
refused with the reason, before anything is written (``engine="auto"``
runs the kernel there; a transfer of no tokens moves nothing on any engine).

Reference: ``kvlayout.reference.transfer``.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from hypothesis import strategies as st

from kvlayout import ops
from kvlayout.ops import staged as staged_mod

from .. import strategies as S
from .core import OpFamily, assert_same, expect_raises, flat, slots, sync
from .transfer import OnTransferCase, expected_transfer, layout_pairs, op_kwargs, transfer_cases

GRAPH_LAUNCHES = ("", "", "host", "device")
"""How the samples run: one call (issued directly, as a new shape's), or three calls of the shape (issued
directly, captured and launched, replayed) with the kept graph launched from the host or on the device."""

RING_BYTES = (0, 0, 4096, 16384)
"""Staging ring sizes the samples draw: the default, and rings small enough that a sample's rows are cut into
several chunks (layer groups and token ranges) or, for wide rows, that one row does not fit (a refusal)."""

CHUNKS = ("lmcache_kv_2ltd", "lmcache_kv_mla")
"""Host chunk layouts whose rows lie back to back in token order (what staging copies as spans)."""


@dataclasses.dataclass(frozen=True)
class StagedSample(OnTransferCase):
    """A transfer between a device cache and a host chunk (``host_side``), with ``engine``."""

    case: S.TransferCase
    host_side: str = "dst"          # "src": a load into the device cache; "dst": a store into the chunk
    engine: str = "staged"          # or "auto" (staged from 64 MiB on: these samples take the kernel)
    ring_bytes: int = 0             # the staging ring's size (0: the default); small rings cut chunks
    graph_launch: str = ""          # "": one call; "host"/"device": three calls, the kept graph launched so
    family = "staged"

    def describe(self) -> str:
        ring = f", ring {self.ring_bytes} B" if self.ring_bytes else ""
        calls = f", 3 calls, graph launched on the {self.graph_launch}" if self.graph_launch else ""
        return f"{self.engine} {self.case.describe()} (host {self.host_side}{ring}{calls})"

    def run(self, device: str) -> None:
        default_ring, default_launch = staged_mod.STAGING_BYTES, staged_mod.staged_graph_launch()
        if self.ring_bytes:
            staged_mod.STAGING_BYTES = self.ring_bytes
        if self.graph_launch:
            staged_mod.set_staged_graph_launch(self.graph_launch)
        try:
            self._run(device)
        finally:
            staged_mod.set_staged_graph_launch(default_launch)
            if self.ring_bytes:
                staged_mod.STAGING_BYTES = default_ring
                staged_mod.release_staging()

    def _run(self, device: str) -> None:
        c = self.case
        src_np, dst_np = c.caches()
        src, dst = self.bound(device, src_np, dst_np, pinned=self.host_side)
        ss, ds = c.slots()
        args = (slots(ss, "int64", device), slots(ds, "int64", device))
        kw = dict(op_kwargs(c), engine=self.engine)
        if torch.device(device).type != "cuda" and self.engine == "staged" and c.T > 0:
            expect_raises(lambda: ops.transfer(src, dst, *args, **kw), ValueError,
                          "cannot stage this transfer: one side must be a CUDA cache")
            assert_same(dst.tensors, flat(c.dst_layout, dst_np), "destination (refused: unchanged)")
            return
        if self.engine == "staged" and torch.device(device).type == "cuda":
            moves = c.T > 0 and c.src_layers != ()
            try:
                assert ops.explain(src, dst, *args, **kw)["engine"] == ("staged" if moves else "none")
            except ValueError as refusal:   # e.g. a row split into column blocks: the same refusal, nothing written
                expect_raises(lambda: ops.transfer(src, dst, *args, **kw), ValueError, re.escape(str(refusal)))
                assert_same(dst.tensors, flat(c.dst_layout, dst_np), "destination (refused: unchanged)")
                return
        expected = flat(c.dst_layout, expected_transfer(c, src_np, dst_np))
        for call in range(3 if self.graph_launch else 1):
            ops.transfer(src, dst, *args, **kw)
            sync(device)
            assert_same(dst.tensors, expected, f"destination (call {call + 1})")
            assert_same(src.tensors, flat(c.src_layout, src_np), f"source (must not change; call {call + 1})")


def _pairs(group: str | None):
    """(pair, host side) of every layout pair with a chunk on one side and a device cache on the other."""
    out = []
    for a, b in layout_pairs(group):
        if b in CHUNKS and a not in CHUNKS and a != "rows":
            out.append(((a, b), "dst"))
        if a in CHUNKS and b not in CHUNKS and b != "rows":
            out.append(((a, b), "src"))
    return out


def _host_positions(case: S.TransferCase, host_side: str) -> bool:
    return (case.src_slots if host_side == "src" else case.dst_slots) is None


@st.composite
def staged_samples(draw, device: str, group: str | None = None):
    pair, host_side = draw(st.sampled_from(_pairs(group)))
    case = draw(transfer_cases(pair).filter(lambda c: _host_positions(c, host_side)))
    return StagedSample(case, host_side, draw(st.sampled_from(("staged", "staged", "auto"))),
                        draw(st.sampled_from(RING_BYTES)), draw(st.sampled_from(GRAPH_LAUNCHES)))


STAGED = OpFamily("staged", "ops.transfer with engine='staged'/'auto' between a device cache and a host chunk",
                  staged_samples, "transfer")
SAMPLES = (StagedSample,)
