"""Two bench runs side by side: did any row get slower?

    python -m kvlayout.bench.compare OLD.jsonl NEW.jsonl [NEW2.jsonl ...] [--tolerance 0.03]

Rows are matched by case key.  Each run is judged against its own limits
(``pct_of_limit``: end to end; ``kernel_gbps / limit_gbps``: kernel only),
so two runs on machines, or at times, whose copy bandwidth differs compare
fairly.  With several NEW runs a row counts as slower only when every one of
them is below OLD by more than the tolerance (the best of the new runs is
compared; one slow run of a ~10 µs kernel is run-to-run spread).  Prints one
line per slower row and a summary; exits 1 when a row is slower.
"""

from __future__ import annotations

import argparse
import sys

from .run import document


def _fractions(row: dict) -> dict:
    """The row's figures as fractions of its run's limit: {"end to end": f, "kernel only": f}."""
    out = {}
    if row.get("pct_of_limit") is not None:
        out["end to end"] = row["pct_of_limit"] / 100
    if row.get("kernel_gbps") and row.get("limit_gbps"):
        out["kernel only"] = row["kernel_gbps"] / row["limit_gbps"]
    return out


def measured_rows(path: str) -> dict:
    """Case key -> row, for the rows of a run that measured something (empty host-cost rows have no rate)."""
    return {r["key"]: r for r in document(path)["results"] if _fractions(r)}


def compare(old: dict, news: list[dict], tolerance: float) -> tuple[list[str], int]:
    """Lines for the rows slower in every new run than in ``old`` by more than ``tolerance``; rows compared."""
    lines, compared = [], 0
    for key, old_row in old.items():
        if not all(key in new for new in news):
            continue
        compared += 1
        for timing, before in _fractions(old_row).items():
            afters = [_fractions(new[key]).get(timing) for new in news]
            if None in afters or before <= 0:
                continue
            best = max(afters)
            if best < before * (1 - tolerance):
                runs = " ".join(f"{a * 100:.1f}" for a in afters)
                lines.append(f"{key} [{timing}]: {before * 100:.1f}% of limit before, now {runs} "
                             f"({best / before:.2f}x)")
    return lines, compared


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlayout.bench.compare", description=__doc__.split("\n")[0])
    parser.add_argument("old")
    parser.add_argument("new", nargs="+")
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="a row is slower when below the old run's fraction of its limit by more than this "
                             "share (default 0.03)")
    args = parser.parse_args(argv)
    old = measured_rows(args.old)
    news = [measured_rows(p) for p in args.new]
    lines, compared = compare(old, news, args.tolerance)
    for line in lines:
        print(line)
    print(f"{compared} rows in both; {len(lines)} figure(s) slower than {args.old} by more than "
          f"{args.tolerance:.0%} in every new run")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
