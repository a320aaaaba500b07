"""Bench output: terminal table, JSON, Markdown and PNG plots."""

from __future__ import annotations

import json
import os
import sys


def _fmt(value, spec=".1f", missing="–"):
    return missing if value is None else format(value, spec)


def _pct(value) -> str:
    return "–" if value is None else f"{value:.0f}%"


def peer_cell(r: dict, k: str) -> str:
    """The best peer in one timing (``k``: "kernel" or "end_to_end") and kvlayout's standing against it."""
    if f"peer_{k}" not in r:
        return "–"
    return (f"{r[f'peer_{k}']} {r[f'peer_{k}_gbps']:.1f} ({r[f'peer_{k}_pct']:.0f}%): {r[f'vs_peer_{k}']} "
            f"{r[f'x_peer_{k}']:.2f}×")


def torch_cell(r: dict) -> str:
    """The faster torch form's GB/s and its name (older records measured one form only)."""
    if r.get("torch_gbps") is None:
        return "–"
    return f"{r['torch_gbps']:.1f} ({r.get('torch_form', 'per_layer')})"


def table_rows(doc: dict) -> list[list[str]]:
    rows = []
    for r in doc["results"]:
        mode = "per layer" if r["layerwise"] else "all layers"
        if r.get("call", "transfer") != "transfer":
            mode += f", {r['call']}"
        if r.get("group") == "staged" and r.get("engine") == "kernel":
            mode += ", kernel engine"   # (a staged row's twin, in its group)
        if r.get("group") == "host_cost":
            mode += ", nothing to move"
            if "torch_op_host_us" in r:
                launch = f", one bare launch: {r['launch_host_us']:.1f} µs" if "launch_host_us" in r else ""
                mode += f" (one torch op: {r['torch_op_host_us']:.1f} µs{launch})"
        rows.append([r["group"], r["shape"], f"{r['device_layout']}->{r['buffer_layout']}", str(r["T"]),
                     str(r["page_size"]), r["direction"], mode,
                     "copy engine" if r.get("engine") == "copy" else str(r["max_ctas"] or "default"),
                     _fmt(r.get("gbps")), _fmt(r.get("kernel_gbps")), _pct(r.get("pct_of_limit")),
                     _pct(r.get("pct_of_same_size")), _fmt(r.get("host_us_per_call", r.get("host_us")), ".1f"),
                     torch_cell(r), _fmt(r.get("x_torch"), ".2f"), peer_cell(r, "kernel"),
                     peer_cell(r, "end_to_end"), "yes" if r["bit_exact"] else "NO"])
    return rows


HEADER = ["group", "shape", "layouts", "T", "ps", "direction", "mode", "CTAs", "GB/s", "kernel GB/s", "% ceiling",
          "% same size", "host µs/call", "torch GB/s (form)", "x torch",
          "kernel only vs best peer overlapped", "end to end vs best peer idle", "bit-exact"]

EXPLAIN = (
    "GB/s = payload bytes moved one way / median end-to-end time (CUDA events around the call, device idle "
    "before it, so host issue time counts); kernel GB/s = the same with the device kept busy while the host "
    "issues the call (launched work only); % ceiling against the pinned 256 MiB copy (host transfers) or the "
    "device copy; % same size against a pinned copy of the same payload size (up to 512 MiB); host µs/call = host "
    "time inside one call (a layer-wise row makes one call per layer; host_cost rows move nothing, so their time "
    "is the calls' host cost); torch = the faster of the baseline's forms on the same data (`per_layer`: "
    "advanced indexing per layer and plane, then one `copy_` across the host boundary; `merged`: one "
    "`index_select` / `index_copy_` per cache tensor over its `[planes·layers·slots, row]` view, then one "
    "`copy_` of the whole chunk, where the layouts allow it); x torch = that torch time / kvlayout's end-to-end "
    "time. Peers (`bench/peers.json`, sources below): the best LMCache / SGLang figure for the same job in each "
    "of two timings, compared like for like by % of each run's own limit: kvlayout's kernel-only figure against "
    "the peers' *overlapped* figure (issued while the device was busy, host issue time hidden), kvlayout's end "
    "to end figure against the peers' *idle* figure (device idle before the call); ahead/behind and kvlayout's "
    "share / the peer's (×). Every row was checked bit-exact against each form of the torch baseline first; L2 "
    "is flushed by reading a buffer larger than L2 before each timed call.")

# a baseline whose (p90 - p10) / median exceeds this on a CPU ran on a loaded machine
LOADED_SPREAD = 0.5


def loaded_rows(doc: dict) -> list[dict]:
    """On a CPU run: the rows whose torch baseline spread more than :data:`LOADED_SPREAD` (a loaded machine)."""
    if doc["environment"].get("device") != "cpu":
        return []
    return [r for r in doc["results"] if (r.get("torch_spread") or 0) > LOADED_SPREAD]


def warnings_lines(doc: dict) -> list[str]:
    """The run's warnings: limits that drifted, a baseline timed on a loaded machine."""
    lines = [f"limit {k} moved from {a:.1f} to {b:.1f} GB/s during the run (more than 5 %)."
             for k, (a, b) in doc.get("limits_drift", {}).items()]
    loaded = loaded_rows(doc)
    if loaded:
        worst = max(r["torch_spread"] for r in loaded)
        timed = sum(1 for r in doc["results"] if r.get("torch_spread") is not None)
        lines.append(f"the torch baseline's spread ((p90 - p10) / median) exceeded {LOADED_SPREAD:.0%} on "
                     f"{len(loaded)} of {timed} rows (up to {worst:.0%}): the machine was loaded "
                     "during the run, and the x torch figures of those rows are not reliable.")
    return lines


def threads_line(doc: dict) -> str | None:
    """On a CPU run: the thread counts kvlayout and the torch baseline ran with."""
    env = doc["environment"]
    if env.get("device") != "cpu":
        return None
    threads, baseline = env.get("threads", "?"), env.get("baseline_threads")
    if baseline is None:
        return (f"Threads: kvlayout and the torch baseline ran with torch's default thread count ({threads}), not "
                "fixed in this record.")
    return (f"Threads: kvlayout ran on {threads} and the torch baseline on {baseline} thread"
            f"{'s' if baseline != 1 else ''} (a count fixed by the bench, so the two compare like for like and "
            "a loaded machine does not oversubscribe torch's thread pool).")


def calibration_line(doc: dict) -> str | None:
    """On a CUDA run that recorded it: the device's calibration (``ops.calibrate``), by which ``engine="auto"``
    chose its engines."""
    found = doc["environment"].get("calibration")
    if not found:
        return None
    ways = [f"{direction.replace('_', ' ')} {f['ratio']:.2f}x ({f['kernel_gbps']:.1f} against "
            f"{f['copy_engine_gbps']:.1f} GB/s{', slow' if f['sm_slow'] else ''})"
            for direction, f in found.items()]
    return ("Calibration (ops.calibrate), the kernel against the copy engine on pinned host memory: "
            + "; ".join(ways) + " (engine=\"auto\" stages a way marked slow from one staged chunk on).")


def terminal_table(doc: dict) -> str:
    rows = [HEADER] + table_rows(doc)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for line in (threads_line(doc), calibration_line(doc)):
        if line:
            lines.append(line)
    if peer_standing(doc):
        lines.append("Against the best peer, " + peer_standing(doc))
    lines += [f"WARNING: {w}" for w in warnings_lines(doc)]
    return "\n".join(lines)


HEADLINE_HEADER = ["shape", "layouts", "T", "direction", "kvlayout end to end GB/s (% ceiling)",
                   "kernel only GB/s (% ceiling)", "torch GB/s (form)", "x torch",
                   "kernel only vs best peer overlapped: GB/s (% of its limit)",
                   "end to end vs best peer idle: GB/s (% of its limit)"]


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (no trailing newline)."""
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def headline_cells(r: dict) -> list[str]:
    """One headline row (:data:`HEADLINE_HEADER`): kvlayout, torch and the peers side by side, per timing."""
    kernel = r.get("kernel_gbps")
    kernel_cell = "–" if kernel is None else f"{kernel:.1f} ({100 * kernel / r['limit_gbps']:.0f}%)"
    return [r["shape"], f"{r['device_layout']}->{r['buffer_layout']}", str(r["T"]), r["direction"],
            f"{r['gbps']:.1f} ({r['pct_of_limit']:.0f}%)", kernel_cell, torch_cell(r), _fmt(r.get("x_torch"), ".2f"),
            peer_cell(r, "kernel"), peer_cell(r, "end_to_end")]


def headline_results(doc: dict) -> list[dict]:
    """The measured rows of the headline group (all layers, default CTAs)."""
    return [r for r in doc["results"] if r["group"] == "headline" and "gbps" in r]


def headline_markdown(doc: dict) -> str:
    """A Markdown table of the headline group."""
    rows = [headline_cells(r) for r in headline_results(doc)]
    return markdown_table(HEADLINE_HEADER, rows) + "\n" if rows else ""


def peer_standing(doc: dict) -> str | None:
    """How many compared rows are ahead of the best peer, per timing (None when no row was compared)."""
    parts = []
    for k, what in (("kernel", "kernel only vs the peers' overlapped figure"),
                    ("end_to_end", "end to end vs the peers' idle figure")):
        vs = [r[f"vs_peer_{k}"] for r in doc["results"] if f"vs_peer_{k}" in r]
        if vs:
            parts.append(f"{what}: ahead on {vs.count('ahead')} of {len(vs)} rows, behind on {vs.count('behind')}")
    return "; ".join(parts) + "." if parts else None


def peer_sources_markdown(doc: dict) -> list[str]:
    """The peer runs the rows were compared with: date, machine, method."""
    out = []
    for s in doc.get("peer_sources", []):
        out.append(f"* `{s['id']}` ({s['date']}, {s['machine']}): {s['peers']}. {s['method']}. Layouts: "
                   f"{s['layouts']}. Limits of that run: "
                   + ", ".join(f"{k} {v:.1f} GB/s" for k, v in s["limits"].items())
                   + (f". {s['notes']}." if s.get("notes") else "."))
    return out


def compared_with_peers(doc: dict) -> dict:
    """``doc`` with every row compared afresh against ``bench/peers.json`` (a committed record re-rendered
    judges its rows against the current peer figures, like for like per timing)."""
    from .peers import load_peers

    return load_peers().annotate(doc)


def markdown(doc: dict) -> str:
    env = doc["environment"]
    out = ["# kvlayout bench", "",
           "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "calibration"), "",
           "## Machine limits (GB/s, one way)", ""]
    if env.get("device") == "cpu":
        out += ["On a CPU, D2D is a host-memory `copy_` of 64 MiB (no pinned copies are measured).", ""]
    out += ["| limit | start | end |", "|---|---|---|"]
    for k, v in doc["limits"].items():
        out.append(f"| {k} | {v:.1f} | {_fmt(doc.get('limits_end', {}).get(k))} |")
    if doc.get("same_size"):
        out += ["", "Pinned copies of each host case's payload size, timed before the first case (the "
                "\"% same size\" column's yardstick): "
                + ", ".join(f"{k.split('_')[0]} {int(k.split('_')[1]) / 2**20:g} MiB {v:.1f}"
                            for k, v in doc["same_size"].items()) + " GB/s."]
    for line in (threads_line(doc), calibration_line(doc)):
        if line:
            out += ["", line]
    for w in warnings_lines(doc):
        out += ["", f"**Warning:** {w}"]
    head = headline_markdown(doc)
    if head:
        out += ["", "## Headline", "", head.rstrip("\n")]
    standing = peer_standing(doc)
    if standing:
        out += ["", "Against the best peer, " + standing]
    out += ["", "## Results", "", EXPLAIN, "", markdown_table(HEADER, table_rows(doc))]
    sources = peer_sources_markdown(doc)
    if sources:
        out += ["", "## Peer figures compared", ""] + sources
    return "\n".join(out) + "\n"


HOST_DIRECTIONS = ("to_host", "from_host")
DEVICE_DIRECTIONS = ("gather_device", "scatter_device")


def series(rows: list[dict], x_key: str, directions: tuple[str, ...], default_x: float = 0) -> dict[str, list]:
    """Plot lines: label -> ``[(x, GB/s), ...]`` sorted by x, one line per (shape, layouts, page size,
    direction), so rows of different layouts (NHD and HND, say) never share a line."""
    lines: dict[str, list] = {}
    for r in rows:
        if r["direction"] not in directions or "gbps" not in r:
            continue
        label = f"{r['shape']} {r['device_layout']}->{r['buffer_layout']} ps={r['page_size']} {r['direction']}"
        lines.setdefault(label, []).append((r[x_key] or default_x, r["gbps"]))
    return {label: sorted(points) for label, points in sorted(lines.items())}


def plots(doc: dict, folder: str, stem: str) -> tuple[list[str], list[str]]:
    """GB/s vs tokens (a panel for host transfers, one for on-device gather / scatter, each only where the run
    has such rows); GB/s vs CTA budget.  Returns (paths written, why a plot was not drawn)."""
    head = [r for r in doc["results"] if r["group"] == "headline" and "gbps" in r]
    ctas = [r for r in doc["results"] if r["group"] == "ctas" and "gbps" in r]
    panels = [(title, lines) for title, lines in
              (("host transfers (pinned)", series(head, "T", HOST_DIRECTIONS)),
               ("on-device gather / scatter", series(head, "T", DEVICE_DIRECTIONS)))
              if lines]
    sms = doc["environment"].get("sms", 0)
    cta_lines = series(ctas, "max_ctas", HOST_DIRECTIONS, default_x=sms or 256)
    skipped = []
    if not panels:
        skipped.append(f"{stem}_tokens.png: the run has no measured headline rows")
    if not cta_lines:
        skipped.append(f"{stem}_ctas.png: the run has no measured CTA-budget (ctas) rows")
    if not panels and not cta_lines:
        return [], skipped
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        wanted = [f"{stem}_tokens.png"] * bool(panels) + [f"{stem}_ctas.png"] * bool(cta_lines)
        return [], skipped + [f"{', '.join(wanted)}: matplotlib is not installed (pip install matplotlib)"]
    paths = []

    def draw(ax, lines, xlabel):
        for label, points in lines.items():
            ax.plot(*zip(*points), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=6)
        ax.grid(alpha=.3)

    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
        for ax, (title, lines) in zip(axes[0], panels):
            draw(ax, lines, "tokens T")
            ax.set_title(title)
        path = os.path.join(folder, f"{stem}_tokens.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    if cta_lines:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        draw(ax, cta_lines, "CTA budget (rightmost: default)")
        path = os.path.join(folder, f"{stem}_ctas.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths, skipped


def write_reports(doc: dict, folder: str, stem: str) -> list[str]:
    """Compare the rows with the peers, print the terminal table; write ``<stem>.json``, ``<stem>.md`` and the
    PNG plots into ``folder``; say on stderr why a plot was not drawn."""
    doc = compared_with_peers(doc)
    print(terminal_table(doc))
    json_path = os.path.join(folder, f"{stem}.json")
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    md_path = os.path.join(folder, f"{stem}.md")
    with open(md_path, "w") as f:
        f.write(markdown(doc))
    pngs, skipped = plots(doc, folder, stem)
    for why in skipped:
        print(f"kvlayout bench: no plot {why}", file=sys.stderr)
    return [json_path, md_path, *pngs]
