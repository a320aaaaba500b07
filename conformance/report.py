"""The conformance report: one data structure, rendered as a terminal table, JSON and Markdown."""

from __future__ import annotations

import datetime
import json
import os

from .families import FAMILIES
from .families.rope import FP32_PAIR_TOLERANCE
from .runner import SANITIZE_SCOPE

RULES = {
    "copies": "every output tensor of the op equals the reference's, bit for bit (compared as unsigned "
              "integers; sources hold random bytes, destinations a sentinel byte or random bytes, so rows that "
              "must stay untouched are checked too); sources must not change",
    "rope": f"rotated dims: |got - want| <= {FP32_PAIR_TOLERANCE:g} * (|x| + |y|) of the element's rotary pair "
            "(fp32 keys), plus one unit in the last place of the result for fp16/bf16 keys; dims past the "
            "rotary part, tokens with a negative position and the V half of packed rows bit for bit",
    "out of range": "a slot >= the cache's slot count in a token that would be copied raises IndexError naming "
                    "the argument: on CPU before anything is written; on CUDA from ops.check_errors() after the "
                    "default path (that token's rows untouched, the rest copied) or before launching with "
                    "validate=True",
    "bad input": "every error kind of every family raises the one exception type of the decided rule it "
                 "breaks (kvlayout.reference.semantics; the kinds and their rules are listed below), with a "
                 "message that names the argument, and the destination unchanged",
}


def build(*, command, settings, statuses, results, environment, seconds, sanitizer, name) -> dict:
    rows, failures = [], []
    order = {f: i for i, f in enumerate(FAMILIES)}
    for r in sorted(results, key=lambda r: (order.get(r["family"], 99), r["device"])):
        for group, rec in sorted(r["groups"].items()):
            rows.append({"family": r["family"], "layouts": group, "device": r["device"], "cases": rec["cases"],
                         "passed": rec["passed"], "failed": rec["failed"], "seconds": round(rec["seconds"], 2),
                         "variants": rec["variants"]})
        failures.extend(r["failures"])
    cases = sum(r["cases"] for r in rows)
    failed = sum(r["failed"] for r in rows)
    per_family = {}
    for r in rows:
        key = (r["family"], r["device"])
        agg = per_family.setdefault(key, {"family": r["family"], "device": r["device"], "cases": 0, "passed": 0,
                                          "failed": 0, "seconds": 0.0})
        for k in ("cases", "passed", "failed", "seconds"):
            agg[k] += r[k]
    return {
        "hostile_inputs": _hostile_summary(rows, sanitizer),
        "name": name,
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "settings": settings,
        "environment": environment,
        "devices": [s.as_dict() for s in statuses],
        "rules": RULES,
        "families": {f: FAMILIES[f].doc for f in settings["families"]},
        "error_kinds": _error_kinds() if "bad_input" in settings["families"] else {},
        "summary": {"cases": cases, "passed": cases - failed, "failed": failed,
                    "status": "FAIL" if failed or (sanitizer and sanitizer.get("errors")) else
                    ("NO DEVICE" if not rows and not any(s.status == "run" for s in statuses) else "PASS")},
        "per_family": [dict(v, seconds=round(v["seconds"], 1)) for v in per_family.values()],
        "results": rows,
        "failures": failures,
        "sanitizer": sanitizer,
    }


def _error_kinds() -> dict:
    """Each error kind of the bad_input family: the rule it cites, that rule's exception, the message regex."""
    from .families.errors import ERROR_KINDS

    return {name: {"rule": k.rule, "error": k.error_type.__name__, "regex": k.error_regex}
            for name, k in ERROR_KINDS.items()}


HOSTILE_FAMILIES = ("bad_input", "fuzz_index", "hostile")


def _hostile_summary(rows: list[dict], sanitizer: dict | None) -> dict:
    """What the invalid and hostile inputs did: tried, crashes, wrong outcomes, out-of-bounds accesses."""
    mine = [r for r in rows if r["family"] in HOSTILE_FAMILIES]
    crashes = sum(r["failed"] for r in mine if r["layouts"] == "(process died)")
    return {"tried": sum(r["cases"] for r in mine), "crashes": crashes,
            "wrong_outcomes": sum(r["failed"] for r in mine) - crashes,
            "out_of_bounds": None if not sanitizer or sanitizer.get("errors") is None else sanitizer["errors"],
            "families": [f for f in HOSTILE_FAMILIES if any(r["family"] == f for r in mine)]}


def hostile_line(data: dict) -> str:
    h = data.get("hostile_inputs")
    if not h or not h["tried"]:
        return ""
    oob = "not measured (no sanitizer run)" if h["out_of_bounds"] is None else str(h["out_of_bounds"])
    return (f"Invalid and hostile inputs ({', '.join(h['families'])}): {h['tried']} tried, {h['crashes']} crashes, "
            f"{h['wrong_outcomes']} wrong outcomes (a missing or unclear rejection, or a write where none was due), "
            f"out-of-bounds accesses under compute-sanitizer: {oob}")


def _table(header: list[str], rows: list[list], align_right: set[int] = frozenset()) -> list[str]:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]

    def fmt(row):
        return "  ".join(c.rjust(w) if i in align_right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return [fmt(header).rstrip(), "  ".join("-" * w for w in widths)] + [fmt(r).rstrip() for r in cells]


def _device_lines(data: dict) -> list[str]:
    out = []
    for d in data["devices"]:
        text = f"{d['device']}: {d['status']}"
        if d.get("name"):
            text += f" ({d['name']})"
        if d.get("reason"):
            text += f" - {d['reason']}"
        out.append(text)
    return out


def terminal(data: dict) -> str:
    lines = [f"kvlayout conformance: {data['summary']['status']} - {data['summary']['cases']} cases, "
             f"{data['summary']['passed']} passed, {data['summary']['failed']} failed in {data['seconds']:.0f}s"]
    lines += ["devices: " + "; ".join(_device_lines(data))]
    if hostile_line(data):
        lines.append(hostile_line(data))
    rows = [[r["family"], r["layouts"], r["device"], r["cases"], r["passed"], r["failed"], f"{r['seconds']:.1f}s"]
            for r in data["results"]]
    if rows:
        lines += [""] + _table(["family", "layouts", "device", "cases", "passed", "failed", "time"], rows, {3, 4, 5, 6})
    for f in data["failures"]:
        first = f["message"].splitlines()[0] if f["message"] else ""
        lines += ["", f"FAILED {f['family']} / {f['layouts']} / {f['device']} ({f['failed_cases']} cases): "
                      f"{f['description']}", f"  {first[:300]}"]
    if data["sanitizer"] is not None:
        s = data["sanitizer"]
        detail = f" - {s['detail']}" if s.get("detail") else ""
        lines += ["", f"sanitizer (compute-sanitizer memcheck): {s['status']}{detail}"]
    return "\n".join(lines)


def markdown(data: dict) -> str:
    env = data["environment"]
    s = data["summary"]
    lines = [f"# kvlayout conformance report: {data['name']}", "",
             f"**{s['status']}**: {s['cases']} cases, {s['passed']} passed, {s['failed']} failed "
             f"({data['seconds']:.0f} s, {data['date']}).", ""]
    if hostile_line(data):
        lines += [hostile_line(data) + ".", ""]
    lines += ["```bash", data["command"], "```", "",
             f"Examples per operation family and device: {data['settings']['examples']}; seed "
             f"{data['settings']['seed']}; families: {', '.join(data['settings']['families'])}.", "",
             "## Devices", ""]
    lines += [f"* {l}" for l in _device_lines(data)]
    lines += ["", "## Environment", "", "| | |", "|---|---|"]
    for k, v in env.items():
        lines.append(f"| {k} | {v} |")
    lines += ["", "## What is checked", ""]
    lines += [f"* **{k}**: {v}" for k, v in data["rules"].items()]
    lines += ["", "Families:", ""]
    lines += [f"* `{k}`: {v}" for k, v in data["families"].items()]
    if data.get("error_kinds"):
        lines += ["", "Error kinds (`bad_input`): rule cited, exception, message pattern:", "",
                  "| kind | rule | exception | message matches |", "|---|---|---|---|"]
        lines += [f"| {k} | `{v['rule']}` | {v['error']} | `{v['regex']}` |" for k, v in data["error_kinds"].items()]
    lines += ["", "## Results", "", "| family | device | cases | passed | failed | time |", "|---|---|--:|--:|--:|--:|"]
    for r in data["per_family"]:
        lines.append(f"| {r['family']} | {r['device']} | {r['cases']} | {r['passed']} | {r['failed']} | "
                     f"{r['seconds']:.1f} s |")
    lines += ["", "Per operation family × layout family (or bad-input class) × device:", "",
              "| family | layouts | device | cases | passed | failed | time |", "|---|---|---|--:|--:|--:|--:|"]
    for r in data["results"]:
        mark = " **✗**" if r["failed"] else ""
        lines.append(f"| {r['family']} | {r['layouts']} | {r['device']} | {r['cases']} | {r['passed']} | "
                     f"{r['failed']}{mark} | {r['seconds']:.1f} s |")
    lines += ["", "## Failures", ""]
    if not data["failures"]:
        lines.append("None.")
    for f in data["failures"]:
        lines += [f"### {f['family']} / {f['layouts']} / {f['device']}", "",
                  f"{f['failed_cases']} failing case(s). "
                  + ("Minimal case (shrunk by hypothesis):" if f["reduced"] else "First failing case (not shrunk):")
                  + f" `{f['description']}`", "", "```", f["message"], "```", "",
                  "Reproducer (the sample's repr and the one replay driver):", "",
                  "```bash", f["reproducer"].rstrip(), "```", ""]
        if f["failed_cases"] > 1:
            lines += ["First failing cases as drawn:", ""] + [f"* `{d}`" for d in f["first_failures"]] + [""]
    lines += ["", "## Sanitizer", ""]
    san = data["sanitizer"]
    if san is None:
        lines.append(f"Not requested (`--sanitize` {SANITIZE_SCOPE}).")
    else:
        lines.append(f"**{san['status']}**" + (f": {san['detail']}" if san.get("detail") else ""))
        if san.get("command"):
            lines += ["", "```bash", f"{san['environment'].split(' (')[0]} {san['command']}", "```"]
            if "cases" in san:
                lines.append(f"\n{san['cases']} cases under memcheck, {san['cases_failed']} failed; "
                             f"{san['seconds']} s.")
            if san.get("error_lines"):
                lines += ["", "```"] + san["error_lines"] + ["```"]
    return "\n".join(lines).rstrip() + "\n"


def write(directory: str, data: dict) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    base = os.path.join(directory, data["name"])
    with open(base + ".json", "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
    with open(base + ".md", "w", encoding="utf-8") as f:
        f.write(markdown(data))
    return [base + ".json", base + ".md"]
