"""kvlayout.dist on the CPU: real processes over gloo, checked bit for bit against the reference.

Two process launches (torch.multiprocessing from a fork server, a FileStore in
a temporary folder) serve the scenarios, each in its own subgroup:

* transfers (6 processes): TP 1->1, 2->1, 1->2, 4->2, replicated heads
  (4->2 and 2->4 with 2 KV heads), MLA 2->1 (fp8), each with other layouts and
  page sizes on the two sides and slot lists with "no token" (-1) on both
  sides; every receiver's whole cache is compared with
  ``reference.reshard`` (gather / scatter of the reference);
* handshakes that must fail on both sides (head size, element type, layer
  count, total KV heads, request) with the cache untouched, and an endpoint
  that goes on after a request mismatch;
* failures (6 processes): a sender killed mid-request, a receiver killed
  mid-request, a receiver that stops answering -- the survivor raises
  ``PeerError`` within its timeout, and its stream is not complete.

Also here: the resharding rule itself (pure Python) and its rendering in the
spec, and ``kvlayout bench --dist`` (its gloo smoke run between two spawned
processes; its refusal to measure without two GPUs).

Where every rank can have a GPU of its own (6 or more), the transfer and
handshake scenarios run again over NCCL with the caches on the GPUs.  The
worker functions live here and run in the child processes, which import this
module but never jax (the parent computes the reference).
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import pickle
import time
import traceback

import numpy as np
import pytest
import torch
import torch.distributed

WORLD = 6
TIMEOUT_S = 30.0            # any one wait in a transfer scenario (they take well under a second)
FAIL_TIMEOUT_S = 1.0        # any one wait in a failure scenario: the survivor must give up this fast
LAUNCH_LIMIT_S = 120.0      # the parent kills what is still running after this


@dataclasses.dataclass(frozen=True)
class Side:
    """One TP group's caches: layout, page size, TP size, element type and what it believes of the model."""

    layout: str
    page: int
    tp: int
    dtype: str = "bfloat16"
    num_kv_heads: int | None = None      # None: the scenario's
    head_size: int | None = None         # None: the scenario's
    layers: int | None = None            # None: the scenario's
    slots: int = 64                      # slots per cache (a chunk: positions)


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    num_kv_heads: int
    src: Side
    dst: Side
    layers: int = 3
    head_size: int = 8
    tokens: int = 11
    columns: tuple = ()                  # column widths of a split MLA row
    expect: str = "ok"                   # "ok", "handshake" (both sides raise), "request" (then a good request)
    stream: bool = False                 # send_layer per layer and the receiver's iterator, not send() and
                                         # recv(on_layer=...)

    def side(self, which: str) -> Side:
        return self.src if which == "src" else self.dst

    def geometry_of(self, which: str):
        s = self.side(which)
        return (s.num_kv_heads or self.num_kv_heads, s.head_size or self.head_size, s.layers or self.layers)

    @property
    def ranks(self) -> list[int]:
        return list(range(self.src.tp + self.dst.tp))


TRANSFERS = [
    Scenario("tp1_to_1", 4, Side("vllm_flash_attn_nhd", 4, 1), Side("sglang_mha", 1, 1), stream=True),
    Scenario("tp2_to_1", 4, Side("vllm_flash_attn_hnd", 8, 2), Side("vllm_flashinfer_nhd", 4, 1)),
    Scenario("tp1_to_2", 4, Side("lmcache_kv_2ltd", 1, 1, slots=16), Side("vllm_packed_nhd", 4, 2)),
    Scenario("tp4_to_2", 8, Side("vllm_flash_attn_nhd", 16, 4), Side("vllm_flash_attn_hnd", 4, 2), stream=True,
             tokens=37),
    Scenario("tp4_to_2_replicated", 2, Side("vllm_cross_layer", 4, 4, "float32"),
             Side("sglang_mha", 2, 2, "float32")),
    Scenario("tp2_to_4_replicated", 2, Side("vllm_flashinfer_hnd", 4, 2), Side("trtllm_cross_layer_hnd", 8, 4)),
    Scenario("mla_tp2_to_1", 1, Side("vllm_mla", 4, 2, "float8_e4m3fn"),
             Side("hicache_mla_page_first_kv_split", 4, 1, "float8_e4m3fn"), head_size=12, columns=(8, 4)),
]

HANDSHAKES = [
    Scenario("bad_head_size", 4, Side("vllm_flash_attn_nhd", 4, 1), Side("sglang_mha", 1, 1, head_size=16),
             expect="handshake"),
    Scenario("bad_dtype", 4, Side("vllm_flash_attn_nhd", 4, 1), Side("sglang_mha", 1, 1, "float16"),
             expect="handshake"),
    Scenario("bad_layers", 4, Side("vllm_flash_attn_nhd", 4, 1), Side("sglang_mha", 1, 1, layers=2),
             expect="handshake"),
    Scenario("bad_total_heads", 4, Side("vllm_flash_attn_nhd", 4, 1),
             Side("sglang_mha", 1, 1, num_kv_heads=2, head_size=16), expect="handshake"),
    Scenario("bad_request", 4, Side("vllm_flash_attn_nhd", 4, 1), Side("sglang_mha", 1, 1), expect="request"),
]

# a receiver whose first slot lists are bad (a slot past its cache, then a slot twice): refused in start(),
# before any message, so the sender's request waits for the receiver's good list and goes through
BAD_SLOTS = [Scenario("bad_receiver_slots", 4, Side("vllm_flash_attn_nhd", 4, 1), Side("sglang_mha", 1, 1),
                      expect="bad_slots")]

# the message each handshake failure must contain (on both sides)
HANDSHAKE_TEXT = {"bad_head_size": "head size", "bad_dtype": "element type", "bad_layers": "layer count",
                  "bad_total_heads": "total KV heads"}


# ---------------------------------------------------------------------------------------
# Caches as numpy bits (the parent makes them; the workers turn them into torch tensors)
# ---------------------------------------------------------------------------------------

_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_BITS = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _geometry(sc: Scenario, which: str, rank: int):
    """The reference geometry of one rank's cache."""
    from kvlayout.reference import get, kv_heads, make_geometry

    side = sc.side(which)
    K, D, L = sc.geometry_of(which)
    lo, hi = kv_heads(rank, side.tp, K)
    layout = get(side.layout)
    axes = {a for part in layout.parts for a in part.full_axes}
    heads, width = (hi - lo, D) if "h" in axes and layout.planes == 2 else (1, (hi - lo) * D)
    return make_geometry(layout, L=L if "l" in axes else 1, N=side.slots, H=heads, E=width, page_size=side.page,
                         columns=sc.columns if any(p.column is not None for p in layout.parts) else ())


def _random_cache(sc: Scenario, which: str, rank: int, rng: np.random.Generator):
    """A physical cache of random bits (numpy, the reference's convention)."""
    from kvlayout.reference import get

    side = sc.side(which)
    layout, geom = get(side.layout), _geometry(sc, which, rank)
    bits = _BITS[_itemsize(side.dtype)]

    def array(part):
        shape = geom.part_shape(part)
        return rng.integers(0, np.iinfo(bits).max, size=shape, dtype=bits, endpoint=True)

    parts = [[array(p) for _ in range(geom.L)] if p.per_layer else array(p) for p in layout.parts]
    return parts[0] if layout.single_part else tuple(parts)


def _slot_list(rng: np.random.Generator, count: int, tokens: int, holes: int) -> np.ndarray:
    """``tokens`` distinct slots out of ``count``, ``holes`` of them -1 ("no token")."""
    slots = rng.permutation(count)[:tokens].astype(np.int64)
    slots[rng.choice(tokens, size=holes, replace=False)] = -1
    return slots


def make_job(sc: Scenario, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"scenario": sc,
            "src": [_random_cache(sc, "src", r, rng) for r in range(sc.src.tp)],
            "dst": [_random_cache(sc, "dst", r, rng) for r in range(sc.dst.tp)],
            "src_slots": _slot_list(rng, sc.src.slots, sc.tokens, 2),
            "dst_slots": _slot_list(rng, sc.dst.slots, sc.tokens, 2),
            "request_id": 1000 + seed}


# ---------------------------------------------------------------------------------------
# Worker side (child processes: no jax here)
# ---------------------------------------------------------------------------------------

def _to_torch(physical, dtype: str):
    def one(a):
        return torch.from_numpy(np.ascontiguousarray(a)).view(getattr(torch, dtype))

    if isinstance(physical, tuple):
        return tuple(_to_torch(p, dtype) for p in physical)
    if isinstance(physical, list):
        return [one(a) for a in physical]
    return one(physical)


def _to(value):
    """A tensor or a list of tensors on the rank's GPU."""
    if isinstance(value, list):
        return [t.cuda() for t in value]
    return value.cuda()


def _to_bits(physical):
    if isinstance(physical, tuple):
        return tuple(_to_bits(p) for p in physical)
    if isinstance(physical, list):
        return [_to_bits(t) for t in physical]
    t = physical.cpu().contiguous()
    return t.view(_TORCH_BITS[t.element_size()]).numpy().copy()


def _init(rank: int, store_path: str, device: str = "cpu") -> None:
    """Join the world: gloo on the CPU; NCCL with one GPU per rank."""
    import torch.distributed as tdist

    torch.set_num_threads(1)
    store = tdist.FileStore(store_path, WORLD)
    kwargs = {}
    if device == "cuda":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    tdist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank, world_size=WORLD,
                             timeout=datetime.timedelta(seconds=60), **kwargs)


def _device(job: dict) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if job.get("device") == "cuda" else torch.device("cpu")


def _endpoint(job: dict, rank: int, group, timeout: float):
    """This rank's Sender or Receiver of the job (and its torch cache)."""
    from kvlayout import dist as kvdist
    from kvlayout import ops

    sc: Scenario = job["scenario"]
    peers = kvdist.Peers.split(sc.src.tp, sc.dst.tp)
    which, index = ("src", rank) if rank < sc.src.tp else ("dst", rank - sc.src.tp)
    side = sc.side(which)
    tensors = _to_torch(job[which][index], side.dtype)
    if _device(job).type == "cuda":
        tensors = tuple(_to(t) for t in tensors) if isinstance(tensors, tuple) else _to(tensors)
    cache = ops.bind(side.layout, tensors, page_size=side.page)
    cls = kvdist.Sender if which == "src" else kvdist.Receiver
    endpoint = cls(cache, num_kv_heads=sc.geometry_of(which)[0], peers=peers, group=group, timeout=timeout)
    return which, tensors, endpoint


def _run_transfer(job: dict, rank: int, group) -> dict:
    """One scenario on one rank; returns what the parent checks."""
    sc: Scenario = job["scenario"]
    which, tensors, ep = _endpoint(job, rank, group, TIMEOUT_S)
    out: dict = {"which": which}
    slots = torch.from_numpy(job[f"{which}_slots"]).to(_device(job))
    rid = job["request_id"]

    def one_request(request_id, slots):
        if which == "src":
            if sc.stream:
                stream = ep.start(request_id, slots)
                for layer in range(stream.num_layers):
                    stream.send_layer(layer)
                stream.finish()
            else:
                stream = ep.send(request_id, slots)
            return stream, []
        if sc.stream:      # the iterator
            stream = ep.start(request_id, slots)
            return stream, [layer for layer in stream]
        layers = []        # the callback
        return ep.recv(request_id, slots, on_layer=layers.append), layers

    if sc.expect == "bad_slots" and which == "dst":
        out["refused"] = []
        valid = slots[slots >= 0]
        for bad in (torch.cat([slots[:-1], slots.new_tensor([1 << 20])]),        # past the cache
                    torch.cat([valid[:1], valid[:1], slots[2:]])):               # one slot twice
            try:
                ep.start(rid, bad)
            except Exception as e:  # noqa: BLE001 - the parent checks the type and message
                out["refused"].append((type(e).__name__, str(e)))
        out["unchanged_after_error"] = _to_bits(tensors)
    if sc.expect == "request":      # the sender's request has one token less: both sides refuse it, then go on
        try:
            one_request(rid, slots[:-1] if which == "src" else slots)
        except Exception as e:     # noqa: BLE001 - the parent checks the type and message
            out["error"] = (type(e).__name__, str(e))
        out["unchanged_after_error"] = _to_bits(tensors)
    try:
        stream, layers = one_request(rid + 1 if sc.expect == "request" else rid, slots)
        out.update(complete=stream.complete, layers=layers)
    except Exception as e:         # noqa: BLE001
        out["error"] = (type(e).__name__, str(e))
    out["final"] = _to_bits(tensors)
    return out


def transfer_worker(rank: int, store_path: str, job_path: str, out_dir: str) -> None:
    import torch.distributed as tdist

    result = {}
    try:
        with open(job_path, "rb") as f:
            jobs = pickle.load(f)
        _init(rank, store_path, jobs[0].get("device", "cpu"))
        groups = [tdist.new_group(job["scenario"].ranks) for job in jobs]   # every rank creates every group
        for job, group in zip(jobs, groups):
            if rank in job["scenario"].ranks:
                result[job["scenario"].name] = _run_transfer(job, rank, group)
        tdist.barrier()
        tdist.destroy_process_group()
    except BaseException:          # noqa: BLE001 - reported by the parent
        result["crash"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


# Failure scenarios: (name, group ranks, who fails and how)
FAILURES = {
    "sender_killed": (0, 1),        # rank 0 sends two layers and dies; rank 1 receives
    "receiver_killed": (2, 3),      # rank 3 takes one layer and dies; rank 2 sends
    "receiver_silent": (4, 5),      # rank 5 connects, then stops answering; rank 4 sends
}
FAIL_JOB = Scenario("failure", 4, Side("vllm_flash_attn_nhd", 4, 1), Side("sglang_mha", 1, 1), layers=8,
                    tokens=40)


def failure_worker(rank: int, store_path: str, job_path: str, out_dir: str) -> None:
    import torch.distributed as tdist

    result = {}
    try:
        _init(rank, store_path)
        with open(job_path, "rb") as f:
            job = pickle.load(f)
        groups = {name: tdist.new_group(list(ranks)) for name, ranks in FAILURES.items()}
        name = next(n for n, ranks in FAILURES.items() if rank in ranks)
        group_rank = FAILURES[name].index(rank)
        _, tensors, ep = _endpoint(job, group_rank, groups[name], FAIL_TIMEOUT_S)
        ep.connect()
        slots = torch.from_numpy(job["src_slots"] if group_rank == 0 else job["dst_slots"])
        start = time.monotonic()
        result.update(name=name, role=group_rank)
        stream = None
        try:
            if group_rank == 0:
                stream = ep.start(7, slots)
                if name == "sender_killed":
                    stream.send_layer(0)
                    stream.send_layer(1)
                    os._exit(17)                      # dies mid-request
                result["stream"] = stream
                stream.finish()
            else:
                stream = ep.start(7, slots)
                if name == "receiver_silent":
                    time.sleep(2 * FAIL_TIMEOUT_S + 1)    # alive, but takes nothing
                    os._exit(0)
                for layer in stream:
                    if name == "receiver_killed":
                        os._exit(17)                  # dies after its first layer
            result["outcome"] = ("no error", "")
        except Exception as e:     # noqa: BLE001
            result["outcome"] = (type(e).__name__, str(e))
        result["seconds"] = time.monotonic() - start
        if stream is None:      # start() itself raised: the peer was gone before the request began
            result.update(complete=False, state="failed", layers=0)
        else:
            result["complete"] = stream.complete
            result["state"] = stream.state
            result["layers"] = getattr(stream, "layers_received", getattr(stream, "layers_sent", None))
        result.pop("stream", None)
    except BaseException:          # noqa: BLE001
        result["crash"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    os._exit(0)                    # no teardown: some peers are gone on purpose


# ---------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------

def _launch(worker, job, tmp_path) -> dict[int, dict]:
    """Run ``worker`` on WORLD spawned processes; returns each rank's result (killing stragglers)."""
    import torch.multiprocessing as mp

    job_path, out_dir = str(tmp_path / "job.pkl"), str(tmp_path / "out")
    os.makedirs(out_dir)
    with open(job_path, "wb") as f:
        pickle.dump(job, f)
    # forkserver: one clean process imports torch once, every worker is forked from it (a spawned worker
    # would import torch again, seconds each on a small machine); the test process itself is never forked
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "numpy", "kvlayout.dist"])
    ctx = mp.start_processes(worker, args=(str(tmp_path / "store"), job_path, out_dir), nprocs=WORLD,
                             join=False, start_method="forkserver")
    deadline = time.monotonic() + LAUNCH_LIMIT_S
    for p in ctx.processes:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
    for i in hung:
        ctx.processes[i].kill()
    assert not hung, f"ranks {hung} still ran after {LAUNCH_LIMIT_S} s"
    results = {}
    for rank in range(WORLD):
        path = os.path.join(out_dir, f"rank{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                results[rank] = pickle.load(f)
    return results


# NCCL runs the same scenarios where every rank has a GPU of its own
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.device_count() >= WORLD and torch.distributed.is_nccl_available() else [])


@pytest.fixture(scope="module", params=DEVICES)
def transfers(tmp_path_factory, request):
    jobs = [dict(make_job(sc, seed), device=request.param)
            for seed, sc in enumerate(TRANSFERS + HANDSHAKES + BAD_SLOTS)]
    started = time.monotonic()
    results = _launch(transfer_worker, jobs, tmp_path_factory.mktemp("dist"))
    crashes = {r: res["crash"] for r, res in results.items() if "crash" in res}
    assert not crashes, "\n".join(f"rank {r}:\n{c}" for r, c in crashes.items())
    assert sorted(results) == list(range(WORLD))
    return {job["scenario"].name: job for job in jobs}, results, time.monotonic() - started


def _results_of(results: dict, sc: Scenario) -> tuple[list[dict], list[dict]]:
    senders = [results[r][sc.name] for r in range(sc.src.tp)]
    receivers = [results[sc.src.tp + r][sc.name] for r in range(sc.dst.tp)]
    return senders, receivers


def _expected(job: dict) -> list:
    """The receivers' caches by ``reference.reshard``, compiled (the slots are valid, see torch_cases)."""
    import kvlayout.reference.operations  # noqa: F401 - 64-bit slots before anything is traced

    from torch_cases import jitted_reference

    sc: Scenario = job["scenario"]
    return jitted_reference.reshard(sc.src.layout, job["src"], job["src_slots"], sc.dst.layout, job["dst"],
                                    job["dst_slots"], num_kv_heads=sc.num_kv_heads)


def _assert_same_bits(got, want, what: str) -> None:
    got_flat = _flat(got)
    want_flat = _flat(want)
    assert len(got_flat) == len(want_flat), what
    for i, (g, w) in enumerate(zip(got_flat, want_flat)):
        w = np.asarray(w)
        w = w.view(_BITS[w.dtype.itemsize]) if w.dtype.kind != "u" else w
        assert g.shape == w.shape, f"{what} array {i}: shape {g.shape}, expected {w.shape}"
        if not np.array_equal(g, w):
            bad = np.argwhere(g != w)
            raise AssertionError(f"{what} array {i}: {len(bad)} of {g.size} elements differ, first at "
                                 f"{tuple(int(v) for v in bad[0])}")


def _flat(physical) -> list:
    if isinstance(physical, (tuple, list)):
        return [x for p in physical for x in _flat(p)]
    return [np.asarray(physical)]


@pytest.mark.parametrize("sc", TRANSFERS, ids=[sc.name for sc in TRANSFERS])
def test_transfer_matches_the_reference_bit_for_bit(transfers, sc):
    jobs, results, _ = transfers
    job = jobs[sc.name]
    senders, receivers = _results_of(results, sc)
    for i, res in enumerate(senders + receivers):
        assert "error" not in res, f"rank {i}: {res['error']}"
        assert res["complete"], f"rank {i}: the request is not complete"
    for r, res in enumerate(receivers):
        assert res["layers"] == list(range(sc.layers)), "each layer is yielded once, in order"
    expected = _expected(job)
    moved = 0
    for r, res in enumerate(receivers):
        _assert_same_bits(res["final"], expected[r], f"{sc.name}: receiver rank {r}")
        moved += sum(int((a != np.asarray(b)).sum()) for a, b in zip(_flat(res["final"]), _flat(job["dst"][r])))
    assert moved > 0, "the transfer changed nothing: the check would pass without it"
    for r, res in enumerate(senders):   # a sender's cache is only read
        _assert_same_bits(res["final"], job["src"][r], f"{sc.name}: sender rank {r}")


@pytest.mark.parametrize("sc", HANDSHAKES[:-1], ids=[sc.name for sc in HANDSHAKES[:-1]])
def test_bad_handshake_fails_on_both_sides_before_any_data_moves(transfers, sc):
    jobs, results, _ = transfers
    job = jobs[sc.name]
    senders, receivers = _results_of(results, sc)
    for side, res, initial in (("sender", senders[0], job["src"][0]), ("receiver", receivers[0], job["dst"][0])):
        assert "error" in res, f"the {side} did not fail"
        kind, text = res["error"]
        assert kind == "HandshakeError", f"{side}: {kind}: {text}"
        assert HANDSHAKE_TEXT[sc.name] in text and "nothing was moved" in text, f"{side}: {text}"
        _assert_same_bits(res["final"], initial, f"{sc.name}: {side} cache")


def test_request_mismatch_fails_on_both_sides_and_the_next_request_goes_through(transfers):
    sc = HANDSHAKES[-1]
    jobs, results, _ = transfers
    job = jobs[sc.name]
    senders, receivers = _results_of(results, sc)
    for side, res, initial in (("sender", senders[0], job["src"][0]), ("receiver", receivers[0], job["dst"][0])):
        kind, text = res["error"]
        assert kind == "HandshakeError" and "request" in text and "tokens" in text, f"{side}: {kind}: {text}"
        _assert_same_bits(res["unchanged_after_error"], initial, f"{side} cache after the refused request")
        assert res["complete"], f"{side}: the next request did not complete"
    _assert_same_bits(receivers[0]["final"], _expected(job)[0], "receiver cache after the next request")


def test_bad_receiver_slots_are_refused_before_any_message_and_the_request_then_goes_through(transfers):
    sc = BAD_SLOTS[0]
    jobs, results, _ = transfers
    job = jobs[sc.name]
    senders, receivers = _results_of(results, sc)
    refused = receivers[0]["refused"]
    assert [kind for kind, _ in refused] == ["IndexError", "ValueError"], refused
    assert "out of range" in refused[0][1] and "repeats slot" in refused[1][1], refused
    assert all("nothing was exchanged" in text for _, text in refused), refused
    _assert_same_bits(receivers[0]["unchanged_after_error"], job["dst"][0], "receiver cache after the refusals")
    for side, res in (("sender", senders[0]), ("receiver", receivers[0])):
        assert "error" not in res, f"{side}: {res['error']}"
        assert res["complete"], f"{side}: the request did not complete after the refused slot lists"
    _assert_same_bits(receivers[0]["final"], _expected(job)[0], "receiver cache")


def test_transfers_take_a_few_seconds(transfers):
    *_, seconds = transfers
    assert seconds < 60, f"the transfer processes took {seconds:.1f} s"


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    job = make_job(FAIL_JOB, 99)
    started = time.monotonic()
    results = _launch(failure_worker, job, tmp_path_factory.mktemp("dist_fail"))
    return results, time.monotonic() - started


@pytest.mark.parametrize("name, survivor", [("sender_killed", 1), ("receiver_killed", 2), ("receiver_silent", 4)])
def test_a_dead_or_silent_peer_ends_the_survivor_with_an_error_in_bounded_time(failures, name, survivor):
    results, seconds = failures
    res = results[survivor]
    assert "crash" not in res, res.get("crash")
    assert res["name"] == name
    kind, text = res["outcome"]
    assert kind == "PeerError", f"{name}: the survivor ended with {kind}: {text}"
    assert not res["complete"] and res["state"] == "failed"
    # bounded: a few waits of FAIL_TIMEOUT_S at most (a dead peer is noticed at once over TCP)
    assert res["seconds"] < 3 * FAIL_TIMEOUT_S + 2, f"{name}: took {res['seconds']:.1f} s"
    if name == "sender_killed":
        assert res["layers"] < FAIL_JOB.layers
    assert seconds < 60


# ---------------------------------------------------------------------------------------
# The rule itself (pure Python: reference.resharding)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads, src_tp, dst_tp", [(8, 4, 2), (8, 2, 4), (8, 1, 8), (8, 8, 1), (2, 4, 2),
                                                   (2, 2, 8), (2, 8, 4), (1, 4, 2), (4, 4, 4)])
def test_routes_cover_every_receiver_head_once_from_a_sender_that_holds_it(heads, src_tp, dst_tp):
    from kvlayout.reference import kv_heads, kv_routes

    routes = kv_routes(heads, src_tp, dst_tp)
    for d in range(dst_tp):
        lo, hi = kv_heads(d, dst_tp, heads)
        covered = sorted(h for r in routes if r.dst_rank == d for h in range(r.head_start, r.head_stop))
        assert covered == list(range(lo, hi))
    for r in routes:
        s_lo, s_hi = kv_heads(r.src_rank, src_tp, heads)
        assert s_lo <= r.head_start < r.head_stop <= s_hi
        assert r.src_head == r.head_start - s_lo and r.dst_head == r.head_start - kv_heads(r.dst_rank, dst_tp, heads)[0]
    pairs = [(r.src_rank, r.dst_rank) for r in routes]
    assert len(pairs) == len(set(pairs)), "one route per (sender, receiver) pair"
    if src_tp > heads:      # replicated senders: the receivers of one head spread over its replicas
        for h in range(heads):
            using = [r for r in routes if r.head_start <= h < r.head_stop]
            assert len({r.src_rank for r in using}) == min(src_tp // heads, len(using))


def test_head_splits_follow_vllm_and_refuse_uneven_ones():
    from kvlayout.reference import kv_heads

    assert [kv_heads(r, 4, 8) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [kv_heads(r, 8, 2) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4     # tp_rank // replicas
    for tp, heads in ((3, 8), (12, 8)):
        with pytest.raises(ValueError, match="cannot be"):
            kv_heads(0, tp, heads)


def test_spec_renders_the_resharding_rule():
    from kvlayout.commands.spec import render

    text = render()
    assert "## Resharding across tensor-parallel sizes" in text
    assert "| 8 | 4 | 2 | [0, 2), [2, 4), [4, 6), [6, 8) | [0, 4), [4, 8) |" in text


# ---------------------------------------------------------------------------------------
# kvlayout bench --dist
# ---------------------------------------------------------------------------------------

def test_bench_dist_without_two_gpus_says_so_and_measures_nothing(tmp_path, capsys):
    from kvlayout.cli import main

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has two GPUs: the bench would run")
    assert main(["bench", "--dist", "--out", str(tmp_path)]) == 2
    assert "needs 2 CUDA GPUs" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "no report may be written"


def test_bench_dist_cpu_smoke_run_moves_bit_exact_kv_over_gloo(tmp_path, capsys):
    import json

    from kvlayout.cli import main

    assert main(["bench", "--dist", "--device", "cpu", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "dist_cpu.json").read_text())
    assert doc["environment"]["backend"] == "gloo" and len(doc["results"]) == 2
    for row in doc["results"]:
        assert row["bit_exact"] is True and row["gbps"] > 0 and row["sendrecv_gbps"] > 0
    assert "kvlayout.dist GB/s" in (tmp_path / "dist_cpu.md").read_text()


@pytest.mark.parametrize("heads, src_tp, dst_tp", [(4, 2, 1), (4, 1, 2), (2, 4, 2), (2, 1, 4)])
def test_reshard_matches_an_index_oracle(heads, src_tp, dst_tp):
    """``reference.reshard`` (compiled, as in the op tests: see torch_cases) against plain index loops over a
    ``[P, L, N, H, D]`` layout, -1 slots included."""
    import kvlayout.reference.operations  # noqa: F401 - 64-bit slots
    from kvlayout.reference import kv_heads

    from torch_cases import jitted_reference

    rng = np.random.default_rng(heads * 100 + src_tp * 10 + dst_tp)
    L, N, D = 2, 12, 3

    def caches(tp):
        return [rng.integers(0, 2 ** 16, (2, L, N, np.subtract(*kv_heads(r, tp, heads)[::-1]), D), dtype=np.uint16)
                for r in range(tp)]

    src, dst = caches(src_tp), caches(dst_tp)
    src_slots, dst_slots = np.array([3, 5, -1, 7, 0]), np.array([1, -1, 2, 9, 11])
    got = jitted_reference.reshard("hicache_layer_first", src, src_slots, "hicache_layer_first", dst, dst_slots,
                                   num_kv_heads=heads)
    for d in range(dst_tp):
        want = dst[d].copy()
        d_lo, d_hi = kv_heads(d, dst_tp, heads)
        for t, (s_slot, d_slot) in enumerate(zip(src_slots, dst_slots)):
            if s_slot < 0 or d_slot < 0:
                continue
            for head in range(d_lo, d_hi):
                copies = max(1, src_tp // heads)     # replicas: receiver d reads replica d % copies
                s = head // (heads // src_tp) if src_tp <= heads else head * copies + d % copies
                want[:, :, d_slot, head - d_lo] = src[s][:, :, s_slot, head - kv_heads(s, src_tp, heads)[0]]
        np.testing.assert_array_equal(np.asarray(got[d]), want)
