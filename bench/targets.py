"""The performance targets a CUDA record is held to, each checked on the record's own rows.

    python -m kvlayout.bench.targets bench/results/h200.jsonl

prints Markdown: per target, on how many rows it is met, then every miss with
its figure and goal. A row is judged by the engine ``engine="auto"`` picks
for it (the staged row of the same case where auto stages it, else the
kernel row), since that is what a caller gets by default:

* ``peers``: every headline row (L32 H8 / H1 / MLA; T = 256, 4096, 32768;
  to host, from host, gather, scatter) at least as fast as the best peer of
  ``bench/peers.json``, in each timing (kernel only against the peers'
  overlapped figure, end to end against their idle figure; rows without a
  peer figure in a timing are not counted in it);
* ``host ceiling``: host transfers at T >= 4096 at 97 % of the pinned
  256 MiB copy or more, end to end;
* ``staged host work``: at most 50 µs of host time per staged call (a repeated call shape, replayed from its
  graph); ``staged host work, new shape``: the same bound for the bench's staged rows issued directly (the
  ``direct`` call: no graph kept, as for a shape not seen before); ``staged host work, new length``: the
  same bound for the ``new-length`` and ``spread-length`` rows (each call a token count the engine has not
  run, its reuse prefix's graph replayed and the rest moved by the direct kernel:
  ``ops.set_staged_graph_reuse("prefix")``) and the ``spread-exact`` rows (the spread rows' lengths under the
  default, each call issued directly);
  ``staged host work, graph launched on the device``: the same bound for the ``device-launch`` rows
  (``ops.set_staged_graph_launch("device")``);
* ``copy engine run list``: the copy engine's run list built in C++ in at most 100 µs of host time per
  8,192 copies (the bench's ``run_list_us``: the list built as the call builds it, not issued; the rest of
  the call is the driver's batched copy call; a record without it is judged by the whole call's host time).
  A row whose list is shorter is judged by the list of the same case at enough tokens for 8,192 copies
  (``run_list_at_target_us``), where the record has it. A miss gives the spread of its builds ((p90 - p10) /
  median, ``run_list_spread``) where the record has it: a wide one says the host was busy with other work;
* ``SM budget``: host transfers under ``max_ctas = 4`` at 90 % of the pinned
  copy or more end to end, and at least as fast as the best peer under the
  same budget in each timing.

The host-work targets are absolute microseconds, so one tree meets fewer of them on a slower host: the report
opens with the host's own yardsticks from the record's ``host_cost`` rows (one bare kernel launch and one torch
op, host µs), by which records of other machines compare.

Whether any row got slower than an earlier tree is not a target of one
record: ``scripts/ab_record.sh`` answers that on one machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from .cases import COPY_ENGINE_RUNS, VARIED_LENGTH_CALLS
from .report import compared_with_peers, markdown_table
from .run import document

HEADLINE_SHAPES = ("L32_H8_D128", "L32_H1_D128", "L32_MLA_D576")
HEADLINE_TOKENS = (256, 4096, 32768)
HOST_CEILING_PCT = 97.0
STAGED_HOST_US = 50.0
COPY_ENGINE_RUN_LIST_US = 100.0   # per COPY_ENGINE_RUNS copies
BUDGET_CTAS = 4
BUDGET_PCT = 90.0
TIMINGS = (("kernel", "kernel only"), ("end_to_end", "end to end"))


@dataclasses.dataclass
class Check:
    """One target on one row: what was measured, what is asked, whether it is met."""

    target: str
    row: str
    measured: str
    goal: str
    met: bool


def _auto_stages(r: dict, calibration: dict | None) -> bool:
    """Whether auto stages the row's case: the bench repeats each call between the same cache objects, so as
    between a pair that moved before, but where it binds caches anew at every call."""
    from kvlayout.ops.staged import auto_stages
    sm_slow = calibration is not None and calibration.get(r["direction"], {}).get("sm_slow", False)
    return auto_stages(r["direction"] == "to_host", r["payload_bytes"], r["max_ctas"], sm_slow,
                       moved_before=r.get("call") != "bind-per-call")


def auto_rows(rows: list[dict], calibration: dict | None = None) -> list[dict]:
    """The measured kernel rows of the headline and ctas groups (a case both measure, once) with, where auto
    stages the case and the record has its staged row, that row in their place. ``calibration``: the record's
    device calibration (``ops.calibrate``, in its environment; records before it have none: auto's fixed
    rule)."""
    staged = {(r["shape"], r["T"], r["direction"], r["max_ctas"]): r for r in rows
              if r["group"] == "staged" and "gbps" in r and r.get("call", "transfer") == "transfer"}
    out, seen = [], set()
    for r in rows:
        if r["group"] not in ("headline", "ctas") or "gbps" not in r or r["key"] in seen:
            continue
        seen.add(r["key"])
        twin = staged.get((r["shape"], r["T"], r["direction"], r["max_ctas"]))
        out.append(twin if twin is not None and _auto_stages(r, calibration) else r)
    return out


# how the staged rows that are not an engine's repeated call are named
CALL_NAMES = {"direct": "issued directly", "new-length": "new lengths",
              "spread-length": "new lengths over three octaves",
              "spread-exact": "new lengths over three octaves, own graphs only", "slot-chunks": "in slot-sized chunks",
              "device-launch": "graph launched on the device", "bind-per-call": "caches bound anew per call"}


def _name(r: dict) -> str:
    engine = " (staged)" if r["engine"] == "staged" else ""
    if r.get("call") in CALL_NAMES:
        engine = f" (staged, {CALL_NAMES[r['call']]})"
    ctas = f" ctas={r['max_ctas']}" if r["max_ctas"] else ""
    return f"{r['shape']} T={r['T']} {r['direction']}{ctas}{engine}"


def _peer_checks(target: str, r: dict) -> list[Check]:
    out = []
    for k, timing in TIMINGS:
        verdict = r.get(f"vs_peer_{k}")
        if verdict is None:
            continue
        out.append(Check(f"{target}, {timing}", _name(r), f"{r[f'x_peer_{k}']:.2f}× {r[f'peer_{k}']}",
                         "≥ 1.00× the best peer", verdict == "ahead"))
    return out


def _run_list_check(r: dict) -> Check:
    goal = f"≤ {COPY_ENGINE_RUN_LIST_US:.0f} µs per {COPY_ENGINE_RUNS:,} copies"
    name = f"{_name(r)} ps={r['page_size']}"
    if "run_list_us" not in r:         # (an older record: the whole call)
        return Check("copy engine run list", name, f"whole call {r['host_us_per_call']:.1f} µs", goal,
                     r["host_us_per_call"] <= COPY_ENGINE_RUN_LIST_US)
    # the list of at least COPY_ENGINE_RUNS copies where the record timed one (the row's own list is shorter)
    at = "_at_target" if "runs_at_target" in r else ""
    runs, us = (r["runs_at_target"], r["run_list_at_target_us"]) if at else (r["runs"], r["run_list_us"])
    scaled = us * COPY_ENGINE_RUNS / max(runs, 1)
    spread = r.get(f"run_list{at}_spread")      # (a record made before the bench kept it has none)
    spread = "" if spread is None else f"; spread {spread:.0%}"
    return Check("copy engine run list", name, f"{scaled:.1f} µs ({runs:,} copies in {us:.1f} µs{spread})", goal,
                 scaled <= COPY_ENGINE_RUN_LIST_US)


def checks(doc: dict) -> list[Check]:
    """Every target on every row it applies to (``doc`` compared with the peers)."""
    rows = doc["results"]
    picked = auto_rows(rows, doc.get("environment", {}).get("calibration"))
    out: list[Check] = []
    for r in picked:
        if r["max_ctas"] == 0 and r["shape"] in HEADLINE_SHAPES and r["T"] in HEADLINE_TOKENS:
            out += _peer_checks("peers", r)
    for r in picked:
        if r["max_ctas"] == 0 and r["direction"] in ("to_host", "from_host") and r["T"] >= 4096:
            out.append(Check("host ceiling", _name(r), f"{r['pct_of_limit']:.1f} %", f"≥ {HOST_CEILING_PCT:.0f} %",
                             r["pct_of_limit"] >= HOST_CEILING_PCT))
    for r in rows:
        if (r["group"] == "staged" and r["engine"] == "staged" and "gbps" in r
                and r.get("call") not in ("slot-chunks", "bind-per-call")):   # (not a default call)
            target = {"direct": "staged host work, new shape",
                      **dict.fromkeys(VARIED_LENGTH_CALLS, "staged host work, new length"),
                      "device-launch": "staged host work, graph launched on the device"}.get(r.get("call"),
                                                                                          "staged host work")
            where = ", the body of a conditional node" if r.get("graph_on_device") else ""
            if r.get("graph_tokens") and r["graph_tokens"] < r["T"]:
                where += f", of its first {r['graph_tokens']} tokens"
            counts = f" ({r['chunks']} chunks, graph of {r['graph_nodes']} nodes{where})" if r.get("graph_nodes") else (
                f" ({r['chunks']} chunks, issued directly)" if "chunks" in r else "")
            out.append(Check(target, _name(r), f"{r['host_us_per_call']:.1f} µs{counts}",
                             f"≤ {STAGED_HOST_US:.0f} µs", r["host_us_per_call"] <= STAGED_HOST_US))
        if r["group"] == "copy_engine" and r["engine"] == "copy" and "gbps" in r:
            out.append(_run_list_check(r))
    for r in picked:
        if r["max_ctas"] == BUDGET_CTAS and r["direction"] in ("to_host", "from_host"):
            out.append(Check("SM budget", _name(r), f"{r['pct_of_limit']:.1f} %", f"≥ {BUDGET_PCT:.0f} %",
                             r["pct_of_limit"] >= BUDGET_PCT))
            out += _peer_checks("SM budget vs peers", r)
    return out


def host_speed(rows: list[dict]) -> str | None:
    """The host's yardsticks in a record (its ``host_cost`` rows' bare launch and torch op, host µs, lowest to
    highest), as one sentence; None where the record has no such rows."""
    cost = [r for r in rows if r["group"] == "host_cost" and "launch_host_us" in r and "torch_op_host_us" in r]
    if not cost:
        return None

    def span(field: str) -> str:
        low, high = min(r[field] for r in cost), max(r[field] for r in cost)
        return f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}"
    return (f"This host: one bare kernel launch {span('launch_host_us')} µs, one torch op "
            f"{span('torch_op_host_us')} µs of host time (the record's {len(cost)} host_cost "
            f"row{'s' if len(cost) > 1 else ''}).")


def markdown(found: list[Check], host: str | None = None) -> str:
    """Per target how many rows meet it, then the misses; ``host`` (:func:`host_speed`) first where given."""
    targets = list(dict.fromkeys(c.target for c in found))
    summary = [[t, f"{sum(c.met for c in found if c.target == t)} of {sum(c.target == t for c in found)}"]
               for t in targets]
    misses = [[c.target, c.row, c.measured, c.goal] for c in found if not c.met]
    return ((f"{host}\n\n" if host else "") + markdown_table(["target", "rows that meet it"], summary)
            + "\n\nMisses:\n\n"
            + markdown_table(["target", "row (engine auto picks)", "measured", "goal"], misses))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jsonl", help="a CUDA record of `kvlayout bench` (its .jsonl)")
    parser.add_argument("--sm-slow", action="append", choices=("to_host", "from_host"), default=None,
                        help="judge auto's picks as on a device whose SMs move host memory that way slowly "
                             "(ops.calibrate; for a record made before the bench recorded the calibration)")
    args = parser.parse_args(argv)
    doc = compared_with_peers(document(args.jsonl))
    if args.sm_slow:
        doc.setdefault("environment", {})["calibration"] = {
            direction: {"sm_slow": direction in args.sm_slow} for direction in ("to_host", "from_host")}
    sys.stdout.write(markdown(checks(doc), host_speed(doc["results"])) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
