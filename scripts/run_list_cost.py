"""Host time of the copy engine's run list (``_C.copy_run_list``) on the bench's copy-engine geometry, on the CPU.

    python scripts/run_list_cost.py [--reps 30] [--tokens T] [--out FILE]

For each copy-engine case of ``kvlayout bench`` (L32 H8 and MLA, T = 4096, page sizes 16 and 64, both
directions), builds the case's tensors on the CPU, unfilled (the run list is host work: the slots are read on
the host and host addresses keep every adjacency a pinned tensor's device alias has) and times ``--reps``
builds of its run list, as the bench's ``run_list_us`` does on a CUDA machine. Prints one line per case: the
copies, the median µs, the µs per 8,192 copies (the performance target's unit) and the builds' spread
((p90 - p10) / median). ``--tokens`` builds the cases with another token count (e.g. 16384: 8,192 copies or
more at page size 64, where a list of T = 4096 holds 2,048 and the unit would count the call's fixed part four
times).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=None, help="token count of every case (default: the bench's)")
    parser.add_argument("--out", default=None, help="also write the lines to this file")
    args = parser.parse_args()

    from kvlayout.bench import cases as C
    from kvlayout.bench.run import time_run_list_builds

    torch.set_num_threads(1)
    lines = [f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} thread, torch "
             f"{torch.__version__}; median of {args.reps} builds"]
    for case in C.plan_cases(quick=False):
        if case.group != "copy_engine" or case.engine != "copy":
            continue
        if args.tokens:
            case = dataclasses.replace(case, T=args.tokens)
        data = C.build(case, C.AddressInputs(), min_cache_slots=2 * case.T)
        copies, built = time_run_list_builds(C.copy_run_list_fn(case, data), args.reps)
        us = built.median * 1e6
        lines.append(f"{case.key}: {copies} copies, {us:.1f} us, {us * 8192 / copies:.1f} us per 8,192 copies "
                     f"(spread {built.spread:.0%})")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
