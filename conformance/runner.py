"""``kvlayout conformance``: every op on every requested device against the reference.

For each operation family of the case database
(:data:`kvlayout.conformance.families.FAMILIES`) and device, hypothesis draws
``--examples`` samples (seeded by ``--seed``, the family and the device: the
same command draws the same cases) and runs each one.  Failures are then
shrunk, per layout family, to a minimal failing sample whose replay command
(``kvlayout conformance --device D --replay '<repr>'``) goes into the report.

The reports (``<name>.json`` and ``<name>.md``) go to ``--out`` (default
``results/conformance``, a git-ignored folder); the committed records in
``conformance/reports`` are refreshed only by naming that folder.

Exit status: 0 when every case passed; 1 when a case failed (or the sanitizer
found errors); 2 on a usage error (one line on standard error) or when none of
the requested devices could be tested; 3 when ``--sanitize`` was asked for but
the sanitizer could not run.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the reference runs on the CPU; jax must not take GPU memory

import argparse
import ast
import collections
import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib

EXAMPLE_PRESETS = {"small": 10, "default": 100, "large": 1000}
DEFAULT_EXAMPLES = EXAMPLE_PRESETS["default"]
"""Cases per operation family and device (the README's main command uses it: conformance/reports/cpu.md)."""

DEFAULT_OUT = os.path.join("results", "conformance")
"""Where the reports go unless ``--out`` names another folder (git-ignored; relative to the working folder)."""

SANITIZE_FAMILIES = "bad_input,fuzz_index,hostile,transfer,staged"
SANITIZE_SCOPE = ("runs the families " + ", ".join(SANITIZE_FAMILIES.split(",")[:-1]) + " and "
                  + SANITIZE_FAMILIES.split(",")[-1] + " once more on CUDA, under compute-sanitizer memcheck, "
                  "with --sanitize-examples cases each (with --only, those of them it selects)")
"""What ``--sanitize`` does, in the words the help, the report and the docs use."""
MAX_SHRUNK_GROUPS = 6
"""Failing groups shrunk per family and device; later ones report their first failing case as drawn."""


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

def _examples(text: str) -> int:
    if text in EXAMPLE_PRESETS:
        return EXAMPLE_PRESETS[text]
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--examples takes a number or one of {', '.join(EXAMPLE_PRESETS)}") from None
    if n < 1:
        raise argparse.ArgumentTypeError("--examples must be >= 1")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", metavar="LIST",
                        help="devices to test: comma-separated cpu, cuda, xpu, or 'all' (default: cpu)")
    parser.add_argument("--examples", type=_examples, default=DEFAULT_EXAMPLES, metavar="N",
                        help=f"cases per operation family and device, or {'/'.join(EXAMPLE_PRESETS)} "
                             f"({', '.join(f'{k} = {v}' for k, v in EXAMPLE_PRESETS.items())}; "
                             f"default {DEFAULT_EXAMPLES})")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the case generation: the same seed, family and device draw the same cases "
                             "(default 0)")
    parser.add_argument("--only", metavar="PATTERN",
                        help="comma-separated shell patterns over family names (transfer, prepared, staged, "
                             "gather, scatter, move, pages, rope, fuzz_index, bad_input, hostile)")
    parser.add_argument("--replay", metavar="SAMPLE",
                        help="run one sample, given as its repr (the reproducer of a report), on --device and "
                             "print the outcome with the traceback")
    parser.add_argument("--out", "--report", dest="out", default=DEFAULT_OUT, metavar="DIR",
                        help=f"write DIR/<name>.json and DIR/<name>.md (name: cpu, h200, or the device kind; "
                             f"default: {DEFAULT_OUT}; the committed records are refreshed with "
                             f"--out conformance/reports)")
    parser.add_argument("--sanitize", action="store_true", help=f"{SANITIZE_SCOPE} (needs a CUDA device)")
    parser.add_argument("--sanitize-examples", type=_examples, default=EXAMPLE_PRESETS["small"], metavar="N",
                        help="cases per family in the sanitizer run (default: small)")
    parser.add_argument("--jobs", type=int, default=0, metavar="N",
                        help="worker processes (default: one per CPU core, at most 8; 1 = in this process)")
    parser.add_argument("--shrink-seconds", type=float, default=60.0, metavar="S",
                        help="time spent shrinking each failing group to a minimal case (default 60; 0 = off)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--fuzz-report", metavar="FILE",
                        help="also write FILE (Markdown) and a .json twin: cases, crashes, out-of-bounds writes "
                             "(guard bytes; with --sanitize the sanitizer's errors) and whether every refusal named "
                             "its argument; e.g. --only hostile --examples 10000")


def main(argv: list[str] | None = None) -> int:
    """``kvlayout conformance ARGS`` (also ``python -m kvlayout.conformance.runner ARGS``); the exit status."""
    from kvlayout.cli import ArgumentParser, UsageError

    parser = ArgumentParser(prog="kvlayout conformance", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return run(parser.parse_args(argv))
    except UsageError as e:
        print(f"kvlayout conformance: {e}", file=sys.stderr)
        return e.code


def command_line(args) -> str:
    """The command, options in canonical order, defaults left out (except the device list)."""
    parts = ["kvlayout", "conformance", "--device", args.device]
    if args.examples != DEFAULT_EXAMPLES:
        parts += ["--examples", str(args.examples)]
    if args.seed:
        parts += ["--seed", str(args.seed)]
    if args.only:
        parts += ["--only", args.only]
    if args.out != DEFAULT_OUT:
        parts += ["--out", args.out]
    if args.sanitize:
        parts.append("--sanitize")
        if args.sanitize_examples != EXAMPLE_PRESETS["small"]:
            parts += ["--sanitize-examples", str(args.sanitize_examples)]
    if args.jobs:
        parts += ["--jobs", str(args.jobs)]
    if args.shrink_seconds != 60.0:
        parts += ["--shrink-seconds", f"{args.shrink_seconds:g}"]
    return " ".join(shlex.quote(p) for p in parts)


# ---------------------------------------------------------------------------------------
# One family on one device (runs in a worker process or in this one)
# ---------------------------------------------------------------------------------------

class _Failed(Exception):
    pass


def _seed(*parts) -> int:
    return zlib.crc32("/".join(str(p) for p in parts).encode())


def _settings(n: int, phases):
    from hypothesis import HealthCheck, Verbosity, settings

    return settings(max_examples=n, database=None, deadline=None, derandomize=False, phases=phases,
                    suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
                    report_multiple_bugs=False, print_blob=False)


_CRASH_FILE: str | None = None
"""Where a worker writes the sample it is about to run (description, then repr), so that a sample that
kills the process (a segmentation fault in a native op) can still be reported."""


def replay_command(case, device: str) -> str:
    """The reproducer of a sample: its repr and the one fixed driver."""
    return f"kvlayout conformance --device {device} --replay {shlex.quote(repr(case))}"


def check(case, device: str) -> str | None:
    """Run the sample on ``device``: ``None`` if it passes, else what went wrong."""
    from .families.core import clear_errors

    clear_errors(device)   # a previous case may have left an error behind
    if _CRASH_FILE:
        with open(_CRASH_FILE, "w", encoding="utf-8") as f:
            f.write(f"{case.describe()}\n{repr(case)}\n")
    try:
        case.run(device)
    except Exception as e:  # noqa: BLE001 - every failure is a finding
        text = f"{type(e).__name__}: {e}"
        return text if len(text) <= 2000 else text[:2000] + " ..."
    return None


def _planned(family: str, device: str, examples: int) -> list[tuple[str | None, int]]:
    from .families import FAMILIES

    groups = FAMILIES[family].groups(device)
    if groups is None:
        return [(None, examples)]
    base, extra = divmod(examples, len(groups))
    return [(g, max(1, base + (i < extra))) for i, g in enumerate(groups)]


def planned_cases(family: str, device: str, examples: int) -> int:
    return sum(n for _, n in _planned(family, device, examples))


def _shrink(family: str, device: str, group: str, seed: int, examples: int, seconds: float):
    """A minimal failing case of ``group`` (hypothesis shrinking), or ``None``."""
    from hypothesis import Phase, given
    from hypothesis import seed as hseed

    from .families import FAMILIES

    memo: dict[str, str | None] = {}
    deadline = time.monotonic() + seconds
    best = [None]

    @hseed(_seed(seed, family, device, group, "shrink"))
    @_settings(max(examples, 50), [Phase.generate, Phase.shrink])
    @given(FAMILIES[family].strategy(device, group))
    def body(case):
        key = repr(case)
        if key not in memo:
            if time.monotonic() > deadline:
                return   # out of time: new candidates count as passing, so shrinking stops
            memo[key] = check(case, device)
        if memo[key] is not None and case.group() == group:
            best[0] = (case, memo[key])
            raise _Failed(memo[key])

    try:
        body()
    except _Failed:
        pass
    except Exception:  # noqa: BLE001 - e.g. no failing case found again
        pass
    return best[0]


def run_task(family: str, device: str, examples: int, seed: int, shrink_seconds: float, progress=None) -> dict:
    """Generate, check and (on failure) shrink the cases of one family on one device."""
    from hypothesis import Phase, given
    from hypothesis import seed as hseed

    from .families import FAMILIES
    from .families.core import REFUSALS

    progress = progress or (lambda n, label: None)
    refusals_before = REFUSALS.copy()
    fam = FAMILIES[family]
    groups: dict[str, dict] = {}
    failures: dict[str, list] = collections.defaultdict(list)
    started = time.perf_counter()
    ran = 0
    planned = _planned(family, device, examples)
    for group, n in planned:
        @hseed(_seed(seed, family, device, group or ""))
        @_settings(n, [Phase.generate])
        @given(fam.strategy(device, group))
        def generate(case):
            nonlocal ran
            t0 = time.perf_counter()
            message = check(case, device)
            g = case.group()
            rec = groups.setdefault(g, {"cases": 0, "passed": 0, "failed": 0, "seconds": 0.0,
                                        "variants": collections.Counter()})
            rec["cases"] += 1
            rec["passed" if message is None else "failed"] += 1
            rec["seconds"] += time.perf_counter() - t0
            rec["variants"][_variant(case)] += 1
            if message is not None:
                failures[g].append((case, message))
            ran += 1
            progress(1, f"{family} {device}")

        generate()
    progress(max(0, sum(n for _, n in planned) - ran), f"{family} {device}")

    reports = []
    for i, (g, items) in enumerate(failures.items()):
        case, message = items[0]
        reduced = False
        if i < MAX_SHRUNK_GROUPS and shrink_seconds > 0:
            progress(0, f"shrinking {family} {g} {device}")
            minimal = _shrink(family, device, g, seed, examples, shrink_seconds)
            if minimal is not None:
                case, message = minimal
                reduced = True
        reports.append({"family": family, "layouts": g, "device": device, "failed_cases": len(items),
                        "reduced": reduced, "description": case.describe(), "message": message,
                        "reproducer": replay_command(case, device),
                        "first_failures": [c.describe() for c, _ in items[:5]]})
    for rec in groups.values():
        rec["variants"] = dict(sorted(rec["variants"].items()))
    return {"family": family, "device": device, "groups": groups, "failures": reports,
            "seconds": time.perf_counter() - started, "refusals": dict(REFUSALS - refusals_before),
            "failure_kinds": dict(collections.Counter(_failure_kind(m) for items in failures.values()
                                                      for _, m in items))}


def _failure_kind(message: str) -> str:
    """What a failing case's message says went wrong (for ``--fuzz-report``)."""
    if "a write outside the tensor" in message:
        return "out_of_bounds"
    if "does not match" in message:
        return "unnamed_refusal"
    if "nothing was raised" in message or message.startswith("AssertionError: expected "):
        return "not_refused"
    return "other"


def _variant(case) -> str:
    """Placement / path / dtype details counted per group in the JSON report."""
    parts = []
    for attr in ("placement", "path"):
        v = getattr(case, attr, None)
        if v is not None:
            parts.append(str(v))
    if getattr(case, "pinned_out", False) or getattr(case, "pinned_rows", False):
        parts.append("pinned host")
    if getattr(case, "engine", "kernel") != "kernel":
        parts.append(f"{case.engine} engine")
    dtype = getattr(case, "dtype", None) or getattr(getattr(case, "case", None), "dtype", None)
    if dtype:
        parts.append(dtype)
    return " ".join(parts) or "-"


# ---------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------

class Progress:
    """A progress bar on stderr (a line every 10 % when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = max(1, total), 0, enabled
        self.tty = sys.stderr.isatty()
        self.start = time.monotonic()
        self.last_decile = -1
        self.lock = threading.Lock()

    def __call__(self, n: int, label: str) -> None:
        with self.lock:
            self.done = min(self.total, self.done + n)
            if not self.enabled:
                return
            frac = self.done / self.total
            elapsed = time.monotonic() - self.start
            if self.tty:
                width = 30
                bar = "#" * int(width * frac) + "." * (width - int(width * frac))
                sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:5.0f}s {label[:48]:<48}")
                sys.stderr.flush()
            elif int(frac * 10) > self.last_decile:
                self.last_decile = int(frac * 10)
                sys.stderr.write(f"conformance: {self.done}/{self.total} cases ({elapsed:.0f}s) {label}\n")
                sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


_worker_queue = None


def _init_worker(queue) -> None:
    global _worker_queue
    _worker_queue = queue


def _worker_task(family, device, examples, seed, shrink_seconds, crash_file) -> dict:
    global _CRASH_FILE
    _CRASH_FILE = crash_file
    result = run_task(family, device, examples, seed, shrink_seconds,
                      progress=lambda n, label: _worker_queue.put((n, label)))
    _CRASH_FILE = None
    os.remove(crash_file) if os.path.exists(crash_file) else None
    return result


def _died(task: tuple, error: BaseException, crash_file: str) -> dict:
    """The result of a task whose worker process died (or whose pool broke while it ran)."""
    family, device = task[0], task[1]
    lines = []
    if os.path.exists(crash_file):
        with open(crash_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    description = lines[0] if lines else "(no case had started)"
    message = (f"{type(error).__name__}: {error}. A worker process died (e.g. a segmentation fault in a native "
               "op) while this family ran; the case shown was running in this task at that moment. "
               f"Rerun with --jobs 1 --only {family} for the traceback.")
    return {"family": family, "device": device, "seconds": 0.0,
            "groups": {"(process died)": {"cases": 1, "passed": 0, "failed": 1, "seconds": 0.0, "variants": {}}},
            "failures": [{"family": family, "layouts": "(process died)", "device": device, "failed_cases": 1,
                          "reduced": False, "description": description, "message": message,
                          "reproducer": f"kvlayout conformance --device {device} --replay {shlex.quote(lines[1])}"
                          if len(lines) > 1 else "", "first_failures": []}]}


def _run_tasks(tasks: list[tuple], jobs: int, progress: Progress) -> list[dict]:
    """Run (family, device, ...) tasks: in this process with ``jobs <= 1``; else each task in a process of its
    own, ``jobs`` at a time, so that a case that kills its process is reported (with the case) and neither ends
    the run nor takes other tasks' results with it."""
    if jobs <= 1:
        return [run_task(*t, progress=progress) for t in tasks]
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    stop = threading.Event()

    def drain():
        while not stop.is_set():
            try:
                n, label = queue.get(timeout=0.2)
            except Exception:  # noqa: BLE001 - queue.Empty
                continue
            progress(n, label)

    crash_dir = tempfile.mkdtemp(prefix="kvlayout-conformance-")

    def isolated(task: tuple) -> dict:
        crash_file = os.path.join(crash_dir, f"{task[0]}-{task[1]}.py")
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=_init_worker,
                                                    initargs=(queue,)) as pool:
            try:
                return pool.submit(_worker_task, *task, crash_file).result()
            except Exception as e:  # noqa: BLE001 - a dead worker is a finding, not the end of the run
                return _died(task, e, crash_file)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as threads:
            results = list(threads.map(isolated, tasks))
    finally:
        time.sleep(0.3)
        stop.set()
        thread.join()
    return results


# ---------------------------------------------------------------------------------------
# Sanitizer
# ---------------------------------------------------------------------------------------

def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "compute-sanitizer"), os.X_OK):
            return os.path.join(root, "bin", "compute-sanitizer")
    return None


def sanitize(args, cuda_ran: bool) -> dict:
    """Re-run the index-heavy families on CUDA under compute-sanitizer memcheck."""
    if not cuda_ran:
        return {"status": "not run", "detail": "no CUDA device was tested, so there is nothing to sanitize"}
    exe = find_sanitizer()
    if exe is None:
        return {"status": "sanitizer not available",
                "detail": "compute-sanitizer is not on PATH (nor in $CUDA_HOME/bin or /usr/local/cuda/bin)"}
    tmp = tempfile.mkdtemp(prefix="kvlayout-sanitize-")
    selected = set(select_families(args.only))   # the index-heavy families among those asked for
    only = ",".join(f for f in SANITIZE_FAMILIES.split(",") if f in selected) or SANITIZE_FAMILIES
    child = [sys.executable, "-m", "kvlayout", "conformance", "--device", "cuda", "--only", only,
             "--examples", str(args.sanitize_examples), "--seed", str(args.seed), "--jobs", "1",
             "--shrink-seconds", "0", "--no-progress", "--out", tmp]
    cmd = [exe, "--tool", "memcheck", "--error-exitcode", "86", "--print-limit", "100"] + child
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    started = time.monotonic()
    sys.stderr.write(f"conformance: sanitizer run: {' '.join(shlex.quote(c) for c in cmd)}\n")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        out, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, code = (e.stdout or "") + (e.stderr or "") if isinstance(e.stdout, str) else "", None
    summaries = re.findall(r"ERROR SUMMARY:\s*(\d+)\s+error", out)
    errors = int(summaries[-1]) if summaries else None
    child_report = None
    for name in sorted(os.listdir(tmp)):
        if name.endswith(".json"):
            with open(os.path.join(tmp, name), encoding="utf-8") as f:
                child_report = json.load(f)
    lines = [l for l in out.splitlines() if l.startswith("=========") and "ERROR SUMMARY" not in l]
    result = {
        "command": " ".join(shlex.quote(c) for c in cmd),
        "environment": "JAX_PLATFORMS=cpu PYTORCH_NO_CUDA_MEMORY_CACHING=1 (every allocation its own, so an "
                       "out-of-bounds access cannot land in a cached block)",
        "exit_code": code,
        "seconds": round(time.monotonic() - started, 1),
        "errors": errors,
        "error_lines": lines[:80],
    }
    if child_report is not None:
        result["cases"] = child_report["summary"]["cases"]
        result["cases_failed"] = child_report["summary"]["failed"]
    if errors is None:
        result["status"] = "no ERROR SUMMARY (the run did not finish)"
        result["output_tail"] = out[-4000:]
    else:
        result["status"] = f"{errors} errors"
    return result


# ---------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------

def select_families(only: str | None) -> list[str]:
    """The families ``--only`` selects (all without it); :class:`~kvlayout.cli.UsageError` when it selects none."""
    from kvlayout.cli import UsageError

    from .families import FAMILIES

    if not only:
        return list(FAMILIES)
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    chosen = [f for f in FAMILIES if any(fnmatch.fnmatchcase(f, p) for p in patterns)]
    if not chosen:
        raise UsageError(f"--only {only!r} matches no family ({', '.join(FAMILIES)})")
    return chosen


def parse_devices(text: str) -> list[str]:
    """``--device``: the device kinds, in order; :class:`~kvlayout.cli.UsageError` for an empty list or an
    unknown kind."""
    from kvlayout.cli import UsageError

    from . import environment

    devices = environment.parse_devices(text)
    if not devices:
        raise UsageError(f"--device {text!r} names no device (cpu, cuda, xpu or all)")
    unknown = [d for d in devices if d not in environment.KNOWN_DEVICES]
    if unknown:
        raise UsageError(f"--device {text!r}: unknown device kind {unknown[0]!r} "
                         f"(known: {', '.join(environment.KNOWN_DEVICES)}, all)")
    return devices


# What a sample's repr is made of: calls of the sample classes by name with keyword arguments, tuples and lists,
# literal numbers, strings, booleans and None, and negative numbers.  Anything else (arithmetic, subscripts,
# attributes, comprehensions, ...) is refused before the text is evaluated, so no replay text can compute.
_REPR_NODES = (ast.Expression, ast.Call, ast.Name, ast.Load, ast.keyword, ast.Constant, ast.Tuple, ast.List,
               ast.UnaryOp, ast.USub)


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def check_replay_text(text: str) -> ast.Expression:
    """The syntax tree of a ``--replay`` text made only of what a sample's repr uses; else
    :class:`~kvlayout.cli.UsageError` naming what is not allowed."""
    from kvlayout.cli import UsageError

    if not text.strip():
        raise UsageError("--replay needs the repr of a sample (the reproducer of a report), not an empty text")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise UsageError(f"--replay is not a sample's repr: {type(e).__name__}: "
                         f"{getattr(e, 'msg', None) or e}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _REPR_NODES):
            raise UsageError(f"--replay is not a sample's repr: {type(node).__name__} "
                             f"{_clip(ast.get_source_segment(text.strip(), node) or '')!r} is not allowed (a sample is "
                             "made of calls with keyword arguments, tuples, numbers, strings, booleans and None)")
        if isinstance(node, ast.UnaryOp) and not (isinstance(node.operand, ast.Constant)
                                                  and type(node.operand.value) in (int, float)):
            raise UsageError("--replay is not a sample's repr: a minus sign may only precede a number")
        if isinstance(node, ast.Constant) and type(node.value) not in (int, float, str, bool, type(None)):
            raise UsageError(f"--replay is not a sample's repr: the literal {node.value!r} is not allowed")
    return tree


def replay(text: str, devices: list[str]) -> int:
    """``--replay``: run one sample on each requested device that is present; 0 if it passed everywhere."""
    check_replay_text(text)   # before the heavy imports: a text that is no sample is refused at once

    import traceback

    from kvlayout.cli import UsageError

    from . import environment
    from .families import parse_sample
    from .families.core import clear_errors

    try:
        sample = parse_sample(text)
    except Exception as e:  # noqa: BLE001 - an unknown class, a missing or unknown field: not a sample
        raise UsageError(f"--replay is not a sample's repr: {str(e).removeprefix('--replay: ')}") from None
    print(f"{sample.family}: {sample.describe()}")
    code, ran = 0, 0
    for status in environment.devices(devices):
        if status.status != "run":
            print(f"{status.device}: {status.status}" + (f" - {status.reason}" if status.reason else ""))
            continue
        ran += 1
        clear_errors(status.device)
        try:
            sample.run(status.device)
            print(f"{status.device}: PASS")
        except Exception:  # noqa: BLE001 - the outcome is the report
            print(f"{status.device}: FAIL")
            traceback.print_exc(file=sys.stdout)
            code = 1
    return code if ran else 2


def run(args) -> int:
    from kvlayout.cli import writable_dir

    from . import environment, report

    if args.replay is not None:
        return replay(args.replay, parse_devices(args.device))
    requested = parse_devices(args.device)
    families = select_families(args.only)
    writable_dir(args.out)   # before the run, not after it
    statuses = environment.devices(requested)
    if "xpu" not in requested:   # say plainly what happened to XPU even when it was not asked for
        xpu = environment.devices(["xpu"])[0]
        statuses.append(environment.DeviceStatus("xpu", "not run", "not requested; " + xpu.reason
                                                 if xpu.status != "run" else "not requested", xpu.name))
    ran = [s.device for s in statuses if s.status == "run"]
    tasks = [(f, d, args.examples, args.seed, args.shrink_seconds) for d in ran for f in families]
    jobs = args.jobs or min(8, os.cpu_count() or 1)
    progress = Progress(sum(planned_cases(f, d, n) for f, d, n, _, _ in tasks), enabled=not args.no_progress)
    started = time.time()
    results = _run_tasks(tasks, jobs, progress)
    progress.close()
    sanitizer = sanitize(args, "cuda" in ran) if args.sanitize else None
    data = report.build(
        command=command_line(args),
        settings={"devices": requested, "examples": args.examples, "seed": args.seed, "only": args.only,
                  "families": families, "jobs": jobs, "shrink_seconds": args.shrink_seconds},
        statuses=statuses, results=results, environment=environment.collect(statuses),
        seconds=time.time() - started, sanitizer=sanitizer, name=environment.report_name(statuses))
    print(report.terminal(data))
    paths = report.write(args.out, data)
    print("reports: " + ", ".join(paths))
    if getattr(args, "fuzz_report", None):
        command = f"{command_line(args)} --fuzz-report {shlex.quote(args.fuzz_report)}"
        print("fuzz report: " + write_fuzz_report(args.fuzz_report, command, results, sanitizer))
    if data["summary"]["failed"] or (sanitizer and sanitizer.get("errors")):
        return 1
    if not ran:
        return 2
    if sanitizer and sanitizer["status"] != "0 errors":
        return 3
    return 0


def write_fuzz_report(path: str, command: str, results: list[dict], sanitizer: dict | None) -> str:
    """``--fuzz-report``: per family and device, cases, crashes (a worker process died), out-of-bounds writes,
    refusals and whether each named its argument; the sanitizer's errors when it ran.  Returns the path."""
    rows, totals = [], collections.Counter()
    for r in results:
        kinds = r.get("failure_kinds", {})
        died = "(process died)" in r["groups"]
        row = {"family": r["family"], "device": r["device"],
               "cases": sum(g["cases"] for g in r["groups"].values()) - died,
               "failed": sum(g["failed"] for g in r["groups"].values()) - died, "crashes": int(died),
               "out_of_bounds": kinds.get("out_of_bounds", 0),
               "refusals_named": r.get("refusals", {}).get("named", 0),
               "refusals_unnamed": r.get("refusals", {}).get("unnamed", 0),
               "not_refused": kinds.get("not_refused", 0), "other_failures": kinds.get("other", 0),
               "groups": {g: v["cases"] for g, v in r["groups"].items()}}
        rows.append(row)
        totals.update({k: v for k, v in row.items() if isinstance(v, int)})
    if sanitizer is not None:
        totals["sanitizer_errors"] = sanitizer.get("errors") or 0
    every_named = totals["refusals_unnamed"] == 0 and totals["not_refused"] == 0
    data = {"command": command, "totals": dict(totals), "every_refusal_named_its_argument": every_named,
            "runs": rows, "sanitizer": sanitizer}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(os.path.splitext(path)[0] + ".json", "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    lines = ["# Hostile-input fuzz run", "", f"Command: `{command}`", "",
             "| | cases | failed | crashes | out of bounds | refusals (named) | refusals not naming the "
             "argument | not refused |", "|---|---|---|---|---|---|---|---|"]
    for row in rows + [dict(totals, family="total", device="")]:
        lines.append(f"| {row['family']} {row['device']} | {row.get('cases', 0)} | {row.get('failed', 0)} | "
                     f"{row.get('crashes', 0)} | {row.get('out_of_bounds', 0)} | {row.get('refusals_named', 0)} | "
                     f"{row.get('refusals_unnamed', 0)} | {row.get('not_refused', 0)} |")
    lines += ["", f"Every refusal named its argument: {'yes' if every_named else 'no'}."]
    if sanitizer is not None:
        lines.append(f"compute-sanitizer memcheck: {sanitizer.get('status')} over {sanitizer.get('cases', '?')} "
                     f"cases (`{sanitizer.get('command', '')}`).")
    for row in rows:
        lines += ["", f"Cases per kind ({row['family']}, {row['device']}): "
                  + ", ".join(f"{g} {n}" for g, n in sorted(row["groups"].items())) + "."]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
