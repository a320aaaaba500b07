"""What ``kvlayout bench`` measures: shapes, layout pairs, directions, and the torch baseline.

A case moves T tokens of every layer (or one layer per call, L calls: the
layer-wise pipeline) between a device cache and a buffer:

* ``to_host`` / ``from_host``: the buffer is pinned host memory (a chunk or a
  host pool), read/written by the kernel directly;
* ``gather_device`` / ``scatter_device``: the buffer is on the device.

The pure-torch baseline does what engines do without kvlayout, in two forms
(:data:`TORCH_FORMS`); a case's "x torch" figure is against the faster:

* ``per_layer``: advanced indexing (``index_select``/``index_put_``) on each
  (layer, plane) view of the cache, plus one ``copy_`` across the host
  boundary through a staging buffer;
* ``merged``: the strongest form a user writes by hand, where the layouts
  allow it (an all-layer LMCache chunk against a one-part cache whose rows,
  or heads, are contiguous): the cache seen as ``[planes*layers*slots, row]``
  (one view per tensor: one for all layers where the cache is one tensor,
  one per layer where each layer is its own tensor), one ``index_select``
  (or ``index_copy_``) per view, and one ``copy_`` of the whole chunk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import random

import torch

from kvlayout import _C, ops
from kvlayout.ops import _native
from kvlayout.ops.views import KVCache


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's KV geometry: layers, KV heads, head size; MLA has one plane and one head."""

    name: str
    L: int
    H: int
    D: int
    mla: bool = False

    @property
    def planes(self) -> int:
        return 1 if self.mla else 2

    def row_bytes(self, itemsize: int = 2) -> int:
        return self.H * self.D * itemsize


SHAPES = {s.name: s for s in (
    Shape("L32_H8_D128", 32, 8, 128),
    Shape("L32_H1_D128", 32, 1, 128),
    Shape("L32_MLA_D576", 32, 1, 576, mla=True),
    Shape("L80_H8_D128", 80, 8, 128),
    Shape("L61_MLA_D576", 61, 1, 576, mla=True),
)}

DIRECTIONS = ("to_host", "from_host", "gather_device", "scatter_device")


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured configuration."""

    group: str            # headline | layouts | layerwise | ctas | host_hints | copy_engine | staged | host_cost
    shape: str
    device_layout: str    # the engine cache
    buffer_layout: str    # the chunk / host pool / device buffer
    T: int
    page_size: int
    direction: str
    layerwise: bool = False
    max_ctas: int = 0
    engine: str = "kernel"  # or "copy": the copy engine, page-granular runs; or "staged" (ops.staged)
    call: str = "transfer"  # layer-wise: "transfer" (ops.transfer per layer), "prepared" (a prepared
    #                         transfer's layer calls), "prepared-early" (the same with early_loads=True),
    #                         "prepared-serial" (without programmatic dependent launch),
    #                         "prepared-no-launch" (skip_prefix = T: checked, nothing launched) or "graph"
    #                         (the prepared calls captured once, replayed); staged: "transfer" (a repeated
    #                         shape's call replays its captured graph), "direct" (every call issued
    #                         directly, as a new shape's is: no graph kept) or "slot-chunks" (replayed, with
    #                         ops.set_staged_chunks(1): chunks of a ring slot's capacity, the fewest nodes)
    #                         or "device-launch" (replayed, with ops.set_staged_graph_launch("device"): the
    #                         kept graph the body of a conditional node, one node for the host's launch);
    #                         or "new-length" (each call a length the engine has not run, T - 1 ... T -
    #                         NEW_LENGTHS tokens in turn, under ops.set_staged_graph_reuse("prefix"): the
    #                         graph of their reuse prefix replayed, the rest moved by the direct kernel);
    #                         or "spread-length" (the same setting, NEW_LENGTHS lengths from T / 8 up,
    #                         spread over three octaves in a fixed shuffled order: more reuse prefixes than
    #                         a transfer keeps graphs, so captures may evict each other; one timed
    #                         repetition is a pass over every length, its bytes theirs) or "spread-exact"
    #                         (the same passes under set_staged_graph_reuse("exact"): every call issued
    #                         directly, since no length comes back while the engine remembers it);
    #                         or "bind-per-call" (both caches bound anew at each call, as an adapter that
    #                         binds a fresh host chunk per call does: the staged engine plans every call;
    #                         with engine "kernel" too, its twin); host_hints: "default-hints"
    #                         (ops.set_host_cache_hints("default")) or "walk" (ops.set_host_launch_shape("walk"));
    #                         host_cost: "bind-per-call" (as in the
    #                         staged group, nothing moved) or "gather" (ops.gather into a view of the buffer
    #                         made at each call)
    empty: bool = False     # every cache slot is -1: nothing moves, the time is the calls' host cost

    @property
    def key(self) -> str:
        mode = "x%d layers" % SHAPES[self.shape].L if self.layerwise else "all layers"
        engine = {"kernel": "", "copy": " copy-engine"}.get(self.engine, f" {self.engine}")
        call = "" if self.call == "transfer" else f" {self.call}"
        empty = " empty" if self.empty else ""
        return (f"{self.shape} T={self.T} ps={self.page_size} {self.device_layout}->{self.buffer_layout} "
                f"{self.direction} {mode} ctas={self.max_ctas or 'default'}{engine}{call}{empty}")

    @property
    def calls(self) -> int:
        """Host calls per measured repetition: one per layer when layer-wise, and as many for an all-layer
        host_cost row (one call of a few microseconds is too short to time alone on a CPU), and NEW_LENGTHS for a
        spread row (a pass over its lengths: a median over calls of different lengths would not be a rate)."""
        if self.call in SPREAD_CALLS:
            return NEW_LENGTHS
        return SHAPES[self.shape].L if self.layerwise or self.group == "host_cost" else 1

    def payload_bytes(self, itemsize: int = 2) -> int:
        """Bytes one timed repetition moves: a call's; a "new-length" row's calls' mean; a spread row's pass
        over all its lengths (:attr:`calls` of them)."""
        s = SHAPES[self.shape]
        lengths = call_lengths(self)
        if not lengths:
            tokens = self.T
        elif self.call in SPREAD_CALLS:
            tokens = sum(lengths)
        else:
            tokens = sum(lengths) / len(lengths)
        return round(s.planes * s.L * tokens * s.row_bytes(itemsize))


def _default_layouts(shape: Shape) -> tuple[str, str]:
    return ("vllm_mla", "lmcache_kv_mla") if shape.mla else ("vllm_flash_attn_nhd", "lmcache_kv_2ltd")


def _device_sms() -> int:
    """The current CUDA device's SMs (0 without one)."""
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def plan_cases(quick: bool) -> list[Case]:
    """The case list: a small one with ``quick``, the full one otherwise."""
    cases = []
    shapes = ["L32_H8_D128", "L32_H1_D128", "L32_MLA_D576"] if quick else list(SHAPES)
    tokens = [256, 4096] if quick else [256, 4096, 32768]
    for name, T, direction in itertools.product(shapes, tokens, DIRECTIONS):
        shape = SHAPES[name]
        if T == 32768 and shape.L > 32:
            continue
        dev, buf = _default_layouts(shape)
        cases.append(Case("headline", name, dev, buf, T, 16, direction))
    # layout sweep: every engine layout against its buffers, page sizes 1/16/64
    pairs = [("vllm_flash_attn_nhd", "lmcache_kv_2ltd"), ("vllm_flash_attn_hnd", "lmcache_kv_2ltd"),
             ("vllm_flashinfer_nhd", "lmcache_kv_2ltd"), ("sglang_mha", "hicache_layer_first"),
             ("sglang_mha", "hicache_page_first"), ("sglang_mha", "hicache_page_head")]
    for name in (["L32_H8_D128"] if quick else ["L32_H8_D128", "L32_H1_D128"]):
        for (dev, buf), ps, direction in itertools.product(pairs, [16] if quick else [1, 16, 64],
                                                           ("to_host", "from_host")):
            cases.append(Case("layouts", name, dev, buf, 4096, ps, direction))
    # layer-wise pipeline: L calls of one layer each (ops.transfer, prepared layer calls, and those calls
    # replayed from a CUDA graph), against the all-layer figure of the headline group
    for name, T, direction, call in itertools.product(shapes[:3], [256] if quick else [256, 4096],
                                                      ("to_host", "from_host"),
                                                      ("transfer", "prepared", "prepared-early", "graph")):
        shape = SHAPES[name]
        dev = "vllm_mla" if shape.mla else "vllm_flash_attn_nhd"
        buf = "lmcache_kv_mla_layer" if shape.mla else "lmcache_kv_t2d"
        cases.append(Case("layerwise", name, dev, buf, T, 16, direction, layerwise=True, call=call))
    # SGLang HiCache: a host pool loaded into the device pool layer by layer (load_to_device_per_layer)
    for T, call in itertools.product([256] if quick else [256, 4096], ("transfer", "prepared")):
        cases.append(Case("layerwise", "L32_H8_D128", "sglang_mha", "hicache_layer_first", T, 16, "from_host",
                          layerwise=True, call=call))
    # CTA budget for host transfers
    for name, direction, ctas in itertools.product(["L32_H8_D128"] if quick else ["L32_H8_D128", "L32_H1_D128",
                                                                                  "L32_MLA_D576"],
                                                   ("to_host", "from_host"), (1, 2, 4, 8, 16, 0)):
        dev, buf = _default_layouts(SHAPES[name])
        cases.append(Case("ctas", name, dev, buf, 4096, 16, direction, max_ctas=ctas))
    # the device rows with a budget of every SM (one CTA of 1024 threads per SM, 2 loads in flight per thread:
    # half an SM's threads) beside the headline rows' default grid (3 CTAs of 256 threads per SM, 4 loads in
    # flight: 3/8 of its threads): which grid keeps the latency-bound T = 256 rows busier
    sms = _device_sms()
    for name, T, direction in itertools.product(shapes[:3], [256] if quick else [256, 4096],
                                                ("gather_device", "scatter_device")):
        if sms:
            dev, buf = _default_layouts(SHAPES[name])
            cases.append(Case("ctas", name, dev, buf, T, 16, direction, max_ctas=sms))
    # the kernel's host transfers with the default cache operators instead of streaming hints (what LMCache's
    # and sgl-kernel's copy kernels use), beside the same cases of the headline and ctas groups
    for name, direction in itertools.product(shapes[:3], ("to_host", "from_host")):
        dev, buf = _default_layouts(SHAPES[name])
        for T, ctas in ((256, 0), (4096, 0), (4096, 4)) if quick else ((256, 0), (4096, 0), (4096, 1), (4096, 4)):
            cases.append(Case("host_hints", name, dev, buf, T, 16, direction, max_ctas=ctas, call="default-hints"))
    # the host transfers the kernel moves one row per CTA by default (no budget, payloads up to
    # HOST_ROW_PER_CTA_MAX_BYTES) walked instead, one CTA per SM, beside the same headline cases
    for name, direction, T in itertools.product(shapes[:3], ("to_host", "from_host"), [256] if quick else [256, 4096]):
        walked = Case("host_hints", name, *_default_layouts(SHAPES[name]), T, 16, direction, call="walk")
        if walked.payload_bytes() <= _native.HOST_ROW_PER_CTA_MAX_BYTES:
            cases.append(walked)
    # the copy engine on page-granular host transfers (no SMs), against the kernel on the same data
    for name, ps, direction, engine in itertools.product(["L32_H8_D128"] if quick else ["L32_H8_D128", "L32_MLA_D576"],
                                                         [16] if quick else [16, 64], ("to_host", "from_host"),
                                                         ("copy", "kernel")):
        dev = "vllm_mla" if SHAPES[name].mla else "vllm_flash_attn_nhd"
        buf = "hicache_mla_page_first_direct" if SHAPES[name].mla else "hicache_page_first_direct"
        cases.append(Case("copy_engine", name, dev, buf, 4096, ps, direction, engine=engine))
    # the staged engine (kernel in device memory, copy engine across PCIe) on every headline host row (what
    # engine="auto" picks there above its threshold), and for the L32 shapes at T = 4096 under the SM budgets
    # of the ctas group (what auto needs to stage budgeted calls)
    for name, T, direction in itertools.product(shapes, tokens, ("to_host", "from_host")):
        if T == 32768 and SHAPES[name].L > 32:
            continue
        dev, buf = _default_layouts(SHAPES[name])
        cases.append(Case("staged", name, dev, buf, T, 16, direction, engine="staged"))
        if T >= 4096 and name in shapes[:3]:
            # a new shape's call (issued directly), calls of new lengths (their prefixes' graphs replayed), and
            # a repeated one whose graph the device launches
            for call in ("direct", "new-length", "device-launch"):
                cases.append(Case("staged", name, dev, buf, T, 16, direction, engine="staged", call=call))
            if T == 4096:   # lengths over three octaves: does the prefix graphs' churn cost more than it saves?
                for call in SPREAD_CALLS:
                    cases.append(Case("staged", name, dev, buf, T, 16, direction, engine="staged", call=call))
        if T == 4096 and name in shapes[:3]:
            for ctas in ((4,) if quick else (1, 2, 4, 8)):
                cases.append(Case("staged", name, dev, buf, T, 16, direction, max_ctas=ctas, engine="staged"))
            cases.append(Case("staged", name, dev, buf, T, 16, direction, max_ctas=4, engine="staged",
                              call="device-launch"))
            # the chunk count's trade (overlap at a call's start and end against host time per chunk): the
            # same calls in chunks of a ring slot's capacity, without a budget and under 4 SMs
            for ctas in (0, 4):
                cases.append(Case("staged", name, dev, buf, T, 16, direction, max_ctas=ctas, engine="staged",
                                  call="slot-chunks"))
    # loads of 32-80 MiB, which the staged engine moves faster than the kernel when one pair of caches repeats,
    # between caches bound anew at each call: the staged engine then plans every call; beside the kernel
    # doing the same (whether auto's load threshold can come down to 32 MiB)
    if not quick:
        for (name, T), engine in itertools.product((("L32_H8_D128", 256), ("L32_H1_D128", 4096),
                                                    ("L80_H8_D128", 256)), ("staged", "kernel")):
            dev, buf = _default_layouts(SHAPES[name])
            cases.append(Case("staged", name, dev, buf, T, 16, "from_host", engine=engine, call="bind-per-call"))
    return cases + host_cost_cases("to_host")


def host_cost_cases(direction: str) -> list[Case]:
    """Host time per call with nothing to move (every slot -1): ops.transfer of all layers (between the same
    caches, between caches bound anew at each call, and as ``ops.gather`` into a view made at each call), of one
    layer, and a prepared layer call (with and without programmatic dependent launch, and one that launches
    nothing: its checks and bookkeeping alone)."""
    return [Case("host_cost", "L32_H8_D128", "vllm_flash_attn_nhd", buf, 256, 16, direction, layerwise=layerwise,
                 call=call, empty=True)
            for buf, layerwise, call in (("lmcache_kv_2ltd", False, "transfer"),
                                         ("lmcache_kv_2ltd", False, "bind-per-call"),
                                         ("lmcache_kv_2ltd", False, "gather"),
                                         ("lmcache_kv_t2d", True, "transfer"),
                                         ("lmcache_kv_t2d", True, "prepared"),
                                         ("lmcache_kv_t2d", True, "prepared-serial"),
                                         ("lmcache_kv_t2d", True, "prepared-no-launch"))]


def cpu_cases() -> list[Case]:
    """A short CPU run: small shapes only (the CPU kernel is a correctness path), and the host cost per call."""
    return [Case("headline", "L32_H1_D128", dev, buf, T, 16, d)
            for (dev, buf), T, d in itertools.product([("vllm_flash_attn_nhd", "lmcache_kv_2ltd"),
                                                       ("vllm_flash_attn_hnd", "lmcache_kv_2ltd")],
                                                      [256, 4096], ("gather_device", "scatter_device"))] + \
        host_cost_cases("gather_device")


def device_cases(device_type: str, quick: bool = False) -> list[Case]:
    """The cases a bench run on a ``device_type`` device plans: :func:`plan_cases` on CUDA, else
    :func:`cpu_cases`."""
    return plan_cases(quick) if device_type == "cuda" else cpu_cases()


def cases_by_key(keys: list[str], device_type: str) -> list[Case]:
    """The planned cases (:func:`device_cases`, full run) of these bench keys, in their order; ValueError
    naming the first key that no case of a ``device_type`` run has."""
    planned = {c.key: c for c in device_cases(device_type)}
    for key in keys:
        if key not in planned:
            raise ValueError(f"no bench case {key!r} on {device_type}; e.g. {next(iter(planned))!r}")
    return [planned[key] for key in keys]


# ---------------------------------------------------------------------------------------------
# Building the tensors
# ---------------------------------------------------------------------------------------------

class Arena:
    """Memory allocated once and carved into a case's tensors: pinned host memory (``pin``) or device memory.

    :meth:`reset` at the start of each case hands the same memory out again:
    a case's tensors lie one after another from the start of one allocation,
    each at a multiple of ``align`` bytes, as an engine's caches lie in what
    it allocates at start, and every run of the same cases places them alike
    (with tensors from torch's caching allocator, a 4 MiB gather at T = 256,
    about 9 µs, ran 0.9 µs faster or slower between runs whose earlier cases
    differed: placement is the likely cause). :meth:`reset` first replaces a
    buffer too small for the case (at least doubling), so a run allocates a
    few times, not once per case; tensors handed out before keep the old
    buffer alive until they are dropped.
    """

    def __init__(self, device: torch.device, align: int, pin: bool = False):
        self.device, self.align, self.pin = torch.device(device), align, pin
        self._buffer: torch.Tensor | None = None
        self._used = 0

    def reset(self, sizes: list[int] = ()) -> None:
        """Hand the memory out again from the start, for tensors of ``sizes`` bytes in turn: a buffer that
        cannot hold them all is replaced first (by one of at least twice its size), so that they lie in one."""
        self._used = 0
        need = 0
        for nbytes in sizes:
            need = self._aligned(need) + nbytes
        if need and (self._buffer is None or need > self._buffer.numel()):
            self._grow(need)

    def _aligned(self, offset: int) -> int:
        """``offset`` rounded up to a multiple of the alignment: where the next tensor starts."""
        return -(-offset // self.align) * self.align

    def _grow(self, nbytes: int) -> None:
        size = max(nbytes, 2 * (self._buffer.numel() if self._buffer is not None else 0))
        self._buffer = None
        self._buffer = torch.empty(size, dtype=torch.uint8, device=self.device, pin_memory=self.pin)

    def take(self, shape, dtype) -> torch.Tensor:
        """A contiguous ``[*shape]`` tensor of ``dtype`` (uninitialised), valid until the next :meth:`reset`."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = self._aligned(self._used)
        if self._buffer is None or start + nbytes > self._buffer.numel():
            self._grow(nbytes)
            start = 0
        self._used = start + nbytes
        return self._buffer[start:start + nbytes].view(dtype).view(shape)


HOST_ALIGN = 4096          # bytes: a page
DEVICE_ALIGN = 2 << 20     # bytes: the device's large page


class Inputs:
    """Where a case's tensors come from: random bits generated on ``device``; on a GPU run, pinned host
    tensors from one host :class:`Arena` (filled by a copy from the device) and device tensors from one device
    :class:`Arena` (filled in place)."""

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.index_generator = torch.Generator().manual_seed(seed)   # slot permutations (small) on the host
        gpu = self.device.type == "cuda"
        self.host_arena = Arena(torch.device("cpu"), HOST_ALIGN, pin=True) if gpu else None
        self.device_arena = Arena(self.device, DEVICE_ALIGN) if gpu else None

    def reset(self, device_shapes: list[tuple] = (), host_shapes: list[tuple] = (), dtype=torch.bfloat16) -> None:
        """A new case, whose tensors are ``device_shapes`` and (pinned) ``host_shapes`` of ``dtype`` in the order
        it takes them: they take the arenas' memory again from the start, each arena one buffer."""
        for arena, shapes in ((self.device_arena, device_shapes), (self.host_arena, host_shapes)):
            if arena is not None:
                arena.reset([math.prod(s) * dtype.itemsize for s in shapes])

    def _bits(self, shape, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, device=self.device,
                             generator=self.generator, out=out)

    def random(self, shape, dtype, *, host: bool) -> torch.Tensor:
        """Random bits (NaN patterns included) of ``dtype``; pinned host memory if ``host`` on a GPU run."""
        n16 = math.prod(shape) * dtype.itemsize // 2
        if self.device_arena is None:
            return self._bits((n16,)).view(dtype).view(shape)
        if host:
            pinned = self.host_arena.take(shape, dtype)
            pinned.copy_(self._bits((n16,)).view(dtype).view(shape))
            return pinned
        carved = self.device_arena.take(shape, dtype)
        self._bits((n16,), out=carved.view(-1).view(torch.uint8).view(torch.int16))
        return carved


class AddressInputs(Inputs):
    """CPU tensors left unfilled (their pages never touched): for host work that reads addresses and slots and
    no data, such as the copy engine's run list, at sizes the machine need not hold."""

    def __init__(self, seed: int = 0):
        super().__init__(torch.device("cpu"), seed)

    def random(self, shape, dtype, *, host: bool) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class _Physical:
    """A layout at one geometry: the shapes of the tensors it binds, in :func:`ops.bind`'s order."""

    layout: object
    page_size: int | None       # ops.bind's page_size (None for a paged layout, whose tensors carry it)
    shapes: list                 # per part: a shape, or a list of shapes (one per layer)

    def all_shapes(self) -> list[tuple]:
        return [s for part in self.shapes for s in (part if isinstance(part, list) else [part])]


def _geometry(layout: str, shape: Shape, n_slots: int, page_size: int, L: int) -> _Physical:
    """``layout`` holding ``n_slots`` slots of ``shape`` (``L`` layers where it has a layer axis)."""
    from kvlayout.reference.layouts import get, make_geometry
    lay = get(layout)
    axes = {a for p in lay.parts for a in p.full_axes}
    H, E = (shape.H, shape.D) if "h" in axes and not shape.mla else (1, shape.H * shape.D)
    ps = page_size if (lay.paged or layout.startswith(("sglang", "hicache"))) else 1
    geom = make_geometry(lay, L=L if "l" in axes else 1, N=n_slots, H=H, E=E, page_size=ps,
                         P=shape.planes if lay.planes is None else None)
    shapes = [[tuple(geom.part_shape(p))] * geom.L if p.per_layer else tuple(geom.part_shape(p)) for p in lay.parts]
    return _Physical(lay, ps if not lay.paged else None, shapes)


def _physical(physical: _Physical, dtype, inputs: Inputs, host: bool) -> KVCache:
    """Random tensors of ``physical``'s shapes bound as a KVCache."""
    parts = [[inputs.random(s, dtype, host=host) for s in part] if isinstance(part, list) else
             inputs.random(part, dtype, host=host) for part in physical.shapes]
    value = parts[0] if physical.layout.single_part else tuple(parts)
    return ops.bind(physical.layout, value, page_size=physical.page_size)


def _page_slots(n_slots: int, page_size: int, T: int, generator) -> torch.Tensor:
    """The first ``T`` slots of whole pages taken in random order."""
    pages = torch.randperm(n_slots // page_size, generator=generator)[: -(-T // page_size)]
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:T]


def build(case: Case, inputs: Inputs, min_cache_slots: int = 8192) -> dict:
    """Tensors and slot arrays for one case (bf16 data), made by ``inputs``.

    The device cache holds ``max(2 T, min_cache_slots)`` slots, so the case's
    pages are spread over a cache larger than L2.
    """
    shape = SHAPES[case.shape]
    dtype = torch.bfloat16
    host = case.direction in ("to_host", "from_host")
    n_cache = max(2 * case.T, min_cache_slots)
    n_cache += -n_cache % case.page_size
    buffer_is_chunk = case.buffer_layout.startswith("lmcache")
    n_buf = case.T if buffer_is_chunk else n_cache
    # layer-wise chunks hold one layer (each layer call reuses it); a host pool holds every layer
    buf_layers = 1 if case.layerwise and buffer_is_chunk else shape.L
    cache_physical = _geometry(case.device_layout, shape, n_cache, case.page_size, shape.L)
    buffer_physical = _geometry(case.buffer_layout, shape, n_buf, case.page_size, buf_layers)
    device_shapes = cache_physical.all_shapes() + ([] if host else buffer_physical.all_shapes())
    inputs.reset(device_shapes, buffer_physical.all_shapes() if host else [], dtype)
    cache = _physical(cache_physical, dtype, inputs, False)
    buffer = _physical(buffer_physical, dtype, inputs, host)
    # the copy engine reads the slots on the host
    slot_device = torch.device("cpu") if case.engine == "copy" else inputs.device
    cache_slots = _page_slots(n_cache, case.page_size, case.T, inputs.index_generator).to(slot_device)
    buffer_slots = None if buffer_is_chunk else \
        _page_slots(n_buf, case.page_size, case.T, inputs.index_generator).to(slot_device)
    if case.empty:
        cache_slots.fill_(-1)
    return {"cache": cache, "buffer": buffer, "cache_slots": cache_slots, "buffer_slots": buffer_slots}


def endpoints(case: Case, data: dict):
    """(src, src_slots, dst, dst_slots) in the case's direction."""
    if case.direction in ("to_host", "gather_device"):
        return data["cache"], data["cache_slots"], data["buffer"], data["buffer_slots"]
    return data["buffer"], data["buffer_slots"], data["cache"], data["cache_slots"]


def _layer_choices(case: Case, data: dict) -> list[dict]:
    """Per layer call: the layers keyword arguments (a one-layer chunk is layer 0 on its side)."""
    L = SHAPES[case.shape].L
    src, _, _, _ = endpoints(case, data)
    chunk = case.buffer_layout.startswith("lmcache")
    cache_is_src = src is data["cache"]
    return [{"src_layers": [layer if cache_is_src or not chunk else 0],
             "dst_layers": [0 if cache_is_src and chunk else layer]} for layer in range(L)]


def _bound_anew(src: KVCache, dst: KVCache) -> tuple[KVCache, KVCache]:
    """Both caches bound anew to their tensors, as an engine's adapter binds its tensors at every call."""
    return ops.bind(src.layout, src.value), ops.bind(dst.layout, dst.value)


def new_length_slots(ss, ds, tokens: int):
    """The slot arguments of a call of the first ``tokens`` tokens (views of the case's slots)."""
    return (None if ss is None else ss[:tokens]), (None if ds is None else ds[:tokens])


def new_length_checks(case: Case) -> list[int]:
    """The lengths a "new-length" or spread row's bytes are checked with before it is timed
    (kvlayout.bench.run): three that it does not time, so that none of those is one the engine has run: the
    first issued directly, the second and third replaying their reuse prefix's graph."""
    return [case.T - NEW_LENGTHS - i for i in (1, 2, 3)]


def call_lengths(case: Case) -> list[int] | None:
    """The token counts a "new-length" row's calls move in turn (T - 1 ... T - NEW_LENGTHS), or a
    spread row's (NEW_LENGTHS lengths from T / 8 to below T - NEW_LENGTHS - 4, evenly apart on a log
    scale, in a fixed shuffled order); None for any other row, whose calls move T."""
    if case.call == "new-length":
        return [case.T - i for i in range(1, NEW_LENGTHS + 1)]
    if case.call in SPREAD_CALLS:
        low, high = case.T / 8, case.T - NEW_LENGTHS - 4
        lengths = [round(low * (high / low) ** (i / NEW_LENGTHS)) for i in range(NEW_LENGTHS)]
        random.Random(0).shuffle(lengths)
        return lengths
    return None


def _new_lengths_fn(case: Case, src, ss, dst, ds):
    """A "new-length" or spread row's repetition: :attr:`Case.calls` calls (one; a spread row's whole pass), each
    of the first n tokens, n each of :func:`call_lengths` in turn (views of the slots made once: what is timed
    is the engine's calls)."""
    lengths = itertools.cycle([new_length_slots(ss, ds, n) for n in call_lengths(case)])

    def new_lengths():
        for _ in range(case.calls):
            s, d = next(lengths)
            ops.transfer(src, dst, s, d, max_ctas=case.max_ctas, engine=case.engine)
    return new_lengths


def kvlayout_fn(case: Case, data: dict):
    """The measured kvlayout call(s)."""
    src, ss, dst, ds = endpoints(case, data)
    if not case.layerwise:
        if case.group != "host_cost":
            if case.call == "bind-per-call":
                return lambda: ops.transfer(*_bound_anew(src, dst), ss, ds, max_ctas=case.max_ctas,
                                            engine=case.engine)
            if case.call in VARIED_LENGTH_CALLS:
                return _with_setting(case, _new_lengths_fn(case, src, ss, dst, ds))
            if case.call in SETTING_CALLS:
                return _with_setting(case, lambda: ops.transfer(src, dst, ss, ds, max_ctas=case.max_ctas,
                                                                engine=case.engine))
            return lambda: ops.transfer(src, dst, ss, ds, max_ctas=case.max_ctas, engine=case.engine)

        if case.call == "bind-per-call":
            def rebinding():
                for _ in range(case.calls):
                    ops.transfer(*_bound_anew(src, dst), ss, ds)
            return rebinding
        if case.call == "gather":
            g = src.geometry
            P, L, T = g.P, g.L, (ss if ss is not None else ds).shape[0]

            def gathering():   # ops.gather into a view of the buffer made at each call
                for _ in range(case.calls):
                    ops.gather(src, ss, out=dst.tensors[0].view(P, L, T, g.H, g.E))
            return gathering

        def repeated():   # the call as an engine writes it (engine at its default, "auto"), case.calls times
            for _ in range(case.calls):
                ops.transfer(src, dst, ss, ds)
        return repeated
    choices = _layer_choices(case, data)
    if case.call == "transfer":
        pairs = [(kw["src_layers"], kw["dst_layers"]) for kw in choices]
        max_ctas = case.max_ctas

        def per_layer():   # (a lean loop: the host_cost rows set this call against a loop of torch ops)
            for src_layers, dst_layers in pairs:
                ops.transfer(src, dst, ss, ds, src_layers=src_layers, dst_layers=dst_layers, max_ctas=max_ctas)
        return per_layer
    options = dict(max_ctas=case.max_ctas, dependent_launch=case.call != "prepared-serial",
                   early_loads=case.call == "prepared-early",
                   skip_prefix=case.T if case.call == "prepared-no-launch" else 0)
    if case.buffer_layout.startswith("lmcache"):
        # one-layer chunks: one prepared transfer per layer (as a layer-wise connector keeps per layer)
        layers = [ops.prepare(src, dst, ss, ds, **options, **kw) for kw in choices]
    else:
        t = ops.prepare(src, dst, ss, ds, **options)
        layers = [functools.partial(t.layer, i) for i in range(t.num_layers)]

    def prepared():
        for call in layers:
            call()
    if case.call != "graph":
        return prepared
    # "graph": the layer calls captured once (on a side stream, as capture requires) and replayed
    prepared()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream()), torch.cuda.graph(graph):
        prepared()
    data["graph"] = graph     # kept alive with the case's tensors
    return graph.replay


def staged_counts(case: Case, data: dict) -> dict:
    """For an all-layer host transfer that its engine stages: the call's ``chunks``, the ``graph_nodes`` of
    the graph it replays (0: issued directly), whether that graph runs as a conditional node's body
    (``graph_on_device``) and the tokens of the call it was captured from (``graph_tokens``: a "new-length"
    row's, of a length it never ran, is its reuse prefix's), as ``ops.explain`` gives them after the
    timed calls; {} where the call is not staged. What a staged call's host time grows with."""
    if case.layerwise or case.direction not in ("to_host", "from_host") or case.engine not in ("auto", "staged"):
        return {}
    src, ss, dst, ds = endpoints(case, data)
    if call_lengths(case):          # a length neither timed nor checked (not seen by the engine, not kept)
        ss, ds = new_length_slots(ss, ds, min(new_length_checks(case)) - 1)
    with _setting(case):
        explained = ops.explain(src, dst, ss, ds, max_ctas=case.max_ctas, engine=case.engine)
    if explained["engine"] != "staged":
        return {}
    return {"chunks": explained["chunks"], "graph_nodes": explained["graph_nodes"],
            "graph_on_device": explained["graph_on_device"], "graph_tokens": explained["graph_tokens"]}


# the calls that run under a setting of their own (_setting)
# a spread row's calls: lengths over three octaves under prefix reuse, and the same under the default (own graphs)
SPREAD_CALLS = ("spread-length", "spread-exact")
VARIED_LENGTH_CALLS = ("new-length",) + SPREAD_CALLS
SETTING_CALLS = ("direct",) + VARIED_LENGTH_CALLS + ("slot-chunks", "device-launch", "default-hints")
# the calls beside a row's default one (diagnostics: under a setting of their own, the kernel in its other host
# launch shape, or between caches bound anew at each call), which no peer's figure is compared with
DIAGNOSTIC_CALLS = SETTING_CALLS + ("walk", "bind-per-call")
# a "new-length" row's calls cycle through this many lengths below its T: more than a staged engine remembers
# (16 shapes seen once), so that every call's length is new to it
NEW_LENGTHS = 64


@contextlib.contextmanager
def _setting(case: Case):
    """The setting ``case`` runs under while the block runs (restored after, also when the call raises): no
    staged graph kept for a "direct" row (``ops.set_cache_capacity(staged_graphs=0)``: every call issued
    directly, as a new shape's is), ``ops.set_staged_graph_reuse("prefix")`` for a "new-length" or
    "spread-length" row and ``"exact"`` for a "spread-exact" row,
    ``ops.set_staged_chunks(1)`` for a "slot-chunks" row (chunks of a ring
    slot's capacity; a call shape is captured and replayed under it as under the default),
    ``ops.set_staged_graph_launch("device")`` for a "device-launch" row (the kept graph the body of a
    conditional node), ``ops.set_host_cache_hints("default")`` for a "default-hints" row,
    ``ops.set_host_launch_shape("walk")`` for a "walk" row; else none. (Each
    reads the setting it restores directly, not through ``ops.cache_info``, which walks every ring.)"""
    if case.call == "direct":
        restore = functools.partial(ops.set_cache_capacity, staged_graphs=_C.staged_graph_capacity())
        ops.set_cache_capacity(staged_graphs=0)
    elif case.call in VARIED_LENGTH_CALLS:
        restore = functools.partial(ops.set_staged_graph_reuse, ops.staged.staged_graph_reuse())
        ops.set_staged_graph_reuse("exact" if case.call == "spread-exact" else "prefix")
    elif case.call == "slot-chunks":
        restore = functools.partial(ops.set_staged_chunks, _C.staged_chunks())
        ops.set_staged_chunks(1)
    elif case.call == "device-launch":
        restore = functools.partial(ops.set_staged_graph_launch, ops.staged.staged_graph_launch())
        ops.set_staged_graph_launch("device")
    elif case.call == "default-hints":
        restore = functools.partial(ops.set_host_cache_hints, _native.host_cache_hints())
        ops.set_host_cache_hints("default")
    elif case.call == "walk":
        restore = functools.partial(ops.set_host_launch_shape, _native.host_launch_shape())
        ops.set_host_launch_shape("walk")
    else:
        restore = None
    try:
        yield
    finally:
        if restore is not None:
            restore()


def _with_setting(case: Case, call):
    """``call`` under ``case``'s setting (:func:`_setting`)."""
    def under_setting():
        with _setting(case):
            call()
    return under_setting


# the copy engine's run-list target is stated per this many copies (kvlayout.bench.targets)
COPY_ENGINE_RUNS = 8192


def copy_run_list_fn(case: Case, data: dict):
    """For a copy-engine case: a callable that builds the run lists its call issues (``_C.copy_run_list``, the
    same C++ as ``kvlayout::copy_runs`` without the driver's part) and returns how many copies they hold."""
    from kvlayout.ops.programs import plan

    src, ss, dst, ds = endpoints(case, data)
    g_src, g_dst = src.geometry, dst.geometry
    launches = plan(src, dst, list(range(g_src.L)), list(range(g_dst.L)), list(range(g_src.P)),
                    list(range(g_dst.P)))
    T = (ss if ss is not None else ds).shape[0]

    def build() -> int:
        return sum(_C.copy_run_list(list(x.src_tensors), list(x.dst_tensors), ss, ds, T, 0, list(x.src_segments),
                                    list(x.dst_segments), list(x.src_geometry), list(x.dst_geometry),
                                    x.num_pieces, x.piece_bytes) for x in launches)
    return build


# ---------------------------------------------------------------------------------------------
# The pure-torch baseline
# ---------------------------------------------------------------------------------------------

def launch_fn(device: torch.device, calls: int):
    """The launch yardstick of the host_cost rows: ``calls`` bare launches through torch's C++ bindings, no
    dispatcher and no tensor: a kernel launch on CUDA (``torch.cuda._sleep(0)``), on the CPU (where a
    kernel is a function call) one call into the bindings that does nothing (``torch._C._get_tracing_state()``)."""
    bare = (lambda: torch.cuda._sleep(0)) if device.type == "cuda" else torch._C._get_tracing_state

    def launches():
        for _ in range(calls):
            bare()
    return launches


def torch_op_fn(device: torch.device, calls: int):
    """The host cost yardstick of the host_cost rows: ``calls`` torch ops launching one kernel each
    (``index_select`` of three rows of a small tensor on ``device``), what an eager op costs the host here."""
    x = torch.ones(16, 4, device=device)
    index = torch.tensor([1, 2, 3], device=device)

    def ops():
        for _ in range(calls):
            torch.index_select(x, 0, index)
    return ops


def _row_views(cache: KVCache, layers) -> list[torch.Tensor]:
    """Per (plane, layer): an ``[NB, BS, H*E]`` or ``[NB, BS, H, E]`` strided view of the rows."""
    g = cache.geometry
    views = []
    for plane in range(g.P):
        (pv,) = cache.part_for(plane)
        for layer in layers:
            tensor, offset = pv.tensor_and_offset(plane, layer)
            st = pv.strides
            views.append(tensor.as_strided((g.NB, g.BS, pv.heads, pv.head_width),
                                           (st["nb"], st["bs"], st["h"], 1), tensor.storage_offset() + offset))
    return views


def _chunk_rows(chunk: KVCache, layers) -> list[torch.Tensor]:
    """A chunk as row blocks ``[*, T, W]``: one block when its memory is plane-layer-token ordered."""
    t = chunk.tensors[0]
    if chunk.layout.name in ("lmcache_kv_2ltd", "lmcache_kv_mla") and t.is_contiguous() \
            and list(layers) == list(range(chunk.geometry.L)):
        return [t.view(-1, t.shape[-2], t.shape[-1])]
    return [v.view(v.shape[0], -1) for v in _row_views(chunk, layers)]


def torch_fn(case: Case, data: dict):
    """Advanced indexing per (plane, layer) on the device + ``copy_`` across the host boundary.

    Chunk buffers cross the boundary in one ``copy_`` (per row block); host
    pools with slots are indexed on the host side through a pinned staging
    buffer.
    """
    cache, cache_slots, buffer, buffer_slots = data["cache"], data["cache_slots"], data["buffer"], data["buffer_slots"]
    cache_slots = cache_slots.to(cache.device)
    L = SHAPES[case.shape].L
    layer_sets = [[layer] for layer in range(L)] if case.layerwise else [list(range(L))]
    g, gb = cache.geometry, buffer.geometry
    W = cache.row_width
    to_buffer = case.direction in ("to_host", "gather_device")
    staging = {}

    def stage(shape, device):
        key = (tuple(shape), str(device))
        if key not in staging:
            staging[key] = torch.empty(shape, dtype=cache.dtype, device=device,
                                       pin_memory=device.type == "cpu" and cache.device.type == "cuda")
        return staging[key]

    def one(layers):
        buffer_layers = [0] * len(layers) if case.layerwise and buffer.geometry.L == 1 else layers
        cache_views = _row_views(cache, layers)
        page, in_page = cache_slots // g.BS, cache_slots % g.BS     # once per call, shared by every view
        if to_buffer:
            rows = torch.stack([v[page, in_page].reshape(case.T, W) for v in cache_views])
            if buffer_slots is None:
                blocks = _chunk_rows(buffer, buffer_layers)
                flat = rows.view(len(blocks), -1, W) if len(blocks) > 1 else rows.view(blocks[0].shape)
                for block, r in zip(blocks, flat if len(blocks) > 1 else [flat]):
                    block.copy_(r.view(block.shape), non_blocking=True)
            else:
                host_rows = stage(rows.shape, buffer.device)
                host_rows.copy_(rows)
                idx = buffer_slots.to(buffer.device)
                buffer_page, buffer_in_page = idx // gb.BS, idx % gb.BS
                for r, v in zip(host_rows, _row_views(buffer, buffer_layers)):
                    v[buffer_page, buffer_in_page] = r.view(case.T, *v.shape[2:])
        else:
            if buffer_slots is None:
                blocks = _chunk_rows(buffer, buffer_layers)
                rows = stage((len(cache_views), case.T, W), cache.device)
                target = rows.view(len(blocks), -1, W) if len(blocks) > 1 else [rows.view(blocks[0].shape)]
                for block, r in zip(blocks, target):
                    r.view(block.shape).copy_(block, non_blocking=True)
            else:
                idx = buffer_slots.to(buffer.device)
                buffer_page, buffer_in_page = idx // gb.BS, idx % gb.BS
                host_rows = stage((len(cache_views), case.T, W), buffer.device)
                for r, v in zip(host_rows, _row_views(buffer, buffer_layers)):
                    r.copy_(v[buffer_page, buffer_in_page].reshape(case.T, W))
                rows = stage(host_rows.shape, cache.device)
                rows.copy_(host_rows, non_blocking=True)
            for r, v in zip(rows, cache_views):
                v[page, in_page] = r.view(case.T, *v.shape[2:])

    return lambda: [one(layers) for layers in layer_sets]


TORCH_FORMS = ("per_layer", "merged")


def _flat_rows(tensor: torch.Tensor, unit: int) -> torch.Tensor:
    """``tensor``'s storage from its first element on, as ``[rows, unit]`` rows (``unit`` contiguous elements)."""
    available = tensor.untyped_storage().nbytes() // tensor.element_size() - tensor.storage_offset()
    return tensor.as_strided((available // unit, unit), (unit, 1), tensor.storage_offset())


def merged_plan(case: Case, data: dict):
    """How the ``merged`` form indexes the cache, or None where the layouts do not allow it.

    Returns ``(unit, groups)``: rows of ``unit`` elements (the whole row where
    the heads are contiguous, else one head); ``groups`` lists, per cache
    tensor in the chunk's (plane, layer) order, ``(flat, bases, layers)``:
    the tensor as ``[rows, unit]`` (:func:`_flat_rows`), the first flat row
    of each of its (plane, layer) blocks (a ``[n]`` int64 tensor on the
    cache's device), and the layers it holds.
    """
    cache, buffer = data["cache"], data["buffer"]
    if case.layerwise or data["buffer_slots"] is not None or len(cache.parts) != 1 \
            or buffer.layout.name not in ("lmcache_kv_2ltd", "lmcache_kv_mla") \
            or not buffer.tensors[0].is_contiguous() or buffer.geometry.L != cache.geometry.L:
        return None
    (pv,) = cache.parts
    g = cache.geometry
    unit = cache.row_width if pv.heads_contiguous else pv.head_width
    strided = ("nb", "bs") if unit == cache.row_width else ("nb", "bs", "h")
    if cache.row_width % unit or any(pv.strides[a] % unit for a in strided):
        return None
    per_tensor: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for plane in range(g.P):
        for layer in range(g.L):
            tensor, offset = pv.tensor_and_offset(plane, layer)
            if offset % unit:
                return None
            _, bases, layers = per_tensor.setdefault(id(tensor), (tensor, [], []))
            bases.append(offset // unit)
            if layer not in layers:
                layers.append(layer)
    groups = [(_flat_rows(t, unit), torch.tensor(b, dtype=torch.int64, device=cache.device), layers)
              for t, b, layers in per_tensor.values()]
    return unit, groups


def torch_merged_fn(case: Case, data: dict):
    """The ``merged`` torch baseline (see the module's docstring), or None where the layouts do not allow it."""
    plan = merged_plan(case, data)
    if plan is None:
        return None
    unit, groups = plan
    cache, buffer = data["cache"], data["buffer"]
    (pv,) = cache.parts
    g = cache.geometry
    heads = 1 if unit == cache.row_width else pv.heads
    # the chunk as [planes, layers, tokens * heads, unit]: the order of the rows the index lists
    chunk = buffer.tensors[0].view(g.P, g.L, case.T * heads, unit)
    slots = data["cache_slots"].to(cache.device)
    head_rows = torch.arange(heads, device=cache.device) * (pv.strides["h"] // unit)
    to_buffer = case.direction in ("to_host", "gather_device")

    def index(bases: torch.Tensor) -> torch.Tensor:
        """Flat rows in the chunk's order: (plane, layer) block, then token, then head."""
        token_rows = (slots // g.BS) * (pv.strides["nb"] // unit) + (slots % g.BS) * (pv.strides["bs"] // unit)
        return (bases[:, None] + (token_rows[:, None] + head_rows).view(1, -1)).view(-1)

    if len(groups) == 1:           # one tensor holds every layer: one op over [planes*layers*slots, unit]
        flat, bases, _ = groups[0]
        on_device = chunk.view(-1, unit) if buffer.device == cache.device else \
            torch.empty(chunk.numel() // unit, unit, dtype=cache.dtype, device=cache.device)

        if to_buffer:
            def gather_all():
                torch.index_select(flat, 0, index(bases), out=on_device)
                if on_device.data_ptr() != chunk.data_ptr():
                    chunk.view(-1, unit).copy_(on_device, non_blocking=True)
            return gather_all

        def scatter_all():
            if on_device.data_ptr() != chunk.data_ptr():
                on_device.copy_(chunk.view(-1, unit), non_blocking=True)
            flat.index_copy_(0, index(bases), on_device)
        return scatter_all
    # one tensor per layer: one op per layer over its [planes*slots, unit] view, into / out of a staging buffer
    # laid out [layers, planes, tokens * heads, unit], and one copy_ of the whole chunk
    staging = torch.empty(g.L, g.P, case.T * heads, unit, dtype=cache.dtype, device=cache.device)

    if to_buffer:
        def gather_per_layer():
            for flat, bases, (layer,) in groups:
                torch.index_select(flat, 0, index(bases), out=staging[layer].view(-1, unit))
            chunk.copy_(staging.transpose(0, 1), non_blocking=True)
        return gather_per_layer

    def scatter_per_layer():
        staging.transpose(0, 1).copy_(chunk, non_blocking=True)
        for flat, bases, (layer,) in groups:
            flat.index_copy_(0, index(bases), staging[layer].view(-1, unit))
    return scatter_per_layer


def torch_fns(case: Case, data: dict) -> dict:
    """The torch baseline's forms that apply to ``case``: form name -> callable (``per_layer`` always).

    Made once per case and kept in ``data``: the bit-exact check's calls then warm the very callables (and
    staging buffers) that are timed.
    """
    if "torch_fns" not in data:
        fns = {"per_layer": torch_fn(case, data)}
        merged = torch_merged_fn(case, data)
        if merged is not None:
            fns["merged"] = merged
        data["torch_fns"] = fns
    return data["torch_fns"]
