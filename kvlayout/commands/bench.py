"""``kvlayout bench``: measure the ops against the machine's copy limits and the torch baseline (see
:mod:`kvlayout.bench.run`); ``--dist``: KV moved between ranks by ``kvlayout.dist`` against a send/recv of the
same bytes (see :mod:`kvlayout.bench.dist`)."""

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


def run(args) -> int:
    if getattr(args, "dist", False):
        from kvlayout.bench.dist import main as dist_main

        return dist_main(args)
    from kvlayout.bench.run import main

    return main(args)
