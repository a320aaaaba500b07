"""``kvlayout bench --ncu``: hardware counters of the copy kernels where the bench misses its targets.

The bench says *how fast*; this says *why not faster*.  For each case of
:func:`profile_cases`, one Nsight Compute (``ncu``) process runs
``kvlayout bench --profile-case KEY``: the case is built and run once to warm
up, then run once more between ``cudaProfilerStart``/``Stop``, so only the
launched work of that one call is profiled (``--profile-from-start off``).
Clocks are left alone (``--clock-control none``), caches are flushed between
replay passes (ncu's default), as the bench flushes L2 before each timed call.

Counters are asked for by name; the ones the installed ncu does not know are
left out (``ncu --query-metrics``), so the table shows what this machine can
measure.  Output: ``<out>/<stem>_ncu.json`` (every counter of every kernel)
and ``<out>/<stem>_ncu.md`` (one row per case, the counters that explain a
copy kernel's speed: DRAM and PCIe bytes per second, achieved occupancy,
sectors per request, the top warp stall reasons).
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys

import torch

from . import cases as C
from .report import _fmt, markdown_table

# Counters, by what they explain.  Each is read per kernel; rates are the bytes over gpu__time_duration.
METRICS = {
    "time_ns": "gpu__time_duration.sum",
    "grid": "launch__grid_size",
    "registers": "launch__registers_per_thread",
    "occupancy_theoretical_pct": "sm__maximum_warps_per_active_cycle_pct",
    "occupancy_achieved_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "dram_peak_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "pcie_read_bytes": "pcie__read_bytes.sum",
    "pcie_write_bytes": "pcie__write_bytes.sum",
    "ld_sectors": "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "ld_requests": "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
    "st_sectors": "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
    "st_requests": "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "issue_active_pct": "sm__inst_issued.avg.pct_of_peak_sustained_active",
}
# Warp stall reasons, as the share of a warp's cycles spent stalled on each.
STALLS = {
    "long_scoreboard": "smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct",
    "lg_throttle": "smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct",
    "drain": "smsp__warp_issue_stalled_drain_per_warp_active.pct",
    "barrier": "smsp__warp_issue_stalled_barrier_per_warp_active.pct",
    "membar": "smsp__warp_issue_stalled_membar_per_warp_active.pct",
    "wait": "smsp__warp_issue_stalled_wait_per_warp_active.pct",
    "math_pipe_throttle": "smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct",
    "not_selected": "smsp__warp_issue_stalled_not_selected_per_warp_active.pct",
    "short_scoreboard": "smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct",
    "no_instruction": "smsp__warp_issue_stalled_no_instruction_per_warp_active.pct",
}

# Counters every Nsight Compute since Ampere knows (used when the list cannot be queried).
BASIC = {METRICS[k] for k in ("time_ns", "grid", "registers", "occupancy_achieved_pct", "dram_read_bytes",
                              "dram_write_bytes")}


def profile_cases() -> list[C.Case]:
    """The bench rows whose targets are missed or regressed, and the rows they are compared with."""
    h8, h1, mla, mla61 = "L32_H8_D128", "L32_H1_D128", "L32_MLA_D576", "L61_MLA_D576"
    out = []
    for shape in (h8, h1, mla):   # on-device gather/scatter at T=256 and 4096 (2 KiB, 256 B and 1152 B rows)
        dev, buf = C._default_layouts(C.SHAPES[shape])
        for T in (256, 4096):
            for direction in ("gather_device", "scatter_device"):
                out.append(C.Case("headline", shape, dev, buf, T, 16, direction))
    dev, buf = C._default_layouts(C.SHAPES[mla61])   # on-device T=256 (the walk's short-transfer regression)
    out.append(C.Case("headline", mla61, dev, buf, 256, 16, "gather_device"))
    for shape in (h8, h1):        # host transfers: default CTAs and SM budgets of 1, 2 and 4
        dev, buf = C._default_layouts(C.SHAPES[shape])
        for direction, ctas in ((d, c) for d in ("to_host", "from_host") for c in (0, 1, 2, 4)):
            out.append(C.Case("headline" if ctas == 0 else "ctas", shape, dev, buf, 4096, 16, direction,
                              max_ctas=ctas))
    for shape in (h8, h1, mla):   # host transfers at T=256 (4-32 MiB), behind the peers' kernels and staging
        dev, buf = C._default_layouts(C.SHAPES[shape])
        for direction in ("to_host", "from_host"):
            out.append(C.Case("headline", shape, dev, buf, 256, 16, direction))
    return out


def profile_case(key: str, device: torch.device) -> int:
    """Runs one bench case (by key) once warm, then once inside the profiler's window.

    (The machine's own copies are not profiled: ``copy_`` of contiguous bytes is a DMA copy, not a kernel.)
    """
    matches = [c for c in C.plan_cases(False) if c.key == key]
    if not matches:
        print(f"kvlayout bench: no case with key {key!r}", file=sys.stderr)
        return 2
    data = C.build(matches[0], C.Inputs(device))
    fn = C.kvlayout_fn(matches[0], data)
    fn()
    torch.cuda.synchronize(device)
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize(device)
    torch.cuda.profiler.stop()
    return 0


def find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    for path in sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu") + glob.glob("/usr/local/cuda*/bin/ncu")):
        return path
    return None


def available_metrics(ncu: str, wanted: list[str]) -> list[str]:
    """The counters of ``wanted`` this ncu knows for the current GPU (by base name: ``dram__bytes_read``)."""
    listed = subprocess.run([ncu, "--query-metrics", "--csv"], capture_output=True, text=True).stdout
    known = {line.split(",")[0].strip('"') for line in listed.splitlines() if line.startswith('"')}
    if not known:           # an ncu that cannot list them: the counters every ncu since Ampere has
        return [m for m in wanted if m in BASIC]
    return [m for m in wanted if m.rsplit(".", 1)[0] in known or m.split(".")[0] in known]


def _parse_raw_csv(text: str) -> list[dict]:
    """Rows of ``ncu --csv --page raw`` output (the unit row dropped; numbers as floats where they parse)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    if not lines:
        return []
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    out = []
    for row in rows:
        if not row.get("ID"):      # the units row
            continue
        parsed = {}
        for k, v in row.items():
            try:
                parsed[k] = float(v.replace(",", ""))
            except (ValueError, AttributeError):
                parsed[k] = v
        out.append(parsed)
    return out


def _summary(kernels: list[dict]) -> dict:
    """One case's kernels folded into the counters that explain its speed."""
    def total(name):
        return sum(k.get(METRICS[name], 0) or 0 for k in kernels)

    def weighted(metric):   # a percentage averaged over the kernels, weighted by their time
        t = total("time_ns")
        vals = [(k.get(metric), k.get(METRICS["time_ns"], 0)) for k in kernels]
        vals = [(v, w) for v, w in vals if isinstance(v, float)]
        return sum(v * w for v, w in vals) / t if vals and t else None

    t_ns = total("time_ns")
    s = {"kernels": len(kernels), "names": sorted({str(k.get("Kernel Name", ""))[:60] for k in kernels}),
         "time_us": t_ns / 1e3}
    if kernels:
        s["grid"] = kernels[0].get(METRICS["grid"])
        s["registers"] = kernels[0].get(METRICS["registers"])
    for name in ("dram_read_bytes", "dram_write_bytes", "pcie_read_bytes", "pcie_write_bytes"):
        if any(METRICS[name] in k for k in kernels):
            s[name.replace("_bytes", "_gbps")] = total(name) / t_ns if t_ns else None
    for name in ("occupancy_theoretical_pct", "occupancy_achieved_pct", "dram_peak_pct", "l2_hit_pct",
                 "issue_active_pct"):
        s[name] = weighted(METRICS[name])
    for op in ("ld", "st"):
        req = total(f"{op}_requests")
        s[f"{op}_sectors_per_request"] = total(f"{op}_sectors") / req if req else None
    stalls = {name: weighted(metric) for name, metric in STALLS.items()}
    s["stalls_pct"] = {k: v for k, v in sorted(stalls.items(), key=lambda kv: -(kv[1] or 0)) if v is not None}
    return s


def profiled(ncu: str, metrics: list[str], python_args: list[str]) -> dict:
    """The counters of one Python process (``python_args`` after the interpreter) under ncu, which profiles
    what it runs between ``cudaProfilerStart`` and ``Stop``: ``returncode``, ``kernels_raw`` (every counter of
    every kernel) and :func:`_summary`'s keys, or ``error`` (the process's last output) where none came."""
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
           "--metrics", ",".join(metrics), sys.executable, *python_args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    kernels = _parse_raw_csv(done.stdout)
    row = {"returncode": done.returncode, "kernels_raw": kernels}
    if done.returncode != 0 or not kernels:
        row["error"] = (done.stderr or done.stdout)[-2000:]
    else:
        row.update(_summary(kernels))
    return row


def run_ncu(out: str, stem: str, only: str | None = None) -> int:
    """Profiles every case of :func:`profile_cases` in its own ncu process."""
    ncu = find_ncu()
    if ncu is None:
        print("kvlayout bench --ncu: Nsight Compute (ncu) not found", file=sys.stderr)
        return 2
    metrics = available_metrics(ncu, list(METRICS.values()) + list(STALLS.values()))
    keys = [c.key for c in profile_cases()]
    if only:
        keys = [k for k in keys if any(t.strip() in k for t in only.split(","))]
    os.makedirs(out, exist_ok=True)
    results = []
    for i, key in enumerate(keys):
        print(f"[{i + 1}/{len(keys)}] {key}", file=sys.stderr, flush=True)
        results.append({"key": key, **profiled(ncu, metrics, ["-m", "kvlayout", "bench", "--device", "cuda",
                                                             "--profile-case", key])})
        _write(results, metrics, out, stem, ncu)
    bad = [r["key"] for r in results if "error" in r]
    if bad:
        print("kvlayout bench --ncu: no counters for:", *bad, sep="\n  ", file=sys.stderr)
    return 1 if bad else 0


# the counters of one profiled call (:func:`counter_cells`), after the columns that name it
COUNTER_HEADER = ["kernel µs", "CTAs", "registers", "achieved occupancy %", "DRAM rd+wr GB/s (% peak)",
                  "PCIe rd+wr GB/s", "sectors/request ld / st", "top stalls (% of warp cycles)"]
NCU_HEADER = ["case"] + COUNTER_HEADER


def counter_cells(r: dict) -> list[str]:
    """:data:`COUNTER_HEADER`'s cells of one profiled call (:func:`profiled`'s row)."""
    if "error" in r:
        return [f"no counters (exit {r['returncode']})"] + ["–"] * (len(COUNTER_HEADER) - 1)
    dram = (r.get("dram_read_gbps") or 0) + (r.get("dram_write_gbps") or 0)
    pcie = (r.get("pcie_read_gbps") or 0) + (r.get("pcie_write_gbps") or 0)
    stalls = ", ".join(f"{k} {v:.0f}%" for k, v in list(r["stalls_pct"].items())[:2])
    return [f"{r['time_us']:.1f}", _fmt(r.get("grid"), ".0f"), _fmt(r.get("registers"), ".0f"),
            _fmt(r.get("occupancy_achieved_pct"), ".0f"), f"{dram:.0f} ({r.get('dram_peak_pct') or 0:.0f}%)",
            f"{pcie:.1f}", f"{_fmt(r.get('ld_sectors_per_request'))} / {_fmt(r.get('st_sectors_per_request'))}",
            stalls]


def ncu_cells(r: dict) -> list[str]:
    """One profiled case (:data:`NCU_HEADER`), named by shape, T, direction and CTA budget."""
    words = r["key"].split()       # shape T=.. ps=.. layouts direction all layers ctas=..
    return [" ".join([words[0], words[1], words[4], words[-1]])] + counter_cells(r)


def ncu_markdown(doc: dict) -> str:
    """The Markdown report of a ``<stem>_ncu.json`` document."""
    return "\n".join([f"# ncu counters ({doc['gpu']}, {doc['ncu']})", "",
                      "Command: `kvlayout bench --device cuda --ncu` (one ncu process per case, "
                      "`--clock-control none`, the case's second call only). Rates are bytes over the kernels' "
                      "summed `gpu__time_duration`.", "",
                      markdown_table(NCU_HEADER, [ncu_cells(r) for r in doc["results"]])]) + "\n"


def _write(results: list[dict], metrics: list[str], out: str, stem: str, ncu: str) -> None:
    version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    doc = {"ncu": version[-1] if version else ncu, "gpu": torch.cuda.get_device_name(0),
           "command": "kvlayout bench --device cuda --ncu", "metrics": metrics, "results": results}
    with open(os.path.join(out, f"{stem}_ncu.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(out, f"{stem}_ncu.md"), "w") as f:
        f.write(ncu_markdown(doc))
