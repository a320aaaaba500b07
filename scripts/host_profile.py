"""Where a bench row's call spends its host time, by runtime call and operator (torch.profiler).

    python scripts/host_profile.py "L32_H8_D128 T=4096 ps=16 ... staged" [KEY ...] [--calls 50] [--device cuda]
        [--timeline] [--stream side]
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

``--timeline``: besides, one call's device activities from the profiler's trace (the device idle before the
call): each kernel and copy with its start, duration, stream, bytes and rate, then where the call's device time
goes (before its first copy, the copies themselves, the gaps between them, after the last), beside one pinned
copy of the same bytes in the same direction, timed alike: what a staged call loses against the pinned ceiling.

``--stream side``: every call issued on a non-blocking stream of the script's own instead of the current stream
(torch's legacy default stream unless a caller set another): whether the stream a call is issued on changes its
host cost (a graph launched on the legacy default stream may cost the driver more than on a non-blocking one).

For a staged call, the script also times a graph of nothing but the same count of pinned copies of the same
bytes (a torch CUDA graph, captured in this process, replayed on the same stream, the device idle before each):
what the graph launch costs in this process apart from the library.

``--record``: the rows of a bench record (of ``--group``, and of ``--call`` where given) whose host time per
call was over ``--over`` µs, slowest first, at most ``--rows`` of them.

A diagnostic, not a measurement of record: the profiler adds its own cost to every event it sees.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvlayout.bench.trace import busy_time, device_activities


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


def timeline_summary(activities: list[dict]) -> dict:
    """Where one call's device time goes (µs): ``span`` from its first activity's start to its last one's end;
    ``before_copies`` up to the first copy's start; ``copying`` the time some copy runs; ``gaps`` the time
    between the first copy's start and the last copy's end with no copy running; ``after_copies`` from there
    to the end; ``copy_bytes`` and ``copies``."""
    if not activities:
        return {"span": 0.0, "before_copies": 0.0, "copying": 0.0, "gaps": 0.0, "after_copies": 0.0,
                "copy_bytes": 0, "copies": 0}
    start = min(a["start"] for a in activities)
    end = max(a["end"] for a in activities)
    copies = sorted((a for a in activities if a["copy"]), key=lambda a: a["start"])
    if not copies:
        return {"span": end - start, "before_copies": end - start, "copying": 0.0, "gaps": 0.0,
                "after_copies": 0.0, "copy_bytes": 0, "copies": 0}
    copying = busy_time(copies)
    first, last = copies[0]["start"], max(c["end"] for c in copies)
    return {"span": end - start, "before_copies": first - start, "copying": copying,
            "gaps": (last - first) - copying, "after_copies": end - last,
            "copy_bytes": sum(c["bytes"] for c in copies), "copies": len(copies)}


def print_timeline(fn, device: torch.device) -> None:
    """One call of ``fn`` under the profiler, the device idle before it: its device activities and
    :func:`timeline_summary`, beside one pinned copy of its copies' bytes in the direction of its first copy."""
    def once(call) -> list[dict]:
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize(device)
        return device_activities(prof)

    activities = once(fn)
    if not activities:
        print("  (no device activity traced)")
        return
    t0 = activities[0]["start"]
    print(f"  {'start µs':>9} {'µs':>8} {'stream':>6} {'bytes':>11} {'GB/s':>6}  activity")
    for a in activities:
        took = a["end"] - a["start"]
        rate = f"{a['bytes'] / took / 1e3:6.1f}" if a["bytes"] and took > 0 else f"{'':6}"
        print(f"  {a['start'] - t0:9.1f} {took:8.1f} {str(a['stream']):>6} {a['bytes']:11d} {rate}  {a['name'][:60]}")
    s = timeline_summary(activities)
    print(f"  on the device {s['span']:.1f} µs: before the first copy {s['before_copies']:.1f}, {s['copies']} "
          f"copies running {s['copying']:.1f} ({s['copy_bytes'] / max(s['copying'], 1e-9) / 1e3:.1f} GB/s while "
          f"they run), gaps between them {s['gaps']:.1f}, after the last {s['after_copies']:.1f}")
    if not s["copies"]:      # (a kernel row's key: a staged row's ends in " staged")
        print("  no copies on the device: this call ran kernels only (a staged row's key ends in ' staged')")
    if s["copy_bytes"]:
        to_host = "DtoH" in next(a["name"] for a in activities if a["copy"])
        dev = torch.empty(s["copy_bytes"], dtype=torch.uint8, device=device)
        host = torch.empty(s["copy_bytes"], dtype=torch.uint8, pin_memory=True)
        dst, src = (host, dev) if to_host else (dev, host)
        dst.copy_(src, non_blocking=True)        # (warm)
        ref = timeline_summary(once(lambda: dst.copy_(src, non_blocking=True)))
        print(f"  one pinned copy of the same {s['copy_bytes']} bytes {'to' if to_host else 'from'} the host: "
              f"{ref['span']:.1f} µs; the call's span is {s['span'] / max(ref['span'], 1e-9):.3f}x that")


def copy_graph_host_us(device: torch.device, nbytes: int, copies: int, to_host: bool, calls: int) -> float:
    """Median host µs of one replay (the device idle before each, on the current stream) of a graph of
    ``copies`` pinned copies, ``nbytes`` in all, in one direction: a staged call's copies with nothing else."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    step = nbytes // copies
    pieces = [(host[i * step:(i + 1) * step], dev[i * step:(i + 1) * step]) for i in range(copies)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for h, d in pieces:
            (h.copy_(d, non_blocking=True) if to_host else d.copy_(h, non_blocking=True))
    times = []
    for i in range(calls + 3):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        graph.replay()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    torch.cuda.synchronize(device)
    return statistics.median(times) * 1e6


def profile_case(case, device: torch.device, calls: int, top: int, timeline: bool = False,
                 side_stream: bool = False) -> None:
    from kvlayout.bench import cases as C

    data = C.build(case, C.Inputs(device))
    fn = C.kvlayout_fn(case, data)
    if side_stream and device.type == "cuda":
        stream = torch.cuda.Stream(device)       # non-blocking with respect to the legacy default stream
        stream.wait_stream(torch.cuda.current_stream(device))   # the case's inputs are written

        def on_stream(call=fn):
            with torch.cuda.stream(stream):
                call()
        fn = on_stream

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
    where = ", on a non-blocking side stream" if side_stream and device.type == "cuda" else ""
    print(f"{case.key}: host {statistics.median(host) * 1e6 / case.calls:.1f} µs per call (median of "
          f"{calls}, device idle before each{where}){staged}")
    print(f"{'event':48} {'per call':>9} {'host µs per call':>17}")
    for e in events:
        print(f"{e.key[:48]:48} {e.count / per_call:9.2f} {e.self_cpu_time_total / per_call:17.2f}")
    if counts:
        src, _, dst, _ = C.endpoints(case, data)
        to_host = src.device.type == "cuda"
        nbytes = sum(t.nbytes for t in (dst if to_host else src).tensors)
        copies = counts["chunks"]
        try:
            with torch.cuda.stream(stream) if side_stream else contextlib.nullcontext():
                alone = copy_graph_host_us(device, nbytes, copies, to_host, calls)
            print(f"a graph of only {copies} pinned copies of the same {nbytes} bytes, on the same stream: "
                  f"host {alone:.1f} µs per replay (median of {calls})")
        except RuntimeError as failed:       # a diagnostic: say why it could not be timed and go on
            print(f"a graph of only the copies could not be timed: {failed}")
    if timeline and device.type == "cuda":
        print("one call's device activities:")
        print_timeline(fn, device)
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
    parser.add_argument("--timeline", action="store_true",
                        help="also one call's device activities beside one pinned copy of the same bytes")
    parser.add_argument("--stream", choices=("current", "side"), default="current",
                        help="issue the calls on the current stream or on a non-blocking stream of the script's")
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
        profile_case(case, device, args.calls, args.top, args.timeline, args.stream == "side")


if __name__ == "__main__":
    main()
