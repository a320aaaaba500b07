"""``kvlayout conformance --fuzz-report``: the hostile family's fuzz record (cases, crashes, out-of-bounds
writes, refusals and whether each named its argument), and the classification it rests on."""

from __future__ import annotations

import json

from kvlayout.conformance import runner
from kvlayout.conformance.families import hostile


def test_fuzz_report_of_a_small_hostile_run(tmp_path):
    kinds = len(hostile.hostile_kinds("cpu"))
    path = tmp_path / "reports" / "fuzz.md"
    code = runner.main(["--device", "cpu", "--only", "hostile", "--examples", str(kinds), "--jobs", "1",
                        "--no-progress", "--shrink-seconds", "0", "--fuzz-report", str(path)])
    assert code == 0
    data = json.loads((tmp_path / "reports" / "fuzz.json").read_text())
    totals = data["totals"]
    assert totals["cases"] == kinds and totals["crashes"] == 0 and totals["out_of_bounds"] == 0
    assert totals["refusals_named"] >= kinds - 1        # every kind but the racing one refuses at least once
    assert data["every_refusal_named_its_argument"] is True
    assert set(data["runs"][0]["groups"]) == set(hostile.hostile_kinds("cpu"))
    text = path.read_text()
    assert "--fuzz-report" in text and "Every refusal named its argument: yes." in text
    for kind in ("overlapping destination layers", "oversized rows", "freed slot storage", "forged dist descriptors"):
        assert kind in text


def test_failures_are_classified_and_an_unnamed_refusal_says_no(tmp_path):
    assert runner._failure_kind("AssertionError: 12 bytes after guarded tensor 0 changed: a write outside the "
                                "tensor") == "out_of_bounds"
    assert runner._failure_kind("AssertionError: ValueError does not match 'dst_slots': bad") == "unnamed_refusal"
    assert runner._failure_kind("AssertionError: expected ValueError matching 'x'; nothing was raised") \
        == "not_refused"
    assert runner._failure_kind("AssertionError: expected ValueError, got KeyError: 3") == "not_refused"
    assert runner._failure_kind("RuntimeError: something else") == "other"
    results = [{"family": "hostile", "device": "cpu", "groups": {"a": {"cases": 5, "failed": 1}},
                "refusals": {"named": 4, "unnamed": 1}, "failure_kinds": {"unnamed_refusal": 1}},
               {"family": "hostile", "device": "cuda", "groups": {"(process died)": {"cases": 1, "failed": 1}},
                "refusals": {}, "failure_kinds": {}}]
    path = tmp_path / "f.md"
    runner.write_fuzz_report(str(path), "cmd", results, {"errors": 2, "status": "2 errors", "cases": 9})
    data = json.loads((tmp_path / "f.json").read_text())
    assert data["totals"]["crashes"] == 1 and data["totals"]["cases"] == 5
    assert data["totals"]["sanitizer_errors"] == 2
    assert data["every_refusal_named_its_argument"] is False
    assert "Every refusal named its argument: no." in path.read_text()
