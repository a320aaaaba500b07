"""Where a bench row's call spends its host time, by runtime call and operator (torch.profiler).

    python scripts/host_profile.py "L32_H8_D128 T=4096 ps=16 ... staged" [KEY ...] [--calls 50] [--device cuda]
    python scripts/host_profile.py --record bench/results/h200.jsonl [--over 50] [--group staged] [--rows 8]
        [--call transfer]

Builds each case as ``kvlayout bench`` does, runs its call a few times first (a staged call of a repeated
shape is captured on its second call and replayed after), then:

* times ``--calls`` calls on the host, the device idle before each (the bench's end-to-end host time);
* for a staged call, gives its chunks and the nodes of the graph it replays (``ops.explain``);
* profiles as many calls, the device idle before each as when timed (calls issued back to back would queue
  behind each other, and the driver's waits for room in its command buffer would be the queue's, not the
  call's), and prints, per event (CUDA runtime and driver calls such as ``cudaGraphLaunch`` or
  ``cudaMemcpyAsync``, and torch operators), how often it ran per call and its host µs per call (self time),
  largest first; the script's own synchronizations between calls are left out.

``--record``: the rows of a bench record (of ``--group``, and of ``--call`` where given) whose host time per
call was over ``--over`` µs, slowest first, at most ``--rows`` of them.

A diagnostic, not a measurement of record: the profiler adds its own cost to every event it sees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile


def keys_over(record: str, group: str, over_us: float, rows: int, call: str | None = None) -> list[str]:
    """The keys of ``record``'s rows of ``group`` (and of ``call``, where given: ``transfer`` for the staged
    rows replayed from their graphs, ``direct`` for those issued directly, ...) whose host time per call was
    over ``over_us``, slowest first."""
    found = []
    with open(record) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "case" and r.get("group") == group and r.get("host_us_per_call", 0) > over_us \
                    and call in (None, r.get("call")):
                found.append((r["host_us_per_call"], r["key"]))
    return [key for _, key in sorted(found, reverse=True)[:rows]]


# the runtime calls of sync() below: the script's waits between calls, not the call's host work
OWN_SYNCS = {"cudaDeviceSynchronize", "cudaStreamSynchronize"}


def host_events(averages, top: int) -> list:
    """The ``top`` events of a profile's averages (``key``, ``count``, ``self_cpu_time_total``) by host self
    time, largest first, without the script's own synchronizations."""
    return sorted((e for e in averages if e.key not in OWN_SYNCS), key=lambda e: -e.self_cpu_time_total)[:top]


def profile_case(case, device: torch.device, calls: int, top: int) -> None:
    from kvlayout.bench import cases as C

    data = C.build(case, C.Inputs(device))
    fn = C.kvlayout_fn(case, data)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        fn()
    sync()
    host = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    sync()
    counts = C.staged_counts(case, data) if device.type == "cuda" else {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            sync()
            fn()
        sync()
    per_call = case.calls * calls
    events = host_events(prof.key_averages(), top)
    staged = f"; {counts['chunks']} chunks, graph of {counts['graph_nodes']} nodes" if counts else ""
    print(f"{case.key}: host {statistics.median(host) * 1e6 / case.calls:.1f} µs per call (median of "
          f"{calls}, device idle before each){staged}")
    print(f"{'event':48} {'per call':>9} {'host µs per call':>17}")
    for e in events:
        print(f"{e.key[:48]:48} {e.count / per_call:9.2f} {e.self_cpu_time_total / per_call:17.2f}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("keys", nargs="*", help="bench rows' keys (kvlayout bench's 'key' field)")
    parser.add_argument("--record", help="a bench record (.jsonl): profile its rows over --over µs")
    parser.add_argument("--over", type=float, default=50.0, help="with --record: host µs per call above which")
    parser.add_argument("--group", default="staged", help="with --record: the bench group")
    parser.add_argument("--rows", type=int, default=8, help="with --record: at most this many rows")
    parser.add_argument("--call", help="with --record: only rows of this call (transfer: staged rows replayed)")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--top", type=int, default=20, help="events listed")
    args = parser.parse_args()

    from kvlayout.bench import cases as C

    device = torch.device(args.device)
    keys = list(args.keys) + (keys_over(args.record, args.group, args.over, args.rows, args.call)
                                   if args.record else [])
    if not keys:
        raise SystemExit("no rows to profile: give keys, or --record with rows over --over µs")
    try:
        chosen = C.cases_by_key(keys, device.type)
    except ValueError as unknown:
        raise SystemExit(str(unknown)) from None
    for case in chosen:
        profile_case(case, device, args.calls, args.top)


if __name__ == "__main__":
    main()
