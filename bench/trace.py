"""A profile's device activities (torch.profiler's CUDA trace), and the part of them one call launched.

:func:`device_activities` reads every kernel, copy and fill of a profile,
with the device's own start and end times. :func:`call_windows` cuts the
activities of a run of repeated sequences *hold, call, mark* (a long
``torch.cuda._sleep`` that holds the device while the host issues the call,
the call, then ``torch.cuda._sleep(0)`` as a marker) into each call's own
activities, with the gap from the hold's end to the call's first activity:
where a call's time on the device goes, launch included, as it runs in the
bench's kernel-only timing rather than under a profiler's replay.
"""

from __future__ import annotations

import json
import os
import tempfile

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
# torch.cuda._sleep's kernel (ATen's spin_kernel): the hold before each call and the marker after it
SPIN_KERNEL = "spin_kernel"


def device_activities(prof) -> list[dict]:
    """The device activities of a profile (kernels, copies, fills) from its trace, in start order, each as
    ``{"name", "kind", "stream", "start", "end", "bytes", "copy"}`` (µs; ``kind`` the trace's category,
    ``"kernel"``, ``"gpu_memcpy"`` or ``"gpu_memset"``; bytes 0 for a kernel; ``copy``: a copy between host
    and device memory, not one inside device memory such as a call's slots into its graph's buffer)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    found = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") in DEVICE_CATEGORIES and e.get("ph") == "X":
            args = e.get("args", {})
            found.append({"name": e.get("name", ""), "kind": e["cat"], "stream": args.get("stream", e.get("tid")),
                          "start": float(e["ts"]), "end": float(e["ts"]) + float(e.get("dur", 0)),
                          "bytes": int(args.get("bytes", 0) or 0),
                          "copy": e["cat"] == "gpu_memcpy" and "DtoD" not in e.get("name", "")})
    return sorted(found, key=lambda a: a["start"])


def call_windows(activities: list[dict]) -> list[dict]:
    """Each call of a profiled run of *hold, call, mark* sequences (module docstring), in order, as
    ``{"launch_gap", "span", "busy", "kernel", "activities", "names"}``: µs from the hold's end to the call's
    first activity's start; from that start to its last activity's end; the time some activity of the call
    runs; its kernels' summed durations; its activity count and their names. The spin kernels pair up in
    order, hold then marker; what runs between a marker and the next hold (a sequence's set-up, such as an L2
    flush) is no call's. A call that launched nothing is left out."""
    spins = [i for i, a in enumerate(activities) if SPIN_KERNEL in a["name"]]
    if len(spins) % 2:
        raise ValueError(f"call_windows: {len(spins)} spin kernels in the trace, not pairs of hold and marker")
    windows = []
    for hold, mark in zip(spins[::2], spins[1::2]):
        own = activities[hold + 1:mark]
        if own:
            windows.append(_window(activities[hold]["end"], own))
    return windows


def busy_time(activities: list[dict]) -> float:
    """µs during which at least one of ``activities`` (in start order) runs: the length of their intervals'
    union."""
    busy, reach = 0.0, activities[0]["start"] if activities else 0.0
    for a in activities:
        if a["end"] > reach:
            busy += a["end"] - max(a["start"], reach)
            reach = a["end"]
    return busy


def _window(held_until: float, own: list[dict]) -> dict:
    start, end = own[0]["start"], max(a["end"] for a in own)
    return {"launch_gap": start - held_until, "span": end - start, "busy": busy_time(own),
            "kernel": sum(a["end"] - a["start"] for a in own if a["kind"] == "kernel"),
            "activities": len(own), "names": sorted({a["name"] for a in own})}
