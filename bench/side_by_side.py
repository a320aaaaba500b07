"""kvlayout beside LMCache's transfer kernel on the same tensors, in one process, timed alike.

    python -m kvlayout.bench.side_by_side --lmcache PATH [--tokens 256,4096] [--out DIR] [--ncu | --timeline]

``PATH`` is LMCache's compiled CUDA extension (the ``cuda_ops`` module of
LMCache 0.5.x, a ``.so`` file), a folder holding it, or an LMCache wheel
(the extension is read out of it; nothing else of LMCache is imported, so
none of its Python dependencies are needed). A wheel's extension loads only
under the torch release it was linked against; for another,
``scripts/build_lmcache_ops.py`` builds it from LMCache's sdist. Without ``--lmcache`` the
script imports ``lmcache.cuda_ops`` (or the older ``lmcache.c_ops``).

For every headline case (L32 H8 / H1 / MLA; each token count; to the host,
from the host, gather and scatter on the device) it builds the bench's
tensors once (``kvlayout.bench.cases.build``: a vLLM paged cache per layer,
an LMCache chunk ``[planes, L, T, row]``, page-granular slots) and times on
them:

* ``kvlayout``: ``ops.transfer`` as an engine calls it (``engine="auto"``);
* ``kvlayout kernel``: the same with ``engine="kernel"`` (host rows only,
  where auto may stage);
* ``kvlayout walk``: ``engine="kernel"`` under
  ``ops.set_host_launch_shape("walk")`` (host rows: the kernel's other launch
  shape, one CTA per SM, beside its default of one CTA per row);
* ``LMCache``: ``multi_layer_kv_transfer`` straight between the paged cache
  and the chunk (on the host: the kernel reads or writes pinned memory);
* ``LMCache staging`` (host rows): ``multi_layer_kv_transfer`` into a device
  chunk, then one pinned ``copy_`` (the other way round for loads).

Before timing, every call's output is checked bit for bit against the
first's (from the same starting contents). Each call is timed in both of
the bench's timings (:class:`kvlayout.bench.timing.Timer`): *idle* (the
device idle before the call: host issue time counts; kvlayout's "end to
end") and *overlapped* (issued while the device is busy: kvlayout's "kernel
only"), in ``--rounds`` rounds that visit the calls in turn, each round from
another call on, the median of the rounds' medians kept. The run's copy limits are measured at its start.

Writes ``DIR/side_by_side.jsonl`` (one row per case and call) and
``DIR/side_by_side.md`` (the table, kvlayout's default call against the
best LMCache call in each timing).

``--ncu`` instead profiles every call of every case with Nsight Compute, one
ncu process per call (its second call, as ``kvlayout bench --ncu`` does:
:mod:`kvlayout.bench.profile`'s counters), into ``DIR/side_by_side_ncu.{json,md}``:
the two libraries' kernels side by side, counters that say why one is faster.

``--timeline`` instead runs every call in the kernel-only timing's sequence
under the profiler (:func:`timeline`), into ``DIR/side_by_side_timeline.{jsonl,md}``:
how much of a call's time is its launch and how much its kernels, in place.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import zipfile

import torch

from kvlayout import ops
from kvlayout.ops import _native

from . import profile, trace
from .cases import SHAPES, Case, Inputs, _default_layouts, _with_setting, build, endpoints
from .report import markdown_table
from .timing import Timer, measure_limits

SHAPE_NAMES = ("L32_H8_D128", "L32_H1_D128", "L32_MLA_D576")
DIRECTIONS = ("to_host", "from_host", "gather_device", "scatter_device")

# LMCache's transfer direction (paged cache -> chunk is "D2H" whichever memory the chunk is in) and its
# engine cache formats: the vLLM flash-attention NHD cache per layer [2, blocks, page, heads, head_size],
# the vLLM MLA cache per layer [blocks, page, width]
LMCACHE_H2D, LMCACHE_D2H = 0, 1
LMCACHE_FLASH_NHD, LMCACHE_MLA = 1, 3


def _is_extension(filename: str) -> bool:
    """Whether ``filename`` (a base name) is LMCache's compiled CUDA extension (``cuda_ops``, earlier ``c_ops``)."""
    return filename.startswith(("cuda_ops.", "c_ops.")) and filename.endswith(".so")


def load_lmcache(path: str | None):
    """LMCache's CUDA extension module from ``path`` (a ``.so``, a folder holding one, or a wheel), or imported
    from an installed LMCache."""
    if path is None:
        for name in ("lmcache.cuda_ops", "lmcache.c_ops"):
            try:
                return importlib.import_module(name)
            except ImportError:
                continue
        raise SystemExit("side_by_side: no LMCache installed; pass --lmcache PATH (its cuda_ops .so or wheel)")
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as wheel:
            members = [m for m in wheel.namelist() if _is_extension(os.path.basename(m))]
            if not members:
                raise SystemExit(f"side_by_side: {path} holds no cuda_ops / c_ops extension")
            path = wheel.extract(members[0], tempfile.mkdtemp(prefix="lmcache_"))
    elif os.path.isdir(path):
        found = [os.path.join(root, f) for root, _, files in os.walk(path) for f in files if _is_extension(f)]
        if not found:
            raise SystemExit(f"side_by_side: no cuda_ops / c_ops extension under {path}")
        path = found[0]
    # LMCache's extension imports lmcache.lmcache_native as it loads: scripts/build_lmcache_ops.py builds that
    # module beside it, in a package folder of its own
    beside = os.path.dirname(os.path.abspath(path))
    if os.path.isfile(os.path.join(beside, "lmcache", "__init__.py")) and beside not in sys.path:
        sys.path.insert(0, beside)
    name = os.path.basename(path).split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _moves_host_rows(case: Case) -> bool:
    return case.direction in ("to_host", "from_host")


def call_names(case: Case) -> list[str]:
    """The calls timed for ``case``, in the order of :func:`kvlayout_calls` then :func:`lmcache_calls`: each
    library straight, and for host rows also kvlayout's kernel engine in either launch shape and LMCache's
    staging pattern."""
    host = _moves_host_rows(case)
    return (["kvlayout"] + (["kvlayout kernel", "kvlayout walk"] if host else []) + ["LMCache"]
            + (["LMCache staging"] if host else []))


def lmcache_calls(lmc, case: Case, data: dict) -> dict:
    """The LMCache calls doing ``case``'s job on ``data``'s tensors: the kernel straight, and (host rows) the
    staging pattern."""
    shape = SHAPES[case.shape]
    cache, chunk = data["cache"], data["buffer"].tensors[0]
    device = cache.tensors[0].device
    pointers = torch.tensor([t.data_ptr() for t in cache.tensors], dtype=torch.int64, device=device)
    slots = data["cache_slots"]
    stores = case.direction in ("to_host", "gather_device")
    common = dict(key_value_ptrs=pointers, slot_mapping=slots, paged_memory_device=device,
                  page_buffer_size=cache.geometry.N, direction=LMCACHE_D2H if stores else LMCACHE_H2D,
                  engine_kv_format=LMCACHE_MLA if shape.mla else LMCACHE_FLASH_NHD,
                  block_size=case.page_size, head_size=shape.D)

    def straight():
        lmc.multi_layer_kv_transfer(chunk, **common)
    calls = {"LMCache": straight}
    if _moves_host_rows(case):
        staging = torch.empty(chunk.shape, dtype=chunk.dtype, device=device)

        def staged():
            if stores:
                lmc.multi_layer_kv_transfer(staging, **common)
                chunk.copy_(staging, non_blocking=True)
            else:
                staging.copy_(chunk, non_blocking=True)
                lmc.multi_layer_kv_transfer(staging, **common)
        calls["LMCache staging"] = staged
    return calls


def kvlayout_calls(case: Case, data: dict) -> dict:
    src, ss, dst, ds = endpoints(case, data)
    calls = {"kvlayout": lambda: ops.transfer(src, dst, ss, ds)}
    if _moves_host_rows(case):
        calls["kvlayout kernel"] = lambda: ops.transfer(src, dst, ss, ds, engine="kernel")
        # (the bench's "walk" rows' setting, restored after each call)
        calls["kvlayout walk"] = _with_setting(dataclasses.replace(case, call="walk"), calls["kvlayout kernel"])
    return calls


def _outputs(case: Case, data: dict) -> list[torch.Tensor]:
    _, _, dst, _ = endpoints(case, data)
    return list(dst.tensors)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)


def check_same_output(case: Case, data: dict, calls: dict) -> None:
    """Every call, run from the same starting contents, leaves its output bit for bit as the first call
    does; raises naming the first that differs."""
    outputs = _outputs(case, data)
    start = [t.clone() for t in outputs]
    first = None
    for name, call in calls.items():
        for t, s in zip(outputs, start):
            t.copy_(s)
        call()
        if data["cache"].device.type == "cuda":
            torch.cuda.synchronize()
        result = [t.clone() for t in outputs]
        if first is None:
            first = (name, result)
            continue
        for i, (a, b) in enumerate(zip(first[1], result)):
            if not torch.equal(_bits(a), _bits(b)):
                raise AssertionError(f"side_by_side: {case.key}: {name} wrote tensor {i} of the output "
                                     f"unlike {first[0]}")


def time_calls(timer: Timer, calls: dict, rounds: int) -> dict:
    """Per call: median seconds idle and overlapped (median of the rounds' medians), and host seconds.

    Each round visits the calls in turn, round r from the r-th call on, so that no call is always timed
    first after another case's calls (whose memory the host's caches then hold)."""
    samples = {name: {"idle": [], "overlapped": [], "host": []} for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            call = calls[name]
            idle = timer(call)
            overlapped = timer(call, kernel_only=True, host_s=idle.host)
            samples[name]["idle"].append(idle.median)
            samples[name]["overlapped"].append(overlapped.median)
            samples[name]["host"].append(idle.host)
    return {name: {k: statistics.median(v) for k, v in s.items()} for name, s in samples.items()}


def headline_cases(tokens: list[int], shapes: list[str], directions: list[str]):
    for name in shapes:
        dev, buf = _default_layouts(SHAPES[name])
        for T in tokens:
            for direction in directions:
                yield Case("headline", name, dev, buf, T, 16, direction)


def measure(lmc, cases, rounds: int, reps: int):
    device = torch.device("cuda", torch.cuda.current_device())
    timer = Timer(device, reps=reps, budget_s=5.0)
    limits = measure_limits(timer, quick=True)
    yield {"limits": limits, "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "lmcache_module": getattr(lmc, "__file__", "")}
    inputs = Inputs(device)
    for case in cases:
        data = build(case, inputs)
        calls = {**kvlayout_calls(case, data), **lmcache_calls(lmc, case, data)}
        check_same_output(case, data, calls)
        times = time_calls(timer, calls, rounds)
        nbytes = case.payload_bytes()
        for call, t in times.items():
            yield {"shape": case.shape, "T": case.T, "direction": case.direction, "call": call, "bytes": nbytes,
                   "idle_gbps": nbytes / t["idle"] / 1e9, "overlapped_gbps": nbytes / t["overlapped"] / 1e9,
                   "host_us": t["host"] * 1e6}
        del data, calls
        torch.cuda.empty_cache()


def _case_label(case: Case) -> str:
    return f"{case.shape},{case.T},{case.direction}"


def _case_of(label: str) -> Case:
    shape, T, direction = label.split(",")
    return next(headline_cases([int(T)], [shape], [direction]))


def profile_call(lmc, label: str, call: str) -> int:
    """Runs one call of one case (``SHAPE,T,DIRECTION``) once warm, then once inside the profiler's window."""
    case = _case_of(label)
    data = build(case, Inputs(torch.device("cuda", torch.cuda.current_device())))
    fn = {**kvlayout_calls(case, data), **lmcache_calls(lmc, case, data)}[call]
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


def timeline(lmc, cases, reps: int):
    """Every call of every case in the kernel-only timing's sequence (L2 flush, the device held while the host
    issues the call, event, call, event), ``reps`` times under the profiler (device activities only), then a
    marker (:mod:`kvlayout.bench.trace`). Yields one row per case and call: the events' median µs beside where
    that time goes on the device, medians over the reps of :func:`trace.call_windows`' figures: from the hold's
    end to the call's first activity (launch), its activities' span, and its kernels' own durations, timed
    in place (not under ncu's replay of one kernel at a time)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device = torch.device("cuda", torch.cuda.current_device())
    timer = Timer(device)
    inputs = Inputs(device)
    yield {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "reps": reps}
    for case in cases:
        data = build(case, inputs)
        calls = {**kvlayout_calls(case, data), **lmcache_calls(lmc, case, data)}
        for name, call in calls.items():
            host_s = timer(call).host
            elapsed = []
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    timer.flush()
                    timer.hold(host_s)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    call()
                    end.record()
                    torch.cuda._sleep(0)         # (the marker that closes the call's activities)
                    end.synchronize()
                    elapsed.append(start.elapsed_time(end) * 1e3)
            windows = trace.call_windows(trace.device_activities(prof))
            if len(windows) != reps:
                raise RuntimeError(f"side_by_side --timeline: {case.key} {name}: {len(windows)} calls traced "
                                   f"of {reps}")
            yield {"case": _case_label(case), "call": name, "event_us": statistics.median(elapsed),
                   **{k: statistics.median(w[k] for w in windows) for k in TIMELINE_FIGURES},
                   "activities": max(w["activities"] for w in windows),
                   "names": sorted({n for w in windows for n in w["names"]})}
        del data, calls
        torch.cuda.empty_cache()


TIMELINE_FIGURES = ("launch_gap", "span", "busy", "kernel")
TIMELINE_HEADER = ["case", "call", "events µs", "launch gap µs", "span µs", "busy µs", "kernels µs",
                   "activities", "names"]


def timeline_markdown(header: dict, rows: list[dict]) -> str:
    cells = [[r["case"], r["call"], f"{r['event_us']:.2f}"] + [f"{r[k]:.2f}" for k in TIMELINE_FIGURES]
             + [str(r["activities"]), "; ".join(n[:48] for n in r["names"])] for r in rows]
    return (f"# kvlayout beside LMCache: each call's time on the device ({header['gpu']}, torch {header['torch']})"
            f"\n\nThe kernel-only timing's sequence under the profiler, medians of {header['reps']} calls: the "
            "events around the call; from the end of the kernel holding the device to the call's first activity "
            "(launch gap); from there to its last activity's end (span); the time some activity of the call runs "
            "(busy); its kernels' own durations.\n\n" + markdown_table(TIMELINE_HEADER, cells) + "\n")


NCU_HEADER = ["case", "call", "kernels"] + profile.COUNTER_HEADER


def _ncu_cells(r: dict) -> list[str]:
    return [r["case"], r["call"], str(r.get("kernels", "–"))] + profile.counter_cells(r)


def run_ncu(lmcache_path: str | None, cases, out: str, calls: list[str] | None = None) -> int:
    """Every call (of ``calls``, where given) of every case profiled in its own ncu process
    (:func:`profile_call`)."""
    ncu = profile.find_ncu()
    if ncu is None:
        print("side_by_side --ncu: Nsight Compute (ncu) not found", file=sys.stderr)
        return 2
    metrics = profile.available_metrics(ncu, list(profile.METRICS.values()) + list(profile.STALLS.values()))
    results = []
    for case in cases:
        for call in [c for c in call_names(case) if calls is None or c in calls]:
            args = ["-m", "kvlayout.bench.side_by_side", "--profile-case", _case_label(case), "--profile-call", call]
            if lmcache_path:
                args += ["--lmcache", lmcache_path]
            print(f"{_case_label(case)} {call}", file=sys.stderr, flush=True)
            results.append({"case": _case_label(case), "call": call, **profile.profiled(ncu, metrics, args)})
            with open(os.path.join(out, "side_by_side_ncu.json"), "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(0), "metrics": metrics, "results": results}, f,
                          indent=1)
            with open(os.path.join(out, "side_by_side_ncu.md"), "w") as f:
                f.write(f"# kvlayout beside LMCache: ncu counters ({torch.cuda.get_device_name(0)})\n\n"
                        "One ncu process per call (`--clock-control none`, the call's second run only); rates "
                        "are bytes over the kernels' summed `gpu__time_duration` (a staged or staging call's "
                        "copy-engine copies are not kernels and not counted).\n\n"
                        + markdown_table(NCU_HEADER, [_ncu_cells(r) for r in results]) + "\n")
    return 1 if any("error" in r for r in results) else 0


TIMINGS = ("overlapped", "idle")


def read(path: str) -> tuple[dict, list[dict]]:
    """(header, rows) of a ``side_by_side.jsonl``."""
    with open(path, encoding="utf-8") as f:
        header, *rows = [json.loads(line) for line in f if line.strip()]
    return header, rows


def _by_case(rows: list[dict]) -> dict[tuple, dict]:
    """The rows by (shape, T, direction), each case's calls by name."""
    cases: dict[tuple, dict] = {}
    for r in rows:
        cases.setdefault((r["shape"], r["T"], r["direction"]), {})[r["call"]] = r
    return cases


def ratios(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """Per case (shape, T, direction): kvlayout's default call / the best LMCache call, in each timing."""
    out = {}
    for case, calls in _by_case(rows).items():
        peers = [r for c, r in calls.items() if c.startswith("LMCache")]
        out[case] = {k: calls["kvlayout"][f"{k}_gbps"] / max(p[f"{k}_gbps"] for p in peers) for k in TIMINGS}
    return out


def standing(rows: list[dict]) -> str:
    """Ahead (ratio >= 1) and behind per timing, with the rows behind and their ratios."""
    by_case = ratios(rows)
    parts = []
    for timing, label in zip(TIMINGS, ("overlapped (kvlayout's kernel only)", "idle (end to end)")):
        behind = [(r[timing], case) for case, r in by_case.items() if r[timing] < 1.0]
        text = f"{label}: ahead on {len(by_case) - len(behind)} of {len(by_case)} rows, behind on {len(behind)}"
        if behind:
            text += " (" + ", ".join(f"{shape} T={T} {direction} {ratio:.3f}x"
                                     for ratio, (shape, T, direction) in sorted(behind)) + ")"
        parts.append(text)
    return "; ".join(parts)


def launch_shapes(rows: list[dict]) -> str:
    """kvlayout's kernel in its default host launch shape against the walk (``kvlayout kernel`` / ``kvlayout
    walk``) and against LMCache's direct kernel, in both timings, per host case of a run that timed both
    shapes whose payload the default moves one row per CTA (larger ones walk either way)."""
    parts = []
    for (shape, T, direction), calls in _by_case(rows).items():
        if "kvlayout walk" not in calls or calls["kvlayout walk"]["bytes"] > _native.HOST_ROW_PER_CTA_MAX_BYTES:
            continue
        kernel = calls["kvlayout kernel"]

        def ratio(other, k=kernel):
            return " / ".join(f"{k[f'{t}_gbps'] / other[f'{t}_gbps']:.2f}x" for t in TIMINGS)
        parts.append(f"{shape} T={T} {direction} {ratio(calls['kvlayout walk'])} the walk, "
                     f"{ratio(calls['LMCache'])} LMCache")
    return ("kvlayout's kernel moving host rows one per CTA (payloads up to "
            f"{_native.HOST_ROW_PER_CTA_MAX_BYTES >> 20} MiB) against its walk and against LMCache's kernel, "
            "kernel only / end to end: " + "; ".join(parts))


def markdown(header: dict, rows: list[dict]) -> str:
    lim = header["limits"]
    out = [f"# kvlayout beside LMCache, same tensors, one process ({header['gpu']}, torch {header['torch']})", "",
           "Limits at the start (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in lim.items()), "",
           "GB/s one way, overlapped (kvlayout's kernel only) / idle (end to end); ratio = kvlayout's default "
           "call / the best LMCache call in the same timing.", "",
           "| shape | T | direction | kvlayout | kvlayout kernel | kvlayout walk | LMCache | LMCache staging | "
           "ratio overlapped | ratio idle |", "|---|---|---|---|---|---|---|---|---|---|"]
    by_case = ratios(rows)

    def cell(r):
        return f"{r['overlapped_gbps']:.1f} / {r['idle_gbps']:.1f}" if r else ""
    for (shape, T, direction), calls in _by_case(rows).items():
        ratio = by_case[(shape, T, direction)]
        out.append(f"| {shape} | {T} | {direction} | {cell(calls['kvlayout'])} | "
                   f"{cell(calls.get('kvlayout kernel'))} | {cell(calls.get('kvlayout walk'))} | "
                   f"{cell(calls.get('LMCache'))} | "
                   f"{cell(calls.get('LMCache staging'))} | {ratio['overlapped']:.2f}x | {ratio['idle']:.2f}x |")
    return "\n".join(out) + "\n\n" + standing(rows) + "\n"


def write_record(rows, render, out: str, stem: str) -> int:
    """``rows`` (a header, then one row per case and call, as :func:`measure` and :func:`timeline` yield them)
    into ``out/stem.jsonl``, each written and printed as it comes, then ``render(header, rows)`` into
    ``out/stem.md``."""
    header, body = None, []
    with open(os.path.join(out, f"{stem}.jsonl"), "w") as f:
        for row in rows:
            line = json.dumps(row)
            print(line, file=f, flush=True)
            print(line, flush=True)
            if header is None:
                header = row
            else:
                body.append(row)
    table = render(header, body)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(table)
    print(table)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lmcache", help="LMCache's cuda_ops extension (.so), a folder holding it, or a wheel")
    parser.add_argument("--tokens", default="256,4096,32768")
    parser.add_argument("--shapes", default=",".join(SHAPE_NAMES))
    parser.add_argument("--directions", default=",".join(DIRECTIONS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=".")
    parser.add_argument("--ncu", action="store_true", help="profile every call with Nsight Compute instead")
    parser.add_argument("--timeline", action="store_true",
                        help="instead, where each call's kernel-only time goes on the device (profiler trace)")
    parser.add_argument("--calls", help="with --ncu: only these calls (comma-separated names, e.g. "
                                        "'kvlayout kernel,LMCache')")
    parser.add_argument("--profile-case", help=argparse.SUPPRESS)    # (one ncu process's case and call)
    parser.add_argument("--profile-call", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("side_by_side: needs a CUDA device", file=sys.stderr)
        return 2
    lmc = load_lmcache(args.lmcache)
    if args.profile_case:
        return profile_call(lmc, args.profile_case, args.profile_call)
    cases = list(headline_cases([int(t) for t in args.tokens.split(",")], args.shapes.split(","),
                                args.directions.split(",")))
    os.makedirs(args.out, exist_ok=True)
    if args.ncu:
        calls = args.calls.split(",") if args.calls else None
        unknown = sorted(set(calls or ()) - {c for case in cases for c in call_names(case)})
        if unknown:
            parser.error(f"--calls: no call named {', '.join(unknown)}")
        return run_ncu(args.lmcache, cases, args.out, calls)
    if args.timeline:
        return write_record(timeline(lmc, cases, args.reps), timeline_markdown, args.out, "side_by_side_timeline")
    # (the binding's own signature, on record beside the figures)
    print(f"LMCache: {getattr(lmc, '__file__', lmc)}\n{lmc.multi_layer_kv_transfer.__doc__}", flush=True)
    return write_record(measure(lmc, cases, args.rounds, args.reps), markdown, args.out, "side_by_side")


if __name__ == "__main__":
    sys.exit(main())
