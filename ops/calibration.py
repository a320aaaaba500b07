"""How fast a CUDA device's SMs read and write pinned host memory beside its copy engine, measured once per device.

The kernel engine moves a host transfer through the SMs (zero-copy loads and stores of pinned memory); the staged
engine moves it with the copy engine. On most hosts both reach the pinned ceiling at large sizes, and
``engine="auto"`` stages a transfer only from :data:`~kvlayout.ops.staged.AUTO_MIN_BYTES` on. On some hosts the
SMs' reads of host memory are capped far below the copy engine (an H100 host in the record of b1ed027: the
kernel's loads at 54-63 % of the pinned ceiling whatever the payload, the copy engine's at 96-99 %); there the
staged engine is the faster one from one staged chunk (8 MiB) on, and auto stages from
:data:`SLOW_SM_AUTO_MIN_BYTES` in that direction.

:func:`calibrate` times, once per device, one transfer of :data:`PROBE_BYTES` each way by the kernel and one
``copy_`` of the same bytes by the copy engine, and keeps their ratio. ``engine="auto"`` calls it lazily for the
first call whose choice depends on it (a payload between the two thresholds), unless the current stream is
capturing a CUDA graph, code is being compiled, or ``KVLAYOUT_CALIBRATE=0``: those calls keep the fixed rule.
The probe synchronizes the device once (about a millisecond, and :data:`PROBE_BYTES` of pinned and device memory
while it runs); an engine that must not stall mid-step calls :func:`calibrate` at start-up.
"""

from __future__ import annotations

import threading

import torch

from . import routes
from .locks import fork_safe
from .settings import environment_choice
from .views import bind

PROBE_BYTES = 16 << 20          # per direction: 2 planes x 4,096 tokens x 2 KiB rows, one layer
SLOW_SM_RATIO = 0.75            # the SMs' rate below this share of the copy engine's: "slow"
SLOW_SM_AUTO_MIN_BYTES = 8 << 20  # auto stages from here in a slow direction (one staged chunk's least bytes)
PROBE_REPEATS = 3
LAZY = environment_choice("KVLAYOUT_CALIBRATE", ("1", "0")) == "1"

_lock = fork_safe(threading.Lock())
_results: dict[int, dict] = {}  # device index -> calibrate()'s result
_listeners: list = []          # called when a result changes (ops.staged.rule_changed: auto's kept answers)
_cuda_indices: dict[torch.device, int] = {}   # a CUDA device naming its index -> it (reading a torch.device's
#                                               type costs a repeated call more than this lookup)


def calibrate(device: torch.device | str | int | None = None, *, again: bool = False) -> dict:
    """Measures (once per device; ``again=True`` measures anew) how fast the kernel moves pinned host memory
    beside the copy engine, each way. Returns ``{"to_host": {...}, "from_host": {...}}``, each with
    ``kernel_gbps``, ``copy_engine_gbps``, ``ratio`` (kernel / copy engine) and ``sm_slow`` (the ratio under
    :data:`SLOW_SM_RATIO`: ``engine="auto"`` stages a transfer that way from :data:`SLOW_SM_AUTO_MIN_BYTES` on,
    not from ``AUTO_MIN_BYTES``). Synchronizes the device."""
    index = _device_index(device)
    with _lock:
        if again or index not in _results:
            try:
                _results[index] = _measure(index)
            except RuntimeError as e:   # (no room for the probe's buffers, pinned or on the device: the fixed
                                        # rule, and why, in the result)
                _results[index] = {direction: {"kernel_gbps": 0.0, "copy_engine_gbps": 0.0, "ratio": 1.0,
                                               "sm_slow": False, "error": f"not measured: {e}".splitlines()[0]}
                                   for direction in ("to_host", "from_host")}
            _changed()
        return {direction: dict(figures) for direction, figures in _results[index].items()}


def sm_is_slow(device: torch.device, host_is_dst: bool, probe: bool = True) -> bool:
    """Whether the SMs of ``device`` move host memory that way slowly beside the copy engine (calibrating it now
    where it is not yet, ``probe`` asks for it and a probe may run here; else False: the fixed rule)."""
    known = known_sm_slow(device, host_is_dst)
    if known is not None:
        return known
    if not (probe and _may_probe()):
        return False
    return calibrate(_index_of(device))["to_host" if host_is_dst else "from_host"]["sm_slow"]


def known_sm_slow(device: torch.device, host_is_dst: bool) -> bool | None:
    """:func:`sm_is_slow`'s answer where ``device`` is calibrated (False off CUDA); None: not yet (a later call
    may calibrate it). Probes nothing."""
    index = _cuda_indices.get(device)
    if index is None:
        if device.type != "cuda":
            return False
        index = _index_of(device)
        if device.index is not None:
            _cuda_indices[device] = index
    found = _results.get(index)
    return None if found is None else found["to_host" if host_is_dst else "from_host"]["sm_slow"]


def when_changed(listener) -> None:
    """Calls ``listener()`` whenever a device's calibration changes (:func:`calibrate`, :func:`forget`)."""
    _listeners.append(listener)


def _changed() -> None:
    for listener in _listeners:
        listener()


def calibrated_devices() -> int:
    """How many devices are calibrated so far (one result kept per device)."""
    return len(_results)


def forget() -> None:
    """Drops every device's calibration (the next choice that needs one probes again)."""
    with _lock:
        _results.clear()
        _changed()


def _may_probe() -> bool:
    return (LAZY and not torch.compiler.is_compiling() and torch.cuda.is_available()
            and not torch.cuda.is_current_stream_capturing())


def _device_index(device) -> int:
    if not torch.cuda.is_available():
        raise RuntimeError("calibrate: there is no CUDA device to calibrate (engine='auto' keeps its fixed rule)")
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"calibrate: device must be a CUDA device, got {device}")
    return _index_of(device)


def _index_of(device: torch.device) -> int:
    """A CUDA device's index (the current device's where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _measure(index: int) -> dict:
    device = torch.device("cuda", index)
    tokens, heads, dim = PROBE_BYTES // (2 * 2048), 8, 128               # 2 KiB rows of bf16
    with torch.cuda.device(device):
        cache = bind("vllm_flash_attn_nhd",
                     [torch.zeros(2, tokens // 16, 16, heads, dim, dtype=torch.bfloat16, device=device)])
        chunk = bind("lmcache_kv_2ltd", torch.zeros(2, 1, tokens, heads * dim, dtype=torch.bfloat16).pin_memory())
        slots = torch.arange(tokens, dtype=torch.int32, device=device)
        host_bytes = chunk.tensors[0].view(-1)
        device_bytes = cache.tensors[0].view(-1)
        runs = {
            "to_host": (lambda: routes.run(cache, chunk, slots),
                        lambda: host_bytes.copy_(device_bytes, non_blocking=True)),
            "from_host": (lambda: routes.run(chunk, cache, None, slots),
                          lambda: device_bytes.copy_(host_bytes, non_blocking=True)),
        }
        out = {}
        for direction, (kernel, copy_engine) in runs.items():
            kernel_gbps, copy_gbps = _gbps(kernel), _gbps(copy_engine)
            ratio = kernel_gbps / copy_gbps if copy_gbps > 0 else 1.0
            out[direction] = {"kernel_gbps": kernel_gbps, "copy_engine_gbps": copy_gbps, "ratio": ratio,
                              "sm_slow": ratio < SLOW_SM_RATIO}
        torch.cuda.current_stream().synchronize()
    return out


def _gbps(fn) -> float:
    """GB/s of PROBE_BYTES moved by ``fn`` on the current stream: the fastest of PROBE_REPEATS runs after one
    warm-up."""
    fn()
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return PROBE_BYTES / (best * 1e-3) / 1e9 if best > 0 else 0.0
