"""The ``transfer`` and ``fuzz_index`` families: ``ops.transfer`` between every pair of layouts.

A :class:`TransferSample` wraps a :class:`~kvlayout.conformance.strategies.TransferCase`
(layouts, geometries, dtype, slots, layers, ``skip_prefix``) with how the op
is called: where each side lives (CUDA: the device, or pinned host memory),
the slot dtypes and where the slots live, whether ``skip_prefix`` is the
argument or folded into the slots by ``ops.skip_prefix``, ``validate``, the
CTA budget, and what the destination holds before the call (sentinel or
random bytes).  A :class:`FuzzIndexSample` is a transfer whose slots carry
huge negative ("no token") and out-of-range values.

Reference: ``kvlayout.reference.transfer``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import strategies as st

from kvlayout import ops
from kvlayout.reference.layouts import get

from .. import strategies as S
from .core import (
    DTYPES_DIFFER,
    REPEATED_DESTINATION,
    ROW_WIDTHS_DIFFER,
    BadSetup,
    ErrorKind,
    Invalid,
    OpFamily,
    assert_same,
    bind,
    expect_raises,
    family_of,
    flat,
    index_out_of_range_message,
    pin_if,
    reference,
    slot_out_of_range_message,
    slots,
    sync,
)

SLOT_DTYPES = ("int64", "int32")
PLACEMENTS = ("device", "pinned src", "pinned dst")
"""Where the two sides of a transfer live on a CUDA run (on CPU everything is host memory)."""
CTA_BUDGETS = (0, 0, 0, 1, 2, 4)
"""``max_ctas`` drawn for a transfer (0 = the default grid; the others split the work over few CTAs)."""


def op_kwargs(case: S.TransferCase) -> dict:
    """``ops.transfer`` keyword arguments of a case (the reference's, less the geometries)."""
    return {k: v for k, v in case.transfer_kwargs().items() if k not in ("src_geom", "dst_geom")}


def expected_transfer(case: S.TransferCase, src_np, dst_np, src_slots=None, dst_slots=None):
    """The reference's destination for ``case`` from the given initial content (slots: the case's by default)."""
    ss, ds = case.slots()
    return reference.transfer(case.src_layout, src_np, case.dst_layout, dst_np,
                              ss if src_slots is None else src_slots, ds if dst_slots is None else dst_slots,
                              **case.transfer_kwargs())


def layout_group(case: S.TransferCase) -> str:
    """The report row of a transfer: catalog family of the source -> of the destination."""
    return f"{family_of(case.src_layout)}->{family_of(case.dst_layout)}"


@dataclasses.dataclass(frozen=True)
class TransferSample:
    """``ops.transfer`` on one case; compares the whole destination and the (unchanged) source."""

    case: S.TransferCase
    placement: str = "device"
    slot_dtypes: tuple[str, str] = ("int64", "int64")
    skip_via: str = "argument"      # or "ops.skip_prefix": the source slots carry the skipped prefix as -1
    validate: bool = False
    dst_fill: str = "sentinel"      # or "random": the destination's initial bytes
    max_ctas: int = 0
    pinned_slots: bool = False      # CUDA: slot tensors in pinned host memory
    family = "transfer"

    def group(self) -> str:
        return layout_group(self.case)

    def describe(self) -> str:
        extra = ["/".join(dict.fromkeys(self.slot_dtypes))]
        if self.placement != "device":
            extra.append(self.placement)
        if self.case.skip_prefix and self.skip_via != "argument":
            extra.append("skip via ops.skip_prefix")
        for flag, text in ((self.validate, "validate"), (self.dst_fill != "sentinel", f"{self.dst_fill} dst"),
                           (self.max_ctas, f"max_ctas={self.max_ctas}"), (self.pinned_slots, "pinned slots")):
            if flag:
                extra.append(text)
        return f"{self.case.describe()} ({', '.join(extra)})"

    def initial(self):
        """``(src, dst)`` numpy physical caches before the call."""
        c = self.case
        src_np, dst_np = c.caches()
        if self.dst_fill == "random":
            dst_np = S.random_cache(c.dst_layout, c.dst_geom, c.dtype, np.random.default_rng(c.seed + 1))
        return src_np, dst_np

    def run(self, device: str) -> None:
        c = self.case
        src_np, dst_np = self.initial()
        src = bind(c.src_layout, src_np, c.src_geom, device, pin=pin_if(device, self.placement == "pinned src"))
        dst = bind(c.dst_layout, dst_np, c.dst_geom, device, pin=pin_if(device, self.placement == "pinned dst"))
        ss, ds = c.slots()
        pin = pin_if(device, self.pinned_slots)
        src_t, dst_t = (slots(s, d, device, pin=pin) for s, d in zip((ss, ds), self.slot_dtypes))
        kw = op_kwargs(c)
        if c.skip_prefix and self.skip_via != "argument":
            src_t = ops.skip_prefix(src_t, kw.pop("skip_prefix"), num_tokens=kw.pop("num_tokens", c.T))
            src_t = slots(src_t.cpu().numpy(), self.slot_dtypes[0], device, pin=pin)
        ops.transfer(src, dst, src_t, dst_t, validate=self.validate or None, max_ctas=self.max_ctas, **kw)
        sync(device)
        assert_same(dst.tensors, flat(c.dst_layout, expected_transfer(c, src_np, dst_np)), "destination")
        assert_same(src.tensors, flat(c.src_layout, src_np), "source (must not change)")


@dataclasses.dataclass(frozen=True)
class FuzzIndexSample:
    """A transfer whose slots carry fuzzed values: huge negatives ("no token") and out-of-range ones.

    An out-of-range slot of a token that would be copied raises
    ``IndexError`` naming the slot tensor: on the CPU (and with ``validate``)
    before anything is written; on the CUDA default path (``path =
    "default"``) the kernel skips that token and ``ops.check_errors()``
    raises, once, with every other token copied.
    """

    case: S.TransferCase
    path: str = "default"
    slot_dtype: str = "int64"
    family = "fuzz_index"

    def bad_tokens(self) -> list[int]:
        s, d = self.case.slots()
        return [t for t in range(self.case.T)
                if (s is not None and s[t] >= self.case.src_geom.N) or (d is not None and d[t] >= self.case.dst_geom.N)]

    def group(self) -> str:
        return layout_group(self.case)

    def describe(self) -> str:
        return (f"{self.case.describe()} ({self.slot_dtype}, {self.path} path, "
                f"out of range at tokens {self.bad_tokens()})")

    def run(self, device: str) -> None:
        c = self.case
        bad = self.bad_tokens()
        src_np, dst_np = c.caches()
        src = bind(c.src_layout, src_np, c.src_geom, device)
        dst = bind(c.dst_layout, dst_np, c.dst_geom, device)
        ss, ds = c.slots()

        def call():
            ops.transfer(src, dst, slots(ss, self.slot_dtype, device), slots(ds, self.slot_dtype, device),
                         validate=True if self.path == "validate" else None, **op_kwargs(c))

        deferred = torch.device(device).type != "cpu" and self.path == "default"
        if not bad:
            call()
            sync(device)
            expected = expected_transfer(c, src_np, dst_np)
        elif deferred:   # skipped on the device, reported by check_errors, once
            call()
            expect_raises(lambda: ops.check_errors(device), IndexError, "src_slots|dst_slots")
            ops.check_errors(device)
            ss, ds = ss.copy(), ds.copy()
            ss[bad] = ds[bad] = -1
            expected = expected_transfer(c, src_np, dst_np, ss, ds)
        else:            # rejected before anything is written
            expect_raises(call, IndexError, "src_slots|dst_slots")
            sync(device)
            expected = dst_np
        assert_same(dst.tensors, flat(c.dst_layout, expected), "destination")


# ---------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------

def layout_pairs(group: str | None = None) -> list[tuple[str, str]]:
    """Every ordered pair of layouts that can exchange rows (the row buffer included), or those of one group."""
    pairs = S.layout_pairs(include_rows=True)
    if group is not None:
        a, b = group.split("->")
        pairs = [(x, y) for x, y in pairs if get(x).family == a and get(y).family == b]
    return pairs


def transfer_cases(pair, **kwargs):
    """Cases of one layout pair: small ones (up to 8 layers, 64 slots) and ones with real row sizes.

    ``kwargs``: more arguments of :func:`kvlayout.conformance.strategies.transfer_cases` (``dtype``,
    ``allow_positions``, ``allow_skip``).
    """
    src, dst = pair
    return st.one_of(S.transfer_cases(src, dst, max_layers=8, max_slots=64, budget=1 << 14, **kwargs),
                     S.transfer_cases(src, dst, max_layers=80, max_slots=256, budget=1 << 16,
                                      row_bytes=S.ROW_BYTES, **kwargs))


def transfer_samples(device: str, group: str | None = None, *, pairs=None, dtype: str | None = None):
    """Transfer samples on ``device``: every layout pair (or those of ``group``, or ``pairs``), every call
    option; ``dtype`` fixes the element type."""
    cuda = torch.device(device).type == "cuda"
    cases = st.sampled_from(pairs or layout_pairs(group)).flatmap(lambda pair: transfer_cases(pair, dtype=dtype))
    slot_dtype = st.sampled_from(SLOT_DTYPES)
    return st.builds(TransferSample, cases,
                     placement=st.sampled_from(PLACEMENTS if cuda else ("device",)),
                     slot_dtypes=st.tuples(slot_dtype, slot_dtype),
                     skip_via=st.sampled_from(("argument", "ops.skip_prefix")),
                     validate=st.booleans() if cuda else st.just(False),
                     dst_fill=st.sampled_from(("sentinel", "sentinel", "random")),
                     max_ctas=st.sampled_from(CTA_BUDGETS),
                     pinned_slots=st.booleans() if cuda else st.just(False))


@st.composite
def fuzz_index_samples(draw, device: str, group: str | None = None):
    """Transfers whose slots are fuzzed token by token: kept, huge negative, or out of range on either side."""
    pair = draw(st.sampled_from(layout_pairs(group)))
    case = draw(transfer_cases(pair, allow_positions=False, allow_skip=False))
    slot_dtype = draw(st.sampled_from(SLOT_DTYPES))
    wide = slot_dtype == "int64"
    s, d = list(case.src_slots), list(case.dst_slots)
    for t in range(len(s)):
        action = draw(st.sampled_from(("keep", "keep", "keep", "negative", "oob src", "oob dst")))
        if action == "negative":
            side = s if draw(st.booleans()) else d
            side[t] = draw(st.sampled_from((-1, -2, -(2**31)) + ((-(2**62),) if wide else ())))
        elif action.startswith("oob") and s[t] >= 0 and d[t] >= 0:
            side, g = (s, case.src_geom) if action == "oob src" else (d, case.dst_geom)
            side[t] = draw(st.sampled_from((g.N, g.N + 1, g.N + g.BS, 2 * g.N + 7, 2**31 - 1)
                                           + ((2**40, 2**62) if wide else ())))
    case = dataclasses.replace(case, src_slots=tuple(s), dst_slots=tuple(d))
    cuda = torch.device(device).type == "cuda"
    return FuzzIndexSample(case, draw(st.sampled_from(("default", "validate"))) if cuda else "default", slot_dtype)


TRANSFER = OpFamily("transfer", "ops.transfer between every pair of catalog layouts (and the row buffer)",
                    transfer_samples, "transfer")
FUZZ_INDEX = OpFamily("fuzz_index", "transfers with fuzzed slot values: huge negatives and out-of-range",
                      fuzz_index_samples, "transfer")
SAMPLES = (TransferSample, FuzzIndexSample)


# ---------------------------------------------------------------------------------------
# Error inputs: each invalid argument of ops.transfer, as data
# ---------------------------------------------------------------------------------------

def valid_token(case: S.TransferCase, token: int) -> int:
    """A token whose pair is copied (both slots >= 0, past the skipped prefix), near ``token``; -1 if none."""
    valid = [t for t in range(case.T) if case.src_slots[t] >= 0 and case.dst_slots[t] >= 0 and t >= case.skip_prefix]
    return valid[token % len(valid)] if valid else -1


def _slot_out_of_range(side: str):
    def build(b, device, validate):
        s = BadSetup.of(b.case, device, validate)
        t = valid_token(b.case, b.token)
        values = s.src_slots if side == "src_slots" else s.dst_slots
        values[t] = (b.case.src_geom.N if side == "src_slots" else b.case.dst_geom.N) + b.offset

        def call():
            ops.transfer(s.src, s.dst, *s.slot_tensors(), validate=validate, **s.layer_kwargs)

        def deferred():   # the kernel skipped token t: the reference with that pair dropped
            ss, ds = np.array(s.src_slots), np.array(s.dst_slots)
            ss[t] = ds[t] = -1
            return s.dst.tensors, flat(b.case.dst_layout, expected_transfer(b.case, s.src_np, s.dst_np, ss, ds))

        return Invalid(call, s.dst_unchanged(), deferred)
    return build


def _other_dtype(b, device, validate, same_size: bool):
    s = BadSetup.of(b.case, device, validate)
    c = b.case
    size = S.numpy_dtype(c.dtype).itemsize
    if not same_size:
        other = "float32" if size != 4 else "float16"
    else:   # a dtype of the same element size; float32 has none among the cache dtypes, so rebind the source
        other = {"bfloat16": "float16", "float16": "bfloat16", "float8_e4m3fn": "float8_e5m2",
                 "float8_e5m2": "float8_e4m3fn", "uint8": "bfloat16", "int8": "bfloat16"}.get(c.dtype, "float16")
        if S.numpy_dtype(other).itemsize != size:
            s.src_np = S.random_cache(c.src_layout, c.src_geom, "bfloat16", np.random.default_rng(0))
            s.src = bind(c.src_layout, s.src_np, c.src_geom, device)
            other = "float16"
    s.rebind_dst(S.sentinel_cache(c.dst_layout, c.dst_geom, other))
    return Invalid(lambda: ops.transfer(s.src, s.dst, *s.slot_tensors(), validate=validate, **s.layer_kwargs),
                   s.dst_unchanged())


def _row_widths_differ(b, device, validate):
    s = BadSetup.of(b.case, device, validate)
    g = b.case.dst_geom
    geom = dataclasses.replace(g, E=g.E + 1, columns=(g.columns[0] + 1, g.columns[1]) if g.columns else ())
    s.rebind_dst(S.sentinel_cache(b.case.dst_layout, geom, b.case.dtype), geom)
    return Invalid(lambda: ops.transfer(s.src, s.dst, *s.slot_tensors(), validate=validate, **s.layer_kwargs),
                   s.dst_unchanged())


def _spoiled(edit, **call_kwargs):
    """A kind that edits the slot lists (``edit(setup, sample)``) and passes ``call_kwargs`` (functions of both)."""
    def build(b, device, validate):
        s = BadSetup.of(b.case, device, validate)
        edit(s, b)
        kw = {**s.layer_kwargs, **{k: f(s, b) for k, f in call_kwargs.items()}}
        return Invalid(lambda: ops.transfer(s.src, s.dst, *s.slot_tensors(), validate=validate, **kw),
                       s.dst_unchanged())
    return build


def duplicate_dst_slots(s, b):
    """Two tokens that are both copied write one destination slot (a repeated source slot is fine)."""
    first = valid_token(b.case, b.token)
    second = (first + 1) % len(s.dst_slots)
    if s.src_slots[second] < 0:
        s.src_slots[second] = s.src_slots[first]
    s.dst_slots[first] = s.dst_slots[second] = b.offset % b.case.dst_geom.N


def _overlapping(b, device, validate):
    """The destination is the source's own memory."""
    s = BadSetup.of(b.case, device, validate)
    src_t = slots(s.src_slots, "int64", device)
    dst_t = slots(list(reversed(s.src_slots)), "int64", device)
    return Invalid(lambda: ops.transfer(s.src, s.src, src_t, dst_t, validate=validate),
                   [(s.src.tensors, flat(b.case.src_layout, s.src_np), "source (must not change)")])


def _unpinned_source(b, device, validate):
    s = BadSetup.of(b.case, device, validate, src_device="cpu")
    return Invalid(lambda: ops.transfer(s.src, s.dst, *s.slot_tensors(), **s.layer_kwargs), s.dst_unchanged())


def _float_slots(b, device, validate):
    s = BadSetup.of(b.case, device, validate)
    src_t = torch.tensor(s.src_slots, dtype=torch.float32, device=device)
    return Invalid(lambda: ops.transfer(s.src, s.dst, src_t, s.slot_tensors()[1], validate=validate,
                                          **s.layer_kwargs), s.dst_unchanged())


def _two_d_slots(b, device, validate):
    s = BadSetup.of(b.case, device, validate)
    src_t, dst_t = s.slot_tensors()
    return Invalid(lambda: ops.transfer(s.src, s.dst, src_t, dst_t.view(1, -1), validate=validate,
                                          **s.layer_kwargs), s.dst_unchanged())


def _layers_out_of_range(arg: str):
    other = "dst_layers" if arg == "src_layers" else "src_layers"

    def layers(s, b):
        return [(b.case.src_geom.L if arg == "src_layers" else b.case.dst_geom.L) + b.offset]

    return _spoiled(lambda s, b: None, **{arg: layers, other: lambda s, b: [0]})


TRANSFER_ERRORS = (
    ErrorKind("transfer: src_slots out of range", "slot_out_of_range",
              slot_out_of_range_message("src_slots"), _slot_out_of_range("src_slots"),
              deferrable=True),
    ErrorKind("transfer: dst_slots out of range", "slot_out_of_range",
              slot_out_of_range_message("dst_slots"), _slot_out_of_range("dst_slots"),
              deferrable=True),
    ErrorKind("transfer: element sizes differ", "element_type",
              DTYPES_DIFFER,
              lambda b, d, v: _other_dtype(b, d, v, same_size=False)),
    ErrorKind("transfer: dtypes differ, same size", "element_type",
              DTYPES_DIFFER,
              lambda b, d, v: _other_dtype(b, d, v, same_size=True)),
    ErrorKind("transfer: row widths differ", "row_width",
              ROW_WIDTHS_DIFFER, _row_widths_differ),
    ErrorKind("transfer: slot lengths differ", "index_shape",
              r"src_slots and dst_slots differ in length: \[\d+, \d+\]",
              _spoiled(lambda s, b: s.dst_slots.pop())),
    ErrorKind("transfer: duplicate dst_slots", "duplicate_destination_slot",
              REPEATED_DESTINATION,
              _spoiled(duplicate_dst_slots)),
    ErrorKind("transfer: overlapping buffers", "memory_overlap",
              r"src\[\d+\] and dst\[\d+\] overlap in memory", _overlapping),
    ErrorKind("transfer: unpinned host source", "devices",
              r"src\[\d+\] is an unpinned host tensor", _unpinned_source, devices=("cuda",)),
    ErrorKind("transfer: src_layers out of range", "layer_plane_out_of_range",
              index_out_of_range_message("src_layers"),
              _layers_out_of_range("src_layers")),
    ErrorKind("transfer: dst_layers out of range", "layer_plane_out_of_range",
              index_out_of_range_message("dst_layers"),
              _layers_out_of_range("dst_layers")),
    ErrorKind("transfer: src_planes out of range", "layer_plane_out_of_range",
              index_out_of_range_message("src_planes"),
              _spoiled(lambda s, b: None, src_planes=lambda s, b: [b.case.src_geom.P + b.offset],
                       dst_planes=lambda s, b: [0])),
    ErrorKind("transfer: layer lists differ in length", "layer_plane_pairing",
              r"src_layers has \d+ layers, dst_layers \d+",
              _spoiled(lambda s, b: None, src_layers=lambda s, b: [0, 0], dst_layers=lambda s, b: [0])),
    ErrorKind("transfer: slots not integers", "index_dtype",
              r"src_slots must be int32 or int64, got torch\.float32", _float_slots),
    ErrorKind("transfer: slots not 1-D", "index_shape",
              r"dst_slots must be 1-D, got shape \(1, \d+\)", _two_d_slots),
    ErrorKind("transfer: skip_prefix out of range", "skip_prefix",
              r"skip_prefix = \d+ must lie in \[0, \d+\]",
              _spoiled(lambda s, b: None, skip_prefix=lambda s, b: b.case.T + 1 + b.offset)),
)
TRANSFER = dataclasses.replace(TRANSFER, errors=TRANSFER_ERRORS)
