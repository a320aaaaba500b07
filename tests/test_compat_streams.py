"""Every compat connector and pool on its streams, with per-call tensors freed right after each call.

A connector that runs work on a stream of its own (LMCache's load and store
streams) must keep what that work reads or writes - the caller's slot mapping
and memory objects, its own staging buffers - from being handed out again by
the caching allocators before the work has run, even when the caller frees it
the moment the call returns.  Each scenario here:

* makes the connector's streams busy first (``torch.cuda._sleep``), so its
  kernels run late;
* passes fresh tensors for every call (slot mappings, memory objects) and
  drops them right after the call;
* allocates and overwrites blocks of the same sizes (device and pinned host
  memory) before the late kernels run: a freed block handed out again would be
  overwritten under them;
* then checks every byte of the caches and objects against indexing oracles.

Connectors and pools that work on the caller's stream run inside a stream the
test makes current, with their per-call tensors made and freed there.

The scenarios also run on the CPU (no streams: the same calls and checks), so
the byte checks themselves are exercised where there is no CUDA device; the
CUDA variants are skipped there.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvlayout.compat import connectors as C
from kvlayout.compat import sglang as S
from kvlayout.compat.lmcache import MemoryFormat as MF

from compat_oracles import Metadata, logical, make_cache, rand, same, zeros_like

NB, BS, H, D = 16, 4, 2, 8
N = NB * BS
LAYERS = 3
CHUNKS = [(0, 8), (8, 16), (16, 21)]
T_ALL = CHUNKS[-1][1]
SLEEP_CYCLES = 20_000_000          # ~10 ms of a busy stream on an H200: the connector's kernels run late

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                  reason="no CUDA device"))]


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------

def _busy(*streams) -> None:
    """Delay the work to be enqueued on each stream (CUDA streams only; None is the host)."""
    for stream in streams:
        if stream is not None:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP_CYCLES)


def _churn(sizes) -> None:
    """Allocate blocks of the given ``(nbytes, device, pinned)`` and overwrite them at once, on the current
    stream: a block freed too early comes back here and is clobbered before a late kernel reads or writes it."""
    junk = []
    for nbytes, device, pinned in sizes:
        for _ in range(2):
            t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device, pin_memory=pinned)
            t.fill_(0xA5)
            junk.append(t)
    del junk


def _size(t: torch.Tensor):
    return (t.numel() * t.element_size(), t.device, t.device.type == "cpu" and t.is_pinned())


def _own_stream(device):
    """A stream the test makes current for the caller-stream connectors and the pools (none on the host)."""
    return torch.cuda.Stream() if device == "cuda" else None


def _current(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _finish(device) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _host(shape, dtype, device):
    """A memory object's tensor in host memory (pinned where a device kernel reads it)."""
    t = torch.zeros(shape, dtype=dtype)
    return t.pin_memory() if device == "cuda" else t


def _obj_tensor(shape, dtype, device, where):
    return _host(shape, dtype, device) if where == "host" else torch.zeros(shape, dtype=dtype, device=device)


def _copy_to(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A fresh copy of ``t`` where ``like`` lives (pinned host memory when ``like`` is pinned)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=like.device,
                      pin_memory=like.device.type == "cpu" and like.is_pinned())
    out.copy_(t)
    return out


def _check_cache(fmt, got, want, slots_cpu) -> None:
    """The slots equal the source, every other slot is still zero."""
    g, w = logical(fmt, got).cpu(), logical(fmt, want).cpu()
    assert same(g[:, :, slots_cpu], w[:, :, slots_cpu])
    rest = torch.ones(g.shape[2], dtype=torch.bool)
    rest[slots_cpu] = False
    assert not g[:, :, rest].any()


def _slots(gen, device):
    return torch.randperm(N, generator=gen)[:T_ALL].to(torch.int64).to(device)


# ---------------------------------------------------------------------------------------
# Chunk connectors: V2, V3, SGLang
# ---------------------------------------------------------------------------------------

def _chunk_round_trip(device, conn_store, conn_load, kv, fmt, planes, where, gen, caller_stream=None,
                      groups=None):
    """Store every chunk, then load every chunk (to_gpu, then batched_to_gpu) into fresh caches, with a fresh
    slot mapping and fresh memory objects per call, all dropped right after it."""
    base = _slots(gen, device)
    slots_cpu = base.cpu()
    stored = []
    with _current(caller_stream):
        for s, e in CHUNKS:
            _busy(conn_store.store_stream if conn_store.store_on_stream else None, caller_stream)
            mapping = base.clone()
            if groups is None:
                obj = C.MemoryObj(_obj_tensor(conn_store.get_shape(e - s), kv_dtype(kv), device, where))
            else:
                obj = C.MemoryObj(None, MF.UNDEFINED, [_obj_tensor(sh, dt, device, where) for sh, dt in
                                                       zip(conn_store.get_shapes(e - s), conn_store.get_dtypes())])
                obj.tensor = obj.tensors[0]
            conn_store.from_gpu(obj, s, e, slot_mapping=mapping, kvcaches=kv)
            freed = [_size(mapping)]
            del mapping
            _churn(freed)
            stored.append(obj)
        _finish(device)
        # every stored object holds its chunk's rows, bit for bit
        for obj, (s, e) in zip(stored, CHUNKS):
            for g, t in enumerate(obj.group_tensors):
                fmt_g, kv_g = (fmt, kv) if groups is None else groups[g]
                want = logical(fmt_g, kv_g).cpu()[:, :, slots_cpu[s:e]]
                assert same(t.cpu()[:want.shape[0]], want)
                assert not t.cpu()[want.shape[0]:].any()         # an MLA object's unused plane
        fresh = zeros_like(kv)
        # one chunk with to_gpu (the caller's stream), the others with batched_to_gpu (the load stream)
        for i, (s, e) in enumerate(CHUNKS):
            _busy(conn_load.load_stream, caller_stream)
            mapping = base.clone()
            copies = [_copy_to(t, t) for t in stored[i].group_tensors]
            obj = C.MemoryObj(copies[0], stored[i].fmt, copies if groups is not None else None)
            if i == 0:
                conn_load.to_gpu(obj, s, e, slot_mapping=mapping, kvcaches=fresh)
            else:
                conn_load.batched_to_gpu([obj], [s], [e], slot_mapping=mapping, kvcaches=fresh)
            freed = [_size(mapping)] + [_size(t) for t in copies]
            del mapping, obj, copies
            _churn(freed)
        _finish(device)
    if groups is None:
        _check_cache(fmt, fresh, kv, slots_cpu)
    else:
        fresh_groups = _split_groups(fresh, groups)
        for (fmt_g, kv_g), fresh_g in zip(groups, fresh_groups):
            _check_cache(fmt_g, fresh_g, kv_g, slots_cpu)


def kv_dtype(kv):
    while isinstance(kv, (list, tuple)):
        kv = kv[0]
    return kv.dtype


def _split_groups(layers, groups):
    out, i = [], 0
    for _, kv_g in groups:
        out.append(layers[i:i + len(kv_g)])
        i += len(kv_g)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", [1, 2, 3])
@pytest.mark.parametrize("use_gpu, where", [(False, "device"), (False, "host"), (True, "host")])
@pytest.mark.parametrize("xpu_class", [False, True])
def test_v2_streams(device, fmt, use_gpu, where, xpu_class):
    """V2, and the XPU class of V2 (the same code; geometry read from the first caches), on a CUDA device."""
    gen = torch.Generator().manual_seed(fmt * 10 + use_gpu)
    heads = 1 if fmt == 3 else H
    kv = make_cache(fmt, LAYERS, NB, BS, heads, D, torch.bfloat16, device, gen)

    def make():
        if xpu_class:
            return C.VLLMPagedMemXPUConnectorV2(use_gpu=use_gpu, device=device, kv_layout="NHD", kvcaches=kv)
        return C.VLLMPagedMemGPUConnectorV2(heads * D, LAYERS, use_gpu=use_gpu, device=device, use_mla=fmt == 3,
                                            kv_layout="NHD")
    _chunk_round_trip(device, make(), make(), kv, fmt, 1 if fmt == 3 else 2, where, gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_gpu, where", [(False, "device"), (True, "host")])
def test_v3_streams_hybrid(device, use_gpu, where):
    gen = torch.Generator().manual_seed(30 + use_gpu)
    groups = [(1, make_cache(1, 2, NB, BS, H, D, torch.bfloat16, device, gen)),
              (1, make_cache(1, 2, NB, BS, H, 6, torch.uint8, device, gen))]
    layers = [t for _, kv_g in groups for t in kv_g]
    md = Metadata(layers=4, chunk=8, heads=H, groups=[[0, 1], [2, 3]])
    make = lambda: C.VLLMPagedMemGPUConnectorV3(md, torch.device(device), use_gpu=use_gpu,  # noqa: E731
                                                kv_layout="NHD", kvcaches=list(layers))
    _chunk_round_trip(device, make(), make(), layers, None, 2, where, gen, groups=groups)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("use_gpu, where", [(False, "device"), (True, "host")])
def test_sglang_connector_on_the_callers_stream(device, mla, use_gpu, where):
    gen = torch.Generator().manual_seed(40 + mla)
    fmt, heads, d = (5, 1, 24) if mla else (4, H, D)
    kv = make_cache(fmt, LAYERS, NB, BS, heads, d, torch.float16, device, gen)
    make = lambda: C.SGLangGPUConnector(heads * d, LAYERS, use_gpu=use_gpu, device=device,  # noqa: E731
                                        use_mla=mla)
    _chunk_round_trip(device, make(), make(), kv, fmt, 1 if mla else 2, where, gen, caller_stream=_own_stream(device))


# ---------------------------------------------------------------------------------------
# Layer-wise connectors
# ---------------------------------------------------------------------------------------

def _layerwise_round_trip(device, conn, kv, fmt, where, gen, caller_stream=None):
    base = _slots(gen, device)
    slots_cpu = base.cpu()
    starts, ends = [s for s, _ in CHUNKS], [e for _, e in CHUNKS]
    objs = [[C.MemoryObj(_obj_tensor(conn.get_shape(e - s), kv_dtype(kv), device, where), conn.layer_format)
             for s, e in CHUNKS] for _ in range(LAYERS)]
    with _current(caller_stream):
        _busy(conn.store_stream, caller_stream)
        mapping = base.clone()
        store = conn.batched_from_gpu(objs, starts, ends, slot_mapping=mapping, kvcaches=kv, sync=False)
        for _ in range(LAYERS + 1):
            next(store)
            _busy(conn.store_stream)
        freed = [_size(mapping)]
        del mapping, store
        _churn(freed)
        _finish(device)
        for l in range(LAYERS):
            for obj, (s, e) in zip(objs[l], CHUNKS):
                want = logical(fmt, kv).cpu()[:, l, slots_cpu[s:e]]                 # [P, T, W]
                got = obj.tensor.cpu()
                got = got.transpose(0, 1) if got.dim() == 3 and conn.layer_format == MF.KV_T2D else got
                assert same(got.reshape(want.shape), want)
        fresh = zeros_like(kv)
        _busy(conn.load_stream, caller_stream)
        mapping = base.clone()
        load = conn.batched_to_gpu(starts, ends, slot_mapping=mapping, kvcaches=fresh, sync=False)
        next(load)
        for l in range(LAYERS):
            _busy(conn.load_stream)
            copies = [_copy_to(o.tensor, o.tensor) for o in objs[l]]
            load.send([C.MemoryObj(t, o.fmt) for t, o in zip(copies, objs[l])])
            freed = [_size(t) for t in copies]
            del copies
            _churn(freed)
        for _ in load:
            pass
        freed = [_size(mapping)]
        del mapping, load
        _churn(freed)
        _finish(device)
    _check_cache(fmt, fresh, kv, slots_cpu)
    assert conn.gpu_buffer_allocator.memcheck()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", [1, 3])
@pytest.mark.parametrize("use_gpu, where", [(False, "device"), (False, "host"), (True, "host")])
@pytest.mark.parametrize("cls", [C.VLLMPagedMemLayerwiseGPUConnector, C.VLLMPagedMemLayerwiseXPUConnector])
def test_vllm_layerwise_streams(device, fmt, use_gpu, where, cls):
    gen = torch.Generator().manual_seed(50 + fmt)
    heads = 1 if fmt == 3 else H
    kv = make_cache(fmt, LAYERS, NB, BS, heads, D, torch.bfloat16, device, gen)
    conn = cls(heads * D, LAYERS, use_gpu, device=device, use_mla=fmt == 3, kv_layout="NHD")
    _layerwise_round_trip(device, conn, kv, fmt, where, gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_gpu, where", [(False, "device"), (True, "host")])
def test_sglang_layerwise_on_the_callers_stream(device, use_gpu, where):
    gen = torch.Generator().manual_seed(60)
    kv = make_cache(4, LAYERS, NB, BS, H, D, torch.float16, device, gen)
    conn = C.SGLangLayerwiseGPUConnector(H * D, LAYERS, use_gpu=use_gpu, device=device)
    _layerwise_round_trip(device, conn, kv, 4, where, gen, caller_stream=_own_stream(device))


@pytest.mark.parametrize("device", DEVICES)
def test_cacheblend_streams(device):
    """CacheBlend: objects sent to the load generator and dropped at once; slots dropped after each call."""
    gen = torch.Generator().manual_seed(70)
    kv = make_cache(1, LAYERS, NB, BS, H, D, torch.float32, device, gen)
    conn = C.VLLMBufferLayerwiseGPUConnector(H * D, LAYERS, use_gpu=True, device=device, kv_layout="NHD")
    base = _slots(gen, device)
    slots_cpu = base.cpu()
    starts, ends = [s for s, _ in CHUNKS], [e for _, e in CHUNKS]
    objs = [[C.MemoryObj(_host(conn.get_shape(e - s), torch.float32, device), MF.KV_2TD) for s, e in CHUNKS]
            for _ in range(LAYERS)]
    _busy(conn.store_stream)
    mapping = base.clone()
    store = conn.batched_from_gpu(objs, starts, ends, slot_mapping=mapping, kvcaches=kv)
    next(store)
    freed = [_size(mapping)]
    del mapping
    _churn(freed)
    for _ in store:
        pass
    _finish(device)
    for l in range(LAYERS):
        for obj, (s, e) in zip(objs[l], CHUNKS):
            assert same(obj.tensor, logical(1, kv).cpu()[:, l, slots_cpu[s:e]])
    fresh = zeros_like(kv)
    mapping = base.clone()
    load = conn.batched_to_gpu(starts, ends, slot_mapping=mapping, kvcaches=fresh)
    next(load)
    for l in range(LAYERS):
        _busy(conn.load_stream)
        copies = [_copy_to(o.tensor, o.tensor) for o in objs[l]]
        sent = [C.MemoryObj(t, MF.KV_2TD) for t in copies]
        for o, src in zip(sent, objs[l]):
            o.cached_positions = src.cached_positions.clone()          # stored where they are now: no rotation
        load.send(sent)
        freed = [_size(t) for t in copies]
        del copies, sent
        _churn(freed)
    for _ in load:
        pass
    freed = [_size(mapping)]
    del mapping, load
    _churn(freed)
    _finish(device)
    _check_cache(1, fresh, kv, slots_cpu)
    assert conn.gpu_buffer_allocator.memcheck()


# ---------------------------------------------------------------------------------------
# SGLang pools (the caller's stream)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_device_pools_on_the_callers_stream(device):
    gen = torch.Generator().manual_seed(80)
    stream = _own_stream(device)
    with _current(stream):
        pool = S.MHATokenToKVPool(N, BS, torch.bfloat16, H, D, LAYERS, device, False)
        want_k = [torch.zeros(N + BS, H, D, dtype=torch.bfloat16) for _ in range(LAYERS)]
        want_v = [torch.zeros(N + BS, H, D, dtype=torch.bfloat16) for _ in range(LAYERS)]
        for step in range(6):
            layer = step % LAYERS
            loc_cpu = torch.randperm(N, generator=gen)[:9] + BS
            k, v = rand((9, H, D), torch.bfloat16, "cpu", gen), rand((9, H, D), torch.bfloat16, "cpu", gen)
            want_k[layer][loc_cpu], want_v[layer][loc_cpu] = k, v
            loc, kd, vd = loc_cpu.to(device), k.to(device), v.to(device)
            pool.set_kv_buffer(layer, loc, kd, vd)
            freed = [_size(loc), _size(kd), _size(vd)]
            del loc, kd, vd
            _churn(freed)
        idx = torch.randperm(N, generator=gen)[:12].to(device) + BS
        src_cpu = idx.cpu()
        flat = pool.get_flat_data(idx.clone())
        flat_want = torch.stack([torch.stack([w[src_cpu] for w in want]) for want in (want_k, want_v)])
        target = torch.arange(12, device=device) + 2 * BS
        tgt_cpu = target.cpu()
        pool.move_kv_cache(target.clone(), idx.clone())
        _churn([_size(target), _size(idx)])
        for w in want_k + want_v:
            w[tgt_cpu] = w[src_cpu].clone()
        _finish(device)
    for t, w in zip(pool.k_buffer + pool.v_buffer, want_k + want_v):
        assert same(t, w)
    assert same(flat.cpu(), flat_want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_host_pool_on_the_callers_stream(device, layout, io_backend):
    gen = torch.Generator().manual_seed(90)
    stream = _own_stream(device)
    with _current(stream):
        pool = S.MHATokenToKVPool(N, BS, torch.float16, H, D, LAYERS, device, False)
        for t in pool.k_buffer + pool.v_buffer:
            t.copy_(rand(t.shape, t.dtype, device, gen))
        host = S.HostKVPool(pool, 2.0, layout=layout)
        h = host.alloc(2 * BS)
        pages = torch.randperm(NB, generator=gen)[:2] + 1
        d_cpu = (pages[:, None] * BS + torch.arange(BS)).reshape(-1)
        hi, di = h.clone(), d_cpu.to(device)
        host.backup_from_device_all_layer(pool, hi, di, io_backend=io_backend)
        freed = [_size(di)]
        del hi, di
        _churn(freed)
        fresh = S.MHATokenToKVPool(N, BS, torch.float16, H, D, LAYERS, device, False)
        hi, di = h.clone(), d_cpu.to(device)
        for layer in range(LAYERS):
            host.load_to_device_per_layer(fresh, hi, di, layer, io_backend=io_backend)
        freed = [_size(di)]
        del hi, di
        _churn(freed)
        _finish(device)
    for got, want in zip(fresh.k_buffer + fresh.v_buffer, pool.k_buffer + pool.v_buffer):
        g, w = got.cpu(), want.cpu()
        assert same(g[d_cpu], w[d_cpu])
        rest = torch.ones(g.shape[0], dtype=torch.bool)
        rest[d_cpu] = False
        assert not g[rest].any()


# ---------------------------------------------------------------------------------------
# Prepared transfers collected at any moment
# ---------------------------------------------------------------------------------------

def test_a_prepared_transfer_collected_while_a_program_registers_does_not_deadlock(monkeypatch):
    """The connectors and the host pool hold prepared transfers and drop them when buffers or indices change;
    the garbage collector may finalize one (unpinning its program) on the thread that is registering another
    program under the program registry's lock.  That must not deadlock."""
    import gc
    import threading

    from kvlayout import ops
    from kvlayout.ops import programs

    real = programs._register

    def register_after_a_collection(key):
        gc.collect()                         # what an allocation in here may trigger
        return real(key)
    monkeypatch.setattr(programs, "_register", register_after_a_collection)

    class Cycle:
        pass

    def work():
        held = Cycle()
        held.self = held                     # only the collector frees it
        held.t = ops.prepare(ops.bind("sglang_mla", [torch.zeros(8, 1, 5)]),
                             ops.bind("sglang_mla", [torch.zeros(8, 1, 5)]), torch.tensor([1]), torch.tensor([2]))
        del held
        ops.transfer(ops.bind("sglang_mla", [torch.zeros(8, 1, 7)]), ops.bind("sglang_mla", [torch.zeros(8, 1, 7)]),
                     torch.tensor([1]), torch.tensor([2]))          # a new program: registered, collecting first
        done.set()

    done = threading.Event()
    gc.collect()
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert done.is_set(), "a finalizer's unpin deadlocked on the program registry's lock"


# ---------------------------------------------------------------------------------------
# InFlight itself (stand-in streams and events, so it runs anywhere)
# ---------------------------------------------------------------------------------------

def test_in_flight_records_device_tensors_and_holds_host_ones_until_the_stream_passes(monkeypatch):
    import types
    import weakref

    from kvlayout.compat import _device

    events = []

    class Event:
        def __init__(self):
            self.done, self.stream = False, None
            events.append(self)

        def record(self, stream):
            self.stream = stream

        def query(self):
            return self.done

    monkeypatch.setattr(_device, "_module", lambda device: types.SimpleNamespace(Event=Event))
    stream = types.SimpleNamespace(device=torch.device("cuda"))

    class DeviceTensor:                       # a device tensor's face: its device and record_stream
        device = torch.device("cuda")

        def __init__(self, can_record=True):
            self.recorded, self.can_record = [], can_record

        def record_stream(self, s):
            if not self.can_record:
                raise RuntimeError("this allocator cannot record")
            self.recorded.append(s)

    flight = _device.InFlight()
    recorded, unrecordable, host = DeviceTensor(), DeviceTensor(can_record=False), torch.zeros(4)
    flight.keep(stream, recorded, None, unrecordable, host)
    assert recorded.recorded == [stream]                      # recorded on the stream, not held
    assert len(flight) == 2 and len(events) == 1 and events[0].stream is stream
    gone = weakref.ref(host)
    del host
    assert gone() is not None                                 # held while the stream's work may still use it
    flight.release_finished()
    assert gone() is not None
    events[0].done = True
    flight.keep(stream)                                       # a later call lets go of what has passed
    assert gone() is None and len(flight) == 0
    flight.keep(None, torch.zeros(1))                         # the host: synchronous, nothing to keep
    assert len(flight) == 0
