"""Where an all-layer ``ops.transfer``'s host time goes, by part: Python, the C++ checks, the launch.

    python scripts/host_path.py [--device cuda] [--reps 41] [KEY ...]

For each bench row (by default the host_cost group's all-layer row, where nothing moves, and the headline
L32_H8_D128 T=256 gather), built as ``kvlayout bench`` builds it and called a few times first (so that the
repeated-call path keeps the choice's bound program), times in turn within every repetition:

* ``ops.transfer``: the call as an engine writes it (the repeated-call path: a few checks in Python, then one
  C++ call);
* ``kernel engine``: the same call with ``engine="kernel"`` (the repeated-call path without auto's decision);
* ``C++ call``: that C++ call alone (``PreparedCopy.run_checking`` of the choice's bound program: the slot
  arguments and the bound tensors checked, the kernel launched);
* ``C++ checks``: the same call with ``skip_prefix`` = T (everything checked, nothing launched);
* ``auto's rule``, for a pair that could be staged (a device cache and a pinned host chunk): the Python that
  decides a repeated call's engine before that C++ call where the answer kept on the pair
  (``CheckedChoice.auto_kernel``, checked inline) is stale or does not cover the call (``_auto_keeps_kernel``),
  alone;
* ``torch op`` (the bench's yardstick: ``index_select`` of three rows of a small tensor) and, on CUDA,
  ``bare launch`` (``torch.cuda._sleep(0)``);

each *warm* (32 calls back to back, per call, the device idle before the 32) and *idle* (one call, the
device synchronized before it: what the bench's end-to-end figure pays). The parts follow: auto =
``ops.transfer`` - ``kernel engine``; Python = ``ops.transfer`` - ``C++ call``; launch = ``C++ call`` -
``C++ checks``.

A diagnostic beside the bench's ``host_cost`` rows, not a measurement of record.
"""

from __future__ import annotations

import argparse
import importlib

import torch

WARM_CALLS = 32
DEFAULT_KEYS = {
    "cuda": ["L32_H8_D128 T=256 ps=16 vllm_flash_attn_nhd->lmcache_kv_2ltd to_host all layers ctas=default empty",
             "L32_H8_D128 T=256 ps=16 vllm_flash_attn_nhd->lmcache_kv_2ltd gather_device all layers ctas=default"],
    "cpu": ["L32_H8_D128 T=256 ps=16 vllm_flash_attn_nhd->lmcache_kv_2ltd gather_device all layers ctas=default "
            "empty"],
}


def parts(case, device: torch.device) -> dict:
    """The callables timed for ``case`` (see the module's docstring), after the calls that bind it."""
    from kvlayout import ops
    from kvlayout.bench import cases as C
    from kvlayout.ops import staged
    transfer_module = importlib.import_module("kvlayout.ops.transfer")   # (ops.transfer is the function)

    if case.engine != "kernel" or case.layerwise:
        raise SystemExit(f"{case.key}: not an all-layer kernel row (the call this script takes apart)")
    data = C.build(case, C.Inputs(device))
    src, ss, dst, ds = C.endpoints(case, data)
    for _ in range(3):
        ops.transfer(src, dst, ss, ds)
    memo = src._checked_choices.get(id(dst))
    bound = memo[1].bound if memo is not None else None
    if bound is None:
        raise SystemExit(f"{case.key}: the repeated-call path keeps no bound program for it (auto stages it?)")
    T = (ss if ss is not None else ds).shape[0]
    x, index = torch.ones(16, 4, device=device), torch.tensor([1, 2, 3], device=device)
    fns = {
        "ops.transfer": lambda: ops.transfer(src, dst, ss, ds),
        "kernel engine": lambda: ops.transfer(src, dst, ss, ds, engine="kernel"),
        "C++ call": lambda: bound.run_checking(0, ss, ds, 0, 0, False),
        "C++ checks": lambda: bound.run_checking(0, ss, ds, T, 0, False),
    }
    choice = memo[1]
    if choice.never_staged != staged.STAGING_BYTES and choice.staged_plan is not None:
        fns["auto's rule"] = lambda: transfer_module._auto_keeps_kernel(choice.staged_plan, choice, ss, ds, 0, 0)
    fns["torch op"] = lambda: torch.index_select(x, 0, index)
    if device.type == "cuda":
        fns["bare launch"] = lambda: torch.cuda._sleep(0)
    return fns


def measure(fns: dict, device: torch.device, reps: int) -> tuple[dict, dict]:
    """(warm, idle) host µs per call of each callable (medians; see the module's docstring)."""
    from kvlayout.bench.timing import Timer

    timer = Timer(device, warmup=3, reps=reps)

    def repeated(fn):
        def calls():
            for _ in range(WARM_CALLS):
                fn()
        return calls

    warm = timer.host_side_by_side({name: repeated(fn) for name, fn in fns.items()})
    idle = timer.host_side_by_side(fns)
    return ({name: s * 1e6 / WARM_CALLS for name, s in warm.items()},
            {name: s * 1e6 for name, s in idle.items()})


def report(key: str, warm: dict, idle: dict) -> str:
    lines = [key, f"{'':16} {'warm µs':>9} {'idle µs':>9}"]
    lines += [f"{name:16} {warm[name]:9.2f} {idle[name]:9.2f}" for name in warm]
    differences = {"Python": ("ops.transfer", "C++ call"), "launch": ("C++ call", "C++ checks")}
    if "kernel engine" in warm:
        differences = {"auto": ("ops.transfer", "kernel engine"), **differences}
    for part, (whole, less) in differences.items():
        lines.append(f"{part:16} {warm[whole] - warm[less]:9.2f} {idle[whole] - idle[less]:9.2f}"
                     f"   ({whole} - {less})")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("keys", nargs="*", help="bench rows' keys (all-layer kernel rows)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=41, help="repetitions (medians over them)")
    args = parser.parse_args(argv)

    from kvlayout.bench import cases as C

    device = torch.device(args.device)
    keys = args.keys or DEFAULT_KEYS[device.type]
    try:
        chosen = C.cases_by_key(keys, device.type)
    except ValueError as unknown:
        raise SystemExit(str(unknown)) from None
    if device.type == "cpu":
        torch.set_num_threads(1)   # (as the bench's CPU runs: one thread, a like-for-like yardstick)
    for case in chosen:
        print(report(case.key, *measure(parts(case, device), device, args.reps)))


if __name__ == "__main__":
    main()
