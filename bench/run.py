"""``kvlayout bench``: measure kvlayout against the machine's copy limits and the torch baseline.

Every case is first checked bit-exact against the baseline (same input, both
outputs compared byte for byte on the device); a mismatch is reported and the
case is not timed.

Each finished case is appended at once to ``<out>/<name>.jsonl`` (first line:
the environment and the limits measured at the start; then one object per
case; last: the limits measured at the end), so a run that is cut short keeps
what it finished, and ``--resume`` continues it.  The JSON, Markdown and PNG
reports are written from that file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

import torch

from kvlayout import ops
from kvlayout.cli import UsageError, writable_dir
from kvlayout.conformance.environment import source_digest

from . import cases as C
from .report import write_reports
from .timing import SameSizeCopies, Timer, Timing, drifted, host_copy_gbps, host_key, measure_limits

# A CPU run sets torch's thread count to this for kvlayout (whose CPU kernel splits tokens over torch's
# threads) and the torch baseline alike: a fixed count keeps the two comparable and the figures comparable
# between machines; torch's default, one thread per core, collapses when other work shares the cores
CPU_THREADS = 1


def _device_copies(tensors, device) -> list[torch.Tensor]:
    return [t.to(device, copy=True) for t in tensors]


def _restore(tensors, saved) -> None:
    for t, s in zip(tensors, saved):
        t.copy_(s)


def _same_bytes(tensors, others, device) -> bool:
    """Whether each of ``tensors`` (on ``device``) holds the same bytes as its twin in ``others``."""
    return all(torch.equal(a.view(torch.uint8), b.to(device).view(torch.uint8)) for a, b in zip(tensors, others))


def check_bit_exact(case: C.Case, data: dict, timer: Timer) -> bool:
    """Run kvlayout and each form of the baseline from the same start; compare every destination byte (on the
    device) of each baseline form with kvlayout's."""
    _, _, dst, _ = C.endpoints(case, data)
    start = _device_copies(dst.tensors, timer.device)
    C.kvlayout_fn(case, data)()
    timer.sync()
    ours = _device_copies(dst.tensors, timer.device)
    ok = True
    for baseline in C.torch_fns(case, data).values():
        _restore(dst.tensors, start)
        baseline()
        timer.sync()
        ok = ok and _same_bytes(ours, dst.tensors, timer.device)
    _restore(dst.tensors, start)
    timer.sync()
    return ok


def check_new_lengths(case: C.Case, data: dict, timer: Timer) -> bool:
    """A "new-length" or spread row's bytes: its call of each of
    :func:`kvlayout.bench.cases.new_length_checks`' lengths (issued directly, then its reuse prefix's graph
    captured and replayed, the rest moved by the direct kernel)
    against the kernel engine's call of the same tokens from the same start (the kernel engine's rows are
    checked against the torch baseline)."""
    src, ss, dst, ds = C.endpoints(case, data)
    start = _device_copies(dst.tensors, timer.device)
    ok = True
    for tokens in C.new_length_checks(case):
        s, d = C.new_length_slots(ss, ds, tokens)
        results = []
        for engine in (case.engine, "kernel"):
            _restore(dst.tensors, start)
            C._with_setting(case, lambda: ops.transfer(src, dst, s, d, max_ctas=case.max_ctas, engine=engine))()
            timer.sync()
            results.append(_device_copies(dst.tensors, timer.device))
        ok = ok and _same_bytes(*results, timer.device)
    _restore(dst.tensors, start)
    timer.sync()
    return ok


def check_untouched(case: C.Case, data: dict, timer: Timer) -> bool:
    """A case with every slot -1 moves nothing: the destination keeps every byte."""
    _, _, dst, _ = C.endpoints(case, data)
    start = _device_copies(dst.tensors, timer.device)
    C.kvlayout_fn(case, data)()
    timer.sync()
    return _same_bytes(start, dst.tensors, timer.device)


GROUPS = ("headline", "layouts", "layerwise", "ctas", "host_hints", "copy_engine", "staged", "host_cost")


def selected(case: C.Case, only: str | None) -> bool:
    """``only``: comma-separated terms; a term that names a group selects that group's cases, any other term
    the cases whose description contains it."""
    if not only:
        return True
    terms = [t.strip() for t in only.split(",") if t.strip()]
    return any(case.group == t if t in GROUPS else t in case.key for t in terms)


def _progress(i: int, n: int, label: str) -> None:
    width = 30
    done = int(width * i / max(n, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label[:70]:<70}")
    sys.stderr.flush()


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "source_digest": source_digest()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda,
                   l2_bytes=props.L2_cache_size,
                   calibration=ops.calibrate(device))   # (engine="auto"'s rule on this device, before any case)
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                   baseline_threads=torch.get_num_threads())
    return env


def measure_case(case: C.Case, data: dict, timer: Timer, baseline_timer: Timer, limits: dict,
                 same_size: SameSizeCopies | None) -> dict:
    """One result row: bit-exactness, then (if exact) kvlayout and torch times against the limits.

    kvlayout is timed with ``timer``; the torch baseline (a comparison, some of
    its paths index on the host and take long) with ``baseline_timer``.
    """
    row = {"group": case.group, "shape": case.shape, "device_layout": case.device_layout,
           "buffer_layout": case.buffer_layout, "T": case.T, "page_size": case.page_size,
           "direction": case.direction, "layerwise": case.layerwise, "max_ctas": case.max_ctas,
           "engine": case.engine, "call": case.call, "payload_bytes": case.payload_bytes(), "key": case.key}
    check = (check_untouched if case.empty else check_new_lengths if C.call_lengths(case)
             else check_bit_exact)
    row["bit_exact"] = check(case, data, timer)
    if not row["bit_exact"]:
        return row
    nbytes = case.payload_bytes()
    fn = C.kvlayout_fn(case, data)
    if case.empty:
        # nothing moved: only the host time means something; beside it, in turn within each repetition, torch's
        # own per op and a bare launch (the yardsticks of the budget: a call costs at most one torch op, a
        # prepared layer call at most a bare launch + 1 µs)
        host = timer.host_side_by_side({"ours": fn, "torch_op": C.torch_op_fn(timer.device, case.calls),
                                        "launch": C.launch_fn(timer.device, case.calls)})
        per_call = {name: seconds * 1e6 / case.calls for name, seconds in host.items()}
        row.update(median_us=host["ours"] * 1e6, host_us=host["ours"] * 1e6, host_us_per_call=per_call["ours"],
                   torch_op_host_us=per_call["torch_op"], launch_host_us=per_call["launch"],
                   x_torch_op=per_call["ours"] / per_call["torch_op"],
                   over_launch_us=per_call["ours"] - per_call["launch"])
        return row
    ours = timer(fn)
    row.update(median_us=ours.median * 1e6, host_us=ours.host * 1e6, host_us_per_call=ours.host * 1e6 / case.calls)
    row.update(gbps=ours.gbps(nbytes), spread=ours.spread)
    if timer.cuda:
        kernel = timer(fn, kernel_only=True, host_s=ours.host)
        row.update(kernel_gbps=kernel.gbps(nbytes), kernel_us=kernel.median * 1e6)
    host = case.direction in ("to_host", "from_host") and timer.cuda
    limit_name = f"{host_key(case.direction)}_256MiB" if host else "D2D"
    row.update(limit_name=limit_name, limit_gbps=limits[limit_name],
               pct_of_limit=100 * row["gbps"] / limits[limit_name])
    if host and same_size is not None:
        row["same_size_gbps"] = same_size.gbps(case.direction, nbytes)
        row["pct_of_same_size"] = 100 * row["gbps"] / row["same_size_gbps"]
    if case.max_ctas == 0 and case.engine == "kernel" and not case.empty and case.group not in ("host_hints",
                                                                                                 "staged"):
        row.update(time_baseline(case, data, baseline_timer, nbytes, ours.median))   # (those: their twins')
    if host and nbytes <= OWN_HOST_COPY_MAX:
        # last: a copy to the host overwrites the case's host bytes
        row["own_host_copy_gbps"] = own_host_copy_gbps(case, data, timer, nbytes)
    if case.engine == "copy":
        row.update(time_run_list(case, data))
    if timer.cuda:
        row.update(C.staged_counts(case, data))
    return row


OWN_HOST_COPY_MAX = 64 << 20   # (bytes) host cases whose own host memory's copy rate is timed too


def own_host_copy_gbps(case: C.Case, data: dict, timer: Timer, nbytes: int) -> float:
    """GB/s of one ``copy_`` of ``nbytes`` between a device buffer and the case's own pinned host memory (its
    first host tensor's bytes, carved from the run's host arena), in the case's direction: beside the same-size
    copy of a fresh pinned buffer timed before the first case, whether this case's host memory itself copies
    slowly at this point of the run (a 4 MiB copy timed between cases once ran at a sixth of its rate)."""
    host = data["buffer"].tensors[0]
    storage, start = host.untyped_storage(), host.storage_offset() * host.element_size()
    nbytes = min(nbytes, storage.nbytes() - start)
    host_bytes = torch.empty(0, dtype=torch.uint8).set_(storage, start, (nbytes,))
    device_bytes = torch.empty(nbytes, dtype=torch.uint8, device=timer.device)
    return host_copy_gbps(timer, host_bytes, device_bytes, case.direction)


def time_run_list(case: C.Case, data: dict, reps: int = 20) -> dict:
    """A copy-engine row's run list alone: built in C++ as the call builds it, not issued (median host µs), and
    how many copies it holds. The rest of the call's host time is the driver's.

    Where the row's list holds fewer than the target's 8,192 copies, the same case at a larger token count
    (whole pages, enough for 8,192 copies or more) is timed too (``runs_at_target``, ``run_list_at_target_us``),
    on unfilled CPU tensors of the same geometry (:class:`~kvlayout.bench.cases.AddressInputs`): the list reads
    addresses and slots only, and scaling the row's short list up would count the call's fixed part again per
    multiple."""
    runs, built = time_run_list_builds(C.copy_run_list_fn(case, data), reps)
    row = {"runs": runs, "run_list_us": built.median * 1e6, "run_list_spread": built.spread}
    if 0 < runs < C.COPY_ENGINE_RUNS:
        tokens = case.T * -(-C.COPY_ENGINE_RUNS // runs)
        tokens += -tokens % case.page_size
        large = dataclasses.replace(case, T=tokens)
        large_data = C.build(large, C.AddressInputs(), min_cache_slots=2 * tokens)
        runs, built = time_run_list_builds(C.copy_run_list_fn(large, large_data), reps)
        row.update(runs_at_target=runs, run_list_at_target_us=built.median * 1e6,
                   run_list_at_target_spread=built.spread)
    return row


def time_run_list_builds(build, reps: int) -> tuple[int, Timing]:
    """(copies, the host seconds of ``reps`` builds: median, percentiles and spread) of a run-list builder
    (``copy_run_list_fn``), after one build that counts the copies. The spread tells a host busy with other work
    while the list was built from a list slow to build."""
    runs = build()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        build()
        samples.append(time.perf_counter() - t0)
    return runs, Timing.of(samples)


def time_baseline(case: C.Case, data: dict, baseline_timer: Timer, nbytes: int, ours_s: float) -> dict:
    """Every form of the torch baseline that applies (:data:`kvlayout.bench.cases.TORCH_FORMS`); ``x_torch``
    against the faster form, named by ``torch_form``."""
    timings = {form: baseline_timer(fn) for form, fn in C.torch_fns(case, data).items()}
    best = min(timings, key=lambda form: timings[form].median)
    out = {f"torch_{form}_gbps": t.gbps(nbytes) for form, t in timings.items()}
    out.update({f"torch_{form}_spread": t.spread for form, t in timings.items()})
    out.update(torch_form=best, torch_gbps=timings[best].gbps(nbytes), torch_spread=timings[best].spread,
               x_torch=timings[best].median / ours_s)
    return out


def read_jsonl(path: str) -> tuple[dict | None, list[dict], dict | None]:
    """(run head, case rows, end limits) of a JSON-lines record; a line cut off by an interrupted run is skipped."""
    head, rows, end = None, [], None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:      # a line cut off by an interrupted run
                continue
            kind = obj.pop("kind", None)
            if kind == "run":
                head = obj
            elif kind == "case":
                rows.append(obj)
            elif kind == "limits_end":
                end = obj["limits"]
    return head, rows, end


def document(path: str) -> dict:
    """The result document of a (finished or interrupted) JSON-lines file."""
    head, rows, end = read_jsonl(path)
    if head is None:
        raise ValueError(f"{path}: no run header line")
    doc = dict(head, results=rows)
    if end is not None:
        doc["limits_end"] = end
        doc["limits_drift"] = drifted(head["limits"], end)
    return doc


def planned(device: torch.device, quick: bool, only: str | None) -> list[C.Case]:
    """The cases a run on ``device`` measures; a :class:`UsageError` when ``only`` selects none of them."""
    every = C.device_cases(device.type, quick)
    cases = [c for c in every if selected(c, only)]
    if not cases:
        raise UsageError(f"--only {only!r} selects none of the {len(every)} cases of a {device.type} run "
                         f"(give group names: {', '.join(GROUPS)}, or texts of case descriptions)")
    return cases


def run(device: torch.device, quick: bool, only: str | None = None, seed: int = 0, *,
        jsonl: str | None = None, resume: bool = False) -> dict:
    """Measure limits then every selected case, appending each to ``jsonl``; returns the result document.

    Raises :class:`UsageError` (before ``jsonl`` is touched) when ``only`` selects no case.  On a CPU, torch
    runs on :data:`CPU_THREADS` threads meanwhile.
    """
    case_list = planned(device, quick, only)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(CPU_THREADS)
    try:
        return _run(device, quick, case_list, seed, jsonl, resume)
    finally:
        torch.set_num_threads(threads)


def _run(device: torch.device, quick: bool, case_list: list[C.Case], seed: int, jsonl: str | None,
         resume: bool) -> dict:
    timer = Timer(device, warmup=1 if quick else 2, reps=7 if quick else 11, budget_s=0.5 if quick else 1.5)
    # the baseline is already warm from the bit-exact check; some of its paths index on the host and are slow
    baseline_timer = Timer(device, warmup=0, reps=7, min_reps=2, budget_s=0.5)
    done: set[str] = set()
    if resume and jsonl and os.path.exists(jsonl):
        head, rows, _ = read_jsonl(jsonl)
        done = {r["key"] for r in rows}
        limits = head["limits"] if head else None
        print(f"kvlayout bench: resuming {jsonl}: {len(done)} cases already measured", file=sys.stderr)
    else:
        head, limits = None, None
        if jsonl:
            open(jsonl, "w").close()
    same_size = None
    if device.type == "cuda":
        same_size = SameSizeCopies(timer, head.get("same_size") if head else None)
    if limits is None:
        limits = measure_limits(timer, quick=quick)
        head = {"environment": environment(device), "limits": limits, "quick": quick, "seed": seed}
    if same_size is not None:
        # before the first case, also for a resumed run whose header lacks some of its sizes
        same_size.measure(c.payload_bytes() for c in case_list
                          if c.direction in ("to_host", "from_host") and not c.empty)
        head["same_size"] = same_size.table()
    if jsonl and not done:
        _append(jsonl, dict(head, kind="run"))
    inputs = C.Inputs(device, seed)
    results = []
    for i, case in enumerate(case_list):
        if case.key in done:
            continue
        _progress(i, len(case_list), case.key)
        data = C.build(case, inputs)
        row = measure_case(case, data, timer, baseline_timer, limits, same_size)
        results.append(row)
        if jsonl:
            _append(jsonl, dict(row, kind="case"))
        del data
        if device.type == "cuda":
            # what a case allocated besides its tensors (which come from the arenas of `inputs`) goes back: a
            # merged baseline's device buffer holds a whole payload (4 GiB at L32 H8 T = 32768)
            torch.cuda.empty_cache()
    _progress(len(case_list), len(case_list), "done")
    sys.stderr.write("\n")
    # the limits again at the end: a drift shows the machine changed during the run
    limits_end = measure_limits(timer, quick=True)
    if jsonl:
        _append(jsonl, {"kind": "limits_end", "limits": limits_end})
        return document(jsonl)
    return dict(head, results=results, limits_end=limits_end, limits_drift=drifted(limits, limits_end))


def _append(path: str, obj: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present, else cpu)")
    parser.add_argument("--quick", action="store_true", help="a short case list")
    parser.add_argument("--out", default="results/bench", help="folder of all outputs (default: %(default)s)")
    parser.add_argument("--name", default=None, help="file stem of the outputs (default: the device kind)")
    parser.add_argument("--only", default=None,
                        help="comma-separated: run only cases of these groups (headline, layouts, layerwise, ctas, "
                             "host_hints, copy_engine, staged, host_cost) or whose description contains one of "
                             "these texts")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run recorded in <out>/<name>.jsonl (skips the cases it holds)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the cache contents and slots (default 0)")
    parser.add_argument("--ncu", action="store_true",
                        help="hardware counters (Nsight Compute) of the cases that miss their targets, one ncu "
                             "process per case: <out>/<name>_ncu.{json,md} (see kvlayout.bench.profile)")
    parser.add_argument("--profile-case", default=None, metavar="KEY",
                        help="run the case with this key once warm, then once between cudaProfilerStart/Stop "
                             "(what --ncu runs under the profiler)")


def main(args: argparse.Namespace) -> int:
    """``kvlayout bench`` (usage errors raise :class:`~kvlayout.cli.UsageError`: one line, exit status 2)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not present on this machine")
    if args.profile_case:
        from .profile import profile_case

        return profile_case(args.profile_case, device)
    stem = args.name or ("h200" if device.type == "cuda" and "H200" in torch.cuda.get_device_name(device)
                         else device.type)
    if not args.ncu:
        planned(device, args.quick, args.only)  # a selection of nothing stops here, before any file is written
    writable_dir(args.out)
    if args.ncu:
        from .profile import run_ncu

        return run_ncu(args.out, stem, args.only)
    doc = run(device, args.quick, args.only, args.seed, jsonl=os.path.join(args.out, f"{stem}.jsonl"),
              resume=args.resume)
    paths = write_reports(doc, args.out, stem)
    bad = [r["key"] for r in doc["results"] if not r["bit_exact"]]
    print(f"wrote {', '.join(paths)}")
    if doc.get("limits_drift"):
        print("WARNING: the machine's limits moved by more than 5 % during the run:",
              ", ".join(f"{k} {a:.1f} -> {b:.1f} GB/s" for k, (a, b) in doc["limits_drift"].items()), file=sys.stderr)
    if bad:
        print(f"{len(bad)} cases were not bit-exact against the baseline:", *bad, sep="\n  ")
        return 1
    return 0
