"""engine="staged" / "auto" (kvlayout.ops.staged): a device copy of a pinned host chunk, the kernel
in device memory and the copy engine across PCIe.

On every machine: the host byte spans a staged transfer copies are exactly the bytes the kernel
writes into the chunk (so the copy engine moves every moved row and nothing else), layers are
grouped in order, and the engine choice is explained and refused with reasons.  On CUDA: staged
transfers leave exactly the bytes the kernel path leaves, in both directions, with negative and
out-of-range device slots, skip_prefix, layer subsets, several groups, MLA, and under CUDA-graph
capture.
"""
from __future__ import annotations

import pytest
import torch

from kvlayout import ops
from kvlayout.ops import staged as staged_mod
from kvlayout.ops.arguments import checked_choice

L, NB, BS, H, D = 4, 6, 16, 2, 64


def _device_cache(device, mla=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if mla:
        layers = [torch.randint(-2**15, 2**15, (NB, BS, 3 * D), generator=g, dtype=torch.int16) for _ in range(L)]
        return ops.bind("vllm_mla", [t.view(torch.bfloat16).to(device) for t in layers])
    layers = [torch.randint(-2**15, 2**15, (2, NB, BS, H, D), generator=g, dtype=torch.int16) for _ in range(L)]
    return ops.bind("vllm_flash_attn_nhd", [t.view(torch.bfloat16).to(device) for t in layers])


def _chunk(T, mla=False, pin=False, fill=0x5A5A):
    shape = (1, L, T, 3 * D) if mla else (2, L, T, H * D)
    t = torch.full(shape, fill, dtype=torch.int16).view(torch.bfloat16)
    if pin:
        t = t.pin_memory()
    return ops.bind("lmcache_kv_mla" if mla else "lmcache_kv_2ltd", t)


def _bytes(cache):
    return torch.cat([t.reshape(-1).view(torch.uint8).cpu() for t in cache.tensors])


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("skip,layers", [(0, None), (5, None), (0, [2, 0]), (3, [1, 2, 3])])
def test_host_spans_are_exactly_the_bytes_the_kernel_writes(mla, skip, layers, monkeypatch):
    monkeypatch.setattr(staged_mod, "GROUP_BYTES", 1)   # one layer per group
    T = 40
    src, dst = _device_cache("cpu", mla), _chunk(T, mla)
    slots = torch.randperm(NB * BS)[:T]
    before = _bytes(dst)
    ops.transfer(src, dst, slots, src_layers=layers, dst_layers=layers, skip_prefix=skip)
    changed = (_bytes(dst) != before).nonzero().flatten()
    choice = checked_choice(src, dst, layers, layers, None, None, 0, "kernel")
    groups = staged_mod.host_groups(src, dst, choice, True, T, skip)
    assert [g.dst_layers for g in groups] == [[layer] for layer in choice.dst_layers]
    covered = torch.zeros_like(before, dtype=torch.bool)
    for g in groups:
        for tensor, begin, end in g.spans:
            assert tensor == 0 and 0 <= begin < end
            covered[begin:end] = True
    # every written byte lies in a span, and a span byte the kernel left equal could only be one
    # whose new value happened to equal the fill pattern
    assert covered[changed].all()
    unchanged_in_spans = covered.sum() - covered[changed].sum()
    assert unchanged_in_spans <= covered.sum() // 50


def test_layers_grouped_by_size_in_order(monkeypatch):
    src, dst = _device_cache("cpu"), _chunk(32)
    choice = checked_choice(src, dst, None, None, None, None, 0, "kernel")
    per_layer = 2 * 32 * H * D * 2   # K and V rows of one layer
    monkeypatch.setattr(staged_mod, "GROUP_BYTES", 2 * per_layer)
    groups = staged_mod.host_groups(src, dst, choice, True, 32, 0)
    assert [g.src_layers for g in groups] == [[0, 1], [2, 3]]
    # K spans of layers 0 and 1 are adjacent in the chunk [2, L, T, H*D]: merged into one
    assert groups[0].spans == [(0, 0, 2 * 32 * H * D * 2), (0, L * 32 * H * D * 2, (L + 2) * 32 * H * D * 2)]


def test_rows_apart_in_the_host_layout_are_not_stageable():
    src = _device_cache("cpu")
    host = ops.bind("vllm_flash_attn_hnd", [torch.zeros(2, NB, H, BS, D, dtype=torch.bfloat16) for _ in range(L)])
    choice = checked_choice(src, host, None, None, None, None, 0, "kernel")
    reason = staged_mod.host_groups(src, host, choice, True, 8, 0)
    assert isinstance(reason, str) and "not back to back" in reason


def test_engine_choice_is_explained_and_refused_with_a_reason():
    src, dst = _device_cache("cpu"), _chunk(8)
    slots = torch.arange(8)
    assert ops.explain(src, dst, slots) == {"engine": "kernel", "reason": "one side must be a CUDA cache and the "
                                                                          "other a pinned host cache"}
    assert ops.explain(src, dst, slots, engine="copy")["engine"] == "copy"
    with pytest.raises(ValueError, match="engine='staged' cannot stage this transfer: one side must be a CUDA"):
        ops.transfer(src, dst, slots, engine="staged")
    with pytest.raises(ValueError, match="engine must be one of 'kernel', 'copy', 'staged', 'auto'"):
        ops.transfer(src, dst, slots, engine="fast")
    with pytest.raises(ValueError, match="prepare: engine='staged' is not supported"):
        ops.prepare(src, dst, slots, engine="staged")
    before = _bytes(dst)
    ops.transfer(src, dst, slots, engine="auto")   # the kernel, as explained
    assert not torch.equal(_bytes(dst), before)
    ops.prepare(src, dst, slots, engine="auto")()


# --------------------------------------------------------------------------------------------- CUDA


def _slots_with_holes(T, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    s = torch.randperm(NB * BS, generator=g)[:T]
    s[3] = -1
    s[T - 2] = -1
    return s.to(device)


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("direction", ["to_host", "from_host"])
@pytest.mark.parametrize("skip,layers", [(0, None), (4, [3, 1])])
def test_staged_equals_kernel(cuda_device, mla, direction, skip, layers, monkeypatch):
    monkeypatch.setattr(staged_mod, "GROUP_BYTES", 1)   # several groups
    T = 48
    slots = _slots_with_holes(T, cuda_device)
    results = []
    for engine in ("kernel", "staged"):
        cache = _device_cache(cuda_device, mla)
        chunk = _chunk(T, mla, pin=True)
        if direction == "to_host":
            ops.transfer(cache, chunk, slots, src_layers=layers, dst_layers=layers, skip_prefix=skip,
                         engine=engine)
        else:
            chunk_src = _chunk(T, mla, pin=True)
            ops.transfer(_device_cache(cuda_device, mla, seed=9), chunk_src, torch.arange(T, device=cuda_device))
            ops.transfer(chunk_src, cache, None, slots, src_layers=layers, dst_layers=layers, skip_prefix=skip,
                         engine=engine)
        torch.cuda.synchronize()
        results.append((_bytes(cache), _bytes(chunk)))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_staged_to_host_records_out_of_range_slots_and_keeps_their_rows(cuda_device):
    T = 24
    slots = _slots_with_holes(T, cuda_device)
    slots[7] = NB * BS + 5
    cache, chunk = _device_cache(cuda_device), _chunk(T, pin=True)
    before = chunk.tensors[0].clone()
    ops.transfer(cache, chunk, slots, engine="staged")
    with pytest.raises(IndexError, match=r"src_slots\[7\] = 101 is out of range"):
        ops.check_errors(cuda_device)
    for t in (3, 7, T - 2):   # no source row: the chunk's row stays as it was
        assert torch.equal(chunk.tensors[0][:, :, t].view(torch.int16), before[:, :, t].view(torch.int16))


def test_auto_stages_large_payloads(cuda_device, monkeypatch):
    T = 32
    cache, chunk = _device_cache(cuda_device), _chunk(T, pin=True)
    slots = torch.arange(T, device=cuda_device)
    assert ops.explain(cache, chunk, slots)["engine"] == "kernel"   # small: the direct path
    monkeypatch.setattr(staged_mod, "AUTO_MIN_BYTES", 0)
    explained = ops.explain(cache, chunk, slots)
    assert explained["engine"] == "staged" and explained["payload_bytes"] == 2 * L * T * H * D * 2
    ops.transfer(cache, chunk, slots, engine="auto")
    torch.cuda.synchronize()
    expected = _chunk(T)
    ops.transfer(_device_cache("cpu"), expected, slots.cpu())
    assert torch.equal(_bytes(chunk), _bytes(expected))


def test_staged_transfer_in_a_cuda_graph(cuda_device):
    T = 32
    cache, chunk = _device_cache(cuda_device), _chunk(T, pin=True)
    slots = torch.arange(T, device=cuda_device)
    ops.transfer(cache, chunk, slots, engine="staged")   # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream()), torch.cuda.graph(graph):
        ops.transfer(cache, chunk, slots, engine="staged")
    chunk.tensors[0].fill_(0)
    slots.copy_(torch.arange(T, device=cuda_device).flip(0))
    graph.replay()
    torch.cuda.synchronize()
    expected = _chunk(T)
    ops.transfer(_device_cache("cpu"), expected, slots.cpu())
    assert torch.equal(_bytes(chunk), _bytes(expected))


@pytest.mark.parametrize("direction", ["to_host", "from_host"])
def test_kept_staging_is_reused_per_stream_and_stays_exact(cuda_device, direction, monkeypatch):
    """Repeated staged calls of one shape on one stream reuse one kept staging cache; each call still moves
    exactly the kernel's bytes (nothing left over from the previous call); another stream gets its own
    buffer; release_staging frees them; a graph capture keeps none."""
    monkeypatch.setattr(staged_mod, "GROUP_BYTES", 1)   # several groups
    staged_mod.release_staging()
    T = 40

    def run(seed, engine, stream):
        cache = _device_cache(cuda_device, seed=seed)
        chunk = _chunk(T, pin=True, fill=seed)
        slots = _slots_with_holes(T, cuda_device, seed=seed)
        with torch.cuda.stream(stream):
            if direction == "to_host":
                ops.transfer(cache, chunk, slots, engine=engine)
            else:   # a host chunk of other bytes each call: a stale staging buffer would show
                ops.transfer(_chunk(T, pin=True, fill=seed + 1), cache, None, slots, engine=engine)
        torch.cuda.synchronize()
        return _bytes(cache), _bytes(chunk)

    main = torch.cuda.current_stream(cuda_device)
    for seed in (1, 2, 3):
        assert all(torch.equal(a, b) for a, b in zip(run(seed, "kernel", main), run(seed, "staged", main)))
    assert len(staged_mod._KEPT) == 1                    # one buffer for three calls of one shape
    kept = next(iter(staged_mod._KEPT.values()))
    other = torch.cuda.Stream(cuda_device)
    assert all(torch.equal(a, b) for a, b in zip(run(4, "kernel", other), run(4, "staged", other)))
    assert len(staged_mod._KEPT) == 2 and kept in staged_mod._KEPT.values()
    staged_mod.release_staging()
    assert not staged_mod._KEPT
    cache, chunk = _device_cache(cuda_device), _chunk(T, pin=True)
    slots = torch.arange(T, device=cuda_device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream()), torch.cuda.graph(graph):
        ops.transfer(cache, chunk, slots, engine="staged")
    assert not staged_mod._KEPT
