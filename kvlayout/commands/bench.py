"""``kvlayout bench``: measure the ops against the machine's copy limits and the torch baseline (see
:mod:`kvlayout.bench.run`)."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def add_arguments(parser) -> None:
    from kvlayout.bench.run import add_arguments as add

    add(parser)


def run(args) -> int:
    from kvlayout.bench.run import main

    return main(args)
