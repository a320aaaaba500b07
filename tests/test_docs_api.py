"""docs/api.md's examples run as written, on the tensors their comments describe, and move what they say.

The examples are taken from the page (its ```python blocks, in order); each test builds the names a block
uses and checks the bytes afterwards.  The CUDA-only blocks (the staged engine, CUDA graphs, early loads) run
where a GPU is present.
"""

from __future__ import annotations

import pathlib
import re
import textwrap

import pytest
import torch

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md"
L, NB, BS, H, D, T = 2, 8, 16, 2, 8, 40
N_HOST = 192                                  # 12 host pages of 16: pages 10 and 11 exist


def _blocks() -> list[str]:
    return [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)]


def _block(first_line_text: str) -> str:
    """The example whose text contains ``first_line_text``."""
    (found,) = [b for b in _blocks() if first_line_text in b]
    return found


def _paged_rows(kv_caches, slots):
    """[2, L, T, H*D]: the rows of ``slots`` in vLLM NHD caches."""
    return torch.stack([torch.stack([kv[:, s // BS, s % BS].reshape(2, H * D) for s in slots.tolist()], 1)
                        for kv in kv_caches], 1)


def _namespace(device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    kv_caches = [torch.randn(2, NB, BS, H, D, generator=g).to(torch.bfloat16).to(device) for _ in range(L)]
    return {"torch": torch, "kv_caches": kv_caches, "memobj": torch.zeros(2, L, T, H * D, dtype=torch.bfloat16,
                                                                          device=device),
            "slot_mapping": torch.randperm(NB * BS, generator=g)[:T].to(device)}


def test_bind_store_and_retrieve():
    ns = _namespace("cpu")
    exec(_block('vllm = ops.bind("vllm_flash_attn_nhd", kv_caches)'), ns)
    store, retrieve = _block("ops.transfer(vllm, chunk, slot_mapping, None)").strip().splitlines()
    rows = _paged_rows(ns["kv_caches"], ns["slot_mapping"])
    exec(store, ns)
    assert torch.equal(ns["memobj"], rows)                                   # stored
    for kv in ns["kv_caches"]:
        kv.zero_()
    exec(retrieve, ns)                                                        # the first 32 tokens skipped
    back = _paged_rows(ns["kv_caches"], ns["slot_mapping"])
    assert torch.equal(back[:, :, 32:], rows[:, :, 32:]) and not back[:, :, :32].any()


def _hicache_namespace() -> dict:
    g = torch.Generator().manual_seed(1)
    ns = _namespace("cpu")
    n = NB * BS
    ns.update(k_buffers=[torch.randn(n + 16, H, D, generator=g).to(torch.bfloat16) for _ in range(L)],
              v_buffers=[torch.randn(n + 16, H, D, generator=g).to(torch.bfloat16) for _ in range(L)],
              host_tensor=torch.zeros(2, N_HOST, L, H, D, dtype=torch.bfloat16),
              device_indices=torch.arange(16, 16 + 48), host_indices=torch.arange(32, 32 + 48))
    exec("from kvlayout import ops", ns)
    return ns


def test_hicache_backup_layerwise_load_and_page_spans():
    ns = _hicache_namespace()
    saved_k = [k.clone() for k in ns["k_buffers"]]
    block = _block('device_pool = ops.bind("sglang_mha"')
    backup, load = block.split("load = ops.prepare", 1)
    exec(backup, ns)
    dev, host = ns["device_indices"], ns["host_indices"]
    for layer in range(L):
        assert torch.equal(ns["host_tensor"][0, host, layer], ns["k_buffers"][layer][dev])
        assert torch.equal(ns["host_tensor"][1, host, layer], ns["v_buffers"][layer][dev])
    for k in ns["k_buffers"]:
        k[dev] = 0                                                    # the load must bring them back
    exec("load = ops.prepare" + load, ns)
    assert all(torch.equal(a, b) for a, b in zip(saved_k, ns["k_buffers"]))
    assert len(ns["ptrs"]) == len(ns["sizes"]) > 0 and sum(ns["sizes"]) == 2 * 2 * BS * L * H * D * 2


def test_prepared_transfer_and_next_step():
    ns = _hicache_namespace()
    exec(_block('vllm = ops.bind("vllm_flash_attn_nhd", kv_caches)'), ns)
    exec('host_pool = ops.bind("hicache_page_first", host_tensor, page_size=16)', ns)
    ns.update(host_slots=torch.arange(T), next_slot_mapping=ns["slot_mapping"].flip(0),
              next_host_slots=torch.arange(T, 2 * T))
    exec(_block("t = ops.prepare(vllm, host_pool, slot_mapping, host_slots)"), ns)
    rows = _paged_rows(ns["kv_caches"], ns["slot_mapping"])             # [2, L, T, H*D]
    assert torch.equal(ns["host_tensor"][:, :T].reshape(2, T, L, H * D).transpose(1, 2), rows)
    ns["t"]()                                                           # the next step's slots, same plan
    assert torch.equal(ns["host_tensor"][:, T:2 * T].reshape(2, T, L, H * D).transpose(1, 2), rows.flip(2))


def test_move():
    ns = _hicache_namespace()
    exec('device_pool = ops.bind("sglang_mha", (k_buffers, v_buffers), page_size=16)', ns)
    ns.update(src_locs=torch.arange(16, 48), tgt_locs=torch.arange(24, 56))      # overlapping
    want = [k[16:48].clone() for k in ns["k_buffers"]]
    exec(_block("ops.move(device_pool, src_locs, tgt_locs)"), ns)
    assert all(torch.equal(k[24:56], w) for k, w in zip(ns["k_buffers"], want))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_auto_engine_and_explain_on_cuda():
    ns = _namespace("cuda")
    ns["memobj"] = ns["memobj"].cpu().pin_memory()
    exec(_block('vllm = ops.bind("vllm_flash_attn_nhd", kv_caches)'), ns)
    exec(_block('ops.transfer(vllm, chunk, slot_mapping, engine="auto")'), ns)
    torch.cuda.synchronize()
    assert torch.equal(ns["memobj"], _paged_rows(ns["kv_caches"], ns["slot_mapping"]).cpu())
    assert ns["ops"].explain(ns["vllm"], ns["chunk"], ns["slot_mapping"])["engine"] in ("kernel", "staged")


@cuda
def test_graph_capture_and_replay_on_cuda():
    ns = _namespace("cuda")
    exec(_block('vllm = ops.bind("vllm_flash_attn_nhd", kv_caches)'), ns)
    ns.update(capacity=T, next_slots=ns["slot_mapping"].flip(0))
    exec(_block("g = torch.cuda.CUDAGraph()"), ns)
    torch.cuda.synchronize()
    assert torch.equal(ns["memobj"], _paged_rows(ns["kv_caches"], ns["slot_mapping"].flip(0)))


@cuda
def test_early_loads_on_a_load_stream_on_cuda():
    ns = _namespace("cuda")
    exec(_block('vllm = ops.bind("vllm_flash_attn_nhd", kv_caches)'), ns)
    rows = _paged_rows(ns["kv_caches"], ns["slot_mapping"])
    for kv in ns["kv_caches"]:
        kv.zero_()
    ns.update(host_chunk=ns["ops"].bind("lmcache_kv_2ltd", rows.cpu().pin_memory()),
              layer_ready=[torch.cuda.Event() for _ in range(L)])
    exec(_block("load_stream = torch.cuda.Stream()"), ns)
    torch.cuda.synchronize()
    assert torch.equal(_paged_rows(ns["kv_caches"], ns["slot_mapping"]), rows)
