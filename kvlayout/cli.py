"""The ``kvlayout`` command line: one subcommand per module, registered in :data:`COMMANDS`.

A subcommand module provides ``add_arguments(parser)``
and ``run(args) -> int``.  Only the chosen subcommand's module is imported,
and each module imports what it needs (jax, torch) inside ``run``, so
``kvlayout layouts`` stays light.  To add a subcommand, add a module under
``kvlayout/commands/`` and one line to :data:`COMMANDS`.

A command line that cannot run (an unknown option, a value out of range, an
``--out`` that cannot be written, ...) is a usage error: one line on standard
error, exit status 2, never a traceback.  Commands raise :class:`UsageError`
for the checks argparse cannot make.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap

COMMANDS: dict[str, tuple[str, str]] = {
    # name: (module, one-line help shown by `kvlayout --help`)
    "layouts": ("kvlayout.commands.layouts", "list the layout catalog (table or JSON)"),
    "spec": ("kvlayout.commands.spec", "write the Markdown spec generated from kvlayout.reference"),
    "conformance": ("kvlayout.commands.conformance", "check every op on every device against the reference"),
    "bench": ("kvlayout.commands.bench", "measure the ops against copy limits and the torch baseline"),
}

USAGE_ERROR = 2
"""Exit status of a usage error (argparse's own)."""

BROKEN_PIPE = 128 + 13
"""Exit status when the reader of standard output went away (``kvlayout layouts --json | head``): what a
process killed by SIGPIPE reports."""


class UsageError(SystemExit):
    """A command line that cannot run; :func:`main` prints ``kvlayout COMMAND: <message>`` and exits with 2.

    A ``SystemExit`` with code 2, as argparse's own errors are, so that it ends the command from wherever it is
    raised; ``str()`` is the message.
    """

    def __init__(self, message: str):
        super().__init__(USAGE_ERROR)
        self.message = message

    def __str__(self) -> str:
        return self.message


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, never breaking a line inside a hyphenated word (tool names such as
    compute-sanitizer, options such as --sanitize-examples stay whole when copied from the help)."""

    def _split_lines(self, text, width):
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with its errors raised as :class:`UsageError` (one line, no usage block)."""

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def writable_dir(path: str, option: str = "--out") -> str:
    """Create the folder ``path`` if needed and check that a file can be written in it; else :class:`UsageError`
    naming ``option``.  Returns ``path``."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{option} {path}: cannot create the folder ({e.strerror or e})") from None
    if not os.path.isdir(path):
        raise UsageError(f"{option} {path}: not a folder")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: the folder is not writable")
    return path


def writable_file(path: str, option: str = "--out") -> str:
    """Check that the file ``path`` can be written (its folder exists and is writable, the path is not a folder),
    without creating it; else :class:`UsageError` naming ``option``.  Returns ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{option} {path}: is a folder, not a file")
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path}: the folder {folder} does not exist")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise UsageError(f"{option} {path}: the file is not writable")
    if not os.path.exists(path) and not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: the folder {folder} is not writable")
    return path


def _parser(selected: str | None) -> ArgumentParser:
    parser = ArgumentParser(prog="kvlayout", description="KV-cache layouts of LLM serving engines: "
                            "the spec, the ops, their conformance.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        if name == selected:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``kvlayout COMMAND ...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    selected = selected if selected in COMMANDS else None
    try:
        args = _parser(selected).parse_args(argv)
        status = int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)
        sys.stdout.flush()   # here, not at interpreter exit, so that a closed pipe is caught below
        return status
    except UsageError as e:
        print(f"kvlayout{' ' + selected if selected else ''}: {e}", file=sys.stderr)
        return USAGE_ERROR
    except BrokenPipeError:
        # the reader stopped reading (`| head`): nothing more to say; point stdout at /dev/null so that the
        # interpreter's own flush at exit does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
