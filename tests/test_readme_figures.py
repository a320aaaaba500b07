"""Every figure of the README (and of docs/performance.md and docs/conformance.md) is printed from a committed
result file: this module renders each figure-bearing sentence and table from the files, and the tests check that
the documents hold exactly that text (compared with whitespace folded, so the prose may wrap anywhere).

The README keeps no other figure: with the rendered parts taken out, no number with a unit is left.
To refresh the documents after new records are committed, run
``python tests/test_readme_figures.py --refresh HEAD~1`` (the revision whose records the documents were rendered
from): every part rendered from that revision's records is replaced by the part rendered from today's. Without
arguments the module prints today's parts.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

from kvlayout.bench import side_by_side, summary, targets
from kvlayout.bench.report import compared_with_peers, peer_standing
from kvlayout.bench.run import document, read_jsonl

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "results"
REPORTS = ROOT / "conformance" / "reports"

# The run of kvlayout beside LMCache on the same tensors that the README cites (its side_by_side*.jsonl files).
SIDE_BY_SIDE_RUN = "h200_29be2ee"
# The latest run of that script, on the library of today's tree.
LATEST_SIDE_BY_SIDE_RUN = "h100_031f2a8"
# The run of the same script that timed the kernel's host launch shapes beside each other.
LAUNCH_SHAPE_RUN = "h100_c8984fe"

# The headline rows the README shows: (shape, T, direction), all from the H200 record's headline group.
README_HEADLINE = [(shape, 4096, direction) for shape in ("L32_H8_D128", "L32_MLA_D576")
                   for direction in ("to_host", "from_host", "gather_device", "scatter_device")]

# The host_cost rows: (what the row measures, the row's `call`, a text its key holds)
HOST_COST_ROWS = [
    ("all-layer `ops.transfer` (32 layers, one call)", "transfer", "all layers"),
    ("the same between caches bound anew at each call", "bind-per-call", "all layers"),
    ("the same as `ops.gather` into a view made at each call", "gather", "all layers"),
    ("one-layer `ops.transfer`", "transfer", "x32 layers"),
    ("prepared layer call `t.layer(i)`", "prepared", "prepared empty"),
    ("the same layer call launching nothing (`skip_prefix` = T)", "prepared-no-launch", "prepared-no-launch"),
]


def fold(text: str) -> str:
    """Whitespace folded to single spaces."""
    return " ".join(text.split())


def _jsonl(path: pathlib.Path) -> tuple[dict, list[dict], dict | None]:
    """(run head, case rows, end limits) of a committed record, read as the bench reads it."""
    return read_jsonl(str(path))


def _row(rows: list[dict], call: str, key_text: str) -> dict | None:
    return next((r for r in rows if r["group"] == "host_cost" and r.get("call") == call and key_text in r["key"]),
                None)


def host_cost_table() -> str:
    """Host time of a call with nothing to move, against one torch op and one bare launch measured beside it in
    the same run (the `host_cost` rows of `bench/results/h200.jsonl`, `bench/results/cpu.jsonl`)."""
    _, gpu, _ = _jsonl(BENCH / "h200.jsonl")
    _, cpu, _ = _jsonl(BENCH / "cpu.jsonl")
    lines = ["| call, nothing to move | H200: host µs | × one torch op | × one bare launch "
             "| CPU (2 cores): host µs | × one torch op |", "|---|--:|--:|--:|--:|--:|"]
    for label, call, key_text in HOST_COST_ROWS:
        cells = [label]
        g = _row(gpu, call, key_text)
        cells += ([f"{g['host_us_per_call']:.1f}", f"{g['host_us_per_call'] / g['torch_op_host_us']:.2f}×",
                   f"{g['host_us_per_call'] / g['launch_host_us']:.2f}×"] if g else ["–", "–", "–"])
        c = _row(cpu, call, key_text)
        cells += ([f"{c['host_us_per_call']:.1f}", f"{c['host_us_per_call'] / c['torch_op_host_us']:.2f}×"]
                  if c else ["–", "–"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def headline_table() -> str:
    """The README's headline rows from the H200 record (`bench/results/h200.jsonl`), each by the engine
    `engine="auto"` picks for it (the staged row of the case where auto stages it); the torch baseline is the
    kernel row's, measured on the same data."""
    _, rows, _ = _jsonl(BENCH / "h200.jsonl")
    picked = {(r["shape"], r["T"], r["direction"]): r for r in targets.auto_rows(rows)
              if r["group"] in ("headline", "staged") and r["max_ctas"] == 0}
    lines = ["| shape | T | direction | engine (auto) | kvlayout GB/s (% of limit) | kernel only GB/s (% of limit) "
             "| torch GB/s | × torch |", "|---|--:|---|---|--:|--:|--:|--:|"]
    for shape, T, direction in README_HEADLINE:
        r = picked[(shape, T, direction)]
        torch_gbps = next(k["torch_gbps"] for k in rows if k["group"] == "headline" and k["shape"] == shape
                          and k["T"] == T and k["direction"] == direction and "torch_gbps" in k)
        lines.append(f"| {shape} | {T} | {direction} | {r['engine']} | {r['gbps']:.1f} ({r['pct_of_limit']:.1f}%) | "
                     f"{r['kernel_gbps']:.1f} ({100 * r['kernel_gbps'] / r['limit_gbps']:.1f}%) | "
                     f"{torch_gbps:.1f} | {r['gbps'] / torch_gbps:.1f}× |")
    return "\n".join(lines)


def limits_note(stem: str) -> str:
    """What a run's limits did: measured at the start and the end; every one that moved by more than 5 % named."""
    head, rows, end = _jsonl(BENCH / f"{stem}.jsonl")
    start = head["limits"]
    moved = [(k, start[k], end[k]) for k in start if end and k in end and abs(end[k] - start[k]) > DRIFT * start[k]]
    text = f"`{stem}` ({len(rows)} cases, {head['environment']['time'][:10]}): "
    if end is None:
        return text + "limits measured at the start only (the run was cut short)."
    if not moved:
        return text + f"no limit moved by more than {DRIFT * 100:.0f} % during the run."
    return text + "flagged: " + "; ".join(f"{k} {a:.1f} → {b:.1f} GB/s" for k, a, b in moved) + "."


def main_job_sentence() -> str:
    """The README's main command, from the committed CPU record."""
    d = json.loads((REPORTS / "cpu.json").read_text(encoding="utf-8"))
    return (f"the committed CPU record ([conformance/reports/cpu.md](conformance/reports/cpu.md)) has "
            f"{d['summary']['cases']:,} cases, {d['summary']['passed']:,} passed, in {d['seconds']:.0f} s on "
            f"{d['environment']['cpu_count']} CPU cores")


def conformance_record(name: str) -> str:
    """One committed conformance record in a sentence (docs/conformance.md)."""
    d = json.loads((REPORTS / f"{name}.json").read_text(encoding="utf-8"))
    s, h, env = d["summary"], d["hostile_inputs"], d["environment"]
    devices = ", ".join(x["device"] for x in d["devices"] if x["status"] == "run")
    text = (f"[`{name}`](../conformance/reports/{name}.md) (devices {devices}, commit "
            f"{(env.get('git_commit') or '?')[:7]}, {d['date'][:10]}): {s['cases']:,} cases, {s['passed']:,} "
            f"passed, in {d['seconds']:.0f} s. Invalid and hostile inputs ({', '.join(h['families'])}): "
            f"{h['tried']} tried, {h['crashes']} crashes, {h['wrong_outcomes']} wrong outcomes")
    san = d.get("sanitizer")
    if san and san.get("errors") is not None:
        text += (f"; {san['cases']} CUDA cases under compute-sanitizer memcheck, {san['errors']} errors "
                 f"({h['out_of_bounds']} out-of-bounds accesses)")
    return text + "."


def method_figures() -> list[str]:
    """Figures of the method, not of a measurement: the size of the pinned copy that is the host ceiling (the
    record's own limit name) and the drift that flags a limit."""
    _, rows, _ = _jsonl(BENCH / "h200.jsonl")
    ceiling = next(r["limit_name"] for r in rows if r.get("direction") == "to_host" and "limit_name" in r)
    return [re.sub(r"^[A-Z2]+_(\d+)MiB$", r"\1 MiB", ceiling), f"{DRIFT * 100:.0f} %"]


DRIFT = 0.05
"""A limit that moved by more than this fraction between a run's start and end is flagged."""

FIGURE = re.compile(r"\d[\d,]*(?:\.\d+)?\s*(?:µs|GB/s|GiB|MiB|%|×|s\b|min\b|cases\b|passed\b)")


def _readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_headline_table_is_the_h200_record():
    assert fold(headline_table()) in fold(_readme())


def test_readme_host_cost_table_is_the_host_cost_records():
    assert fold(host_cost_table()) in fold(_readme())


def peer_sentence() -> str:
    """The README's standing against the peers, per timing, from the H200 record compared afresh."""
    return peer_standing(compared_with_peers(document(str(BENCH / "h200.jsonl"))))


def side_by_side_sentence(run: str = SIDE_BY_SIDE_RUN) -> str:
    """The README's standing beside LMCache on the same tensors, per timing, from ``run``'s files."""
    rows = []
    for path in sorted((BENCH / run).glob("side_by_side*.jsonl")):
        if path.name != "side_by_side_timeline.jsonl":    # (its --timeline rows: where each call's time goes)
            rows += side_by_side.read(str(path))[1]
    return side_by_side.standing(rows)


@pytest.mark.parametrize("run", [SIDE_BY_SIDE_RUN, LATEST_SIDE_BY_SIDE_RUN])
def test_readme_side_by_side_standing_is_the_run_beside_lmcache(run):
    assert fold(side_by_side_sentence(run)) in fold(_readme())


def launch_shape_sentence() -> str:
    """The README's host launch shapes against each other and LMCache's kernel, from that run's files."""
    return side_by_side.launch_shapes(side_by_side.read(str(BENCH / LAUNCH_SHAPE_RUN / "side_by_side.jsonl"))[1])


def test_readme_launch_shapes_are_the_run_that_timed_both():
    assert fold(launch_shape_sentence()) in fold(_readme())


def test_readme_peer_standing_is_the_h200_record():
    assert fold(peer_sentence()) in fold(_readme())


def test_readme_main_job_figures_are_the_cpu_record():
    assert fold(main_job_sentence()) in fold(_readme())


def test_readme_limits_notes_name_every_flagged_limit():
    for stem in ("h200", "cpu"):
        assert fold(limits_note(stem)) in fold(_readme()), stem


def test_readme_has_no_figure_without_a_source():
    """With the rendered parts and the code blocks taken out, no number with a unit is left in the README."""
    text = fold(re.sub(r"```.*?```", " ", _readme(), flags=re.S))
    parts = [headline_table(), host_cost_table(), main_job_sentence(), peer_sentence(), side_by_side_sentence(),
             launch_shape_sentence()] + [
        limits_note(s) for s in ("h200", "cpu")]
    for part in parts + method_figures():
        text = text.replace(fold(part), " ")
    assert not FIGURE.findall(text), FIGURE.findall(text)


def targets_section() -> str:
    """The H200 record against the performance targets (kvlayout.bench.targets)."""
    doc = compared_with_peers(document(str(BENCH / "h200.jsonl")))
    return targets.markdown(targets.checks(doc), targets.host_speed(doc["results"]))


def record_tables() -> dict[str, str]:
    """The H200 record's tables as `kvlayout.bench.summary` prints them, by name ("record Staged", ...)."""
    return {f"record {name}": text for name, text in summary.sections(str(BENCH / "h200.jsonl"))}


def test_performance_doc_figures_are_the_records():
    doc = fold((ROOT / "docs" / "performance.md").read_text(encoding="utf-8"))
    assert fold(host_cost_table()) in doc
    assert fold(headline_table()) in doc
    assert fold(targets_section()) in doc
    for name, table in record_tables().items():
        assert fold(table) in doc, name
    for path in sorted(BENCH.glob("*.jsonl")):
        assert fold(limits_note(path.stem)) in doc, path.stem


def test_conformance_doc_records_are_the_reports():
    doc = fold((ROOT / "docs" / "conformance.md").read_text(encoding="utf-8"))
    for name in ("cpu", "h200"):
        assert fold(conformance_record(name)) in doc, name


DOCUMENTS = ("README.md", "docs/performance.md", "docs/conformance.md")


def rendered_parts() -> dict[str, str]:
    """Every part the documents hold, rendered from the records under BENCH and REPORTS, by name."""
    parts = {"headline": headline_table(), "host cost": host_cost_table(), "main job": main_job_sentence(),
             "peers": peer_sentence(), "side by side": side_by_side_sentence(),
             "launch shapes": launch_shape_sentence(), "targets": targets_section(),
             **record_tables()}
    parts.update({f"limits {p.stem}": limits_note(p.stem) for p in sorted(BENCH.glob("*.jsonl"))})
    parts.update({f"conformance {n}": conformance_record(n) for n in ("cpu", "h200")})
    return parts


def refresh(rev: str) -> list[str]:
    """Rewrites the documents: each part rendered from the records committed at ``rev`` (found with its
    whitespace folded, as the tests compare) becomes the part rendered from the records now. Returns the names
    of the parts replaced; a part new since ``rev`` (a record added) has no text to replace and is left to the
    author."""
    global BENCH, REPORTS
    new = rendered_parts()
    here = (BENCH, REPORTS)
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", rev, "bench/results", "conformance/reports"], cwd=ROOT,
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        BENCH, REPORTS = pathlib.Path(tmp) / "bench" / "results", pathlib.Path(tmp) / "conformance" / "reports"
        try:
            old = rendered_parts()
        finally:
            BENCH, REPORTS = here
    replaced = []
    for name in DOCUMENTS:
        path = ROOT / name
        text = path.read_text(encoding="utf-8")
        for part, before in old.items():
            after = new.get(part)
            if after is None or after == before:
                continue
            pattern = re.compile(r"\s+".join(re.escape(word) for word in before.split()))
            text, n = pattern.subn(lambda _: after, text)
            if n:
                replaced.append(f"{part} ({name})")
        path.write_text(text, encoding="utf-8")
    return replaced


if __name__ == "__main__":
    if sys.argv[1:2] == ["--refresh"]:
        print("\n".join(refresh(sys.argv[2] if len(sys.argv) > 2 else "HEAD")) or "nothing changed")
    else:
        print(*rendered_parts().values(), sep="\n\n")
