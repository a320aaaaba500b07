"""The ``bad_input`` family: every error kind of every family, each checked on its own share of examples.

The kinds are data (:class:`~kvlayout.conformance.families.core.ErrorKind`:
the exception type and the regex its message matches, naming the argument)
owned by the family of the operation they call.  A :class:`BadInputSample`
names the kind and a valid transfer case to spoil; running it makes the
invalid call, which must raise the kind's exception and leave every tensor
as it was.  On CUDA an out-of-range slot or position (a *deferrable* kind)
is either checked before the launch (``path = "validate"``) or skipped by
the kernel and reported by ``ops.check_errors()`` (``path =
"check_errors"``; RoPE positions always take that path), with every other
token done.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from kvlayout import ops

from .. import strategies as S
from .core import ErrorInput, OpFamily, assert_same, expect_raises, sync
from .pages import PAGES
from .rope import ROPE
from .rows import GATHER, MOVE, SCATTER
from .transfer import TRANSFER, valid_token

ERROR_KINDS = {k.name: k for fam in (TRANSFER, GATHER, SCATTER, MOVE, PAGES, ROPE) for k in fam.errors}
"""Every error kind by name (``"transfer: src_slots out of range"``, ...), in family order."""


def error_kinds(device: str) -> tuple[str, ...]:
    """The kinds that apply on ``device`` (an unpinned host source needs a CUDA device to face)."""
    return tuple(name for name, k in ERROR_KINDS.items() if k.applies_to(device))


@dataclasses.dataclass(frozen=True)
class BadInputSample:
    """One invalid call: error kind ``kind`` applied to a valid transfer case.

    ``token`` picks the token the bad value goes to; ``offset`` how far past
    the bound it lies; ``path``: ``"validate"`` or ``"check_errors"`` for
    the deferrable kinds on CUDA.
    """

    kind: str
    case: S.TransferCase
    token: int = 0
    offset: int = 0
    path: str = "validate"
    family = "bad_input"

    def group(self) -> str:
        return self.kind

    def describe(self) -> str:
        path = f" ({self.path})" if ERROR_KINDS[self.kind].deferrable else ""
        return f"{self.kind}{path}: {self.case.describe()} token={self.token} offset={self.offset}"

    def error_input(self) -> ErrorInput:
        kind = ERROR_KINDS[self.kind]
        return ErrorInput(self, kind.error_type, kind.error_regex)

    def run(self, device: str) -> None:
        kind = ERROR_KINDS[self.kind]
        cuda = torch.device(device).type == "cuda"
        deferred = cuda and kind.deferrable and (self.path == "check_errors" or kind.family == "rope")
        invalid = kind.build(self, device, True if cuda and not deferred else None)
        regex = kind.regex(invalid)
        if deferred:
            invalid.call()
            expect_raises(lambda: ops.check_errors(device), IndexError, regex)
            tensors, expected = invalid.deferred()
            assert_same(tensors, expected, "destination (the bad token untouched)")
            return
        expect_raises(invalid.call, kind.error_type, regex)
        sync(device)
        for tensors, expected, what in invalid.keep:
            assert_same(tensors, expected, what)


def _usable(c: S.TransferCase) -> bool:
    return c.T >= 2 and c.dst_geom.N >= 2 and valid_token(c, 0) >= 0


@st.composite
def bad_input_samples(draw, device: str, group: str | None = None):
    kind = group or draw(st.sampled_from(error_kinds(device)))
    src, dst = draw(st.sampled_from(S.layout_pairs()))
    case = draw(S.transfer_cases(src, dst, max_layers=3, max_slots=16, budget=1 << 11, allow_positions=False,
                                 allow_skip=False).filter(_usable))
    path = draw(st.sampled_from(("validate", "check_errors"))) if torch.device(device).type == "cuda" else "validate"
    return BadInputSample(kind, case, draw(st.integers(0, 31)), draw(st.integers(0, 5)), path)


BAD_INPUT = OpFamily("bad_input", "every class of invalid argument raises the documented exception",
                     bad_input_samples, "(the family of each kind)", groups_of=error_kinds)
SAMPLES = (BadInputSample,)
