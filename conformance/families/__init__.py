"""The case database: every operation family of ``kvlayout.ops``, its samples, reference and error inputs.

Both harnesses consume it: ``kvlayout conformance`` iterates families x
devices x drawn samples and writes a report; the pytest suite
(``tests/test_families.py``) draws a few samples of every family on every
device and runs every error kind.  A failing sample is reproduced by its
``repr`` and one fixed driver::

    kvlayout conformance --device cpu --replay '<repr of the sample>'

Families (:data:`FAMILIES`, in report order):

* ``transfer`` (:mod:`.transfer`) - every layout pair of the catalog and the
  row buffer, every dtype, slot patterns, layer subsets, ``skip_prefix`` (as
  the argument or through ``ops.skip_prefix``), CTA budgets, placements
  (CUDA: device, pinned source, pinned destination, pinned slots);
* ``prepared`` (:mod:`.prepared`) - ``ops.prepare``, all layers or layer by layer;
* ``staged`` (:mod:`.staged`) - ``engine="staged"``/``"auto"`` between a
  device cache and a pinned host chunk (on the CPU: refused with the reason);
* ``gather`` / ``scatter`` / ``move`` (:mod:`.rows`);
* ``pages`` (:mod:`.pages`) - the page helpers;
* ``rope`` (:mod:`.rope`) - key repositioning within a stated tolerance;
* ``fuzz_index`` (:mod:`.transfer`) - huge negative and out-of-range slots;
* ``bad_input`` (:mod:`.errors`) - every error kind of every family;
* ``hostile`` (:mod:`.hostile`) - aliasing, racing and lying inputs.
"""

from __future__ import annotations

import ast

from kvlayout.reference.layouts import Geometry

from .. import strategies as S
from . import errors, hostile, pages, prepared, rope, rows, staged, transfer
from .core import ErrorInput, ErrorKind, OpFamily

FAMILIES: dict[str, OpFamily] = {f.name: f for f in (
    transfer.TRANSFER, prepared.PREPARED, staged.STAGED, rows.GATHER, rows.SCATTER, rows.MOVE, pages.PAGES, rope.ROPE,
    transfer.FUZZ_INDEX, errors.BAD_INPUT, hostile.HOSTILE)}

SAMPLE_TYPES = {cls.__name__: cls for module in (transfer, prepared, staged, rows, pages, rope, errors, hostile)
                for cls in module.SAMPLES}
"""Every sample class by name: what a ``--replay`` text may construct."""

_REPLAY_NAMES = {**SAMPLE_TYPES, "TransferCase": S.TransferCase, "Geometry": Geometry}


def parse_sample(text: str):
    """The sample a ``repr`` describes (``TransferSample(case=TransferCase(...), ...)``).

    Only the sample classes, ``TransferCase`` and ``Geometry`` may be called,
    with literal arguments: the text is checked before it is evaluated.
    """
    tree = ast.parse(text.strip(), mode="eval")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in _REPLAY_NAMES):
                raise ValueError(f"--replay: only {', '.join(sorted(_REPLAY_NAMES))} may be called")
        elif isinstance(node, ast.Name) and node.id not in _REPLAY_NAMES and node.id not in ("True", "False", "None"):
            raise ValueError(f"--replay: unknown name {node.id!r}")
        elif isinstance(node, (ast.Attribute, ast.Lambda, ast.Subscript)):
            raise ValueError("--replay takes the repr of a sample, nothing else")
    sample = eval(compile(tree, "<replay>", "eval"), {"__builtins__": {}}, dict(_REPLAY_NAMES))  # noqa: S307
    if type(sample).__name__ not in SAMPLE_TYPES:
        raise ValueError(f"--replay: {type(sample).__name__} is not a sample")
    return sample


__all__ = ["FAMILIES", "SAMPLE_TYPES", "ErrorInput", "ErrorKind", "OpFamily", "parse_sample"]
