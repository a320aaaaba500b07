"""Times one bench case's kvlayout call in a fresh process, with the allocation sequence fixed by this script.

``scripts/ab_record.sh`` compares two trees through each tree's own bench, whose processes allocate
differently (other cases, other baselines before the row), so the caches of a row can land at other
addresses in the two runs. This probe builds only the case, after an optional pad allocation
(``--pad-mib``), with whichever ``kvlayout`` is imported (``PYTHONPATH`` picks the tree), and prints one
JSON line:

* ``kernel_us``: median over ``--reps`` of the call alone on an idle device, its issue hidden (the stream
  held by a sleep while the host issues it; the bench's "kernel only"), L2 flushed before each;
* ``back_to_back_us``: ``--calls`` calls issued back to back, per call (no flush);
* with ``--trace``, what the device ran for the call (torch.profiler's CUDA activities: kernels, copies, memsets)
  after the sleep that held the stream, in ``--trace`` calls issued as the kernel-only ones but without the L2
  flush (whose own kernels would follow each call):
  ``launch_gap_us`` (from the sleep's end to the first of them, median), ``device_span_us`` (from the sleep's
  end to the last one's end, median) and ``device_work`` (each activity of the last call: name, start after the
  sleep's end, duration, in µs). A difference between two trees' kernel-only times that the kernels' own
  durations do not show is in the gap or in an activity besides the kernel.

    PYTHONPATH=OLD/package python scripts/ab_case_probe.py "L32_H1_D128 T=256 ... ctas=default" --pad-mib 0 96
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("keys", nargs="+", help="bench rows' keys (kvlayout bench's 'key' field)")
    parser.add_argument("--pad-mib", type=int, nargs="+", default=[0],
                        help="device memory allocated before each case (one measurement per value)")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--trace", type=int, default=0, metavar="N",
                        help="also trace N kernel-only calls' device work (torch.profiler)")
    args = parser.parse_args()

    import kvlayout
    from kvlayout.bench import cases as C

    device = torch.device("cuda")
    flush = torch.ones(256 << 18, dtype=torch.int32, device=device)   # 256 MiB: several times the L2
    cycles_per_s = (getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 2_000_000) * 1e3
    planned = {c.key: c for c in C.plan_cases(quick=False)}
    for pad_mib in args.pad_mib:
        for key in args.keys:
            pad = torch.empty(pad_mib << 20, dtype=torch.uint8, device=device) if pad_mib else None
            case = planned[key]
            data = C.build(case, C.Inputs(device))
            fn = C.kvlayout_fn(case, data)
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            kernel = []
            for _ in range(args.reps):
                flush.sum()
                torch.cuda._sleep(int(300e-6 * cycles_per_s))
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                kernel.append(start.elapsed_time(end) * 1e3)
            torch.cuda._sleep(int(300e-6 * cycles_per_s))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.calls):
                fn()
            end.record()
            end.synchronize()
            row = {"tree": kvlayout.__file__, "key": key, "pad_mib": pad_mib,
                   "kernel_us": statistics.median(kernel), "kernel_us_p10": sorted(kernel)[len(kernel) // 10],
                   "back_to_back_us": start.elapsed_time(end) * 1e3 / args.calls}
            if args.trace:
                row.update(device_work(fn, cycles_per_s, args.trace))
            print(json.dumps(row), flush=True)
            del pad, data, fn
            torch.cuda.empty_cache()


def device_work(fn, cycles_per_s: float, calls: int) -> dict:
    """``calls`` calls of ``fn``, each after a sleep that holds the stream (as "kernel only" times them), under
    torch.profiler: the device's activities between each sleep and the next (see the module's docstring)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.cuda._sleep(int(300e-6 * cycles_per_s))
            fn()
            torch.cuda.synchronize()
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    device.sort(key=lambda e: e.time_range.start)
    sleeps = [i for i, e in enumerate(device) if "spin" in e.name]   # torch.cuda._sleep's kernel
    gaps, spans, last = [], [], []
    for n, i in enumerate(sleeps):
        after = device[i + 1:sleeps[n + 1] if n + 1 < len(sleeps) else len(device)]
        if not after:
            continue
        slept = device[i].time_range.end
        gaps.append(after[0].time_range.start - slept)
        spans.append(max(e.time_range.end for e in after) - slept)
        last = [[e.name[:80], e.time_range.start - slept, e.time_range.elapsed_us()] for e in after]
    if not gaps:
        return {"device_work": [], "trace_note": "no device activity found after a sleep"}
    return {"launch_gap_us": statistics.median(gaps), "device_span_us": statistics.median(spans),
            "device_work": last}


if __name__ == "__main__":
    main()
