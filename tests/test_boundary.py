"""The Python <-> C++ boundary as an engine lives with it: threads, freed slot tensors, weeks of uptime.

* Slot tensors whose storage was freed or shrunk, meta slot tensors: refused
  with an error naming the argument, never read as "no slots" (which would
  write destination slots 0..T-1).
* Threads: ``set_slots`` on one thread while others run ``layer(i)`` and
  ``ops.transfer`` with fresh slot tensors: a running call owns the slot
  tensors it reads; every row lands where its slots say. A process forked
  while other threads transfer (an engine starting its workers) transfers
  right in the child.
* Long runs: many calls with ever new token counts, layer subsets and tensors
  keep every cache (and the process's memory) bounded.
"""

from __future__ import annotations

import os
import random
import threading
import time

import numpy as np
import pytest
import torch

from kvlayout import ops
from kvlayout.ops import programs

import torch_cases as TC

L, NB, BS, H, E = 4, 16, 8, 2, 8       # 128 slots, rows of 16 elements
CACHE, CHUNK, POOL = "vllm_flash_attn_nhd", "lmcache_kv_2ltd", "hicache_layer_first"


def _kv(device, layers=L, dtype=torch.float32):
    """A paged cache whose every element holds its own (plane, layer, slot, column) code."""
    tensors = []
    for layer in range(layers):
        p = torch.arange(2).view(2, 1, 1, 1, 1) * 1_000_000
        s = torch.arange(NB * BS).view(1, NB, BS, 1, 1) * 100
        c = torch.arange(H * E).view(1, 1, 1, H, E)
        tensors.append((p + layer * 10_000 + s + c).to(dtype).to(device))
    return ops.bind(CACHE, tensors)


def _row_code(plane, layer, slot):
    return plane * 1_000_000 + layer * 10_000 + slot * 100 + torch.arange(H * E, dtype=torch.float64)


def _checked_transfer(kv, rng: random.Random, device: str = "cpu") -> None:
    """One ops.transfer of random slots and layers of ``kv`` (:func:`_kv`) into a fresh chunk, every row checked."""
    T = rng.randint(1, 64)
    s = rng.sample(range(NB * BS), T)
    layers = sorted(rng.sample(range(L), rng.randint(1, L)))
    chunk = torch.empty(2, len(layers), T, H * E, device=device)
    ops.transfer(kv, ops.bind(CHUNK, chunk), torch.tensor(s, device=device), src_layers=layers)
    TC.sync(device)
    want = torch.stack([torch.stack([torch.stack([_row_code(p, layer, slot) for slot in s])
                                     for layer in layers]) for p in range(2)])
    if not torch.equal(chunk.cpu().double(), want):
        raise AssertionError(f"rows of {T} tokens, layers {layers} are not the cache's")


# ---------------------------------------------------------------------------------------------
# Slot tensors that hold no slots
# ---------------------------------------------------------------------------------------------

def _freed(device, T=6):
    s = torch.arange(T, device=device)
    s.untyped_storage().resize_(0)
    return s


def _shrunk(device, T=6):
    s = torch.arange(T, device=device)
    s.untyped_storage().resize_(3 * s.element_size())
    return s


@pytest.mark.parametrize("make", [_freed, _shrunk], ids=["freed", "shrunk"])
def test_slots_without_storage_are_refused(device, make):
    kv = _kv(device)
    chunk = torch.full((2, L, 6, H * E), -7.0, device=device)
    before = chunk.clone()
    for call in (lambda: ops.transfer(kv, ops.bind(CHUNK, chunk), make(device)),
                 lambda: ops.transfer(ops.bind(CHUNK, chunk.clone()), kv, None, make(device)),
                 lambda: ops.gather(kv, make(device))):
        with pytest.raises(ValueError, match=r"slots has 6 entries but its storage does not hold them"):
            call()
    TC.sync(device)
    assert torch.equal(chunk, before)


def test_prepared_slots_freed_after_set_slots_are_refused(device):
    kv = _kv(device)
    pool = ops.bind(POOL, torch.full((2, L, 64, H, E), -7.0, device=device))
    src, dst = torch.arange(6, device=device), torch.arange(6, device=device) + 10
    t = ops.prepare(kv, pool, src, dst)
    t.layer(0)
    dst.untyped_storage().resize_(0)        # the engine freed the step's slot buffer
    before = pool.tensors[0].clone()
    for call in (lambda: t.layer(1), t):
        with pytest.raises(ValueError, match=r"dst_slots has 6 entries but its storage does not hold them"):
            call()
    TC.sync(device)
    assert torch.equal(pool.tensors[0], before)


def test_meta_slots_are_refused(device):
    kv = _kv(device)
    chunk = torch.zeros(2, L, 4, H * E, device=device)
    with pytest.raises(ValueError, match="src_slots is on meta"):
        ops.transfer(kv, ops.bind(CHUNK, chunk), torch.arange(4, device="meta"))


def test_the_raw_op_refuses_freed_slots(device):
    """The native op itself refuses them (the check is in C++, whatever route reaches it)."""
    from kvlayout.ops import _native
    kv = _kv(device)
    chunk = ops.bind(CHUNK, torch.zeros(2, L, 6, H * E, device=device))
    (launch,) = ops.plan(kv, chunk, list(range(L)), list(range(L)), [0, 1], [0, 1])
    with pytest.raises(ValueError, match="src_slots has 6 entries but its storage does not hold them"):
        _native.copy_rows(launch.src_tensors, launch.dst_tensors, _freed(device), None, 6, 0,
                          launch.src_segments, launch.dst_segments, launch.src_geometry, launch.dst_geometry,
                          launch.num_pieces, launch.piece_bytes)


# ---------------------------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------------------------

ROUNDS = int(os.environ.get("KVLAYOUT_THREAD_ROUNDS", "1000"))   # (the recorded H200 run: 10000)
THREADS = 8


def test_threads_set_slots_layer_calls_and_transfers(device):
    """8 threads x ROUNDS rounds: one re-points a prepared transfer at fresh slot tensors of random sizes,
    three run its layer calls, four run ops.transfer into chunks of their own and check every row.

    The prepared transfer always maps slot s to pool slot s, so whatever slot tensor a layer call
    read, a pool row is either untouched or the cache row of its own index; a call that read
    freed memory as slots would put rows elsewhere (or fault).
    """
    kv = _kv(device)
    pool = ops.bind(POOL, torch.full((2, L, NB * BS, H, E), -1.0, device=device))
    first = torch.arange(4, device=device)
    t = ops.prepare(kv, pool, first, first.clone())
    errors: list = []
    stop = threading.Event()

    def guarded(body):
        def run(seed):
            rng = random.Random(seed)
            try:
                for _ in range(ROUNDS):
                    if stop.is_set():
                        return
                    body(rng)
            except Exception as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)
                stop.set()
        return run

    def set_slots(rng):
        T = rng.randint(1, NB * BS)
        s = torch.tensor(rng.sample(range(NB * BS), T), device=device)
        t.set_slots(s, s.clone())                       # the old slot tensors are dropped here

    def layer_calls(rng):
        t.layer(rng.randrange(L))

    def transfers(rng):
        _checked_transfer(kv, rng, device)

    bodies = [set_slots] + [layer_calls] * 3 + [transfers] * 4
    threads = [threading.Thread(target=guarded(body), args=(i,)) for i, body in enumerate(bodies)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    TC.sync(device)
    rows = pool.tensors[0].cpu().double()               # [2, L, N, H, E]
    for p in range(2):
        for layer in range(L):
            got = rows[p, layer].reshape(NB * BS, H * E)
            written = got[:, 0] != -1
            want = torch.stack([_row_code(p, layer, slot) for slot in range(NB * BS)])
            assert torch.equal(got[written], want[written]), (p, layer)
            assert bool(written.any())


FORKS = 12
fork_test = pytest.mark.skipif(not hasattr(os, "fork") or "thread" in os.environ.get("KVLAYOUT_TEST_SANITIZE", ""),
                               reason="needs os.fork (and ThreadSanitizer does not follow a fork of a threaded "
                                      "process)")


def _in_a_child(kv, seed: int, deadline_s: float = 60.0):
    """Forks; the child runs 20 checked transfers of ``kv`` and exits 0 (3 on any error); the parent waits at most
    ``deadline_s`` and returns the child's exit code, or "hung" (the child is then killed)."""
    pid = os.fork()
    if pid == 0:                                        # the child: no pytest, no return
        code = 0
        try:
            rng = random.Random(seed)
            for _ in range(20):
                _checked_transfer(kv, rng)
        except BaseException:  # noqa: BLE001 - the exit code says it
            code = 3
        os._exit(code)
    deadline = time.monotonic() + deadline_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return "hung"
        time.sleep(0.002)


@fork_test
def test_children_forked_while_threads_transfer_can_transfer():
    """An engine that forks its workers after kvlayout has run (fork is vLLM's start method where CUDA is not
    yet initialized), here while two threads keep transferring: each child, forked at a random moment of
    those calls, runs transfers of its own and gets every row right within a deadline (a lock held by another
    thread at the fork would hang it; state shared with the parent would corrupt it)."""
    kv = _kv("cpu")
    stop = threading.Event()
    errors: list = []

    def keep_transferring(seed):
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                _checked_transfer(kv, rng)
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=keep_transferring, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    try:
        outcomes = []
        for i in range(FORKS):
            time.sleep(random.Random(i).random() * 0.01)
            outcomes.append(_in_a_child(kv, 1000 + i))
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert not errors, errors[0]
    assert outcomes == [0] * FORKS, outcomes


@fork_test
def test_a_fork_while_another_thread_holds_the_program_lock_waits_for_it():
    """The moment the test above can only hit by chance, made certain: another thread holds the program
    registry's lock (as while it plans a program) when the main thread forks. The fork waits until it is
    released, and the child, whose first transfer of a new pair needs that lock, transfers right; a child
    that inherited the lock held would wait for it forever."""
    kv = _kv("cpu")
    held, release = threading.Event(), threading.Event()

    def hold_the_lock():
        with programs._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    held.wait(10)
    threading.Timer(0.2, release.set).start()
    try:
        outcome = _in_a_child(kv, 7, deadline_s=20)
    finally:
        release.set()
        holder.join()
    assert outcome == 0, outcome


# ---------------------------------------------------------------------------------------------
# Weeks of uptime
# ---------------------------------------------------------------------------------------------

CALLS = int(os.environ.get("KVLAYOUT_SOAK_CALLS", "10000"))   # (the recorded soak runs 100000)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc to read resident memory")
def test_many_calls_keep_memory_and_caches_bounded(device):
    """CALLS transfers with random T (1..65536, log-uniform), random ordered layer subsets (far more
    programs than the registry keeps), fresh chunks and slot tensors: resident memory and every
    cache stay bounded, and sampled results are exact."""
    layers = 8
    big_slots = 65536
    kv = ops.bind(CACHE, [torch.arange(2 * (big_slots // 16) * 16 * 2, dtype=torch.int16, device=device)
                          .view(2, big_slots // 16, 16, 1, 2) + layer for layer in range(layers)])
    kv_before = [t.clone() for t in kv.tensors]
    rng = np.random.default_rng(0)
    warmup = min(2000, CALLS // 10)
    peak_caches: dict = {}
    base = None
    trail = []      # resident memory against the warm-up's end, every tenth of the calls (MiB)
    for call in range(CALLS):
        if call == warmup:
            base = _resident_bytes()
        T = int(np.exp(rng.uniform(0, np.log(big_slots)))) or 1
        chosen = [int(x) for x in rng.permutation(layers)[:rng.integers(1, layers + 1)]]
        slots = torch.from_numpy(rng.integers(0, big_slots, T)).to(device)
        chunk = torch.empty(2, len(chosen), T, 2, dtype=torch.int16, device=device)
        if call % 2:
            ops.transfer(kv, ops.bind(CHUNK, chunk), slots, src_layers=chosen)
        else:       # into the cache, every token without a slot: nothing may be written
            ops.transfer(ops.bind(CHUNK, chunk.zero_()), kv, None, -torch.ones_like(slots), dst_layers=chosen)
        if call % 1000 == 1:
            TC.sync(device)
            s = slots.cpu().long()
            want = torch.stack([torch.stack([kv.tensors[layer][p].reshape(-1, 2)[s.to(kv.device)].cpu()
                                             for layer in chosen]) for p in range(2)])
            assert torch.equal(chunk.cpu(), want), call
        if call % 1000 == 0:
            for name, value in ops.cache_info().items():
                peak_caches[name] = max(peak_caches.get(name, 0), value)
        if base is not None and (call + 1) % max(1, CALLS // 10) == 0:
            trail.append(f"{call + 1}: {(_resident_bytes() - base) / 2**20:+.1f}")
    TC.sync(device)
    assert all(torch.equal(a, b) for a, b in zip(kv.tensors, kv_before))
    grown = _resident_bytes() - base
    info = ops.cache_info()
    print(f"\n{CALLS} calls: resident memory grew {grown / 2**20:.1f} MiB after {warmup} warm-up calls "
          f"(MiB by call: {', '.join(trail)}); cache peaks {peak_caches}; now {info}")
    assert peak_caches["programs"] <= info["programs_capacity"] + info["pinned_programs"]
    assert peak_caches["native_programs"] <= info["programs_capacity"] + info["pinned_programs"]
    assert peak_caches["bindings"] <= info["bindings_capacity"]
    assert peak_caches["shapes"] <= info["shapes_capacity"]
    assert grown < 64 << 20


def test_a_large_call_gives_its_host_scratch_back():
    """A call of 2**20 tokens with scattered destination slots grows the calling thread's host scratch (its
    copy of the slots, the repeated-destination table, the destination runs) and a copy engine run list of as
    many copies grows the list, each to several MiB; when each call ends the thread keeps at most the bound
    per vector (``ops.cache_info()["thread_scratch_bytes"]``). A small call's scratch is kept for the next."""
    from kvlayout import _C

    T = 1 << 20
    kept = ops.cache_info()["thread_scratch_kept_bytes"]
    cache = ops.bind(CACHE, [torch.zeros(2, T // 16, 16, 1, 2, dtype=torch.int32)])
    chunk = torch.arange(2 * T * 2, dtype=torch.int32).view(2, 1, T, 2)
    slots = torch.randperm(T, generator=torch.Generator().manual_seed(0))
    ops.transfer(ops.bind(CHUNK, chunk), cache, None, slots)
    assert torch.equal(cache.tensors[0].view(2, T, 2)[:, slots], chunk[:, 0])
    after_transfer = ops.cache_info()["thread_scratch_bytes"]

    row = 16
    flat = [torch.zeros(T * row, dtype=torch.uint8)]
    geometry = [T, 1, row, row, 0]
    copies = _C.copy_run_list(flat, [torch.zeros_like(flat[0])], None, slots, T, 0, [0, 0], [0, 0], geometry,
                              geometry, 1, row)
    assert copies > T * 0.99                      # (a random permutation continues itself only by chance)
    after_run_list = ops.cache_info()["thread_scratch_bytes"]
    print(f"\nthread scratch after a {T}-token transfer: {after_transfer} bytes, after a run list of {copies} "
          f"copies: {after_run_list} (kept at most {kept} per vector)")
    assert after_transfer <= 8 * kept and after_run_list <= 8 * kept

    ops.transfer(ops.bind(CHUNK, chunk[:, :, :4096]), cache, None, slots[:4096])
    small = ops.cache_info()["thread_scratch_bytes"]
    assert 4096 * 8 <= small <= 8 * kept          # (the slot copy alone: 4096 int64)


def test_program_registry_evicts_unpinned_programs_only(device):
    """Past its capacity the registry drops the least recently used programs that nothing pins;
    a prepared transfer's program survives, and a dropped handle raises instead of running."""
    kv = _kv(device, layers=6)
    pool = ops.bind(POOL, torch.zeros(2, 6, 64, H, E, device=device))
    saved = programs.program_cache_capacity()
    try:
        ops.set_cache_capacity(programs=4)
        t = ops.prepare(kv, pool, torch.arange(3, device=device), torch.arange(3, device=device))
        handles = [programs.program_handle(programs.program_key(kv, pool, [i], [i], [0, 1], [0, 1]))
                   for i in range(6)]
        info = ops.cache_info()
        assert info["programs"] <= 4 + info["pinned_programs"]   # (compiled graphs elsewhere pin theirs)
        t.layer(2)                                     # its program is still registered
        with pytest.raises(IndexError, match="no copy program has handle"):
            torch.ops.kvlayout.copy_program(handles[0], list(kv.tensors), list(pool.tensors), None, None, 0, 1, 0,
                                            0, ops._native.status_tensor(device), False)
        ops.transfer(kv, pool, torch.arange(3, device=device), torch.arange(3, device=device) + 5,
                     src_layers=[0], dst_layers=[0])   # an evicted choice is planned again
    finally:
        ops.set_cache_capacity(programs=saved)


def test_staged_graph_capacity_is_a_setting_and_a_variable(monkeypatch):
    """The staged graph bound: ops.set_cache_capacity(staged_graphs=N) (N >= 0, 0 meaning none) shows in
    ops.cache_info(); KVLAYOUT_STAGED_GRAPHS sets it at import and accepts 0, unlike the other bounds."""
    from kvlayout.ops.settings import environment_capacity
    saved = ops.cache_info()["staged_graphs_capacity"]
    try:
        for n in (0, 3):
            ops.set_cache_capacity(staged_graphs=n)
            assert ops.cache_info()["staged_graphs_capacity"] == n
        for bad in (-1, 2.0, True):
            with pytest.raises(ValueError, match="staged graph capacity must be an int >= 0"):
                ops.set_cache_capacity(staged_graphs=bad)
    finally:
        ops.set_cache_capacity(staged_graphs=saved)
    monkeypatch.setenv("KVLAYOUT_STAGED_GRAPHS", "0")
    assert environment_capacity("KVLAYOUT_STAGED_GRAPHS", 8, minimum=0) == 0
    monkeypatch.setenv("KVLAYOUT_BINDING_CACHE", "0")
    with pytest.raises(ValueError, match="KVLAYOUT_BINDING_CACHE = '0': it must be a positive integer"):
        environment_capacity("KVLAYOUT_BINDING_CACHE", 256)
    monkeypatch.setenv("KVLAYOUT_STAGED_GRAPHS", "-1")
    with pytest.raises(ValueError, match="it must be an integer >= 0"):
        environment_capacity("KVLAYOUT_STAGED_GRAPHS", 8, minimum=0)


# the process-wide settings that are one of a few choices (ops.settings.NativeChoice): the module that reads
# them, their name there (set_<name> in ops, <name>() the reader), the choices (the default first), what a refusal
# calls them, and the native setter's own refusal of an index past its choices (None: a flag, which has none)
CHOICE_SETTINGS = {
    "host_cache_hints": ("_native", ("streaming", "default"), "host cache hints",
                         "host cache hints must be 0 .streaming. or 1 .default., got 2"),
    "host_launch_shape": ("_native", ("row_per_cta", "walk"), "a host launch shape",
                          "a host launch shape must be 0 .row per CTA. or 1 .walk., got 2"),
    "staged_graph_launch": ("staged", ("host", "device"), "a staged graph's launch", None),
    "staged_graph_reuse": ("staged", ("exact", "prefix"), "a staged graph's reuse", None),
}


@pytest.mark.parametrize("name", sorted(CHOICE_SETTINGS))
def test_choice_settings_are_settings_and_variables(name):
    """ops.set_host_cache_hints, ops.set_host_launch_shape, ops.set_staged_graph_launch and
    ops.set_staged_graph_reuse: the first of their choices by default, the other when set (the extension's copy,
    which the code that reads it sees, follows); anything else refused, by the Python setter and by the native
    one, and a refused value changes nothing; KVLAYOUT_<NAME> sets it at import, and refuses anything else."""
    import re

    from kvlayout import _C
    module, choices, what, native_error = CHOICE_SETTINGS[name]
    read = getattr(getattr(ops, module), name)
    default, other = choices
    setter = getattr(ops, f"set_{name}")
    native = {"staged_graph_launch": _C.staged_graph_on_device, "staged_graph_reuse": _C.staged_graph_prefixes}.get(
        name, getattr(_C, name, None))
    assert read() == default and int(native()) == 0
    try:
        setter(other)
        assert read() == other and int(native()) == 1
        for bad in ("cached", None, 1, True):
            with pytest.raises(ValueError, match=re.escape(f"{what} must be one of {choices}")):
                setter(bad)
        if native_error is not None:
            with pytest.raises(ValueError, match=native_error):
                getattr(_C, f"set_{name}")(2)
        assert read() == other and int(native()) == 1
    finally:
        setter(default)
    assert int(native()) == 0
    variable, reader = f"KVLAYOUT_{name.upper()}", f"ops.{module}.{name}()"
    assert TC.read_at_import(variable, other, reader).stdout.strip() == other
    bad = TC.read_at_import(variable, "fast", reader)
    assert bad.returncode != 0 and f"{variable} = 'fast'" in bad.stderr
