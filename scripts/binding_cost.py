"""Host time per call of the calls an engine's adapter makes with tensors it binds at every call.

    python scripts/binding_cost.py [--device cuda] [--reps 41]

With nothing to move (every slot -1) on L32 H8 D128 caches (vLLM NHD pages for kvlayout and LMCache, SGLang
per-layer K/V buffers), 256 tokens, times in turn within every repetition, 32 calls per sample:

* ``ops.transfer``, the same cache objects each call (the repeated-call path);
* ``ops.transfer`` from the cache bound once into a chunk bound at each call, the chunks taken in turn from
  four (an engine that binds its KV cache at start and gets each call's chunk from an allocator);
* ``ops.transfer`` between caches bound anew at each call (``ops.bind`` of the same tensors);
* ``ops.prepare`` between caches bound anew at each call (a prepared transfer made per request; its
  binding, of the same tensors each time, comes from the binding cache from the second on);
* ``ops.gather`` into a view of a chunk made at each call;
* ``compat.lmcache.multi_layer_kv_transfer`` (paged -> chunk, all layers);
* ``compat.sglang.transfer_kv_per_layer`` (one layer's K and V) and ``transfer_kv_all_layer``;
* one torch op (``index_select`` of three rows of a small tensor: the bench's yardstick).

Only public entry points are called, so the script times an older tree as well (run it there with that tree's
``kvlayout`` installed). A diagnostic beside the bench's ``host_cost`` rows, not a measurement of record.
"""

from __future__ import annotations

import argparse
import itertools

import torch

CALLS = 32
L, NB, BS, H, D, T = 32, 64, 16, 8, 128, 256


def calls(device: torch.device) -> dict:
    """The timed callables (see the module's docstring), each making CALLS calls."""
    from kvlayout import ops
    from kvlayout.compat import lmcache, sglang

    pinned = device.type == "cuda"
    dtype = torch.bfloat16
    kv = [torch.zeros(2, NB, BS, H, D, dtype=dtype, device=device) for _ in range(L)]
    chunk = torch.zeros(2, L, T, H * D, dtype=dtype, pin_memory=pinned)
    pool = [torch.zeros(2, L, T, H * D, dtype=dtype, pin_memory=pinned) for _ in range(4)]
    turn = itertools.count()
    k, v = ([torch.zeros(NB * BS, H, D, dtype=dtype, device=device) for _ in range(L)] for _ in range(2))
    host_k, host_v = ([torch.zeros(NB * BS, H, D, dtype=dtype, pin_memory=pinned) for _ in range(L)]
                      for _ in range(2))   # (zeros_like would not pin)
    slots = torch.full((T,), -1, dtype=torch.int64, device=device)
    host_slots = torch.full((T,), -1, dtype=torch.int64, device=device)
    cache, bound_chunk = ops.bind("vllm_flash_attn_nhd", kv), ops.bind("lmcache_kv_2ltd", chunk)
    x, index = torch.ones(16, 4, device=device), torch.tensor([1, 2, 3], device=device)
    item = H * D * 2
    one = {
        "ops.transfer, same caches": lambda: ops.transfer(cache, bound_chunk, slots),
        "ops.transfer, a fresh chunk": lambda: ops.transfer(
            cache, ops.bind("lmcache_kv_2ltd", pool[next(turn) % len(pool)]), slots),
        "ops.transfer, bound per call": lambda: ops.transfer(ops.bind("vllm_flash_attn_nhd", kv),
                                                             ops.bind("lmcache_kv_2ltd", chunk), slots),
        "ops.prepare, bound per call": lambda: ops.prepare(ops.bind("vllm_flash_attn_nhd", kv),
                                                           ops.bind("lmcache_kv_2ltd", chunk), slots),
        "ops.gather into a fresh view": lambda: ops.gather(cache, slots, out=chunk.view(2, L, T, H, D)),
        "lmcache multi_layer_kv_transfer": lambda: lmcache.multi_layer_kv_transfer(
            chunk, kv, slots, direction=lmcache.TransferDirection.D2H),
        "sglang transfer_kv_per_layer": lambda: sglang.transfer_kv_per_layer(
            k[0], host_k[0], v[0], host_v[0], slots, host_slots, item),
        "sglang transfer_kv_all_layer": lambda: sglang.transfer_kv_all_layer(
            k, host_k, v, host_v, slots, host_slots, item, L),
        "torch op": lambda: torch.index_select(x, 0, index),
    }

    def repeated(fn):
        def run():
            for _ in range(CALLS):
                fn()
        return run
    return {name: repeated(fn) for name, fn in one.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=41)
    args = parser.parse_args(argv)
    from kvlayout.bench.timing import Timer

    device = torch.device(args.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # (on the CPU the calls' kernels move nothing; one thread, as the bench's baseline)
    try:
        medians = Timer(device, warmup=3, reps=args.reps).host_side_by_side(calls(device))
    finally:
        torch.set_num_threads(threads)
    op = medians["torch op"]
    print(f"{'call, nothing to move':34s} {'host µs':>8s} {'× torch op':>11s}")
    for name, seconds in medians.items():
        print(f"{name:34s} {seconds * 1e6 / CALLS:8.1f} {seconds / op:10.2f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
