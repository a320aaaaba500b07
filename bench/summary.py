"""The README's performance tables, from a bench run's JSON-lines file.

    python -m kvlayout.bench.summary bench/results/h200.jsonl [--ncu bench/results/h200_8f0a720/h200_ncu.json]

prints Markdown: the headline rows (L32 shapes, all layers, T = 256 and
4096; kernel only against the peers' overlapped figures and end to end
against their idle figures, from ``bench/peers.json``), the layer-wise
pipeline, the host cost per call, the staged engine and the CTA budget,
and (with ``--ncu``) the counters of the rows that miss their targets.
Every figure is read from the files given; nothing is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from .profile import NCU_HEADER, ncu_cells
from .report import (
    HEADLINE_HEADER,
    compared_with_peers,
    headline_cells,
    headline_results,
    markdown_table,
    peer_cell,
    peer_standing,
)
from .run import document
from .targets import CALL_NAMES


def _pct(r: dict, key: str = "gbps") -> str:
    if r is None or r.get(key) is None:
        return "–"
    return f"{r[key]:.1f} ({100 * r[key] / r['limit_gbps']:.0f}%)"


def _find(rows: list[dict], **want) -> dict | None:
    for r in rows:
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def headline(doc: dict) -> str:
    """The headline group's L32 rows at T = 256 and 4096, with the host time per call."""
    results = [r for r in headline_results(doc) if r["shape"].startswith("L32") and r["T"] in (256, 4096)]
    table = markdown_table(HEADLINE_HEADER + ["host µs/call"],
                           [headline_cells(r) + [f"{r['host_us']:.0f}"] for r in results])
    standing = peer_standing(dict(doc, results=results))
    return table + ("\n\nAgainst the best peer, " + standing if standing else "")


def layerwise(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["group"] != "layerwise" or r["call"] != "transfer":
            continue
        same = dict(group="layerwise", shape=r["shape"], T=r["T"], direction=r["direction"],
                    buffer_layout=r["buffer_layout"], device_layout=r["device_layout"])
        prepared, graph = _find(rows, call="prepared", **same), _find(rows, call="graph", **same)
        early = _find(rows, call="prepared-early", **same)
        whole = _find(rows, group="headline", shape=r["shape"], T=r["T"], direction=r["direction"])
        arrow = "↔" if r["buffer_layout"].startswith("lmcache") else "←"
        host = f"{r['host_us_per_call']:.1f} / {prepared['host_us_per_call']:.1f}" if prepared else "–"
        out.append([r["shape"], str(r["T"]), r["direction"], f"{r['device_layout']}{arrow}{r['buffer_layout']}",
                    _pct(r), _pct(prepared), _pct(early), _pct(graph), _pct(whole),
                    peer_cell(r, "kernel"), peer_cell(r, "end_to_end"), host])
    return markdown_table(["shape", "T", "direction", "layouts", "ops.transfer ×L: GB/s (% ceiling)",
                           "prepared `t.layer(i)` ×L", "prepared, `early_loads=True`", "graph replay",
                           "all layers, one `ops.transfer`",
                           "ops.transfer ×L, kernel only vs best peer overlapped",
                           "ops.transfer ×L, end to end vs best peer idle",
                           "host µs per layer call (transfer / prepared)"], out)


def host_cost(rows: list[dict]) -> str:
    names = {(False, "transfer"): "one all-layer `ops.transfer`",
             (False, "bind-per-call"): "the same between caches bound anew at each call",
             (False, "gather"): "the same as `ops.gather` into a view made at each call",
             (True, "transfer"): "one one-layer `ops.transfer`",
             (True, "prepared"): "one prepared layer call",
             (True, "prepared-serial"): "one prepared layer call without programmatic dependent launch",
             (True, "prepared-no-launch"): "one prepared layer call that launches nothing (`skip_prefix` = T)"}
    costs = [r for r in rows if r["group"] == "host_cost"]
    parts = []
    for r in costs:
        ratio = ""
        if "x_torch_op" in r:
            ratio = f" ({r['x_torch_op']:.2f}× one torch op, bare launch {r['over_launch_us']:+.1f} µs)"
        parts.append(f"{names[(r['layerwise'], r['call'])]} {r['host_us_per_call']:.1f} µs{ratio}")
    yardsticks = [("one torch op, `index_select` of three rows of a small tensor on the bench's device",
                   "torch_op_host_us"),
                  ("one bare launch (`torch.cuda._sleep(0)`; on the CPU one empty call into torch's bindings)",
                   "launch_host_us")]
    beside = [f"{what}: {statistics.median(values):.1f} µs" for what, key in yardsticks
              if (values := [r[key] for r in costs if key in r])]
    same_run = f" (in the same run, {'; '.join(beside)})" if beside else ""
    return "Host cost per call with nothing to move (`host_cost` rows): " + "; ".join(parts) + same_run + "."


def staged(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["group"] != "staged":
            continue
        if r.get("engine", "staged") != "staged":
            continue   # (a kernel row of the staged group: the twin of a staged one, below)
        twin = {"group": "staged", "engine": "kernel", "call": r["call"]} if r.get("call") == "bind-per-call" else \
            {"group": "ctas" if r["max_ctas"] else "headline"}
        kernel = _find(rows, **twin, shape=r["shape"], T=r["T"], direction=r["direction"],
                       max_ctas=r["max_ctas"])
        direction = r["direction"] + (f", {CALL_NAMES[r['call']]}" if r.get("call") in CALL_NAMES else "")
        out.append([r["shape"], str(r["T"]), direction, str(r["max_ctas"] or "default"), _pct(r),
                    _pct(r, "kernel_gbps"), _pct(kernel), f"{r['host_us']:.0f}", _counts(r),
                    peer_cell(r, "kernel"), peer_cell(r, "end_to_end")])
    return markdown_table(["shape", "T", "direction", "CTAs", "staged GB/s (% ceiling)",
                           "staged kernel only (% ceiling)", "kernel engine, same case (% ceiling)",
                           "host µs/call (staged)", "chunks / graph nodes",
                           "staged kernel only vs best peer overlapped", "staged end to end vs best peer idle"], out)


def _counts(r: dict) -> str:
    """A staged row's chunks and the nodes of the graph its calls replay ("direct": none, issued directly; "in
    a conditional": the body of a conditional node, launched on the device; "of P tokens": the graph of the
    calls' reuse prefix, the rest moved by the direct kernel); "–" in records made before the bench counted them."""
    if "chunks" not in r:
        return "–"
    where = " in a conditional" if r.get("graph_on_device") else ""
    if r.get("graph_nodes") and r.get("graph_tokens") and r["graph_tokens"] < r["T"]:
        where += f" of {r['graph_tokens']} tokens"
    return f"{r['chunks']} / {r['graph_nodes'] or 'direct'}{where}"


def ctas(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["group"] == "ctas" and r["max_ctas"] in (1, 4, 16):
            out.append([r["shape"], r["direction"], str(r["max_ctas"]), _pct(r), _pct(r, "kernel_gbps")])
    return markdown_table(["shape", "direction", "CTAs", "GB/s (% ceiling)", "kernel only (% ceiling)"], out)


def device_grid(rows: list[dict]) -> str:
    """The on-device rows under a budget of every SM (one 1024-thread CTA per SM) beside the same case on the
    default grid (the headline row), both timings, and the budgeted row's kernel-only time over the default's."""
    out = []
    for r in rows:
        if r["group"] != "ctas" or r["direction"] not in ("gather_device", "scatter_device") or "gbps" not in r:
            continue
        default = _find(rows, group="headline", shape=r["shape"], T=r["T"], direction=r["direction"], max_ctas=0)
        ratio = (f"{default['kernel_us'] / r['kernel_us']:.2f}×" if default is not None and
                 default.get("kernel_us") and r.get("kernel_us") else "–")
        out.append([r["shape"], str(r["T"]), r["direction"], str(r["max_ctas"]), _pct(default),
                    _pct(default, "kernel_gbps"), _pct(r), _pct(r, "kernel_gbps"), ratio])
    return markdown_table(["shape", "T", "direction", "CTAs of 1024", "default grid GB/s (% D2D)",
                           "default kernel only", "one CTA per SM GB/s (% D2D)", "one CTA per SM kernel only",
                           "kernel only, one CTA per SM vs default"], out)


def _setting_rows(rows: list[dict], call: str) -> list[tuple[dict, dict | None, str]]:
    """(row, twin, ratio) for each host_hints row of ``call`` (a setting's rerun of a case) that has a figure:
    its twin is the same case under the default settings (the ctas row under a budget, else the headline row),
    the ratio the twin's kernel-only time over the row's (None where either is missing)."""
    out = []
    for r in rows:
        if r["group"] != "host_hints" or r.get("call") != call or "gbps" not in r:
            continue
        twin = _find(rows, group="ctas" if r["max_ctas"] else "headline", shape=r["shape"], T=r["T"],
                     direction=r["direction"], max_ctas=r["max_ctas"])
        ratio = (twin["kernel_us"] / r["kernel_us"] if twin is not None and twin.get("kernel_us")
                 and r.get("kernel_us") else None)
        out.append((r, twin, ratio))
    return out


def _times(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.2f}×"


def host_hints(rows: list[dict]) -> str:
    """The kernel's host transfers with the default cache operators (host_hints rows) beside the same case
    with streaming hints (its headline or ctas row), both timings, and the kernel-only ratio (above 1: the
    default operators are faster)."""
    out = [[r["shape"], str(r["T"]), r["direction"], str(r["max_ctas"] or "default"), _pct(twin),
            _pct(twin, "kernel_gbps"), _pct(r), _pct(r, "kernel_gbps"), _times(ratio)]
           for r, twin, ratio in _setting_rows(rows, "default-hints")]
    return markdown_table(["shape", "T", "direction", "CTAs", "streaming GB/s (% ceiling)", "streaming kernel only",
                           "default operators GB/s (% ceiling)", "default operators kernel only",
                           "kernel only, default vs streaming"], out)


def host_launch_shape(rows: list[dict]) -> str | None:
    """The kernel's host transfers walked, one CTA per SM (host_hints rows of call "walk"), beside the same
    case in its default shape, one row per CTA (its headline row), both timings, and the kernel-only ratio
    (above 1: one row per CTA is faster); None for a record without such rows."""
    out = [[r["shape"], str(r["T"]), r["direction"], _pct(twin), _pct(twin, "kernel_gbps"), _pct(r),
            _pct(r, "kernel_gbps"), _times(None if ratio is None else 1 / ratio)]
           for r, twin, ratio in _setting_rows(rows, "walk")]
    if not out:
        return None
    return markdown_table(["shape", "T", "direction", "row per CTA GB/s (% ceiling)", "row per CTA kernel only",
                           "walk GB/s (% ceiling)", "walk kernel only", "kernel only, row per CTA vs walk"], out)


def sections(jsonl: str) -> list[tuple[str, str]]:
    """(name, markdown) of every table of a bench record (a ``kvlayout bench`` .jsonl), peers compared."""
    doc = compared_with_peers(document(jsonl))
    rows = doc["results"]
    out = [("Headline", headline(doc)), ("Layer-wise", layerwise(rows)), ("Host cost", host_cost(rows)),
           ("Staged", staged(rows)), ("CTA budget", ctas(rows)), ("Device grid", device_grid(rows)),
           ("Host cache hints", host_hints(rows))]
    shapes = host_launch_shape(rows)
    return out + ([("Host launch shape", shapes)] if shapes is not None else [])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jsonl")
    parser.add_argument("--ncu", default=None, help="the <stem>_ncu.json of `kvlayout bench --ncu`")
    args = parser.parse_args(argv)
    parts = sections(args.jsonl)
    if args.ncu:
        with open(args.ncu) as f:
            parts.append(("ncu", markdown_table(NCU_HEADER, [ncu_cells(r) for r in json.load(f)["results"]])))
    for name, text in parts:
        sys.stdout.write(f"<!-- {name} -->\n{text}\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
