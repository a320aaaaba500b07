"""python -m kvlayout.bench.compare: which rows got slower between bench runs, against each run's limits or,
for runs of one machine in one sitting, by their rates."""

import json

import pytest

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


def test_medians_judge_a_row_by_where_most_of_its_rounds_fall(tmp_path, capsys):
    olds = [_record(tmp_path / f"old{i}.jsonl", 100, [("split", 50, 60), ("steady", 50, 60)]) for i in range(3)]
    # split: one new round as fast as before, two 10 % slower (every-run mode forgives it, the medians do not);
    # steady: one round 10 % slower, two as fast (the medians forgive it)
    news = [_record(tmp_path / "new0.jsonl", 100, [("split", 50, 60), ("steady", 45, 60)]),
            _record(tmp_path / "new1.jsonl", 100, [("split", 45, 60), ("steady", 50, 60)]),
            _record(tmp_path / "new2.jsonl", 100, [("split", 45, 60), ("steady", 50, 60)])]
    assert compare.main(["--same-machine", olds[0], *news]) == 0
    capsys.readouterr()
    assert compare.main(["--same-machine", "--medians", "3", *olds, *news]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("split [end to end]: median 50.0 GB/s before (50.0 50.0 50.0), 45.0 now (50.0 45.0 45.0) "
                      "(0.90x; the new median below every old run)")
    assert len(out) == 2 and out[-1].startswith("2 rows in every run; 1 figure(s) slower by more than 3% in the "
                                                "median of 3 new run(s) than in the median of 3 old run(s)")


def test_medians_need_a_new_run_after_the_old_ones(tmp_path, capsys):
    runs = [_record(tmp_path / f"r{i}.jsonl", 100, [("a", 50, 60)]) for i in range(2)]
    with pytest.raises(SystemExit) as exit_:
        compare.main(["--medians", "2", *runs])
    assert exit_.value.code == 2 and "needs at least one new run" in capsys.readouterr().err


def test_a_slower_median_says_where_the_new_runs_lie_against_the_old_runs_spread(tmp_path, capsys):
    """Below the old median by more than the tolerance: every new run below every old one (a real step), or
    only the new median below every old run, or the new median within the old runs' spread (a noisy row)."""
    olds = [_record(tmp_path / f"old{i}.jsonl", 100, [("step", 50, 60), ("noisy", g, 60)])
            for i, g in enumerate((40, 60, 80))]
    news = [_record(tmp_path / f"new{i}.jsonl", 100, [("step", g, 60), ("noisy", n, 60)])
            for i, (g, n) in enumerate(((45, 45), (44, 50), (46, 70)))]
    assert compare.main(["--same-machine", "--medians", "3", *olds, *news]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("(0.90x; every new run below every old run)")
    assert out[1].startswith("noisy [end to end]: median 60.0 GB/s before (40.0 60.0 80.0), 50.0 now")
    assert out[1].endswith("(0.83x; the new median within the old runs' spread)")
    assert len(out) == 3
