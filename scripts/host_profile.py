"""Where a bench row's call spends its host time, by runtime call and operator (torch.profiler).

    python scripts/host_profile.py "L32_H8_D128 T=4096 ps=16 ... staged" [--calls 50] [--device cuda]

Builds the case as ``kvlayout bench`` does, runs its call a few times first (a staged call of a repeated
shape is captured on its second call and replayed after), then:

* times ``--calls`` calls on the host, the device idle before each (the bench's end-to-end host time);
* profiles as many calls and prints, per event (CUDA runtime and driver calls such as ``cudaGraphLaunch``
  or ``cudaMemcpyAsync``, and torch operators), how often it ran per call and its host µs per call (self
  time), largest first.

A diagnostic, not a measurement of record: the profiler adds its own cost to every event it sees.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("key", help="a bench row's key (kvlayout bench's 'key' field)")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--top", type=int, default=20, help="events listed")
    args = parser.parse_args()

    from kvlayout.bench import cases as C

    device = torch.device(args.device)
    planned = {c.key: c for c in (C.plan_cases(quick=False) if device.type == "cuda" else C.cpu_cases())}
    if args.key not in planned:
        raise SystemExit(f"no bench case {args.key!r} on {device.type}; e.g. {next(iter(planned))!r}")
    case = planned[args.key]
    fn = C.kvlayout_fn(case, C.build(case, C.Inputs(device)))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        fn()
    sync()
    host = []
    for _ in range(args.calls):
        sync()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.calls):
            fn()
        sync()
    per_call = case.calls * args.calls
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.top]
    print(f"{args.key}: host {statistics.median(host) * 1e6 / case.calls:.1f} µs per call (median of "
          f"{args.calls}, device idle before each)")
    print(f"{'event':48} {'per call':>9} {'host µs per call':>17}")
    for e in events:
        print(f"{e.key[:48]:48} {e.count / per_call:9.2f} {e.self_cpu_time_total / per_call:17.2f}")


if __name__ == "__main__":
    main()
