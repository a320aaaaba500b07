"""python -m kvlayout.bench.compare: which rows got slower between bench runs, against each run's limits or,
for runs of one machine in one sitting, by their rates."""

import json

from kvlayout.bench import compare


def _record(path, limit_gbps, rows):
    """A bench JSON-lines record: a run header, then one case line per (key, end-to-end GB/s, kernel GB/s)."""
    lines = [{"kind": "run", "environment": {"device": "cuda"}, "limits": {"D2D": limit_gbps}}]
    for key, gbps, kernel_gbps in rows:
        lines.append({"kind": "case", "key": key, "gbps": gbps, "kernel_gbps": kernel_gbps,
                      "limit_gbps": limit_gbps, "pct_of_limit": 100 * gbps / limit_gbps})
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_a_row_is_slower_only_when_every_new_run_is(tmp_path, capsys):
    old = _record(tmp_path / "old.jsonl", 100, [("a", 50, 60), ("b", 50, 60)])
    new1 = _record(tmp_path / "new1.jsonl", 100, [("a", 40, 60), ("b", 40, 60)])
    new2 = _record(tmp_path / "new2.jsonl", 100, [("a", 40, 60), ("b", 49.5, 60)])   # b: within 3 % once
    assert compare.main([old, new1, new2]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("a [end to end]: 50.0% of limit before, now 40.0 40.0 (0.80x)")
    assert out[-1].startswith("2 rows in both; 1 figure(s) slower")


def test_shares_of_limits_forgive_a_slower_machine_rates_do_not(tmp_path, capsys):
    old = _record(tmp_path / "old.jsonl", 100, [("a", 50, 60)])
    new = _record(tmp_path / "new.jsonl", 80, [("a", 40, 48)])    # the machine's limit 20 % lower, the row alike
    assert compare.main([old, new]) == 0
    assert compare.main(["--same-machine", old, new]) == 1
    out = capsys.readouterr().out
    assert "a [end to end]: 50.0 GB/s before, now 40.0 (0.80x)" in out
    assert "a [kernel only]: 60.0 GB/s before, now 48.0 (0.80x)" in out


def test_rows_missing_from_a_new_run_are_not_compared(tmp_path, capsys):
    old = _record(tmp_path / "old.jsonl", 100, [("a", 50, 60), ("gone", 50, 60)])
    new = _record(tmp_path / "new.jsonl", 100, [("a", 55, 60)])
    assert compare.main([old, new]) == 0
    assert capsys.readouterr().out.startswith("1 rows in both; 0 figure(s) slower")
