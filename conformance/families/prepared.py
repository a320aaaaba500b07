"""The ``prepared`` family: a transfer planned once by ``ops.prepare``, called for all layers or layer by layer.

A prepared transfer must move exactly the bytes ``ops.transfer`` (and the
reference) moves: ``t()`` runs every layer at once, ``t.layer(i)`` one
layer of the pipeline; either way the destination ends as
``kvlayout.reference.transfer`` says, the source unchanged.

Reference: ``kvlayout.reference.transfer``.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from kvlayout import ops

from .. import strategies as S
from .core import OpFamily, assert_same, flat, slots, sync
from .transfer import OnTransferCase, expected_transfer, layout_pairs, op_kwargs, transfer_cases

CALLS = ("all layers", "layer by layer")


@dataclasses.dataclass(frozen=True)
class PreparedSample(OnTransferCase):
    """``ops.prepare(src, dst, src_slots, dst_slots, ...)`` on one case, then ``t()`` or ``t.layer(i)`` for each i."""

    case: S.TransferCase
    call: str = "all layers"
    slot_dtypes: tuple[str, str] = ("int32", "int64")
    family = "prepared"

    def describe(self) -> str:
        return f"prepared {self.case.describe()} ({self.call}, {'/'.join(dict.fromkeys(self.slot_dtypes))})"

    def run(self, device: str) -> None:
        c = self.case
        src_np, dst_np = c.caches()
        src, dst = self.bound(device, src_np, dst_np)
        ss, ds = c.slots()
        t = ops.prepare(src, dst, slots(ss, self.slot_dtypes[0], device), slots(ds, self.slot_dtypes[1], device),
                        **op_kwargs(c))
        if self.call == "all layers":
            t()
        else:
            for i in range(t.num_layers):
                t.layer(i)
        sync(device)
        assert_same(dst.tensors, flat(c.dst_layout, expected_transfer(c, src_np, dst_np)), f"destination ({self.call})")
        assert_same(src.tensors, flat(c.src_layout, src_np), "source (must not change)")


@st.composite
def prepared_samples(draw, device: str, group: str | None = None):
    case = draw(st.sampled_from(layout_pairs(group)).flatmap(transfer_cases))
    slot_dtype = st.sampled_from(("int32", "int64"))
    return PreparedSample(case, draw(st.sampled_from(CALLS)), (draw(slot_dtype), draw(slot_dtype)))


PREPARED = OpFamily("prepared", "ops.prepare: a planned transfer called for all layers or layer by layer",
                    prepared_samples, "transfer")
SAMPLES = (PreparedSample,)
