"""Two bench runs side by side: did any row get slower?

    python -m kvlayout.bench.compare OLD.jsonl NEW.jsonl [NEW2.jsonl ...] [--tolerance 0.03]

Rows are matched by case key.  Each run is judged against its own limits
(``pct_of_limit``: end to end; ``kernel_gbps / limit_gbps``: kernel only),
so two runs on machines, or at times, whose copy bandwidth differs compare
fairly.  Runs made on one machine in one sitting (``scripts/ab_record.sh``)
compare their rates directly (``--same-machine``): the small copies that
set the limits of small rows are noisier than the rows themselves.  With
several NEW runs a row counts as slower only when every one of them is
below OLD by more than the tolerance (the best of the new runs is compared;
one slow run of a ~10 µs kernel is run-to-run spread).  Prints one line per
slower row and a summary; exits 1 when a row is slower.

    python -m kvlayout.bench.compare --medians N OLD_1 .. OLD_N NEW_1 .. [--same-machine]

compares instead, row by row, the median of the N old runs with the median of
the new runs: a row counts as slower when the new median is below the old one
by more than the tolerance (a row whose rounds split between two speeds is
judged by where most of them fall); each such line says whether every new run
lies below every old one, the new median below every old run, or the new
median within the old runs' spread (where a noisy row's median moves).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from .run import document


def _fractions(row: dict, same_machine: bool = False) -> dict:
    """The row's figures as fractions of its run's limit, or (``same_machine``) its rates in GB/s:
    {"end to end": f, "kernel only": f}."""
    out = {}
    if same_machine:
        for timing, field in (("end to end", "gbps"), ("kernel only", "kernel_gbps")):
            if row.get(field):
                out[timing] = row[field]
        return out
    if row.get("pct_of_limit") is not None:
        out["end to end"] = row["pct_of_limit"] / 100
    if row.get("kernel_gbps") and row.get("limit_gbps"):
        out["kernel only"] = row["kernel_gbps"] / row["limit_gbps"]
    return out


def measured_rows(path: str) -> dict:
    """Case key -> row, for the rows of a run that measured something (empty host-cost rows have no rate)."""
    return {r["key"]: r for r in document(path)["results"] if _fractions(r)}


def compare(old: dict, news: list[dict], tolerance: float,
            same_machine: bool = False) -> tuple[list[str], int]:
    """Lines for the rows slower in every new run than in ``old`` by more than ``tolerance``; rows compared."""
    lines, compared = [], 0
    unit = " GB/s" if same_machine else "% of limit"
    scale = 1 if same_machine else 100
    for key, old_row in old.items():
        if not all(key in new for new in news):
            continue
        compared += 1
        for timing, before in _fractions(old_row, same_machine).items():
            afters = [_fractions(new[key], same_machine).get(timing) for new in news]
            if None in afters or before <= 0:
                continue
            best = max(afters)
            if best < before * (1 - tolerance):
                runs = " ".join(f"{a * scale:.1f}" for a in afters)
                lines.append(f"{key} [{timing}]: {before * scale:.1f}{unit} before, now {runs} "
                             f"({best / before:.2f}x)")
    return lines, compared


def compare_medians(olds: list[dict], news: list[dict], tolerance: float,
                    same_machine: bool = False) -> tuple[list[str], int]:
    """Lines for the rows whose median over ``news`` is below their median over ``olds`` by more than
    ``tolerance``; rows compared (those in every run)."""
    lines, compared = [], 0
    unit = " GB/s" if same_machine else "% of limit"
    scale = 1 if same_machine else 100
    for key, first in olds[0].items():
        if not all(key in run for run in olds + news):
            continue
        compared += 1
        for timing in _fractions(first, same_machine):
            befores = [_fractions(run[key], same_machine).get(timing) for run in olds]
            afters = [_fractions(run[key], same_machine).get(timing) for run in news]
            if None in befores or None in afters:
                continue
            before, after = statistics.median(befores), statistics.median(afters)
            if before > 0 and after < before * (1 - tolerance):
                lines.append(f"{key} [{timing}]: median {before * scale:.1f}{unit} before "
                             f"({' '.join(f'{b * scale:.1f}' for b in befores)}), "
                             f"{after * scale:.1f} now ({' '.join(f'{a * scale:.1f}' for a in afters)}) "
                             f"({after / before:.2f}x; {_against_spread(befores, afters)})")
    return lines, compared


def _against_spread(befores: list[float], afters: list[float]) -> str:
    """Where a slower row's new runs lie against the old runs' spread (a noisy row's median moves within it)."""
    if max(afters) < min(befores):
        return "every new run below every old run"
    if statistics.median(afters) < min(befores):
        return "the new median below every old run"
    return "the new median within the old runs' spread"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlayout.bench.compare", description=__doc__.split("\n")[0])
    parser.add_argument("old")
    parser.add_argument("new", nargs="+")
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="a row is slower when below the old run's fraction of its limit by more than this "
                             "share (default 0.03)")
    parser.add_argument("--same-machine", action="store_true",
                        help="the runs were made on one machine in one sitting: compare rates, not shares of "
                             "each run's limits")
    parser.add_argument("--medians", type=int, default=0, metavar="N",
                        help="the first N runs are old runs, the rest new: compare each row's median over the "
                             "old runs with its median over the new ones")
    args = parser.parse_args(argv)
    if args.medians:
        paths = [args.old] + args.new
        if not 0 < args.medians < len(paths):
            parser.error(f"--medians {args.medians}: needs at least one new run after the {args.medians} old ones "
                         f"({len(paths)} runs given)")
        olds = [measured_rows(p) for p in paths[:args.medians]]
        news = [measured_rows(p) for p in paths[args.medians:]]
        lines, compared = compare_medians(olds, news, args.tolerance, args.same_machine)
        summary = (f"{compared} rows in every run; {len(lines)} figure(s) slower by more than {args.tolerance:.0%} "
                   f"in the median of {len(news)} new run(s) than in the median of {len(olds)} old run(s)")
    else:
        lines, compared = compare(measured_rows(args.old), [measured_rows(p) for p in args.new], args.tolerance,
                                  args.same_machine)
        summary = (f"{compared} rows in both; {len(lines)} figure(s) slower than {args.old} by more than "
                   f"{args.tolerance:.0%} in every new run")
    for line in lines + [summary]:
        print(line)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
