"""A machine with little free memory: no call allocates memory that grows with the payload.

An engine sizes its KV pools to fill the machine (host RAM for host pools, GPU memory for the
paged cache) and leaves a little headroom. A transfer that allocates a temporary the size of
what it moves (a gathered copy, a reordered view made contiguous, a torch fallback, a staging
buffer the size of the payload) fails there, or pushes the host into swap, only at the sizes
production uses. So each public route runs in a fresh process on a payload of PAYLOAD_MIB,
after a warm-up of a few tokens (code, thread pools, programs, plans and the staging ring are
in place), three times (on CUDA a staged transfer is issued directly, then captured, then
replayed), and may raise the process's peak memory by at most HEADROOM_MIB, an eighth of the
payload: host memory by the kernel's high-water mark ``VmHWM`` (reset to what is resident when
the calls start, so a temporary freed at once still shows; pinned memory counts), device
memory by the caching allocator's peak. ``move`` is the one documented exception: it is
overlap-safe at any size, so it gathers the rows it moves into one buffer first (as a torch
``cache[dst] = cache[src]`` does); it may add that buffer and no more. Results are checked
against plain torch indexing of the same rows, so a route that moved nothing cannot pass.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PAYLOAD_MIB = 64      # bytes moved by one full-size call (K and V, every layer)
HEADROOM_MIB = 8      # what a call may add to the process's peak resident memory
# Under AddressSanitizer (scripts/sanitize_cpu.sh) the resident peak also holds the shadow memory of what the
# process touched, an eighth of it: the host bound grows by that much.
ASAN_SHADOW = 1 / 8 if "address" in os.environ.get("KVLAYOUT_TEST_SANITIZE", "") else 0.0

# The child: one route on one device per run, printed as JSON {"host_mib", "device_mib", "exact", "engine"}.
_CHILD = r"""
import json, sys
import torch
from kvlayout import ops
from kvlayout.compat import lmcache, sglang

torch.manual_seed(0)
route, device, payload_mib = sys.argv[1], torch.device(sys.argv[2]), int(sys.argv[3])
L, BS, H, D = 8, 16, 8, 128                         # bf16: 4 KiB per token, plane and layer
T = payload_mib * 2**20 // (2 * L * H * D * 2)      # tokens of a full-size call (K and V, every layer)
NB = 2 * T // BS                                    # a paged cache twice the chunk


def rand(*shape, pinned=False):
    t = torch.randn(*shape).to(torch.bfloat16)
    return t.pin_memory() if pinned else t.to(device)


kv = [rand(2, NB, BS, H, D) for _ in range(L)]
paged = ops.bind("vllm_flash_attn_nhd", kv)
slots = torch.randperm(NB * BS).to(device)
pages = torch.randperm(NB).to(device)


def cache_rows(s, plane=None):                      # [2, L, n, H*D] (or one plane's [L, n, H*D]) at slots s
    planes = range(2) if plane is None else [plane]
    got = torch.stack([torch.stack([kv[l][p].reshape(NB * BS, H * D)[s] for l in range(L)]) for p in planes])
    return (got if plane is None else got[0]).cpu()


picked = {"engine": "kernel"}                       # the engine of the last transfer set up


def setup(n, engine=None):
    # (run, check) for n tokens; everything run touches is allocated and resident here
    s = slots[:n]
    host = route.endswith("_host")                  # the chunk in pinned host memory (CUDA)
    # (the host routes measure the staging ring's bound, asked for by name: auto stages only far larger calls)
    engine = engine or ("staged" if host else "auto")
    chunk = rand(2, L, n, H * D, pinned=host)
    flat = ops.bind("lmcache_kv_2ltd", chunk)
    same = lambda: torch.equal(chunk.cpu(), cache_rows(s))
    if route in ("store", "store_host"):            # paged cache -> chunk
        picked["engine"] = ops.explain(paged, flat, s, None, engine=engine)["engine"]
        return (lambda: ops.transfer(paged, flat, s, None, engine=engine)), same
    if route in ("load", "load_host"):              # chunk -> paged cache
        picked["engine"] = ops.explain(flat, paged, None, s, engine=engine)["engine"]
        return (lambda: ops.transfer(flat, paged, None, s, engine=engine)), same
    if route == "gather":
        out = rand(2, L, n, H, D)
        return (lambda: ops.gather(paged, s, out=out)), (lambda: torch.equal(out.flatten(3).cpu(), cache_rows(s)))
    if route == "scatter":
        return (lambda: ops.scatter(paged, chunk.view(2, L, n, H, D), s)), same
    if route == "move":                             # n slots onto n others
        src, dst = slots[:n], slots[n:2 * n]
        return (lambda: ops.move(paged, src, dst)), (lambda: torch.equal(cache_rows(dst), cache_rows(src)))
    if route == "prepared":                         # a layer-wise store, one call per layer
        t = ops.prepare(paged, flat, s, None)

        def run():
            for i in range(t.num_layers):
                t.layer(i)
        return run, same
    if route == "lmcache":                          # LMCache's multi_layer_kv_transfer, cache -> memory object
        return (lambda: lmcache.multi_layer_kv_transfer(chunk, kv, s, direction=lmcache.TransferDirection.D2H)), same
    if route == "sglang":                           # SGLang's all-layer transfer, whole pages
        idx = (pages[: n // BS, None] * BS + torch.arange(BS, device=device)).reshape(-1)
        dst_k = [rand(NB * BS, H * D) for _ in range(L)]
        dst_v = [rand(NB * BS, H * D) for _ in range(L)]
        src_k = [kv[l][0].view(NB * BS, H * D) for l in range(L)]
        src_v = [kv[l][1].view(NB * BS, H * D) for l in range(L)]

        def run():
            sglang.transfer_kv_all_layer(src_k, dst_k, src_v, dst_v, idx, idx, item_size=H * D * 2, num_layers=L)

        def check():
            return all(torch.equal(torch.stack([d[idx] for d in dst]).cpu(), cache_rows(idx, p))
                       for p, dst in enumerate((dst_k, dst_v)))
        return run, check
    raise SystemExit("unknown route " + route)


def status_kib(field):                              # VmRSS (resident now) or VmHWM (its peak), in KiB
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1])


cuda = device.type == "cuda"
# warm-up: code, programs, plans, thread pools and (through the host) the staging ring, which a full-size
# call through the host then uses (auto stages it): a bounded allocation kept per stream, not per call
run, check = setup(2 * BS, "staged" if route.endswith("_host") else "auto")
for _ in range(3):
    run()
assert check()
run, check = setup(T)
if cuda:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    device_before = torch.cuda.memory_allocated()
with open("/proc/self/clear_refs", "w") as f:       # the peak starts again from what is resident now
    f.write("5")
resident = status_kib("VmRSS")
for _ in range(3):
    run()
if cuda:
    torch.cuda.synchronize()
host_grown = status_kib("VmHWM") - resident
device_grown = torch.cuda.max_memory_allocated() - device_before if cuda else 0
print(json.dumps({"host_mib": max(0, host_grown) / 1024, "device_mib": device_grown / 2**20, "exact": check(),
                  "engine": picked["engine"]}))
"""

ROUTES = ["store", "load", "gather", "scatter", "move", "prepared", "lmcache", "sglang"]
CUDA_ROUTES = ["store_host", "load_host"]           # through the pinned host: the staged engine's ring


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc to reset the peak")
@pytest.mark.parametrize("route", ROUTES + CUDA_ROUTES)
def test_a_full_size_call_adds_no_payload_sized_memory(route, device):
    """Each route moves PAYLOAD_MIB exactly, three times, and raises the process's peak host and device
    memory by at most HEADROOM_MIB each (move: by its one buffer of the rows it moves, and no more)."""
    if route in CUDA_ROUTES and device != "cuda":
        pytest.skip("a chunk in pinned host memory: CUDA")
    done = subprocess.run([sys.executable, "-c", _CHILD, route, device, str(PAYLOAD_MIB)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\n{device} {route}: {PAYLOAD_MIB} MiB moved x3, peak memory +{got['host_mib']:.1f} MiB host, "
          f"+{got['device_mib']:.1f} MiB device")
    assert got["exact"], f"{route}: the rows moved differ from the cache's"
    if route in CUDA_ROUTES:
        assert got["engine"] == "staged", got          # the full-size call goes through the staging ring
    buffer_on = "device" if device == "cuda" else "host"    # where move's buffer lives: the cache's memory
    for where, grown in (("host", got["host_mib"]), ("device", got["device_mib"])):
        limit = HEADROOM_MIB + (PAYLOAD_MIB if route == "move" and where == buffer_on else 0)
        if where == "host":
            limit *= 1 + ASAN_SHADOW
        assert grown <= limit, (f"{device} {route}: a {PAYLOAD_MIB} MiB call raised peak {where} memory by "
                                f"{grown:.1f} MiB (at most {limit} MiB allowed)")
