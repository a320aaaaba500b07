"""``kvlayout bench``: measure kvlayout against the machine's copy limits and the torch baseline.

Every measured case is first checked bit-exact against the baseline (same
input, both outputs compared byte for byte); a mismatch is reported and the
case is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from . import cases as C
from .report import write_reports
from .timing import Timer, host_limit, measure_limits


def _snapshot(cache) -> list[torch.Tensor]:
    return [t.clone() for t in cache.tensors]


def _restore(cache, saved) -> None:
    for t, s in zip(cache.tensors, saved):
        t.copy_(s)


def check_bit_exact(case: C.Case, data: dict, timer: Timer) -> bool:
    """Run kvlayout and the baseline from the same start; compare every destination byte."""
    _, _, dst, _ = C.endpoints(case, data)
    start = _snapshot(dst)
    C.kvlayout_fn(case, data)()
    timer.sync()
    ours = _snapshot(dst)
    _restore(dst, start)
    C.torch_fn(case, data)()
    timer.sync()
    ok = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ours, dst.tensors))
    _restore(dst, start)
    return ok


def _limit_for(case: C.Case, limits: dict) -> tuple[str, float]:
    if case.direction in ("to_host", "from_host") and "D2H_256MiB" in limits:
        return host_limit(limits, case.direction, case.payload_bytes())
    return "D2D", limits["D2D"]


def _progress(i: int, n: int, label: str) -> None:
    width = 30
    done = int(width * i / max(n, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label[:70]:<70}")
    sys.stderr.flush()


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda,
                   l2_bytes=props.L2_cache_size)
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def run(device: torch.device, quick: bool, only: str | None = None, seed: int = 0) -> dict:
    """Measure limits then every case; returns the result document."""
    timer = Timer(device, warmup=2 if quick else 3, reps=7 if quick else 15)
    limits = measure_limits(timer, quick=quick)
    case_list = C.plan_cases(quick) if device.type == "cuda" else C.cpu_cases()
    if only:
        case_list = [c for c in case_list if only in c.key]
    generator = torch.Generator().manual_seed(seed)
    results = []
    for i, case in enumerate(case_list):
        _progress(i, len(case_list), case.key)
        data = C.build(case, device, generator)
        row = {"group": case.group, "shape": case.shape, "device_layout": case.device_layout,
               "buffer_layout": case.buffer_layout, "T": case.T, "page_size": case.page_size,
               "direction": case.direction, "layerwise": case.layerwise, "max_ctas": case.max_ctas,
               "engine": case.engine,
               "payload_bytes": case.payload_bytes(), "key": case.key}
        row["bit_exact"] = check_bit_exact(case, data, timer)
        if row["bit_exact"]:
            ours = timer(C.kvlayout_fn(case, data))
            base = timer(C.torch_fn(case, data)) if case.max_ctas == 0 else None
            limit_name, limit = _limit_for(case, limits)
            row.update(gbps=ours.gbps(case.payload_bytes()), spread=ours.spread, median_us=ours.median * 1e6,
                       limit_name=limit_name, limit_gbps=limit,
                       pct_of_limit=100 * ours.gbps(case.payload_bytes()) / limit)
            if base is not None:
                row.update(torch_gbps=base.gbps(case.payload_bytes()), torch_spread=base.spread,
                           x_torch=base.median / ours.median)
        results.append(row)
        del data
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _progress(len(case_list), len(case_list), "done")
    sys.stderr.write("\n")
    # the limits again at the end: a drift shows the machine changed during the run
    limits_end = measure_limits(timer, quick=True)
    return {"environment": environment(device), "limits": limits, "limits_end": limits_end,
            "quick": quick, "results": results}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present, else cpu)")
    parser.add_argument("--quick", action="store_true", help="a short case list")
    parser.add_argument("--out", default="bench-results", help="folder for JSON, Markdown and PNG output")
    parser.add_argument("--name", default=None, help="file stem of the outputs (default: the device kind)")
    parser.add_argument("--only", default=None, help="run only cases whose description contains this text")
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("kvlayout bench: CUDA requested but not present", file=sys.stderr)
        return 2
    doc = run(device, args.quick, args.only, args.seed)
    stem = args.name or ("h200" if "H200" in doc["environment"].get("gpu", "") else device.type)
    os.makedirs(args.out, exist_ok=True)
    paths = write_reports(doc, args.out, stem)
    bad = [r["key"] for r in doc["results"] if not r["bit_exact"]]
    print(f"wrote {', '.join(paths)}")
    if bad:
        print(f"{len(bad)} cases were not bit-exact against the baseline:", *bad, sep="\n  ")
        return 1
    return 0
