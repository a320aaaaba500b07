"""The ``hostile`` family: inputs a careless or hostile caller passes.

Where ``bad_input`` checks each documented invalid argument, this family
tries the inputs that break a library's safety promise rather than its
argument checks (:data:`HOSTILE_KINDS`):

* ``slots alias the destination`` - a slot tensor that is a view of the
  destination's own bytes (a copy would rewrite slots not yet used);
* ``slots rewritten during the call`` - a second thread rewrites one slot
  between a valid and an out-of-range value while transfers run (the value
  checked must be the value used);
* ``two storages over one buffer`` - source and destination are different
  tensors (different storages) over the same host memory;
* ``expanded destination`` - a destination whose rows alias each other
  (stride 0), which torch refuses for in-place writes;
* ``a destination layer twice`` - two source layers written into one;
* ``host allocator abuse`` - ``HostKVPool.free``/``alloc`` with negative,
  repeated, never allocated or out-of-range slots and negative sizes;
* ``adapter shape lies`` - SGLang adapter arguments (page size, head count)
  that contradict the host tensor's shape;
* ``positions alias the keys`` / ``expanded keys`` - RoPE positions stored in
  the keys' own buffer, and keys whose tokens alias one row;
* ``overlapping destination layers`` - per-layer destination views of one
  buffer, each some pages further than the one before (one address would be
  written by two (layer, slot) pairs);
* ``oversized rows`` - the raw row mover with a row longer than the device
  walk's 32-bit vector count (pieces stacked at one offset, so the tensors
  stay small);
* ``freed slot storage`` - a slot tensor whose storage was resized to 0 bytes
  after the transfer was prepared or before it was called;
* ``forged dist descriptors`` - ``kvlayout.dist`` handshake descriptors with a
  field out of its range (a role of 7 or -1, a TP rank past the TP size,
  negative or zero counts, an unknown element type): refused with a
  :class:`~kvlayout.dist.HandshakeError` text naming the field.

Each kind is a function of the sample (no generated source).  Every case
passes only when the call either raises a clear exception (naming
the argument) and leaves every tensor as it was, or - for the concurrent
rewrite, where which calls fail depends on timing - raises nothing but
``IndexError``; and in every case no byte outside the given tensors changed:
destinations are placed between guard regions of one buffer, which must keep
their guard byte.  A crash of the process is a failure (the runner reports
the case that was running).  On CUDA the kinds run under compute-sanitizer
with ``kvlayout conformance --sanitize``.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import torch
from hypothesis import strategies as st

from kvlayout import ops
from kvlayout.reference.layouts import Geometry, get

from .. import strategies as S
from .core import OpFamily, assert_unchanged, bind, expect_raises, slots, snapshot, to_torch

GUARD_BYTE = 0x5A
GUARD_BYTES = 4096
REJECTED = (ValueError, RuntimeError)
"""What a rejected hostile call may raise (with a message naming the argument)."""

HOSTILE_KINDS = ("slots alias the destination", "slots rewritten during the call", "two storages over one buffer",
                 "expanded destination", "a destination layer twice", "host allocator abuse",
                 "adapter shape lies", "positions alias the keys", "expanded keys",
                 "overlapping destination layers", "oversized rows", "freed slot storage", "forged dist descriptors")
CPU_ONLY_KINDS = ("two storages over one buffer", "host allocator abuse", "adapter shape lies",
                  "forged dist descriptors")


# ---------------------------------------------------------------------------------------
# Guarded memory, aliases, a racing writer
# ---------------------------------------------------------------------------------------

def guarded(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(copy, buffer)``: a contiguous copy of ``t`` placed between two guard regions of one buffer."""
    nbytes = t.numel() * t.element_size()
    buffer = torch.full((2 * GUARD_BYTES + nbytes,), GUARD_BYTE, dtype=torch.uint8, device=t.device)
    inner = buffer[GUARD_BYTES:GUARD_BYTES + nbytes].view(t.dtype).view(t.shape)
    inner.copy_(t)
    return inner, buffer


def guarded_cache(layout, physical, device: str) -> tuple[object, list[torch.Tensor]]:
    """A numpy physical cache as guarded torch tensors: ``(value to bind, guard buffers)``."""
    lay = get(layout)
    value = to_torch(layout, physical, device)
    parts = (value,) if lay.single_part else tuple(value)
    buffers, out = [], []
    for part, v in zip(lay.parts, parts):
        tensors = [guarded(t) for t in (v if part.per_layer else [v])]
        buffers += [b for _, b in tensors]
        out.append([t for t, _ in tensors] if part.per_layer else tensors[0][0])
    return (out[0] if lay.single_part else tuple(out)), buffers


def assert_guards(buffers: list[torch.Tensor]) -> None:
    """No byte before or after any guarded tensor changed."""
    for i, b in enumerate(buffers):
        for where, region in (("before", b[:GUARD_BYTES]), ("after", b[-GUARD_BYTES:])):
            changed = int((region != GUARD_BYTE).sum())
            assert changed == 0, f"{changed} bytes {where} guarded tensor {i} changed: a write outside the tensor"


def alias_slots(target: torch.Tensor, values) -> torch.Tensor:
    """An int64 tensor over the first bytes of ``target`` (contiguous) holding ``values``."""
    alias = target.reshape(-1).view(torch.uint8)[:8 * len(values)].view(torch.int64)
    alias.copy_(torch.tensor(list(values), dtype=torch.int64))
    return alias


def hammer(slot_tensor: torch.Tensor, index: int, values: tuple[int, int], call, calls: int) -> list[str]:
    """Run ``call`` ``calls`` times while another thread flips ``slot_tensor[index]`` between ``values``.

    Returns the errors the calls raised (each must be an ``IndexError``).
    """
    stop = threading.Event()

    def flip():
        k = 0
        while not stop.is_set():
            slot_tensor[index] = values[k & 1]
            k += 1
            time.sleep(0)

    thread = threading.Thread(target=flip, daemon=True)
    thread.start()
    errors = []
    try:
        for _ in range(calls):
            try:
                call()
            except IndexError as e:
                errors.append(str(e))
    finally:
        stop.set()
        thread.join()
    return errors


# ---------------------------------------------------------------------------------------
# The kinds
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HostileSample:
    """One hostile call: ``kind`` (see :data:`HOSTILE_KINDS`) on a valid transfer case.

    ``side``: which slot tensor is attacked (``src_slots`` or ``dst_slots``);
    ``engine``: the engine of the concurrent-rewrite kind on CUDA.
    """

    kind: str
    case: S.TransferCase
    side: str = "dst_slots"
    engine: str = "kernel"
    family = "hostile"

    def group(self) -> str:
        return self.kind

    def describe(self) -> str:
        extra = f" engine={self.engine}" if self.kind == "slots rewritten during the call" else ""
        return f"{self.kind}: {self.case.describe()} side={self.side}{extra}"

    def run(self, device: str) -> None:
        _KINDS[self.kind](self, device)


class _Guarded:
    """The case's source on ``device`` and its destination between guard regions."""

    def __init__(self, c: S.TransferCase, device: str):
        self.src_np, self.dst_np = c.caches()
        self.src = bind(c.src_layout, self.src_np, c.src_geom, device)
        value, self.guards = guarded_cache(c.dst_layout, self.dst_np, device)
        self.dst = ops.bind(c.dst_layout, value, page_size=None if get(c.dst_layout).paged else c.dst_geom.BS)
        self.layers = {} if c.src_layers is None else {"src_layers": list(c.src_layers),
                                                       "dst_layers": list(c.dst_layers)}


def _alias(h: HostileSample, device: str) -> None:
    g = _Guarded(h.case, device)
    values = {"src_slots": h.case.src_slots, "dst_slots": h.case.dst_slots}
    tensors = {name: slots(v, "int64", device) for name, v in values.items()}
    tensors[h.side] = alias_slots(g.dst.tensors[0], values[h.side])    # slots stored in the destination's bytes
    before = snapshot(g.dst.tensors)
    expect_raises(lambda: ops.transfer(g.src, g.dst, tensors["src_slots"], tensors["dst_slots"], **g.layers),
                  REJECTED, h.side)
    assert_unchanged(g.dst.tensors, before, "destination")
    assert_guards(g.guards)


def _rewritten(h: HostileSample, device: str) -> None:
    c = h.case
    g = _Guarded(c, device)
    bound = c.src_geom.N if h.side == "src_slots" else c.dst_geom.N
    slot_device = "cpu" if h.engine == "copy" else device
    index = len(c.src_slots) // 2
    valid = (c.src_slots if h.side == "src_slots" else c.dst_slots)[index]
    src_t, dst_t = slots(c.src_slots, "int64", slot_device), slots(c.dst_slots, "int64", slot_device)
    hammer(src_t if h.side == "src_slots" else dst_t, index, (valid, bound + 7),
           lambda: ops.transfer(g.src, g.dst, src_t, dst_t, engine=h.engine), 40)
    if torch.device(device).type != "cpu" and h.engine == "kernel":
        try:
            ops.check_errors(device)     # the out-of-range value, when a kernel saw it
        except IndexError:
            pass
    assert_guards(g.guards)


def _two_storages(h: HostileSample, device: str) -> None:
    c = h.case
    buffer = np.ascontiguousarray(c.caches()[0])                        # one host buffer ...
    src = ops.bind(c.src_layout, torch.from_numpy(buffer), page_size=c.src_geom.BS)
    dst = ops.bind(c.src_layout, torch.from_numpy(buffer), page_size=c.src_geom.BS)   # ... two storages
    before = snapshot(dst.tensors)
    expect_raises(lambda: ops.transfer(src, dst, slots(c.src_slots), slots(list(reversed(c.src_slots)))),
                  REJECTED, "overlap")
    assert_unchanged(dst.tensors, before, "buffer")


def _expanded(h: HostileSample, device: str) -> None:
    c = h.case
    g = c.src_geom
    src = bind(c.src_layout, c.caches()[0], g, device)
    base = torch.zeros(g.P, g.L, 1, g.H * g.E, dtype=getattr(torch, c.dtype), device=device)
    chunk = ops.bind("lmcache_kv_2ltd", base.expand(-1, -1, c.T, -1))    # every token row is one memory row
    expect_raises(lambda: ops.transfer(src, chunk, slots(c.src_slots, "int64", device), None), REJECTED,
                  "dst|expanded|overlap")
    assert int(base.view(torch.uint8).count_nonzero()) == 0, "the expanded destination was written"


def _layer_twice(h: HostileSample, device: str) -> None:
    c = h.case
    g = _Guarded(c, device)
    before = snapshot(g.dst.tensors)
    expect_raises(lambda: ops.transfer(g.src, g.dst, slots(c.src_slots, "int64", device),
                                       slots(c.dst_slots, "int64", device), src_layers=[0, 1], dst_layers=[0, 0]),
                  REJECTED, "dst_layers")
    assert_unchanged(g.dst.tensors, before, "destination")
    assert_guards(g.guards)


def _allocator(h: HostileSample, device: str) -> None:
    from kvlayout.compat import sglang as sg

    n = 1 + len(h.case.src_slots) % 3
    pool = sg.MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu")
    host = sg.HostKVPool(pool, 2.0, layout="page_first")
    taken = host.alloc(host.size)
    host.free(taken[:4 * n])                                           # some whole pages back
    available, used = host.available_size(), int(taken[-1])
    for bad in ([-1], [host.size], [1 << 40], [used, used], [int(taken[0])]):   # negative, beyond, repeated, free
        expect_raises(lambda: host.free(bad), REJECTED, "indices")
        assert host.available_size() == available, f"a rejected free({bad}) changed the allocator"
    expect_raises(lambda: host.alloc(-4), REJECTED, "need_size")
    assert host.available_size() == available
    got = host.alloc(available)
    assert got is not None and len(set(got.tolist())) == available, "a slot handed out twice"
    assert all(int(p) % host.page_size == 0 for p in got[::host.page_size]), "an unaligned page"


def _adapter(h: HostileSample, device: str) -> None:
    from kvlayout.compat import sglang as sg

    L, H, P, D = 2, 2, 4, 8
    dev_k = [torch.randn(64, H, D).to(torch.bfloat16) for _ in range(L)]
    dev_v = [torch.randn(64, H, D).to(torch.bfloat16) for _ in range(L)]
    host = torch.zeros(2, 4, H, P, L, D, dtype=torch.bfloat16)        # page_head [2, NP, H, P, L, D]
    idx = torch.arange(P, 2 * P)
    item = H * D * 2
    expect_raises(lambda: sg.transfer_kv_all_layer_lf_ph(dev_k, host[0], dev_v, host[1], idx, idx, item,
                                                         item * L, L, P, 2 * H), REJECTED, "head_num")
    expect_raises(lambda: sg.transfer_kv_all_layer_lf_ph(dev_k, host[0], dev_v, host[1], idx, idx, item,
                                                         item * L, L, 2 * P, H), REJECTED, "page_size")
    assert int(host.view(torch.int16).count_nonzero()) == 0, "a rejected call wrote the host pool"


def _rope_inputs(h: HostileSample, device: str):
    """Keys ``[T, 2, 8]`` (fp32, T from the case), positions ``0..T-1`` and a cos/sin cache of 16 positions."""
    from .rope import cos_sin_table

    T = max(2, min(h.case.T, 8))
    return T, slots(range(T), "int64", device), torch.from_numpy(cos_sin_table(16, 8)).to(device)


def _positions_alias_keys(h: HostileSample, device: str) -> None:
    """Positions stored inside the keys' own buffer: rotating the keys would rewrite them mid-call."""
    T, pos, cos_sin = _rope_inputs(h, device)
    buf = torch.zeros(T * 2 * 8, dtype=torch.float32, device=device)
    keys = buf.view(T, 2, 8)
    alias = buf.view(torch.int64)[:T]
    alias.copy_(pos)
    before = snapshot([buf])
    side = "old_positions" if h.side == "src_slots" else "new_positions"
    args = (alias, pos) if side == "old_positions" else (pos, alias)
    expect_raises(lambda: ops.rope_reposition(keys, *args, cos_sin, is_neox=True), REJECTED,
                  side + " overlaps key in memory")
    assert_unchanged([buf], before, "keys and positions")


def _expanded_keys(h: HostileSample, device: str) -> None:
    """Keys whose tokens alias one row (stride 0): an in-place rotation would write that row T times."""
    T, pos, cos_sin = _rope_inputs(h, device)
    base = torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(h.case.seed % (1 << 31))).to(device)
    before = snapshot([base])
    expect_raises(lambda: ops.rope_reposition(base.expand(T, 2, 8), pos, pos.flip(0), cos_sin, is_neox=True),
                  REJECTED, "key has internal overlap")
    assert_unchanged([base], before, "keys")


def _overlapping_layers(h: HostileSample, device: str) -> None:
    """The case's source into per-layer views of one guarded buffer, layer l starting ``shift * l`` pages in."""
    c = h.case
    g = c.src_geom
    src = bind(c.src_layout, c.caches()[0], g, device)
    pages = max(2, g.NB)                                  # a layer of at least 2 pages: a shift of 1 overlaps
    shift = 1 + c.seed % (pages - 1)
    plain = torch.zeros(2, pages + shift * (g.L - 1), g.BS, g.H, g.E, dtype=getattr(torch, c.dtype), device=device)
    buf, guard = guarded(plain)
    layers = [buf[:, shift * i:shift * i + pages] for i in range(g.L)]
    dst = ops.bind("vllm_flash_attn_nhd", layers)
    n = min(c.T, g.N)
    ids = slots(range(n), "int64", device)
    before = snapshot([buf])
    expect_raises(lambda: ops.transfer(src, dst, ids, ids.flip(0)), REJECTED, r"dst\[\d+\] and dst\[\d+\] overlap")
    expect_raises(lambda: ops.prepare(src, dst, ids, ids.flip(0)), REJECTED, r"dst\[\d+\] and dst\[\d+\] overlap")
    assert_unchanged([buf], before, "destination buffer")
    assert_guards([guard])


def _oversized_rows(h: HostileSample, device: str) -> None:
    """``kvlayout::copy_rows`` with ``num_pieces * piece_bytes`` past the walk's limit, every piece at one offset
    (stride_piece 0) so that 64 KiB tensors carry a row of 2 GiB or more."""
    from kvlayout.ops import _native

    c = h.case
    piece_bytes = 1 << (10 + c.seed % 7)                  # 1 KiB .. 64 KiB
    num_pieces = (1 << 31) // piece_bytes + c.seed % 5    # at or past 2^31 bytes
    src = torch.full((piece_bytes,), 3, dtype=torch.uint8, device=device)
    dst, guard = guarded(torch.zeros(piece_bytes, dtype=torch.uint8, device=device))
    geom = [1 + c.seed % 2, 1, 0, 0, 0]
    ids = slots([0], "int64", device)
    expect_raises(lambda: _native.copy_rows([src], [dst], ids, ids, 1, 0, [0, 0], [0, 0], geom, list(geom),
                                            num_pieces, piece_bytes), REJECTED, "num_pieces \\* piece_bytes")
    assert int(dst.count_nonzero()) == 0, "a refused row was written"
    assert_guards([guard])


def _freed_slots(h: HostileSample, device: str) -> None:
    """A slot tensor whose storage is resized to 0 bytes: before a transfer, and after a prepare."""
    c = h.case
    g = _Guarded(c, device)
    before = snapshot(g.dst.tensors)

    def pair():   # (storages of their own, which can be resized)
        return slots(c.src_slots, "int64", device).clone(), slots(c.dst_slots, "int64", device).clone()

    s, d = pair()
    (s if h.side == "src_slots" else d).untyped_storage().resize_(0)
    expect_raises(lambda: ops.transfer(g.src, g.dst, s, d, **g.layers), REJECTED, h.side)
    s, d = pair()
    t = ops.prepare(g.src, g.dst, s, d, **g.layers)
    (s if h.side == "src_slots" else d).untyped_storage().resize_(0)
    expect_raises(t, REJECTED, h.side)
    expect_raises(lambda: t.layer(0), REJECTED, h.side)
    assert_unchanged(g.dst.tensors, before, "destination")
    assert_guards(g.guards)


_DESCRIPTOR_FIELDS = ("role", "tp_rank", "tp_size", "peer_tp_size", "num_kv_heads", "head_size", "num_layers",
                      "planes", "dtype", "itemsize")


def _forged_descriptor(h: HostileSample, device: str) -> None:
    """A peer's handshake descriptor with one field forged: the receiving side names the field in its
    refusal (a HandshakeError text) and reads nothing else from it."""
    from kvlayout.dist.handshake import Descriptor, HandshakeError, dtype_code, mismatches

    c = h.case
    rng = np.random.default_rng(c.seed)
    mine = Descriptor(1, 0, 1, 1, 4, 8, 2, 2, dtype_code(torch.bfloat16), 2)
    field = _DESCRIPTOR_FIELDS[int(rng.integers(len(_DESCRIPTOR_FIELDS)))]
    forged = {"role": [7, -1, 2, -(1 << 62)], "tp_rank": [1, 5, -1], "tp_size": [0, -3],
              "peer_tp_size": [0, -1], "num_kv_heads": [0, -8], "head_size": [0, -1], "num_layers": [0, -2],
              "planes": [0, 3, -1], "dtype": [12345, -1], "itemsize": [0, 3, 16, -2]}[field]
    value = forged[int(rng.integers(len(forged)))]
    theirs = dataclasses.replace(Descriptor(0, 0, 1, 1, 4, 8, 2, 2, dtype_code(torch.bfloat16), 2),
                                 **{field: value})
    parsed = Descriptor.from_tensor(theirs.tensor("cpu"))
    assert isinstance(parsed, str), f"a descriptor with {field} = {value} was accepted"
    texts = mismatches(mine, parsed, 0)
    assert texts and f"{field} = {value}" in texts[0], f"the refusal does not name {field}: {texts}"
    expect_raises(lambda: _refuse(texts), HandshakeError, field)


def _refuse(texts: list[str]) -> None:
    from kvlayout.dist.handshake import HandshakeError

    raise HandshakeError("kvlayout.dist handshake failed; nothing was moved:\n  " + "\n  ".join(texts))


_KINDS = {"slots alias the destination": _alias, "slots rewritten during the call": _rewritten,
          "two storages over one buffer": _two_storages, "expanded destination": _expanded,
          "a destination layer twice": _layer_twice, "host allocator abuse": _allocator,
          "adapter shape lies": _adapter, "positions alias the keys": _positions_alias_keys,
          "expanded keys": _expanded_keys, "overlapping destination layers": _overlapping_layers,
          "oversized rows": _oversized_rows, "freed slot storage": _freed_slots,
          "forged dist descriptors": _forged_descriptor}


def hostile_kinds(device: str) -> tuple[str, ...]:
    return tuple(k for k in HOSTILE_KINDS if torch.device(device).type == "cpu" or k not in CPU_ONLY_KINDS)


def _rewrite_case(draw) -> S.TransferCase:
    """A transfer long enough for another thread to act while it runs: T tokens of 128-byte rows, 2 layers."""
    pages = draw(st.sampled_from((64, 128, 256)))
    g = Geometry(P=2, L=2, NB=pages, BS=16, H=1, E=64)
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31)))
    T = g.N // 2
    return S.TransferCase("vllm_flash_attn_nhd", g, "hicache_page_first", g, "bfloat16",
                          tuple(int(x) for x in rng.permutation(g.N)[:T]),
                          tuple(int(x) for x in rng.permutation(g.N)[:T]), seed=int(rng.integers(1 << 30)))


def _case_for(kind: str, draw) -> S.TransferCase:
    if kind == "slots rewritten during the call":
        return _rewrite_case(draw)
    small = dict(max_layers=3, max_slots=16, budget=1 << 11, allow_positions=False, allow_skip=False)
    if kind == "two storages over one buffer":     # float16: torch.from_numpy takes no ml_dtypes
        return draw(S.transfer_cases("hicache_layer_first", "hicache_layer_first", dtype="float16", **small)
                    .filter(lambda c: c.T >= 2))
    if kind == "expanded destination":
        return draw(S.transfer_cases("vllm_flash_attn_nhd", "lmcache_kv_2ltd", **small)
                    .filter(lambda c: c.T >= 2 and c.src_layers is None))
    return draw(S.transfer_cases("vllm_flash_attn_nhd", "hicache_layer_first", **small)
                .filter(lambda c: c.T >= 2 and c.src_geom.L >= 2 and c.dst_geom.N * c.dst_geom.H * c.dst_geom.E
                        * S.numpy_dtype(c.dtype).itemsize >= 8 * c.T))


@st.composite
def hostile_samples(draw, device: str, group: str | None = None):
    kind = group or draw(st.sampled_from(hostile_kinds(device)))
    case = _case_for(kind, draw)
    side = draw(st.sampled_from(("src_slots", "dst_slots")))
    engine = draw(st.sampled_from(("kernel", "copy"))) if device != "cpu" else "kernel"
    return HostileSample(kind, case, side, engine)


HOSTILE = OpFamily("hostile", "hostile inputs: slot tensors aliasing destinations, slots rewritten by another "
                   "thread, two storages over one buffer, expanded destinations, repeated destination layers, host "
                   "allocator abuse, adapter shape lies, overlapping destination layers, oversized rows, freed slot "
                   "storage, forged dist descriptors; nothing outside the tensors may change", hostile_samples,
                   "transfer", groups_of=hostile_kinds)
SAMPLES = (HostileSample,)
