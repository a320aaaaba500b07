"""``kvlayout bench``: measure the ops against the machine's copy limits and the torch baseline (see
:mod:`kvlayout.bench.run`); ``--dist``: KV moved between ranks by ``kvlayout.dist`` against a send/recv of the
same bytes (see :mod:`kvlayout.bench.dist`).

Outputs go to ``--out`` (default ``results/bench``, a git-ignored folder); the committed records in
``bench/results`` are refreshed only by naming that folder.  The command line is checked before anything is
measured: an ``--out`` that cannot be written, a ``--device`` torch does not know or an ``--only`` that selects no
case is a usage error (one line, exit status 2).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def add_arguments(parser) -> None:
    from kvlayout.bench.run import add_arguments as add

    add(parser)
    parser.add_argument("--dist", action="store_true",
                        help="measure kvlayout.dist between ranks (needs 2 GPUs per pair over NCCL; "
                             "--device cpu: a gloo smoke run between two CPU processes)")
    parser.add_argument("--pairs", type=int, default=1, help="with --dist: sender/receiver GPU pairs run at once")


def _check_device(text: str | None):
    """The torch device ``--device`` names (``None``: the default); :class:`~kvlayout.cli.UsageError` otherwise."""
    import torch

    from kvlayout.cli import UsageError

    if text is None:
        return None
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {text!r} is not a device (cuda or cpu)") from None
    if device.type not in ("cuda", "cpu"):
        raise UsageError(f"--device {text!r}: the bench runs on cuda or cpu")
    return device


def run(args) -> int:
    from kvlayout.cli import writable_dir

    if getattr(args, "dist", False):
        from kvlayout.bench.dist import main as dist_main

        writable_dir(args.out)
        return dist_main(args)
    _check_device(args.device)
    from kvlayout.bench.run import main  # (which checks --only and --out before measuring anything)

    return main(args)
