"""The README's performance tables, from a bench run's JSON-lines file.

    python -m kvlayout.bench.summary bench/results/h200.jsonl [--ncu bench/results/h200_ncu.json]

prints Markdown: the headline rows (L32 shapes, all layers, T = 256 and
4096), the layer-wise pipeline, the host cost per call, the staged engine
and the CTA budget, and (with ``--ncu``) the counters of the rows that miss
their targets.  Every figure is read from the files given; nothing is typed
by hand.
"""

from __future__ import annotations

import argparse
import json
import sys

from .run import document


def _pct(r: dict, key: str = "gbps") -> str:
    if r is None or r.get(key) is None:
        return "–"
    return f"{r[key]:.1f} ({100 * r[key] / r['limit_gbps']:.0f}%)"


def _table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def _find(rows: list[dict], **want) -> dict | None:
    for r in rows:
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def headline(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["group"] != "headline" or not r["shape"].startswith("L32") or r["T"] not in (256, 4096):
            continue
        peer = f"{r['peer']}: {r['peer_gbps']:.1f} ({r['peer_pct']:.0f}%)" if "peer" in r else "–"
        vs = f"{r['vs_peer']} / {r.get('vs_peer_kernel', '–')}" if "peer" in r else "–"
        out.append([r["shape"], str(r["T"]), r["direction"], _pct(r), _pct(r, "kernel_gbps"),
                    f"{r['torch_gbps']:.1f}" if "torch_gbps" in r else "–", peer, vs, f"{r['host_us']:.0f}"])
    return _table(["shape", "T", "direction", "kvlayout GB/s (% ceiling)", "kernel only GB/s (% ceiling)",
                   "torch GB/s", "best peer: GB/s (% of its limit)", "vs peer (end to end / kernel)",
                   "host µs/call"], out)


def layerwise(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["group"] != "layerwise" or r["call"] != "transfer":
            continue
        same = dict(group="layerwise", shape=r["shape"], T=r["T"], direction=r["direction"],
                    buffer_layout=r["buffer_layout"], device_layout=r["device_layout"])
        prepared, graph = _find(rows, call="prepared", **same), _find(rows, call="graph", **same)
        whole = _find(rows, group="headline", shape=r["shape"], T=r["T"], direction=r["direction"])
        arrow = "↔" if r["buffer_layout"].startswith("lmcache") else "←"
        host = f"{r['host_us_per_call']:.1f} / {prepared['host_us_per_call']:.1f}" if prepared else "–"
        out.append([r["shape"], str(r["T"]), r["direction"], f"{r['device_layout']}{arrow}{r['buffer_layout']}",
                    _pct(r), _pct(prepared), _pct(graph), _pct(whole),
                    f"{r['peer']}: {r['peer_pct']:.0f}%" if "peer" in r else "–", host])
    return _table(["shape", "T", "direction", "layouts", "ops.transfer ×L: GB/s (% ceiling)",
                   "prepared `t.layer(i)` ×L", "graph replay", "all layers, one `ops.transfer`",
                   "best peer (% of its limit)", "host µs per layer call (transfer / prepared)"], out)


def host_cost(rows: list[dict]) -> str:
    names = {(False, "transfer"): "one all-layer `ops.transfer`", (True, "transfer"): "one one-layer `ops.transfer`",
             (True, "prepared"): "one prepared layer call",
             (True, "prepared-serial"): "one prepared layer call without programmatic dependent launch"}
    parts = [f"{names[(r['layerwise'], r['call'])]} {r['host_us_per_call']:.1f} µs"
             for r in rows if r["group"] == "host_cost"]
    return "Host cost per call with nothing to move (`host_cost` rows): " + ", ".join(parts) + "."


def staged(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["group"] != "staged":
            continue
        kernel = _find(rows, group="ctas" if r["max_ctas"] else "headline", shape=r["shape"], T=r["T"],
                       direction=r["direction"], max_ctas=r["max_ctas"])
        out.append([r["shape"], str(r["T"]), r["direction"], str(r["max_ctas"] or "default"), _pct(r),
                    _pct(r, "kernel_gbps"), _pct(kernel), f"{r['host_us']:.0f}"])
    return _table(["shape", "T", "direction", "CTAs", "staged GB/s (% ceiling)", "staged kernel only (% ceiling)",
                   "kernel engine, same case (% ceiling)", "host µs/call (staged)"], out)


def ctas(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["group"] == "ctas" and r["max_ctas"] in (1, 4, 16):
            out.append([r["shape"], r["direction"], str(r["max_ctas"]), _pct(r), _pct(r, "kernel_gbps")])
    return _table(["shape", "direction", "CTAs", "GB/s (% ceiling)", "kernel only (% ceiling)"], out)


def ncu(doc: dict) -> str:
    out = []
    for r in doc["results"]:
        if "error" in r:
            continue
        stalls = ", ".join(f"{k} {v:.0f}%" for k, v in list(r["stalls_pct"].items())[:2])
        dram = (r.get("dram_read_gbps") or 0) + (r.get("dram_write_gbps") or 0)
        pcie = (r.get("pcie_read_gbps") or 0) + (r.get("pcie_write_gbps") or 0)
        words = r["key"].split()       # shape T=.. ps=.. layouts direction all layers ctas=..
        out.append([" ".join([words[0], words[1], words[4], words[-1]]), f"{r['time_us']:.1f}",
                    f"{r.get('grid', 0):.0f}", f"{r.get('registers', 0):.0f}",
                    f"{r.get('occupancy_achieved_pct') or 0:.0f}",
                    f"{dram:.0f} ({r.get('dram_peak_pct') or 0:.0f}%)", f"{pcie:.1f}",
                    f"{r.get('ld_sectors_per_request') or 0:.1f} / {r.get('st_sectors_per_request') or 0:.1f}",
                    stalls])
    return _table(["case", "kernel µs", "CTAs", "registers", "achieved occupancy %", "DRAM rd+wr GB/s (% peak)",
                   "PCIe rd+wr GB/s", "sectors/request ld / st", "top stalls (% of warp cycles)"], out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jsonl")
    parser.add_argument("--ncu", default=None, help="the <stem>_ncu.json of `kvlayout bench --ncu`")
    args = parser.parse_args(argv)
    rows = document(args.jsonl)["results"]
    sections = [("Headline", headline(rows)), ("Layer-wise", layerwise(rows)), ("Host cost", host_cost(rows)),
                ("Staged", staged(rows)), ("CTA budget", ctas(rows))]
    if args.ncu:
        with open(args.ncu) as f:
            sections.append(("ncu", ncu(json.load(f))))
    for name, text in sections:
        sys.stdout.write(f"<!-- {name} -->\n{text}\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
