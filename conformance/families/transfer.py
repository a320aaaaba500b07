"""The ``transfer`` and ``fuzz_index`` families: ``ops.transfer`` between every pair of layouts.

A :class:`TransferSample` wraps a :class:`~kvlayout.conformance.strategies.TransferCase`
(layouts, geometries, dtype, slots, layers, ``skip_prefix``) with how the op
is called: where each side lives (CUDA: the device, or pinned host memory),
the slot dtypes and where the slots live, whether ``skip_prefix`` is the
argument or folded into the slots by ``ops.skip_prefix``, ``validate``, the
CTA budget, the engine (the copy kernel, or ``engine="copy"``: the copy
engine, which reads the slots on the host), what the destination holds
before the call (sentinel or random bytes) and what the source holds (random
bytes, or every NaN bit pattern of an fp8/16-bit type: payloads must
survive).  A :class:`FuzzIndexSample` is a transfer whose slots carry huge
negative ("no token") and out-of-range values.

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
ENGINES = ("kernel", "kernel", "copy")
"""Engines drawn for a transfer: mostly the copy kernel, a third the copy engine."""
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


class OnTransferCase:
    """Base of the samples of one transfer case (a ``case`` field): the report row is its layout pair's."""

    def group(self) -> str:
        return layout_group(self.case)

    def bound(self, device: str, src_np, dst_np, pinned: str | None = None):
        """``(src, dst)``: the case's two sides on ``device`` from these contents; ``pinned`` (``"src"`` or
        ``"dst"``): that side in pinned host memory instead, on CUDA."""
        c = self.case
        return (bind(c.src_layout, src_np, c.src_geom, device, pin=pin_if(device, pinned == "src")),
                bind(c.dst_layout, dst_np, c.dst_geom, device, pin=pin_if(device, pinned == "dst")))


@dataclasses.dataclass(frozen=True)
class TransferSample(OnTransferCase):
    """``ops.transfer`` on one case; compares the whole destination and the (unchanged) source."""

    case: S.TransferCase
    placement: str = "device"
    slot_dtypes: tuple[str, str] = ("int64", "int64")
    skip_via: str = "argument"      # or "ops.skip_prefix": the source slots carry the skipped prefix as -1
    validate: bool = False
    dst_fill: str = "sentinel"      # or "random": the destination's initial bytes
    max_ctas: int = 0
    pinned_slots: bool = False      # CUDA: slot tensors in pinned host memory
    engine: str = "kernel"          # or "copy": the copy engine (slots on the host)
    src_fill: str = "random"        # or "nan": every source element a NaN pattern (S.NAN_DTYPES only)
    strided_slots: bool = False     # slot tensors as views with stride 2 (core.STRIDE_FILLER between)
    family = "transfer"

    def describe(self) -> str:
        extra = ["/".join(dict.fromkeys(self.slot_dtypes))]
        if self.placement != "device":
            extra.append(self.placement)
        if self.case.skip_prefix and self.skip_via != "argument":
            extra.append("skip via ops.skip_prefix")
        for flag, text in ((self.validate, "validate"), (self.dst_fill != "sentinel", f"{self.dst_fill} dst"),
                           (self.max_ctas, f"max_ctas={self.max_ctas}"), (self.pinned_slots, "pinned slots"),
                           (self.engine != "kernel", f"{self.engine} engine"),
                           (self.src_fill != "random", f"{self.src_fill} source"),
                           (self.strided_slots, "strided slots")):
            if flag:
                extra.append(text)
        return f"{self.case.describe()} ({', '.join(extra)})"

    def initial(self):
        """``(src, dst)`` numpy physical caches before the call."""
        c = self.case
        src_np, dst_np = c.caches()
        if self.src_fill == "nan":
            src_np = S.nan_cache(c.src_layout, c.src_geom, c.dtype)
        if self.dst_fill == "random":
            dst_np = S.random_cache(c.dst_layout, c.dst_geom, c.dtype, np.random.default_rng(c.seed + 1))
        return src_np, dst_np

    def run(self, device: str) -> None:
        c = self.case
        src_np, dst_np = self.initial()
        src, dst = self.bound(device, src_np, dst_np, self.placement.removeprefix("pinned "))
        ss, ds = c.slots()
        pin = pin_if(device, self.pinned_slots)
        slot_device = device if self.engine == "kernel" else "cpu"
        src_t, dst_t = (slots(s, d, slot_device, pin=pin, strided=self.strided_slots)
                        for s, d in zip((ss, ds), self.slot_dtypes))
        kw = op_kwargs(c)
        if c.skip_prefix and self.skip_via != "argument":
            src_t = ops.skip_prefix(src_t, kw.pop("skip_prefix"), num_tokens=kw.pop("num_tokens", c.T))
            src_t = slots(src_t.cpu().numpy(), self.slot_dtypes[0], slot_device, pin=pin, strided=self.strided_slots)
        ops.transfer(src, dst, src_t, dst_t, validate=self.validate or None, max_ctas=self.max_ctas,
                     engine=self.engine, **kw)
        sync(device)
        assert_same(dst.tensors, flat(c.dst_layout, expected_transfer(c, src_np, dst_np)), "destination")
        assert_same(src.tensors, flat(c.src_layout, src_np), "source (must not change)")


@dataclasses.dataclass(frozen=True)
class FuzzIndexSample(OnTransferCase):
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
    engine: str = "kernel"      # "copy": the copy engine checks the slots on the host, before copying
    family = "fuzz_index"

    def bad_tokens(self) -> list[int]:
        s, d = self.case.slots()
        return [t for t in range(self.case.T)
                if (s is not None and s[t] >= self.case.src_geom.N) or (d is not None and d[t] >= self.case.dst_geom.N)]

    def describe(self) -> str:
        return (f"{self.case.describe()} ({self.slot_dtype}, {self.path} path, {self.engine} engine, "
                f"out of range at tokens {self.bad_tokens()})")

    def run(self, device: str) -> None:
        c = self.case
        bad = self.bad_tokens()
        src_np, dst_np = c.caches()
        src, dst = self.bound(device, src_np, dst_np)
        ss, ds = c.slots()
        slot_device = device if self.engine == "kernel" else "cpu"

        def call():
            ops.transfer(src, dst, slots(ss, self.slot_dtype, slot_device), slots(ds, self.slot_dtype, slot_device),
                         validate=True if self.path == "validate" else None, engine=self.engine, **op_kwargs(c))

        deferred = torch.device(device).type != "cpu" and self.path == "default" and self.engine == "kernel"
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

    def options(case):
        nan = ("random", "random", "nan") if case.dtype in S.NAN_DTYPES else ("random",)
        return st.builds(TransferSample, st.just(case),
                         placement=st.sampled_from(PLACEMENTS if cuda else ("device",)),
                         slot_dtypes=st.tuples(slot_dtype, slot_dtype),
                         skip_via=st.sampled_from(("argument", "ops.skip_prefix")),
                         validate=st.booleans() if cuda else st.just(False),
                         dst_fill=st.sampled_from(("sentinel", "sentinel", "random")),
                         max_ctas=st.sampled_from(CTA_BUDGETS),
                         pinned_slots=st.booleans() if cuda else st.just(False),
                         engine=st.sampled_from(ENGINES),
                         src_fill=st.sampled_from(nan),
                         strided_slots=st.booleans())

    return cases.flatmap(options)


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
    return FuzzIndexSample(case, draw(st.sampled_from(("default", "validate"))) if cuda else "default", slot_dtype,
                           draw(st.sampled_from(ENGINES)))


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


def _transfer_call(s: BadSetup, **kwargs):
    """The invalid ``ops.transfer`` of a setup: its slots (as tensors) and layers, ``kwargs`` on top."""
    src_t, dst_t = s.slot_tensors()
    src_t, dst_t = kwargs.pop("src_slots", src_t), kwargs.pop("dst_slots", dst_t)
    kw = {**s.layer_kwargs, **kwargs}
    return lambda: ops.transfer(s.src, s.dst, src_t, dst_t, validate=s.validate, **kw)


def _slot_out_of_range(side: str):
    def build(b, device, validate):
        s = BadSetup.of(b.case, device, validate)
        t = valid_token(b.case, b.token)
        bound = b.case.src_geom.N if side == "src_slots" else b.case.dst_geom.N
        (s.src_slots if side == "src_slots" else s.dst_slots)[t] = bound + b.offset

        def deferred():   # the kernel skipped token t: the reference with that pair dropped
            ss, ds = np.array(s.src_slots), np.array(s.dst_slots)
            ss[t] = ds[t] = -1
            return s.dst.tensors, flat(b.case.dst_layout, expected_transfer(b.case, s.src_np, s.dst_np, ss, ds))

        return Invalid(_transfer_call(s), s.dst_unchanged(), deferred,
                       values={"token": t, "value": bound + b.offset, "bound": bound})
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
    return Invalid(_transfer_call(s), s.dst_unchanged(),
                   values={"src": s.src.dtype, "dst": s.dst.dtype})


def _row_widths_differ(b, device, validate):
    s = BadSetup.of(b.case, device, validate)
    sg, g = b.case.src_geom, b.case.dst_geom
    geom = dataclasses.replace(g, E=g.E + 1, columns=(g.columns[0] + 1, g.columns[1]) if g.columns else ())
    s.rebind_dst(S.sentinel_cache(b.case.dst_layout, geom, b.case.dtype), geom)
    return Invalid(_transfer_call(s), s.dst_unchanged(),
                   values={"src": f"{sg.H}*{sg.E}", "dst": f"{geom.H}*{geom.E}"})


def _spoiled(edit, values=None, **call_kwargs):
    """A kind that edits the slot lists (``edit(setup, sample)``) and passes ``call_kwargs`` (functions of both);
    ``values(setup, sample)``: what the message must say."""
    def build(b, device, validate):
        s = BadSetup.of(b.case, device, validate)
        edit(s, b)
        return Invalid(_transfer_call(s, **{k: f(s, b) for k, f in call_kwargs.items()}), s.dst_unchanged(),
                       values=values(s, b) if values else {})
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


def _slot_tensor_as(side: str, dtype: str, shape=None):
    """A kind whose ``side`` slot tensor has element type ``dtype`` (and, with ``shape``, that shape)."""
    def build(b, device, validate):
        s = BadSetup.of(b.case, device, validate)
        bad = torch.tensor(s.src_slots if side == "src_slots" else s.dst_slots, device=device)
        bad = bad.to(getattr(torch, dtype))
        if shape is not None:
            bad = bad.view(*shape, -1)
        return Invalid(_transfer_call(s, **{side: bad}), s.dst_unchanged(),
                       values={"dtype": f"torch.{dtype}", "shape": tuple(bad.shape)})
    return build


def _index_out_of_range(arg: str, value):
    """A kind choosing layer or plane ``value(geometry count)`` for ``arg``, and index 0 on the other side."""
    side, what = arg.split("_")
    other = ("dst_" if side == "src" else "src_") + what

    def count(b):
        g = b.case.src_geom if side == "src" else b.case.dst_geom
        return g.L if what == "layers" else g.P

    return _spoiled(lambda s, b: None, values=lambda s, b: {"value": value(count(b), b), "count": count(b)},
                    **{arg: lambda s, b: [value(count(b), b)], other: lambda s, b: [0]})


def past_the_end(count: int, b) -> int:
    """An index ``b.offset`` past the last of ``count``."""
    return count + b.offset


def negative_index(count: int, b) -> int:
    """A negative index (-1 - ``b.offset``): never "from the end"."""
    return -1 - b.offset


INDEX_CHOICES = (("out of range", past_the_end), ("negative", negative_index))
"""Bad layer or plane indices: past the end, and negative."""

SLOT_DTYPE_MESSAGE = r"{side} must be int32 or int64, got {dtype}"

TRANSFER_ERRORS = (
    ErrorKind("transfer: src_slots out of range", "slot_out_of_range",
              slot_out_of_range_message("src_slots"), _slot_out_of_range("src_slots"), deferrable=True),
    ErrorKind("transfer: dst_slots out of range", "slot_out_of_range",
              slot_out_of_range_message("dst_slots"), _slot_out_of_range("dst_slots"), deferrable=True),
    ErrorKind("transfer: element sizes differ", "element_type", DTYPES_DIFFER,
              lambda b, d, v: _other_dtype(b, d, v, same_size=False)),
    ErrorKind("transfer: dtypes differ, same size", "element_type", DTYPES_DIFFER,
              lambda b, d, v: _other_dtype(b, d, v, same_size=True)),
    ErrorKind("transfer: row widths differ", "row_width", ROW_WIDTHS_DIFFER, _row_widths_differ),
    ErrorKind("transfer: slot lengths differ", "index_shape",
              r"src_slots and dst_slots differ in length: \[{shorter}, {longer}\]",
              _spoiled(lambda s, b: s.dst_slots.pop(),
                       values=lambda s, b: {"shorter": len(s.dst_slots), "longer": len(s.src_slots)})),
    ErrorKind("transfer: duplicate dst_slots", "duplicate_destination_slot", REPEATED_DESTINATION,
              _spoiled(duplicate_dst_slots)),
    ErrorKind("transfer: overlapping buffers", "memory_overlap", r"src\[\d+\] and dst\[\d+\] overlap in memory",
              _overlapping),
    ErrorKind("transfer: unpinned host source", "devices", r"src\[\d+\] is an unpinned host tensor",
              _unpinned_source, devices=("cuda",)),
    *(ErrorKind(f"transfer: {arg} {where}", "layer_plane_out_of_range", index_out_of_range_message(arg),
                _index_out_of_range(arg, value))
      for arg in ("src_layers", "dst_layers", "src_planes", "dst_planes")
      for where, value in INDEX_CHOICES),
    ErrorKind("transfer: layer lists differ in length", "layer_plane_pairing",
              r"the source gives 2 layers \(src_layers\) but the destination takes 1 layer \(dst_layers\)",
              _spoiled(lambda s, b: None, src_layers=lambda s, b: [0, 0], dst_layers=lambda s, b: [0])),
    *(ErrorKind(f"transfer: {side} of {dtype}", "index_dtype", SLOT_DTYPE_MESSAGE.replace("{side}", side),
                _slot_tensor_as(side, dtype))
      for side in ("src_slots", "dst_slots") for dtype in ("float32", "int16", "uint8", "bool")),
    *(ErrorKind(f"transfer: {side} not 1-D", "index_shape", side + r" must be 1-D, got shape {shape}",
                _slot_tensor_as(side, "int64", shape=(1,)))
      for side in ("src_slots", "dst_slots")),
    ErrorKind("transfer: skip_prefix out of range", "skip_prefix", r"skip_prefix = {value} must lie in \[0, {T}\]",
              _spoiled(lambda s, b: None, skip_prefix=lambda s, b: b.case.T + 1 + b.offset,
                       values=lambda s, b: {"value": b.case.T + 1 + b.offset, "T": b.case.T})),
)
TRANSFER = dataclasses.replace(TRANSFER, errors=TRANSFER_ERRORS)
