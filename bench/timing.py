"""Timing primitives: device events, L2 flushing, medians with spread, the machine's copy limits."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch


@dataclasses.dataclass
class Timing:
    """Seconds per call: median and the 10th/90th percentiles over the timed repetitions."""

    median: float
    p10: float
    p90: float
    reps: int

    def gbps(self, nbytes: int) -> float:
        return nbytes / self.median / 1e9

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how noisy the measurement was."""
        return (self.p90 - self.p10) / self.median if self.median else 0.0


class Timer:
    """Times a callable on one device: CUDA events on GPUs, perf_counter on CPU.

    Before each timed repetition the L2 cache is flushed (a write of a buffer
    larger than L2), outside the timed region, so that no measurement reads
    data the previous one left in cache.
    """

    def __init__(self, device: torch.device, warmup: int = 3, reps: int = 15):
        self.device = torch.device(device)
        self.warmup, self.reps = warmup, reps
        self._flush = None
        if self.device.type == "cuda":
            l2 = torch.cuda.get_device_properties(self.device).L2_cache_size
            self._flush = torch.empty(max(2 * l2, 256 << 20), dtype=torch.uint8, device=self.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def flush(self) -> None:
        if self._flush is not None:
            self._flush.zero_()

    def __call__(self, fn: Callable[[], object]) -> Timing:
        for _ in range(self.warmup):
            fn()
        self.sync()
        samples = []
        for _ in range(self.reps):
            self.flush()
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        samples.sort()
        q = statistics.quantiles(samples, n=10) if len(samples) >= 2 else [samples[0]] * 9
        return Timing(statistics.median(samples), q[0], q[-1], len(samples))


MiB = 1 << 20


def measure_limits(timer: Timer, *, quick: bool) -> dict[str, float]:
    """The machine's own copy bandwidth (GB/s, one way): device copy and pinned host copies.

    Keys: ``D2D`` (a large device-to-device ``copy_``), ``H2D_<n>MiB`` and
    ``D2H_<n>MiB`` (pinned host <-> device ``copy_``) at 1, 32 and 256 MiB.
    On CPU only ``D2D`` (a host memcpy) is measured.
    """
    dev = timer.device
    limits = {}
    big = (256 if quick else 2048) * MiB if dev.type == "cuda" else 64 * MiB
    a = torch.empty(big, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    limits["D2D"] = timer(lambda: b.copy_(a)).gbps(big)
    del a, b
    if dev.type == "cuda":
        for size in (1, 32, 256):
            host = torch.empty(size * MiB, dtype=torch.uint8, pin_memory=True)
            device = torch.empty(size * MiB, dtype=torch.uint8, device=dev)
            limits[f"H2D_{size}MiB"] = timer(lambda: device.copy_(host, non_blocking=True)).gbps(size * MiB)
            limits[f"D2H_{size}MiB"] = timer(lambda: host.copy_(device, non_blocking=True)).gbps(size * MiB)
    return limits


def host_limit(limits: dict[str, float], direction: str, nbytes: int) -> tuple[str, float]:
    """The pinned-copy limit matching a host transfer: the 256 MiB figure (the ceiling)."""
    key = f"{'D2H' if direction == 'to_host' else 'H2D'}_256MiB"
    return key, limits[key]
