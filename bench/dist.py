"""``kvlayout bench --dist``: KV moved between ranks by ``kvlayout.dist`` against a plain send/recv of the same bytes.

Each pair is two processes: a sender rank holding a request's KV in one layout
and a receiver rank writing it into another layout (TP 1 -> 1, so every head
moves).  Per case and pair, in the same run:

* ``kvlayout.dist``: ``Sender.send`` / ``Receiver.recv`` of T tokens of every
  layer: per layer a gather into a contiguous buffer, one ``isend``/``irecv``,
  a scatter on the receiver, layers pipelined;
* the baseline: one ``torch.distributed.send``/``recv`` of a contiguous
  buffer of the same number of bytes (what the wire can do with no layout
  work and no per-layer messages).

Before timing, the receiver checks every moved byte: it rebuilds the sender's
cache from the same seed and compares the gathered rows.  A repetition is
timed from a barrier to the moment both sides are done (the host waits for the
device), the pair's time is the slower side's, and the report gives the
median GB/s of KV moved (10th-90th percentile spread) and its ratio to the
baseline.

``--device cuda`` (the default) needs two GPUs per pair (``--pairs``) and an
NCCL build; without them it says so and exits with status 2, measuring
nothing.  ``--device cpu`` runs the same code over gloo between two CPU
processes with small shapes: a smoke run of the whole path, not a figure for
NCCL.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback

import torch

from .cases import SHAPES, Shape

TIMEOUT_S = 300.0            # any one wait inside a transfer (the first NCCL call connects the pair)
LAUNCH_LIMIT_S = 3600.0


@dataclasses.dataclass(frozen=True)
class DistCase:
    """One measured configuration: a model shape, T tokens, the sender's and the receiver's layout."""

    shape: Shape
    T: int
    src_layout: str
    src_page: int
    dst_layout: str
    dst_page: int
    dtype: str = "bfloat16"

    @property
    def key(self) -> str:
        return (f"{self.shape.name} T={self.T} {self.src_layout}(ps={self.src_page}) -> "
                f"{self.dst_layout}(ps={self.dst_page})")

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def payload_bytes(self) -> int:
        """Bytes of KV moved: every plane, layer, token and head."""
        s = self.shape
        return s.planes * s.L * self.T * s.H * s.D * self.itemsize


MHA_PAIRS = (("vllm_flash_attn_nhd", 16, "vllm_flash_attn_hnd", 16), ("vllm_flash_attn_nhd", 16, "sglang_mha", 1))
MLA_PAIRS = (("vllm_mla", 64, "sglang_mla", 1),)


def plan_cases(device: str, quick: bool) -> list[DistCase]:
    if device == "cpu":      # the smoke run: small shapes, the same code path
        shape = Shape("L4_H2_D16", 4, 2, 16)
        return [DistCase(shape, 64, *MHA_PAIRS[0]), DistCase(shape, 64, *MHA_PAIRS[1])]
    tokens = (256, 4096) if quick else (256, 4096, 32768)
    out = []
    for T in tokens:
        out += [DistCase(SHAPES["L32_H8_D128"], T, *pair) for pair in MHA_PAIRS]
        out += [DistCase(SHAPES["L32_MLA_D576"], T, *pair) for pair in MLA_PAIRS]
    return out


# ---------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------

def _cache(case: DistCase, which: str, device: torch.device, seed: int | None):
    """A bound cache of ``case``'s sender or receiver side: random bits from ``seed``, or zeros."""
    from kvlayout import ops
    from kvlayout.reference import get, make_geometry

    s = case.shape
    layout_name, page = (case.src_layout, case.src_page) if which == "src" else (case.dst_layout, case.dst_page)
    layout = get(layout_name)
    axes = {a for part in layout.parts for a in part.full_axes}
    heads, width = (s.H, s.D) if "h" in axes and layout.planes == 2 else (1, s.H * s.D)
    pages = math.ceil(case.T / page) + 1                       # one spare page (SGLang's padding page)
    geom = make_geometry(layout, L=s.L, N=pages * page, H=heads, E=width, page_size=page)
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None

    def tensor(shape):
        if gen is None:
            return torch.zeros(shape, dtype=dtype, device=device)
        nbytes = math.prod(shape) * case.itemsize
        bits = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
        return bits.view(dtype).view(shape)

    parts = [[tensor(geom.part_shape(p)) for _ in range(geom.L)] if p.per_layer else tensor(geom.part_shape(p))
             for p in layout.parts]
    return ops.bind(layout, parts[0] if layout.single_part else tuple(parts), page_size=page)


def _slots(case: DistCase, which: str, seed: int) -> torch.Tensor:
    """Whole pages in random order (page-structured, like an engine's block table), the spare page unused."""
    page = case.src_page if which == "src" else case.dst_page
    pages = math.ceil(case.T / page)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(pages + 1, generator=g)
    order = order[order != 0][:pages]           # page 0 is SGLang's padding page: never handed out
    return (order[:, None] * page + torch.arange(page)).reshape(-1)[:case.T].to(torch.int64)


def _next_request(move, ids) -> None:
    """Move the next request (ids count up alike on both sides)."""
    move(next(ids))


def _timed(fn, group, device, reps: int, warmup: int) -> list[float]:
    import torch.distributed as tdist

    samples = []
    for i in range(warmup + reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            tdist.barrier(group=group, device_ids=[device.index])
            torch.cuda.synchronize(device)
        else:
            tdist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    return samples


def _bit_exact(case: DistCase, receiver_cache, src_slots, dst_slots, seed: int, device) -> bool:
    """The receiver's rows at its slots are the sender's rows at its slots (the sender's cache rebuilt here)."""
    from kvlayout import ops

    sender_copy = _cache(case, "src", device, seed)
    want = ops.gather(sender_copy, src_slots.to(device))
    del sender_copy
    got = ops.gather(receiver_cache, dst_slots.to(device))
    return bool(torch.equal(want.reshape(-1).view(torch.uint8), got.reshape(-1).view(torch.uint8)))


def _worker(rank: int, world: int, device_kind: str, store_path: str, case_list: list, out_dir: str,
            reps: int, warmup: int) -> None:
    result: dict = {"rank": rank, "cases": []}
    try:
        import torch.distributed as tdist

        from kvlayout import dist as kvdist

        pairs = world // 2
        pair, role = rank % pairs, ("src" if rank < pairs else "dst")
        if device_kind == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            device = torch.device("cpu")
            torch.set_num_threads(1)
            backend = "gloo"
        store = tdist.FileStore(store_path, world)
        kwargs = {"device_id": device} if backend == "nccl" else {}
        tdist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                 timeout=datetime.timedelta(seconds=TIMEOUT_S), **kwargs)
        groups = [tdist.new_group([p, pairs + p]) for p in range(pairs)]      # every rank creates every group
        group = groups[pair]
        peers = kvdist.Peers((0,), (1,))                                       # group ranks: sender 0, receiver 1
        for i, case in enumerate(case_list):
            seed = 1000 + i
            cache = _cache(case, "src", device, seed) if role == "src" else _cache(case, "dst", device, None)
            src_slots, dst_slots = _slots(case, "src", seed), _slots(case, "dst", seed + 1)
            slots = (src_slots if role == "src" else dst_slots).to(device)
            heads = 1 if case.shape.mla else case.shape.H
            cls = kvdist.Sender if role == "src" else kvdist.Receiver
            endpoint = cls(cache, num_kv_heads=heads, peers=peers, group=group, timeout=TIMEOUT_S)
            # request ids 0, 1, 2, ... on both sides (warm-up included)
            step = functools.partial(endpoint.send if role == "src" else endpoint.recv, slots=slots)
            ids = itertools.count()
            step(next(ids))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            exact = _bit_exact(case, cache, src_slots, dst_slots, seed, device) if role == "dst" else None
            ours = _timed(functools.partial(_next_request, step, ids), group, device, reps, warmup)
            # the baseline: the same bytes in one contiguous message
            buffer = torch.empty(case.payload_bytes, dtype=torch.uint8, device=device)
            base = functools.partial(tdist.send, buffer, group=group, group_dst=1) if role == "src" else \
                functools.partial(tdist.recv, buffer, group=group, group_src=0)
            base()
            baseline = _timed(base, group, device, reps, warmup)
            result["cases"].append({"key": case.key, "pair": pair, "role": role, "bit_exact": exact,
                                    "seconds": ours, "baseline_seconds": baseline})
            del cache, buffer, endpoint, step, base
            if device.type == "cuda":
                torch.cuda.empty_cache()
        tdist.barrier()
        tdist.destroy_process_group()
    except BaseException:      # noqa: BLE001 - reported by the parent
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------

def _quantiles(samples: list[float]) -> tuple[float, float, float]:
    samples = sorted(samples)
    q = statistics.quantiles(samples, n=10) if len(samples) >= 2 else [samples[0]] * 9
    return statistics.median(samples), q[0], q[-1]


def combine(case_list: list[DistCase], per_rank: list[dict], pairs: int) -> list[dict]:
    """One row per case and pair: the slower side's time per repetition, as GB/s, against the baseline."""
    rows = []
    by = {(c["key"], c["pair"], c["role"]): c for r in per_rank for c in r["cases"]}
    for case in case_list:
        for pair in range(pairs):
            src, dst = by[(case.key, pair, "src")], by[(case.key, pair, "dst")]
            ours = [max(a, b) for a, b in zip(src["seconds"], dst["seconds"])]
            base = [max(a, b) for a, b in zip(src["baseline_seconds"], dst["baseline_seconds"])]
            med, p10, p90 = _quantiles(ours)
            bmed, _, _ = _quantiles(base)
            gbps, base_gbps = case.payload_bytes / med / 1e9, case.payload_bytes / bmed / 1e9
            rows.append({"key": case.key, "shape": case.shape.name, "T": case.T, "pair": pair,
                         "src_layout": case.src_layout, "src_page": case.src_page, "dst_layout": case.dst_layout,
                         "dst_page": case.dst_page, "payload_bytes": case.payload_bytes,
                         "bit_exact": dst["bit_exact"], "median_s": med, "gbps": gbps,
                         "gbps_p10": case.payload_bytes / p90 / 1e9, "gbps_p90": case.payload_bytes / p10 / 1e9,
                         "sendrecv_gbps": base_gbps, "pct_of_sendrecv": 100 * gbps / base_gbps})
    return rows


def markdown(doc: dict) -> str:
    env = doc["environment"]
    lines = [f"# kvlayout bench --dist ({env['device']}, {env['backend']})", "",
             f"torch {env['torch']}, {env.get('gpu', env.get('cpu', ''))}, {doc['pairs']} pair(s), "
             f"{doc['reps']} timed repetitions per case, {env['time']}.", "",
             "| case | pair | MiB moved | bit-exact | kvlayout.dist GB/s (p10-p90) | send/recv GB/s | % of send/recv |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        lines.append(f"| {r['key']} | {r['pair']} | {r['payload_bytes'] / 2 ** 20:.3g} | "
                     f"{'yes' if r['bit_exact'] else 'NO'} | {r['gbps']:.3g} ({r['gbps_p10']:.3g}-{r['gbps_p90']:.3g}) "
                     f"| {r['sendrecv_gbps']:.3g} | {r['pct_of_sendrecv']:.0f}% |")
    return "\n".join(lines) + "\n"


def run(device: str, pairs: int, quick: bool, reps: int, warmup: int) -> dict:
    """Spawn ``2 * pairs`` ranks, run every case, return the result document (raises if a rank failed)."""
    import torch.multiprocessing as mp

    case_list = plan_cases(device, quick)
    world = 2 * pairs
    with tempfile.TemporaryDirectory(prefix="kvlayout-bench-dist-") as tmp:
        ctx = mp.start_processes(_worker, args=(world, device, os.path.join(tmp, "store"), case_list, tmp, reps,
                                                warmup), nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + LAUNCH_LIMIT_S
        for p in ctx.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        per_rank = []
        for rank in range(world):
            path = os.path.join(tmp, f"rank{rank}.json")
            if not os.path.exists(path):
                raise RuntimeError(f"kvlayout bench --dist: rank {rank} ended without a result "
                                   f"(exit code {ctx.processes[rank].exitcode})")
            with open(path) as f:
                per_rank.append(json.load(f))
    errors = [f"rank {r['rank']}:\n{r['error']}" for r in per_rank if "error" in r]
    if errors:
        raise RuntimeError("kvlayout bench --dist: a rank failed\n" + "\n".join(errors))
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
           "backend": "nccl" if device == "cuda" else "gloo", "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return {"environment": env, "pairs": pairs, "reps": reps, "quick": quick,
            "results": combine(case_list, per_rank, pairs)}


def main(args) -> int:
    device = args.device or "cuda"
    pairs = args.pairs
    if device not in ("cuda", "cpu"):
        print(f"kvlayout bench --dist: --device must be cuda or cpu, got {device!r}", file=sys.stderr)
        return 2
    if pairs < 1:
        print(f"kvlayout bench --dist: --pairs must be >= 1, got {pairs}", file=sys.stderr)
        return 2
    if device == "cuda":
        import torch.distributed as tdist

        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < 2 * pairs or not tdist.is_nccl_available():
            why = (f"found {found} CUDA GPU(s)" if found < 2 * pairs else "this torch build has no NCCL")
            print(f"kvlayout bench --dist: needs {2 * pairs} CUDA GPUs with NCCL (a sender and a receiver GPU per "
                  f"pair, --pairs {pairs}) and {why}; nothing was measured. `--device cpu` runs the same "
                  "transfers over gloo between two CPU processes (a smoke run, not an NCCL figure).",
                  file=sys.stderr)
            return 2
    reps = 3 if device == "cpu" else (5 if args.quick else 11)
    doc = run(device, pairs, args.quick, reps, warmup=1 if device == "cpu" else 2)
    stem = args.name or f"dist_{device}"
    os.makedirs(args.out, exist_ok=True)
    text = markdown(doc)
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {os.path.join(args.out, stem)}.json and .md")
    bad = [r["key"] for r in doc["results"] if not r["bit_exact"]]
    if bad:
        print(f"{len(bad)} cases were not bit-exact:", *bad, sep="\n  ", file=sys.stderr)
        return 1
    return 0
