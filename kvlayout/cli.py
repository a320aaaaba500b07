"""The ``kvlayout`` command line: one subcommand per module, registered in :data:`COMMANDS`.

A subcommand module provides ``add_arguments(parser)``
and ``run(args) -> int``.  Only the chosen subcommand's module is imported,
and each module imports what it needs (jax, torch) inside ``run``, so
``kvlayout layouts`` stays light.  To add a subcommand, add a module under
``kvlayout/commands/`` and one line to :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    # name: (module, one-line help shown by `kvlayout --help`)
    "layouts": ("kvlayout.commands.layouts", "list the layout catalog (table or JSON)"),
    "spec": ("kvlayout.commands.spec", "write the Markdown spec generated from kvlayout.reference"),
    "conformance": ("kvlayout.commands.conformance", "check every op on every device against the reference"),
    "bench": ("kvlayout.commands.bench", "measure the ops against copy limits and the torch baseline"),
}


def _parser(selected: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlayout", description="KV-cache layouts of LLM serving engines: "
                                     "the spec, the ops, their conformance.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``kvlayout COMMAND ...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    args = _parser(selected if selected in COMMANDS else None).parse_args(argv)
    return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
