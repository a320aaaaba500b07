"""Bench output: terminal table, JSON, Markdown and PNG plots."""

from __future__ import annotations

import json
import os


def _fmt(value, spec=".1f", missing="–"):
    return missing if value is None else format(value, spec)


def _pct(value) -> str:
    return "–" if value is None else f"{value:.0f}%"


def _peer(r: dict) -> str:
    if "peer" not in r:
        return "–"
    kernel = f", kernel {r['vs_peer_kernel']}" if "vs_peer_kernel" in r else ""
    return f"{r['peer']}: {r['peer_gbps']:.1f} ({r['peer_pct']:.0f}%) {r['vs_peer']}{kernel}"


def table_rows(doc: dict) -> list[list[str]]:
    rows = []
    for r in doc["results"]:
        mode = "per layer" if r["layerwise"] else "all layers"
        if r.get("call", "transfer") != "transfer":
            mode += f", {r['call']}"
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
                     _fmt(r.get("torch_gbps")), _fmt(r.get("x_torch"), ".2f"), _peer(r),
                     "yes" if r["bit_exact"] else "NO"])
    return rows


HEADER = ["group", "shape", "layouts", "T", "ps", "direction", "mode", "CTAs", "GB/s", "kernel GB/s", "% ceiling",
          "% same size", "host µs/call", "torch GB/s", "x torch", "best peer GB/s (% of its limit)", "bit-exact"]

EXPLAIN = (
    "GB/s = payload bytes moved one way / median end-to-end time (CUDA events around the call, device idle "
    "before it, so host issue time counts); kernel GB/s = the same with the device kept busy while the host "
    "issues the call (launched work only); % ceiling against the pinned 256 MiB copy (host transfers) or the "
    "device copy; % same size against a pinned copy of the same payload size (up to 512 MiB); host µs/call = host "
    "time inside one call (a layer-wise row makes one call per layer; host_cost rows move nothing, so their time "
    "is the calls' host cost); x torch = torch time / kvlayout time on the same data; best peer = the best "
    "LMCache / SGLang / torch figure recorded for the same job in `bench/peers.json`, ahead/behind by % of each "
    "run's own limit, end to end (and kernel only: the peers were timed with L2 flushed by a memset queued "
    "just before the call, which hides host issue time shorter than that memset). Every row was checked "
    "bit-exact against the torch baseline first; L2 is flushed by reading "
    "a buffer larger than L2 before each timed call.")


def terminal_table(doc: dict) -> str:
    rows = [HEADER] + table_rows(doc)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for k, (a, b) in doc.get("limits_drift", {}).items():
        lines.append(f"WARNING: limit {k} moved from {a:.1f} to {b:.1f} GB/s during the run (> 5 %)")
    return "\n".join(lines)


HEADLINE_HEADER = ["shape", "T", "direction", "kvlayout GB/s (% ceiling)", "kernel only GB/s (% ceiling)",
                   "torch GB/s", "best peer: GB/s (% of its limit)", "vs peer (end to end / kernel)"]


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (no trailing newline)."""
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def headline_cells(r: dict) -> list[str]:
    """One headline row (:data:`HEADLINE_HEADER`): kvlayout, torch and the peers side by side."""
    kernel = r.get("kernel_gbps")
    kernel_cell = "–" if kernel is None else f"{kernel:.1f} ({100 * kernel / r['limit_gbps']:.0f}%)"
    peer = "–" if "peer" not in r else f"{r['peer']}: {r['peer_gbps']:.1f} ({r['peer_pct']:.0f}%)"
    vs = "–" if "peer" not in r else f"{r['vs_peer']} / {r.get('vs_peer_kernel', '–')}"
    return [r["shape"], str(r["T"]), r["direction"], f"{r['gbps']:.1f} ({r['pct_of_limit']:.0f}%)",
            kernel_cell, _fmt(r.get("torch_gbps")), peer, vs]


def headline_results(doc: dict) -> list[dict]:
    """The measured rows of the headline group (all layers, default CTAs)."""
    return [r for r in doc["results"] if r["group"] == "headline" and "gbps" in r]


def headline_markdown(doc: dict) -> str:
    """A Markdown table of the headline group."""
    rows = [headline_cells(r) for r in headline_results(doc)]
    return markdown_table(HEADLINE_HEADER, rows) + "\n" if rows else ""


def markdown(doc: dict) -> str:
    env = doc["environment"]
    out = ["# kvlayout bench", "",
           "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), "",
           "## Machine limits (GB/s, one way)", "",
           "On a CPU, D2D is a host-memory `copy_` of 64 MiB (no pinned copies are measured).", "",
           "| limit | start | end |", "|---|---|---|"]
    for k, v in doc["limits"].items():
        out.append(f"| {k} | {v:.1f} | {_fmt(doc.get('limits_end', {}).get(k))} |")
    for k, (a, b) in doc.get("limits_drift", {}).items():
        out += ["", f"**Warning:** limit {k} moved from {a:.1f} to {b:.1f} GB/s during the run (more than 5 %)."]
    head = headline_markdown(doc)
    if head:
        out += ["", "## Headline", "", head.rstrip("\n")]
    out += ["", "## Results", "", EXPLAIN, "", markdown_table(HEADER, table_rows(doc))]
    return "\n".join(out) + "\n"


def plots(doc: dict, folder: str, stem: str) -> list[str]:
    """GB/s vs tokens per layout pair and direction; GB/s vs CTA budget."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    head = [r for r in doc["results"] if r["group"] == "headline" and "gbps" in r]
    if head:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        for ax, directions in zip(axes, (("to_host", "from_host"), ("gather_device", "scatter_device"))):
            for shape in sorted({r["shape"] for r in head}):
                for d in directions:
                    pts = sorted((r["T"], r["gbps"]) for r in head if r["shape"] == shape and r["direction"] == d)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=f"{shape} {d}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens T")
            ax.set_ylabel("GB/s")
            ax.legend(fontsize=7)
            ax.grid(alpha=.3)
        axes[0].set_title("host transfers (pinned)")
        axes[1].set_title("on-device gather / scatter")
        path = os.path.join(folder, f"{stem}_tokens.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    ctas = [r for r in doc["results"] if r["group"] == "ctas" and "gbps" in r]
    if ctas:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        sms = doc["environment"].get("sms", 0)
        for shape in sorted({r["shape"] for r in ctas}):
            for d in ("to_host", "from_host"):
                pts = sorted(((r["max_ctas"] or sms or 256), r["gbps"]) for r in ctas
                             if r["shape"] == shape and r["direction"] == d)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{shape} {d}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("CTA budget (rightmost: default)")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=7)
        ax.grid(alpha=.3)
        path = os.path.join(folder, f"{stem}_ctas.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def write_reports(doc: dict, folder: str, stem: str) -> list[str]:
    """Print the terminal table; write ``<stem>.json``, ``<stem>.md`` and the PNG plots into ``folder``."""
    print(terminal_table(doc))
    json_path = os.path.join(folder, f"{stem}.json")
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    md_path = os.path.join(folder, f"{stem}.md")
    with open(md_path, "w") as f:
        f.write(markdown(doc))
    return [json_path, md_path, *plots(doc, folder, stem)]
