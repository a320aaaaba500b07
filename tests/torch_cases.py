"""numpy <-> torch for the op-library tests: the case database's own helpers, under the names the tests use.

The cases come from ``kvlayout.conformance.strategies`` as numpy physical
values (the reference's convention); ``kvlayout.conformance.families.core``
turns them into torch tensors on a device (optionally pinned host memory),
reads tensors back as unsigned bits (every comparison is byte-exact whatever
the dtype, NaN payloads included) and runs the reference under ``jax.jit``
(:class:`~kvlayout.conformance.families.core.JittedReference`).  The tests
and ``kvlayout conformance`` share these, so they compare the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from kvlayout.conformance.families.core import assert_same as assert_same_bytes
from kvlayout.conformance.families.core import (
    assert_unchanged,
    bits,
    flat,
    random_array,
    slots,
    snapshot,
    sync,
    tensor,
    to_torch,
)
from kvlayout.conformance.families.core import reference as jitted_reference

__all__ = ["assert_same_bytes", "assert_unchanged", "bits", "examples", "flat", "jitted_reference", "random_array",
           "read_at_import", "slots", "snapshot", "sync", "tensor", "to_torch", "torch_dtype"]


def examples(default: int) -> int:
    """Hypothesis examples for one test: ``default``, scaled by ``KVLAYOUT_HYPOTHESIS_EXAMPLES``.

    The variable is a multiplier (``KVLAYOUT_HYPOTHESIS_EXAMPLES=10`` runs ten
    times the default examples of every generated test).
    """
    scale = float(os.environ.get("KVLAYOUT_HYPOTHESIS_EXAMPLES", "1") or 1)
    return max(1, int(round(default * scale)))


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a strategies dtype name."""
    return getattr(torch, name)


def read_at_import(variable: str, value: str, expression: str) -> subprocess.CompletedProcess:
    """A fresh interpreter, environment variable ``variable`` set to ``value``, that imports kvlayout's ops and
    prints ``expression`` (a setting read at import); its stdout, stderr and return code."""
    code = f"import torch; from kvlayout import ops; from kvlayout.ops import _native; print({expression})"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, variable: value}, capture_output=True,
                          text=True)
