"""The ``hostile`` conformance family: inputs a careless or hostile caller passes.

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
  that contradict the host tensor's shape.

Every case passes only when the call either raises a clear exception (naming
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

from . import strategies as S
from .checks import HEADER

GUARD_BYTE = 0x5A
GUARD_BYTES = 4096

HOSTILE_KINDS = ("slots alias the destination", "slots rewritten during the call", "two storages over one buffer",
                 "expanded destination", "a destination layer twice", "host allocator abuse",
                 "adapter shape lies")
CPU_ONLY_KINDS = ("two storages over one buffer", "host allocator abuse", "adapter shape lies")


# ---------------------------------------------------------------------------------------
# Helpers used by the generated scripts
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
    from kvlayout.reference.layouts import get
    from .checks import to_torch

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


def snapshot(tensors) -> list[np.ndarray]:
    from .checks import bits

    return [bits(t).copy() for t in tensors]


def assert_unchanged(tensors, before: list[np.ndarray], what: str) -> None:
    from .checks import bits

    for i, (t, b) in enumerate(zip(tensors, before)):
        changed = int((bits(t) != b).sum())
        assert changed == 0, f"{what} {i}: {changed} elements changed although the call was rejected"


def expect_rejected(fn, names) -> BaseException:
    """``fn`` must raise ValueError or RuntimeError naming one of ``names``."""
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        assert any(n in str(e) for n in names), f"{type(e).__name__} does not name {' or '.join(names)}: {e}"
        return e
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"expected a rejection (ValueError/RuntimeError), got {type(e).__name__}: {e}") from None
    raise AssertionError(f"expected a rejection naming {' or '.join(names)}; the call was accepted")


def alias_slots(target: torch.Tensor, values) -> torch.Tensor:
    """An int64 tensor over the first bytes of ``target`` (contiguous) holding ``values``."""
    alias = target.reshape(-1).view(torch.uint8)[:8 * len(values)].view(torch.int64)
    alias.copy_(torch.tensor(list(values), dtype=torch.int64))
    return alias


def hammer(slots: torch.Tensor, index: int, values: tuple[int, int], call, calls: int) -> list[str]:
    """Run ``call`` ``calls`` times while another thread flips ``slots[index]`` between ``values``.

    Returns the errors the calls raised (each must be an ``IndexError``).
    """
    stop = threading.Event()

    def flip():
        k = 0
        while not stop.is_set():
            slots[index] = values[k & 1]
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
# Cases
# ---------------------------------------------------------------------------------------

HOSTILE_HEADER = HEADER + [
    "from kvlayout.conformance.hostile import (alias_slots, assert_guards, assert_unchanged, expect_rejected,",
    "                                          guarded_cache, hammer, snapshot)",
]


@dataclasses.dataclass(frozen=True)
class HostileOp:
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

    def to_python(self, device: str) -> str:
        return "\n".join(HOSTILE_HEADER + _LINES[self.kind](self, device)) + "\n"


def _setup(c: S.TransferCase, device: str) -> list[str]:
    return [
        f"case = {c!r}",
        "src_np, dst_np = case.caches()",
        f"src = ops.bind(case.src_layout, to_torch(case.src_layout, src_np, {device!r}), page_size={c.src_geom.BS})",
        f"value, guards = guarded_cache(case.dst_layout, dst_np, {device!r})",
        f"dst = ops.bind(case.dst_layout, value, page_size={c.dst_geom.BS})",
        f"src_slots, dst_slots = {list(c.src_slots)}, {list(c.dst_slots)}",
        f"layers = {_layers(c)}",
    ]


def _layers(c: S.TransferCase) -> dict:
    return {} if c.src_layers is None else {"src_layers": list(c.src_layers), "dst_layers": list(c.dst_layers)}


def _alias(h: HostileOp, device: str) -> list[str]:
    other = "src_slots" if h.side == "dst_slots" else "dst_slots"
    return _setup(h.case, device) + [
        f"{h.side}_t = alias_slots(dst.tensors[0], {h.side})   # slots stored in the destination's own bytes",
        f"{other}_t = slots_tensor({other}, 'int64', {device!r})",
        "before = snapshot(dst.tensors)",
        "expect_rejected(lambda: ops.transfer(src, dst, src_slots_t, dst_slots_t, **layers), "
        f"[{h.side!r}])",
        "assert_unchanged(dst.tensors, before, 'destination')",
        "assert_guards(guards)",
    ]


def _rewritten(h: HostileOp, device: str) -> list[str]:
    c = h.case
    bound = c.src_geom.N if h.side == "src_slots" else c.dst_geom.N
    slot_device = "cpu" if h.engine == "copy" else device
    index = len(c.src_slots) // 2
    valid = (c.src_slots if h.side == "src_slots" else c.dst_slots)[index]
    lines = _setup(c, device) + [
        f"src_t = slots_tensor(src_slots, 'int64', {slot_device!r})",
        f"dst_t = slots_tensor(dst_slots, 'int64', {slot_device!r})",
        f"call = lambda: ops.transfer(src, dst, src_t, dst_t, engine={h.engine!r})",
        f"errors = hammer({'src_t' if h.side == 'src_slots' else 'dst_t'}, {index}, ({valid}, {bound + 7}), "
        "call, 40)",
    ]
    if device != "cpu" and h.engine == "kernel":
        lines += ["try:", f"    ops.check_errors({device!r})   # the out-of-range value, when a kernel saw it",
                  "except IndexError:", "    pass"]
    return lines + ["assert_guards(guards)"]


def _two_storages(h: HostileOp, device: str) -> list[str]:
    c = h.case
    return [
        f"case = {c!r}",
        "buffer = np.ascontiguousarray(case.caches()[0])   # one host buffer ...",
        f"src = ops.bind(case.src_layout, torch.from_numpy(buffer), page_size={c.src_geom.BS})",
        f"dst = ops.bind(case.src_layout, torch.from_numpy(buffer), page_size={c.src_geom.BS})   # ... two storages",
        "before = snapshot(dst.tensors)",
        f"s = slots_tensor({list(c.src_slots)}, 'int64')",
        f"d = slots_tensor({list(reversed(c.src_slots))}, 'int64')",
        "expect_rejected(lambda: ops.transfer(src, dst, s, d), ['overlap'])",
        "assert_unchanged(dst.tensors, before, 'buffer')",
    ]


def _expanded(h: HostileOp, device: str) -> list[str]:
    c = h.case
    g = c.src_geom
    return [
        f"case = {c!r}",
        "src_np, _ = case.caches()",
        f"src = ops.bind(case.src_layout, to_torch(case.src_layout, src_np, {device!r}), page_size={g.BS})",
        f"T = {c.T}",
        f"base = torch.zeros({g.P}, {g.L}, 1, {g.H * g.E}, dtype=getattr(torch, case.dtype), device={device!r})",
        "chunk = ops.bind('lmcache_kv_2ltd', base.expand(-1, -1, T, -1))   # every token row is one memory row",
        f"s = slots_tensor({list(c.src_slots)}, 'int64', {device!r})",
        "expect_rejected(lambda: ops.transfer(src, chunk, s, None), ['dst', 'expanded', 'overlap'])",
        "assert int(base.view(torch.uint8).count_nonzero()) == 0, 'the expanded destination was written'",
    ]


def _layer_twice(h: HostileOp, device: str) -> list[str]:
    return _setup(h.case, device) + [
        f"src_t = slots_tensor(src_slots, 'int64', {device!r})",
        f"dst_t = slots_tensor(dst_slots, 'int64', {device!r})",
        "before = snapshot(dst.tensors)",
        "expect_rejected(lambda: ops.transfer(src, dst, src_t, dst_t, src_layers=[0, 1], dst_layers=[0, 0]), "
        "['dst_layers'])",
        "assert_unchanged(dst.tensors, before, 'destination')",
        "assert_guards(guards)",
    ]


def _allocator(h: HostileOp, device: str) -> list[str]:
    n = 1 + len(h.case.src_slots) % 3
    return [
        "from kvlayout.compat import sglang as sg",
        "pool = sg.MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, 'cpu')",
        "host = sg.HostKVPool(pool, 2.0, layout='page_first')",
        "taken = host.alloc(host.size)",
        f"host.free(taken[:{4 * n}])   # some whole pages back",
        "available, used = host.available_size(), int(taken[-1])",
        "for bad in ([-1], [host.size], [1 << 40], [used, used], [int(taken[0])]):   # negative, beyond, repeated, free",
        "    expect_rejected(lambda: host.free(bad), ['indices'])",
        "    assert host.available_size() == available, f'a rejected free({bad}) changed the allocator'",
        "expect_rejected(lambda: host.alloc(-4), ['need_size'])",
        "assert host.available_size() == available",
        "got = host.alloc(available)",
        "assert got is not None and len(set(got.tolist())) == available, 'a slot handed out twice'",
        "assert all(int(p) % host.page_size == 0 for p in got[::host.page_size]), 'an unaligned page'",
    ]


def _adapter(h: HostileOp, device: str) -> list[str]:
    return [
        "from kvlayout.compat import sglang as sg",
        "L, H, P, D = 2, 2, 4, 8",
        "dev_k = [torch.randn(64, H, D).to(torch.bfloat16) for _ in range(L)]",
        "dev_v = [torch.randn(64, H, D).to(torch.bfloat16) for _ in range(L)]",
        "host = torch.zeros(2, 4, H, P, L, D, dtype=torch.bfloat16)   # page_head [2, NP, H, P, L, D]",
        "idx = torch.arange(P, 2 * P)",
        "item = H * D * 2",
        "expect_rejected(lambda: sg.transfer_kv_all_layer_lf_ph(dev_k, host[0], dev_v, host[1], idx, idx, item, "
        "item * L, L, P, 2 * H), ['head_num'])",
        "expect_rejected(lambda: sg.transfer_kv_all_layer_lf_ph(dev_k, host[0], dev_v, host[1], idx, idx, item, "
        "item * L, L, 2 * P, H), ['page_size'])",
        "assert int(host.view(torch.int16).count_nonzero()) == 0, 'a rejected call wrote the host pool'",
    ]


_LINES = {"slots alias the destination": _alias, "slots rewritten during the call": _rewritten,
          "two storages over one buffer": _two_storages, "expanded destination": _expanded,
          "a destination layer twice": _layer_twice, "host allocator abuse": _allocator,
          "adapter shape lies": _adapter}


def hostile_kinds(device: str) -> tuple[str, ...]:
    return tuple(k for k in HOSTILE_KINDS if device == "cpu" or k not in CPU_ONLY_KINDS)


def _rewrite_case(draw) -> S.TransferCase:
    """A transfer long enough for another thread to act while it runs: T tokens of 128-byte rows, 2 layers."""
    from kvlayout.reference.layouts import Geometry

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
def hostile_ops(draw, device: str, group: str | None = None):
    kind = group or draw(st.sampled_from(hostile_kinds(device)))
    case = _case_for(kind, draw)
    side = draw(st.sampled_from(("src_slots", "dst_slots")))
    engine = draw(st.sampled_from(("kernel", "copy"))) if device != "cpu" else "kernel"
    return HostileOp(kind, case, side, engine)
