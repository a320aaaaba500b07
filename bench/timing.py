"""Timing primitives: device events, L2 flushing, medians with spread, the machine's copy limits."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Callable

import torch


@dataclasses.dataclass
class Timing:
    """Seconds per call: median and the 10th/90th percentiles over the timed repetitions.

    ``host`` is the median host time spent inside the call (issuing it, not
    waiting for the device).
    """

    median: float
    p10: float
    p90: float
    reps: int
    host: float = 0.0

    def gbps(self, nbytes: int) -> float:
        return nbytes / self.median / 1e9

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how noisy the measurement was."""
        return (self.p90 - self.p10) / self.median if self.median else 0.0

    @classmethod
    def of(cls, samples: list[float], host: list[float] | None = None) -> Timing:
        """The timing of ``samples`` (seconds, at least one); ``host``: the host seconds of the same calls, where
        they are not the samples themselves."""
        ordered = sorted(samples)
        q = statistics.quantiles(ordered, n=10) if len(ordered) >= 2 else [ordered[0]] * 9
        return cls(statistics.median(ordered), q[0], q[-1], len(ordered), statistics.median(host or samples))


class Timer:
    """Times a callable on one device: CUDA events on GPUs, perf_counter on CPU.

    Before each timed repetition, outside the timed region, the L2 cache is
    flushed by *reading* a buffer larger than L2 (a write would leave dirty
    lines that are written back inside the next timed call).

    Two times per call on CUDA:

    * end to end (:meth:`__call__`): events recorded around the call with the
      device idle before it, so the host's issue time counts where the device
      waits for it (what a caller feels);
    * kernel only (``kernel_only=True``): the device is first held busy
      (``torch.cuda._sleep``) for longer than the host needs to issue the call,
      so the events enclose only the launched work, back to back.

    Repetitions stop after ``reps``, or after ``min_reps`` once ``budget_s``
    seconds have been spent (slow baselines need no more samples to be
    compared).
    """

    def __init__(self, device: torch.device, warmup: int = 3, reps: int = 15, *, min_reps: int = 3,
                 budget_s: float = 2.0):
        self.device = torch.device(device)
        self.warmup, self.reps, self.min_reps, self.budget_s = warmup, reps, min(min_reps, reps), budget_s
        self._flush = None
        self._cycles_per_s = 2e9
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            self._flush = torch.ones(max(2 * props.L2_cache_size, 256 << 20) // 4, dtype=torch.int32,
                                     device=self.device)
            self._cycles_per_s = getattr(props, "clock_rate", 2_000_000) * 1e3 or 2e9

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def flush(self) -> None:
        if self._flush is not None:
            self._flush.sum()   # reads every line; writes one scalar

    def hold(self, host_s: float) -> None:
        """Keeps the device busy (a spin kernel) for longer than the host needs to issue a call that takes it
        ``host_s`` seconds, so that the call's launched work then runs back to back (kernel-only timing)."""
        torch.cuda._sleep(int((2 * host_s + 200e-6) * self._cycles_per_s))

    def __call__(self, fn: Callable[[], object], *, kernel_only: bool = False, host_s: float = 0.0) -> Timing:
        """Time ``fn``; ``host_s`` (kernel only): how long the host takes to issue it (from an end-to-end run)."""
        if kernel_only and not self.cuda:
            raise ValueError("kernel-only timing needs a CUDA device")
        for _ in range(self.warmup):
            fn()
        self.sync()
        samples, host = [], []
        started = time.perf_counter()
        while len(samples) < self.reps and not (len(samples) >= self.min_reps
                                                 and time.perf_counter() - started > self.budget_s):
            self.flush()
            if self.cuda:
                if kernel_only:
                    self.hold(host_s)
                else:
                    self.sync()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                fn()
                host.append(time.perf_counter() - t0)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
                host.append(samples[-1])
        return Timing.of(samples, host)


    def host_side_by_side(self, fns: dict[str, Callable[[], object]]) -> dict[str, float]:
        """Median host seconds of each callable, timed in turn within every repetition (so that a machine whose
        speed drifts during the run, as a loaded CPU's does, slows them alike); the device is idle before each
        call. ``reps`` repetitions after ``warmup`` calls of each."""
        for fn in fns.values():
            for _ in range(self.warmup):
                fn()
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(self.reps):
            for name, fn in fns.items():
                self.sync()
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
        self.sync()
        return {name: statistics.median(s) for name, s in samples.items()}


MiB = 1 << 20
LIMIT_SIZES_MIB = (1, 32, 256)
SAME_SIZE_MAX = 512 * MiB


def host_copy_gbps(timer: Timer, host: torch.Tensor, device: torch.Tensor, direction: str) -> float:
    """GB/s of one ``copy_`` between the byte tensors ``host`` and ``device`` (of one size): into ``host`` for
    ``direction`` ``"to_host"``, out of it otherwise."""
    if direction == "to_host":
        return timer(lambda: host.copy_(device, non_blocking=True)).gbps(host.numel())
    return timer(lambda: device.copy_(host, non_blocking=True)).gbps(host.numel())


def _pinned_copy_gbps(timer: Timer, nbytes: int) -> tuple[float, float]:
    """(H2D, D2H) GB/s of one pinned ``copy_`` of ``nbytes``."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if not host.is_pinned():
        raise RuntimeError(f"a pinned host buffer of {nbytes} bytes came back pageable: no pinned copy to time")
    device = torch.empty(nbytes, dtype=torch.uint8, device=timer.device)
    return (host_copy_gbps(timer, host, device, "from_host"), host_copy_gbps(timer, host, device, "to_host"))


def measure_limits(timer: Timer, *, quick: bool) -> dict[str, float]:
    """The machine's own copy bandwidth (GB/s, one way): device copy and pinned host copies.

    Keys: ``D2D`` (a large device-to-device ``copy_``), ``H2D_<n>MiB`` and
    ``D2H_<n>MiB`` (pinned host <-> device ``copy_``) at 1, 32 and 256 MiB;
    the 256 MiB figure is the host ceiling.  On CPU only ``D2D`` (a host
    memcpy) is measured.
    """
    dev = timer.device
    limits = {}
    big = (256 if quick else 2048) * MiB if dev.type == "cuda" else 64 * MiB
    a = torch.empty(big, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    limits["D2D"] = timer(functools.partial(b.copy_, a)).gbps(big)   # (holds a and b only while timed)
    del a, b
    if dev.type == "cuda":
        for size in LIMIT_SIZES_MIB:
            limits[f"H2D_{size}MiB"], limits[f"D2H_{size}MiB"] = _pinned_copy_gbps(timer, size * MiB)
    return limits


def drifted(start: dict[str, float], end: dict[str, float], tolerance: float = 0.05) -> dict[str, tuple]:
    """Limits that moved by more than ``tolerance`` (relative) between the start and the end of a run."""
    return {k: (start[k], end[k]) for k in start
            if k in end and start[k] and abs(end[k] - start[k]) / start[k] > tolerance}


def host_key(direction: str) -> str:
    return "D2H" if direction == "to_host" else "H2D"


class SameSizeCopies:
    """The pinned ``copy_`` of the same payload size as a host case, measured once per size and direction.

    :meth:`measure` times the sizes a run will need before its first case, as
    the limits are timed: a copy timed between cases ran at a sixth of its
    rate in some full runs (a 4 MiB copy from the host after the 4 GiB cases,
    on an H100 and an H200) where the same size timed alone did not. Payloads
    above 512 MiB are judged against the 512 MiB copy (the pinned copy rate is
    flat well below that size).
    """

    def __init__(self, timer: Timer, known: dict[str, float] | None = None):
        self.timer = timer
        self._seen: dict[int, tuple[float, float]] = {}
        for name, h2d in (known or {}).items():
            if name.startswith("H2D_"):
                nbytes = int(name[len("H2D_"):])
                self._seen[nbytes] = (h2d, known[f"D2H_{nbytes}"])

    def measure(self, payloads) -> None:
        """Time the copies of every payload size in ``payloads`` (bytes) not timed yet, smallest first."""
        for nbytes in sorted({min(n, SAME_SIZE_MAX) for n in payloads} - set(self._seen)):
            self._seen[nbytes] = _pinned_copy_gbps(self.timer, nbytes)
            torch.cuda.empty_cache()

    def table(self) -> dict[str, float]:
        """``{"H2D_<bytes>": GB/s, "D2H_<bytes>": GB/s}`` of every size timed (a run's record keeps it)."""
        out = {}
        for nbytes, (h2d, d2h) in sorted(self._seen.items()):
            out[f"H2D_{nbytes}"], out[f"D2H_{nbytes}"] = h2d, d2h
        return out

    def gbps(self, direction: str, nbytes: int) -> float:
        self.measure([nbytes])
        h2d, d2h = self._seen[min(nbytes, SAME_SIZE_MAX)]
        return d2h if direction == "to_host" else h2d
