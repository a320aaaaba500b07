"""``kvlayout layouts``: the catalog as a terminal table or JSON."""

from __future__ import annotations

import json
import sys

COLUMNS = ("name", "family", "planes", "structure", "origin")


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the catalog as JSON records")


def table(rows: list[dict], columns=COLUMNS) -> str:
    """A plain text table: a header, a rule, one line per record."""
    cells = [[str("-" if r[c] is None else r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def run(args) -> int:
    from kvlayout.reference.layouts import catalog_table

    rows = catalog_table()
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(table(rows))
    return 0
