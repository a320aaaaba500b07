"""``kvlayout conformance``: every op on every requested device against the reference (see
:mod:`kvlayout.conformance.runner`)."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before anything imports jax: the reference runs on the CPU


def add_arguments(parser) -> None:
    from kvlayout.conformance.runner import add_arguments as add

    add(parser)


def run(args) -> int:
    from kvlayout.conformance.runner import run as run_conformance

    return run_conformance(args)
