"""kvlayout bench on the CPU: cases run, are checked bit-exact against each form of the torch baseline, every
finished case is on disk at once, an interrupted run resumes, reports are written and compare with the peers like
for like, plots and usage errors say what went wrong."""

import dataclasses
import json
import pathlib
import struct
import sys
import warnings

import pytest
import torch

from kvlayout import ops
from kvlayout.bench import cases as C
from kvlayout.bench.peers import load_peers
from kvlayout.bench.report import markdown, plots, series, terminal_table, write_reports
from kvlayout.bench.run import CPU_THREADS, check_bit_exact, document, measure_case, run, selected, time_baseline
from kvlayout.bench.timing import Timer, Timing, drifted

ONLY = "T=256 ps=16 vllm_flash_attn_hnd"
ONE_CASE = "T=256 ps=16 vllm_flash_attn_hnd->lmcache_kv_2ltd gather_device"
RESULTS = pathlib.Path(__file__).resolve().parents[1] / "bench" / "results"


def test_bench_cpu_short_run_writes_reports(tmp_path):
    doc = run(torch.device("cpu"), quick=True, only=ONLY)
    assert doc["results"] and all(r["bit_exact"] and r["gbps"] > 0 for r in doc["results"])
    paths = write_reports(doc, str(tmp_path), "cpu")
    assert json.loads((tmp_path / "cpu.json").read_text())["results"][0]["key"] == doc["results"][0]["key"]
    assert any(p.endswith("cpu.md") for p in paths)


def test_each_case_is_appended_at_once_and_a_run_resumes(tmp_path, monkeypatch):
    jsonl = tmp_path / "cpu.jsonl"
    calls = []
    import kvlayout.bench.run as bench_run
    real = bench_run.measure_case

    def measure_then_stop(case, *args):
        calls.append(case.key)
        if len(calls) == 2:
            raise KeyboardInterrupt      # the run is cut short during its second case
        return real(case, *args)

    monkeypatch.setattr(bench_run, "measure_case", measure_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run(torch.device("cpu"), quick=True, only=ONLY, jsonl=str(jsonl))
    lines = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["run", "case"] and lines[1]["key"] == calls[0]

    monkeypatch.setattr(bench_run, "measure_case", real)
    doc = run(torch.device("cpu"), quick=True, only=ONLY, jsonl=str(jsonl), resume=True)
    keys = [r["key"] for r in doc["results"]]
    assert keys[0] == calls[0] and calls[1] in keys and len(keys) == len(set(keys)) == 2
    assert doc["limits"] == lines[0]["limits"] and "limits_end" in doc
    assert document(str(jsonl))["results"] == doc["results"]


def test_only_selects_by_group_or_text():
    case = C.plan_cases(quick=True)[0]
    assert selected(case, None) and selected(case, case.group) and selected(case, f"nothing, {case.group}")
    assert selected(case, case.shape) and not selected(case, "copy_engine") and not selected(case, "no such text")
    groups = {c.group for c in C.plan_cases(quick=False) if selected(c, "layerwise,ctas")}
    assert groups == {"layerwise", "ctas"}


def test_limit_drift_is_flagged_in_the_reports():
    assert drifted({"D2D": 100.0, "H2D": 50.0}, {"D2D": 94.0, "H2D": 49.0}) == {"D2D": (100.0, 94.0)}
    doc = run(torch.device("cpu"), quick=True, only=ONE_CASE)
    assert len(doc["results"]) == 1
    doc["limits_drift"] = {"D2D": (100.0, 90.0)}
    assert "WARNING: limit D2D moved from 100.0 to 90.0" in terminal_table(doc)
    assert "**Warning:** limit D2D moved" in markdown(doc)


def test_peer_figures_match_the_same_job():
    peers = load_peers()
    head = C.Case("headline", "L32_H8_D128", "vllm_flash_attn_nhd", "lmcache_kv_2ltd", 4096, 16, "to_host")
    names = {(r["peer"], r["op"]) for r in peers.matching(head)}
    assert ("LMCache", "staging: multi_layer_kv_transfer + one pinned copy_") in names
    assert all(r["T"] == 4096 and r["max_ctas"] == 0 for r in peers.matching(head))
    # the side-by-side run used NHD caches: an HND cache is another job
    assert peers.matching(C.Case("layouts", "L32_H8_D128", "vllm_flash_attn_hnd", "lmcache_kv_2ltd", 4096, 16,
                                 "to_host")) == []
    pool = C.Case("layouts", "L32_H8_D128", "sglang_mha", "hicache_page_first", 4096, 64, "to_host")
    assert {r["peer"] for r in peers.matching(pool)} == {"SGLang"}
    assert all("ps=64" in r["op"] for r in peers.matching(pool))
    # an SM budget of N CTAs is compared with sgl-kernel's block_quota = N, and with nothing where none was run
    budget = peers.matching(C.Case("ctas", "L32_H8_D128", "vllm_flash_attn_nhd", "lmcache_kv_2ltd", 4096, 16,
                                   "to_host", max_ctas=4))
    assert [(r["peer"], r["overlapped_gbps"]) for r in budget] == [("SGLang", 52.0)]
    assert peers.matching(C.Case("ctas", "L32_H8_D128", "vllm_flash_attn_nhd", "lmcache_kv_2ltd", 4096, 16,
                                 "to_host", max_ctas=16)) == []
    # the staged call of a repeated shape is compared; the same call issued directly (a diagnostic) is not
    staged = C.Case("staged", "L32_H8_D128", "vllm_flash_attn_nhd", "lmcache_kv_2ltd", 4096, 16, "to_host",
                    engine="staged")
    assert peers.matching(staged) and peers.matching(dataclasses.replace(staged, call="direct")) == []


def test_staged_rows_issued_directly_keep_no_graph_while_they_run():
    """The bench's "direct" staged rows: each call runs with no staged graph kept (as a new shape's call), and
    the bound is back after it, also when the call raises."""
    seen = []
    saved = ops.cache_info()["staged_graphs_capacity"]
    direct = next(c for c in C.plan_cases(quick=False) if c.call == "direct")
    C._with_setting(direct, lambda: seen.append(ops.cache_info()["staged_graphs_capacity"]))()
    assert seen == [0] and ops.cache_info()["staged_graphs_capacity"] == saved

    def fails():
        raise RuntimeError("a failed call")
    with pytest.raises(RuntimeError, match="a failed call"):
        C._with_setting(direct, fails)()
    assert ops.cache_info()["staged_graphs_capacity"] == saved
    keys = [c.key for c in C.plan_cases(quick=False) if c.call == "direct"]
    assert len(keys) == 12 and all(k.endswith(" staged direct") for k in keys) and len(set(keys)) == 12


def test_peers_json_holds_both_timings_with_their_source():
    """Every row names a source with date, machine, method and limits; the side-by-side run's rows carry the
    overlapped and the idle figure (null only where a row's note says the run gave one figure)."""
    doc = json.loads((RESULTS.parent / "peers.json").read_text())
    sources = {s["id"]: s for s in doc["sources"]}
    for s in sources.values():
        assert s["date"] and s["machine"] and s["method"] and {"D2D", "H2D_256MiB", "D2H_256MiB"} <= set(s["limits"])
    for r in doc["rows"]:
        assert r["source"] in sources and r["overlapped_gbps"] is not None
        if r["source"] == "side_by_side_7d5fbfc" and "note" not in r:
            assert r["idle_gbps"] is not None, r
    side = [r for r in doc["rows"] if r["source"] == "side_by_side_7d5fbfc"]
    assert len({(r["shape"], r["T"], r["direction"]) for r in side if r["max_ctas"] == 0}) == 30   # 23 note rows
    h8 = next(r for r in side if (r["shape"], r["T"], r["direction"]) == ("L32_H8_D128", 256, "gather_device"))
    assert (h8["peer"], h8["overlapped_gbps"], h8["idle_gbps"]) == ("LMCache", 1700, 1116)
    assert h8["kvlayout_same_run"] == {"overlapped_gbps": 1549, "idle_gbps": 947}


def _cuda_result(**over) -> dict:
    """A result row of a CUDA run (the H8 T=256 on-device gather), figures chosen by the test."""
    row = {"group": "headline", "shape": "L32_H8_D128", "device_layout": "vllm_flash_attn_nhd",
           "buffer_layout": "lmcache_kv_2ltd", "T": 256, "page_size": 16, "direction": "gather_device",
           "layerwise": False, "max_ctas": 0, "engine": "kernel", "call": "transfer", "bit_exact": True,
           "limit_name": "D2D", "limit_gbps": 2120.0, "pct_of_limit": None, "host_us": 20.0}
    row.update(over)
    row["pct_of_limit"] = 100 * row["gbps"] / row["limit_gbps"]
    return row


def test_report_compares_kernel_only_with_overlapped_and_end_to_end_with_idle(tmp_path):
    """The peers' overlapped figure (1700 GB/s) is judged against kvlayout's kernel-only figure, their idle figure
    (1116) against kvlayout's end to end one: 1800 kernel only is ahead, 1000 end to end behind, though 1000 would
    be 'behind' and 1800 'ahead' of either figure; a stale comparison stored by an older record is replaced."""
    row = _cuda_result(gbps=1000.0, kernel_gbps=1800.0, vs_peer="behind", vs_peer_kernel="behind",
                       peer="LMCache old", peer_gbps=1431.5, peer_pct=67.0)
    doc = {"environment": {"device": "cuda", "gpu": "NVIDIA H200"}, "limits": {"D2D": 2120.0}, "results": [row]}
    paths = write_reports(doc, str(tmp_path), "h200")
    (out,) = json.loads((tmp_path / "h200.json").read_text())["results"]
    assert (out["vs_peer_kernel"], out["peer_kernel_gbps"]) == ("ahead", 1700)
    assert (out["vs_peer_end_to_end"], out["peer_end_to_end_gbps"]) == ("behind", 1116)
    assert out["x_peer_kernel"] == pytest.approx(1800 / 1700) and "vs_peer" not in out and "peer" not in out
    md = (tmp_path / "h200.md").read_text()
    assert "LMCache: multi_layer_kv_transfer 1700.0 (80%): ahead 1.06×" in md
    assert "LMCache: multi_layer_kv_transfer 1116.0 (53%): behind 0.90×" in md
    assert "kernel only vs the peers' overlapped figure: ahead on 1 of 1 rows" in md
    assert "end to end vs the peers' idle figure: ahead on 0 of 1 rows, behind on 1" in md
    assert "`side_by_side_7d5fbfc` (2026-12-04" in md and any(p.endswith("h200.md") for p in paths)


def test_a_cpu_run_is_compared_with_no_peer():
    """The peers ran on an H200: a CPU row of the same job is not judged against them."""
    row = _cuda_result(gbps=20.0, limit_gbps=25.0)
    doc = load_peers().annotate({"environment": {"device": "cpu"}, "limits": {}, "results": [row]})
    assert not any(k.startswith(("peer", "vs_peer", "x_peer")) for k in doc["results"][0])


@pytest.mark.parametrize("stem", ["h200", "h200_headline", "h200_layerwise"])
def test_committed_records_render_with_the_current_peers(tmp_path, stem, capsys):
    doc = document(str(RESULTS / f"{stem}.jsonl"))
    write_reports(doc, str(tmp_path), stem)
    md = (tmp_path / f"{stem}.md").read_text()
    assert "end to end vs best peer idle" in md
    rows = json.loads((tmp_path / f"{stem}.json").read_text())["results"]
    assert not any("vs_peer" in r for r in rows)         # the stale single comparison is gone
    assert any("vs_peer_kernel" in r for r in rows)
    if stem in ("h200", "h200_headline"):
        assert any("vs_peer_end_to_end" in r for r in rows)


def test_merged_torch_baseline_where_the_layouts_allow_it_and_bit_exact():
    """The merged form (index_select over [planes*layers*slots, row] views, one copy_) runs beside the per-layer
    form for one-part caches against an all-layer chunk, in every direction; both match kvlayout byte for byte."""
    timer = Timer(torch.device("cpu"), warmup=0, reps=1)
    for dev, buf, shape in [("vllm_flash_attn_nhd", "lmcache_kv_2ltd", "L32_H8_D128"),
                            ("vllm_flash_attn_hnd", "lmcache_kv_2ltd", "L32_H8_D128"),
                            ("vllm_flashinfer_nhd", "lmcache_kv_2ltd", "L32_H1_D128"),
                            ("vllm_mla", "lmcache_kv_mla", "L32_MLA_D576")]:
        for direction in C.DIRECTIONS:
            case = C.Case("headline", shape, dev, buf, 24, 16, direction)
            data = C.build(case, C.Inputs(torch.device("cpu"), seed=3), min_cache_slots=128)
            assert set(C.torch_fns(case, data)) == {"per_layer", "merged"}, case.key
            assert check_bit_exact(case, data, timer), case.key
    # two-part caches (K and V apart), host pools with slots and one-layer calls: the per-layer form only
    for case in (C.Case("layouts", "L32_H1_D128", "sglang_mha", "lmcache_kv_2ltd", 24, 16, "to_host"),
                 C.Case("layouts", "L32_H1_D128", "vllm_flash_attn_nhd", "hicache_layer_first", 24, 16, "to_host"),
                 C.Case("layerwise", "L32_H1_D128", "vllm_flash_attn_nhd", "lmcache_kv_t2d", 24, 16, "to_host",
                        layerwise=True)):
        data = C.build(case, C.Inputs(torch.device("cpu"), seed=4), min_cache_slots=128)
        assert set(C.torch_fns(case, data)) == {"per_layer"}, case.key


def test_bit_exact_check_covers_each_torch_form(monkeypatch):
    """A merged form that moves nothing fails the check, though the per-layer form is right."""
    case = C.Case("headline", "L32_H1_D128", "vllm_flash_attn_nhd", "lmcache_kv_2ltd", 24, 16, "gather_device")
    data = C.build(case, C.Inputs(torch.device("cpu"), seed=5), min_cache_slots=128)
    timer = Timer(torch.device("cpu"), warmup=0, reps=1)
    assert check_bit_exact(case, data, timer)
    monkeypatch.setattr(C, "torch_merged_fn", lambda case, data: (lambda: None))
    data = C.build(case, C.Inputs(torch.device("cpu"), seed=5), min_cache_slots=128)
    assert not check_bit_exact(case, data, timer)


def test_new_length_rows_are_checked_call_by_call_against_the_kernel_engine(monkeypatch):
    """A new-length row's bytes: each of its check lengths (none of the lengths it times) moved by the row's call
    and by the kernel engine from the same start must match; a call that leaves its last token out fails."""
    from kvlayout.bench import run as bench_run

    T = C.NEW_LENGTHS + 24
    case = C.Case("staged", "L32_H1_D128", "vllm_flash_attn_nhd", "lmcache_kv_2ltd", T, 16, "to_host",
                  engine="kernel", call="new-length")      # (the CPU has no staged engine: the kernel stands in)
    assert set(C.new_length_checks(case)).isdisjoint(range(T - C.NEW_LENGTHS, T))
    data = C.build(case, C.Inputs(torch.device("cpu"), seed=6), min_cache_slots=256)
    timer = Timer(torch.device("cpu"), warmup=0, reps=1)
    assert bench_run.check_new_lengths(case, data, timer)
    real, seen = ops.transfer, []

    def short_of_one(src, dst, src_slots, dst_slots, **options):   # the row's call (each first of a pair) errs
        seen.append(src_slots.shape[0])
        if len(seen) % 2:
            src_slots = src_slots[:-1]
        real(src, dst, src_slots, dst_slots, **options)
    monkeypatch.setattr(ops, "transfer", short_of_one)
    assert not bench_run.check_new_lengths(case, data, timer)
    assert seen == [n for n in C.new_length_checks(case) for _ in range(2)]


def test_merged_torch_baseline_on_cuda_is_bit_exact(cuda_device):
    """On the device, with pinned host chunks: the merged form's permuted and cross-device copies move the same
    bytes as kvlayout, in every direction."""
    timer = Timer(torch.device(cuda_device), warmup=0, reps=1)
    for dev, buf, shape in [("vllm_flash_attn_nhd", "lmcache_kv_2ltd", "L32_H8_D128"),
                            ("vllm_flash_attn_hnd", "lmcache_kv_2ltd", "L32_H8_D128"),
                            ("vllm_mla", "lmcache_kv_mla", "L32_MLA_D576")]:
        for direction in C.DIRECTIONS:
            case = C.Case("headline", shape, dev, buf, 40, 16, direction)
            data = C.build(case, C.Inputs(torch.device(cuda_device), seed=6), min_cache_slots=256)
            assert "merged" in C.torch_fns(case, data), case.key
            assert check_bit_exact(case, data, timer), case.key


def test_cuda_bench_row_is_compared_with_the_peers_in_both_timings(cuda_device, tmp_path):
    only = "L32_H8_D128 T=256 ps=16 vllm_flash_attn_nhd->lmcache_kv_2ltd gather_device all layers ctas=default"
    doc = run(torch.device(cuda_device), quick=True, only=only)
    (row,) = doc["results"]
    assert row["bit_exact"] and row["kernel_gbps"] > 0 and {"torch_per_layer_gbps", "torch_merged_gbps"} <= set(row)
    write_reports(doc, str(tmp_path), "gpu")
    (out,) = json.loads((tmp_path / "gpu.json").read_text())["results"]
    assert out["vs_peer_kernel"] in ("ahead", "behind") and out["vs_peer_end_to_end"] in ("ahead", "behind")
    assert (out["peer_kernel_gbps"], out["peer_end_to_end_gbps"]) == (1700, 1116)
    assert "own_host_copy_gbps" not in row                             # (a device row)


def test_an_arena_hands_each_case_the_same_aligned_memory():
    """Arena: contiguous tensors of the asked shape and dtype, one after another in one buffer, each at a
    multiple of the alignment; reset(sizes) hands the same addresses out again, first replacing a buffer too
    small for all of ``sizes`` (by one of at least twice its size); a tensor beyond an unreserved buffer gets a
    new one, and tensors taken before keep their bytes."""
    arena = C.Arena(torch.device("cpu"), align=64)
    arena.reset([30, 28])
    a = arena.take((3, 5), torch.bfloat16)                        # 30 bytes at 0
    b = arena.take((7,), torch.int32)                             # 28 bytes at 64
    assert a.shape == (3, 5) and a.dtype == torch.bfloat16 and a.is_contiguous()
    assert b.data_ptr() - a.data_ptr() == 64 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert a.untyped_storage().nbytes() == 92
    a.fill_(1)
    b.fill_(2)
    arena.reset([30, 28])
    assert [arena.take((3, 5), torch.bfloat16).data_ptr(), arena.take((7,), torch.int32).data_ptr()] == \
        [a.data_ptr(), b.data_ptr()]
    arena.reset([30, 28, 400])                                    # 528 bytes: a new buffer holds all three
    c, d, e = arena.take((3, 5), torch.bfloat16), arena.take((7,), torch.int32), arena.take((100,), torch.int32)
    assert d.data_ptr() - c.data_ptr() == 64
    assert c.untyped_storage().data_ptr() == e.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert e.data_ptr() - c.data_ptr() == 128 and c.untyped_storage().nbytes() == 528
    assert torch.equal(b, torch.full((7,), 2, dtype=torch.int32))   # (the old buffer lives while b does)
    arena.reset()
    assert arena.take((100,), torch.int32).data_ptr() == c.data_ptr()
    beyond = arena.take((200,), torch.int32)                      # 800 bytes past 400, unreserved: a new buffer
    assert beyond.untyped_storage().nbytes() == 2 * 528 and beyond.data_ptr() != c.data_ptr()


def _check_cases_lie_in_their_arenas(inputs: C.Inputs, timer: Timer) -> None:
    """A gather's 33 device tensors (32 layers of the cache, the chunk) in one device-arena buffer at multiples
    of 2 MiB, in order; a load from the host beside it; the gather built again lies at the same addresses,
    random bits, and both move exactly."""
    gather = C.Case("headline", "L32_H1_D128", "vllm_flash_attn_nhd", "lmcache_kv_2ltd", 256, 16, "gather_device")
    load = C.Case("headline", "L32_MLA_D576", "vllm_mla", "lmcache_kv_mla", 256, 16, "from_host")

    def device_tensors(data):
        return [t for side in ("cache", "buffer") for t in data[side].tensors if not t.is_pinned()]

    data = C.build(gather, inputs, min_cache_slots=1024)
    tensors = device_tensors(data)
    base = tensors[0].untyped_storage().data_ptr()
    assert len(tensors) == 33 and all(t.untyped_storage().data_ptr() == base for t in tensors)
    offsets = [t.data_ptr() - base for t in tensors]
    assert offsets == sorted(offsets) and all(o % C.DEVICE_ALIGN == 0 for o in offsets), offsets
    assert check_bit_exact(gather, data, timer)
    addresses = [t.data_ptr() for t in tensors]
    del data, tensors
    moved = C.build(load, inputs, min_cache_slots=1024)
    assert moved["buffer"].tensors[0].storage_offset() == 0 and check_bit_exact(load, moved, timer)
    del moved
    data = C.build(gather, inputs, min_cache_slots=1024)
    assert [t.data_ptr() for t in device_tensors(data)] == addresses
    assert data["cache"].tensors[0].view(torch.int16).unique().numel() > 1000    # random bits, filled in place
    assert check_bit_exact(gather, data, timer)


def test_bench_case_tensors_lie_in_their_arenas():
    """The arenas' route on the CPU (a GPU run's arenas, unpinned): see _check_cases_lie_in_their_arenas."""
    inputs = C.Inputs(torch.device("cpu"), seed=7)
    inputs.device_arena, inputs.host_arena = C.Arena(inputs.device, C.DEVICE_ALIGN), \
        C.Arena(torch.device("cpu"), C.HOST_ALIGN)
    _check_cases_lie_in_their_arenas(inputs, Timer(torch.device("cpu"), warmup=0, reps=1))


def test_cuda_bench_case_tensors_lie_in_one_device_arena(cuda_device):
    """On a GPU run: device tensors in one device arena at multiples of 2 MiB, host tensors pinned."""
    inputs = C.Inputs(torch.device(cuda_device), seed=7)
    _check_cases_lie_in_their_arenas(inputs, Timer(torch.device(cuda_device), warmup=0, reps=1))
    data = C.build(C.Case("headline", "L32_H1_D128", "vllm_flash_attn_nhd", "lmcache_kv_2ltd", 256, 16, "to_host"),
                   inputs, min_cache_slots=1024)
    assert data["buffer"].tensors[0].is_pinned() and data["cache"].tensors[0].is_cuda


def test_cuda_bench_host_row_times_a_copy_of_its_own_host_memory(cuda_device):
    """A host row of a few MiB: beside the same-size copy of a fresh buffer (timed before the first case, kept in
    the run's header), a copy of the same size out of the case's own pinned host memory, both rates."""
    only = "L32_H1_D128 T=256 ps=16 vllm_flash_attn_nhd->lmcache_kv_2ltd from_host all layers ctas=default"
    doc = run(torch.device(cuda_device), quick=True, only=only)
    (row,) = [r for r in doc["results"] if r["key"] == only]
    assert row["bit_exact"] and row["own_host_copy_gbps"] > 0 and row["same_size_gbps"] > 0
    assert doc["same_size"] == {f"H2D_{row['payload_bytes']}": row["same_size_gbps"],
                                f"D2H_{row['payload_bytes']}": doc["same_size"][f"D2H_{row['payload_bytes']}"]}


def test_cuda_bench_rows_under_a_setting_are_exact_and_leave_it_as_it_was(cuda_device):
    """A host_hints row, a device-grid row (every SM's one 1024-thread CTA), a slot-chunks staged row, a
    device-launch staged row and a default staged row, run by the bench on the device: bit-exact, measured, the
    staged rows with their chunks and the nodes of the graph they replayed (the device-launch row's a conditional
    node's body); the settings are back to their defaults after."""
    from kvlayout import _C
    from kvlayout.ops import _native
    head = "L32_H1_D128 T=256 ps=16 vllm_flash_attn_nhd->lmcache_kv_2ltd"
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    keys = [f"{head} to_host all layers ctas=default default-hints", f"{head} gather_device all layers ctas={sms}",
            "L32_H1_D128 T=4096 ps=16 vllm_flash_attn_nhd->lmcache_kv_2ltd to_host all layers ctas=default staged "
            "slot-chunks",
            "L32_H1_D128 T=4096 ps=16 vllm_flash_attn_nhd->lmcache_kv_2ltd from_host all layers ctas=default staged "
            "device-launch",
            "L32_H1_D128 T=4096 ps=16 vllm_flash_attn_nhd->lmcache_kv_2ltd to_host all layers ctas=default staged"]
    doc = run(torch.device(cuda_device), quick=True, only=",".join(keys))
    rows = {r["key"]: r for r in doc["results"] if r["key"] in keys}   # (--only matches keys' beginnings too)
    assert sorted(rows) == sorted(keys)
    assert all(r["bit_exact"] and r["gbps"] > 0 and r["kernel_gbps"] > 0 for r in rows.values())
    staged = rows[keys[2]]
    # 64 MiB in slot-sized chunks of 32 MiB: two layer groups of one chunk each (no short chunk: staged_cut)
    assert staged["chunks"] == 2 and staged["graph_nodes"] > 0, staged
    on_device, default = rows[keys[3]], rows[keys[4]]
    assert on_device["graph_nodes"] > 0 and on_device["graph_on_device"], on_device
    # by default two layer groups of 2 chunks of 16 MiB, and the short chunk of 4 MiB at the pipeline's idle end
    # (the last from the host, the first to it; staged_chunk_tokens, staged_cut), each exact
    assert on_device["chunks"] == default["chunks"] == 5, (on_device, default)
    assert ops.cache_info()["staged_chunks"] == 8 and _native.host_cache_hints() == "streaming"
    assert not _C.staged_graph_on_device()


class _FixedTimer:
    """Stands in for a Timer: each callable's median is the seconds it was registered with."""

    cuda = False

    def __init__(self, seconds: dict):
        self.seconds = seconds

    def __call__(self, fn):
        s = self.seconds[fn]
        return Timing(s, s * 0.9, s * 1.2, 3)


def test_x_torch_is_against_the_faster_torch_form(monkeypatch):
    per_layer, merged = (lambda: None), (lambda: None)
    monkeypatch.setattr(C, "torch_fns", lambda case, data: {"per_layer": per_layer, "merged": merged})
    out = time_baseline(None, None, _FixedTimer({per_layer: 4e-3, merged: 1e-3}), 10**6, 5e-4)
    assert out["torch_form"] == "merged" and out["x_torch"] == pytest.approx(2.0)
    assert out["torch_gbps"] == pytest.approx(1.0) and out["torch_per_layer_gbps"] == pytest.approx(0.25)
    assert out["torch_spread"] == pytest.approx(0.3)
    monkeypatch.setattr(C, "torch_fns", lambda case, data: {"per_layer": per_layer})
    out = time_baseline(None, None, _FixedTimer({per_layer: 4e-3}), 10**6, 5e-4)
    assert out["torch_form"] == "per_layer" and out["x_torch"] == pytest.approx(8.0)


def test_cpu_run_fixes_the_thread_count_and_says_so():
    before = torch.get_num_threads()
    doc = run(torch.device("cpu"), quick=True, only=ONE_CASE)
    assert torch.get_num_threads() == before                       # restored after the run
    env = doc["environment"]
    assert env["threads"] == env["baseline_threads"] == CPU_THREADS
    from kvlayout.conformance.environment import source_digest
    assert env["source_digest"] == source_digest()        # the code that ran, whatever the copy's .git says
    (row,) = doc["results"]
    assert row["torch_form"] in ("per_layer", "merged") and {"torch_per_layer_gbps", "torch_merged_gbps"} <= set(row)
    text = markdown(doc)
    assert f"Threads: kvlayout ran on {CPU_THREADS} and the torch baseline on {CPU_THREADS} thread" in text
    assert "calibration" not in env and "Calibration" not in text      # (a CUDA run's)


def test_a_cuda_records_calibration_is_one_line_of_its_reports():
    """The device calibration a CUDA run records (ops.calibrate, in its environment) is said in one line of the
    terminal table and of the Markdown report, not as a raw dict in the environment line; a record without one
    says nothing."""
    doc = document(str(pathlib.Path(__file__).resolve().parents[1] / "bench" / "results" / "h100_adb7620"
                       / "staged_settings.jsonl"))
    text, table = markdown(doc), terminal_table(doc)
    line = ("Calibration (ops.calibrate), the kernel against the copy engine on pinned host memory: to host "
            "0.93x (51.1 against 54.9 GB/s); from host 0.92x")
    assert line in text and line in table and "'sm_slow'" not in text
    del doc["environment"]["calibration"]
    assert "Calibration" not in markdown(doc)


def test_a_loaded_machine_is_flagged_by_the_baseline_spread():
    row = {"group": "headline", "shape": "L32_H1_D128", "device_layout": "vllm_flash_attn_nhd",
           "buffer_layout": "lmcache_kv_2ltd", "T": 256, "page_size": 16, "direction": "gather_device",
           "layerwise": False, "max_ctas": 0, "bit_exact": True, "gbps": 20.0, "limit_gbps": 20.0,
           "pct_of_limit": 100.0, "torch_gbps": 2.0, "x_torch": 10.0, "torch_spread": 0.2}
    doc = {"environment": {"device": "cpu", "threads": 1, "baseline_threads": 1}, "limits": {"D2D": 20.0},
           "results": [row, dict(row, torch_spread=3.5)]}
    assert "the machine was loaded" in markdown(doc) and "WARNING: the torch baseline's spread" in terminal_table(doc)
    assert "on 1 of 2 rows (up to 350%)" in markdown(doc)
    quiet = dict(doc, results=[row])
    assert "the machine was loaded" not in markdown(quiet) and "WARNING" not in terminal_table(quiet)


def _cpu_rows(layouts=("vllm_flash_attn_nhd", "vllm_flash_attn_hnd")) -> list[dict]:
    return [{"group": "headline", "shape": "L32_H1_D128", "device_layout": dev, "buffer_layout": "lmcache_kv_2ltd",
             "T": T, "page_size": 16, "direction": d, "layerwise": False, "max_ctas": 0, "bit_exact": True,
             "gbps": float(T // 256 + i), "limit_gbps": 20.0, "pct_of_limit": 5.0 * (T // 256 + i)}
            for i, dev in enumerate(layouts) for T in (256, 4096) for d in ("gather_device", "scatter_device")]


def test_plot_lines_keep_layouts_apart():
    lines = series(_cpu_rows(), "T", ("gather_device", "scatter_device"))
    assert len(lines) == 4                                  # NHD and HND, gather and scatter: never one zigzag
    for label, points in lines.items():
        assert [T for T, _ in points] == [256, 4096], label
    assert series(_cpu_rows(), "T", ("to_host", "from_host")) == {}


def test_a_plot_that_cannot_be_drawn_says_why(tmp_path, monkeypatch, capsys):
    doc = {"environment": {"device": "cpu"}, "limits": {"D2D": 20.0}, "results": _cpu_rows()}
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # as if it were not installed
    paths, skipped = plots(doc, str(tmp_path), "cpu")
    assert paths == [] and any("cpu_tokens.png: matplotlib is not installed" in s for s in skipped)
    assert any("cpu_ctas.png: the run has no measured CTA-budget" in s for s in skipped)
    write_reports(doc, str(tmp_path), "cpu")
    err = capsys.readouterr().err
    assert "kvlayout bench: no plot cpu_tokens.png: matplotlib is not installed (pip install matplotlib)" in err


def test_cpu_plot_has_no_empty_panel_and_no_warning(tmp_path):
    pytest.importorskip("matplotlib")
    doc = {"environment": {"device": "cpu"}, "limits": {"D2D": 20.0}, "results": _cpu_rows()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)         # a leaked matplotlib warning fails the test
        paths, _ = plots(doc, str(tmp_path), "cpu")
    assert paths == [str(tmp_path / "cpu_tokens.png")]
    width = struct.unpack(">I", (tmp_path / "cpu_tokens.png").read_bytes()[16:20])[0]
    assert width < 800                                        # one panel (6.5 in at 110 dpi), not two


def _cli(*argv) -> int:
    from kvlayout.cli import main

    return main(["bench", *argv])


def test_only_matching_nothing_is_a_usage_error_that_keeps_previous_results(tmp_path, capsys):
    previous = tmp_path / "cpu.jsonl"
    previous.write_text('{"kind": "run"}\n')
    assert _cli("--device", "cpu", "--only", "no such case", "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("kvlayout bench: --only 'no such case' selects none of the")
    assert previous.read_text() == '{"kind": "run"}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["cpu.jsonl"]


def test_an_unwritable_out_is_a_usage_error(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for out in (blocker, blocker / "sub"):
        assert _cli("--device", "cpu", "--only", "host_cost", "--out", str(out)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"kvlayout bench: --out {out}: ")


@pytest.mark.slow   # CPU only: the transfers themselves are covered by the ops tests and conformance
def test_every_planned_case_builds_and_matches_the_baseline_on_small_data():
    """Each layout pair and direction of the GPU plan, shrunk: kvlayout and the baseline agree byte for byte."""
    timer = Timer(torch.device("cpu"), warmup=0, reps=1)
    seen = set()
    for case in C.plan_cases(quick=False):
        if case.engine == "staged":
            continue   # needs CUDA and pinned memory: tests/test_staged.py
        small = C.Case(case.group, "L32_H1_D128" if not C.SHAPES[case.shape].mla else case.shape,
                       case.device_layout, case.buffer_layout, 32, min(case.page_size, 16), case.direction,
                       case.layerwise, engine=case.engine)
        key = (small.shape, small.device_layout, small.buffer_layout, small.page_size, small.direction, small.layerwise,
               small.engine)
        if key in seen:
            continue
        seen.add(key)
        data = C.build(small, C.Inputs(torch.device("cpu"), seed=len(seen)), min_cache_slots=256)
        assert check_bit_exact(small, data, timer), small.key


def test_ncu_profile_cases_are_bench_rows_and_counters_fold_per_case():
    from kvlayout.bench import profile as P

    planned = {c.key for c in C.plan_cases(quick=False)}
    profiled = P.profile_cases()
    assert all(c.key in planned for c in profiled)   # every profiled case is a measured bench row
    assert len({c.key for c in profiled}) == len(profiled)
    # the host rows at T = 256 that trail the peers are among them, both directions, every headline shape
    assert {(c.shape, c.direction) for c in profiled if c.T == 256 and c.direction.endswith("_host")} == {
        (shape, d) for shape in ("L32_H8_D128", "L32_H1_D128", "L32_MLA_D576") for d in ("to_host", "from_host")}
    text = "\n".join([
        "==PROF== Connected to process 1",
        '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes_write.sum",'
        '"l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum","l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",'
        '"smsp__warp_issue_stalled_drain_per_warp_active.pct",'
        '"smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct"',
        '"","","nsecond","byte","byte","sector","request","%","%"',
        '"0","copy_rows_kernel","1,000","3000","1000","40","10","10","60"',
        '"1","copy_rows_kernel","3,000","9000","3000","40","10","30","20"',
    ])
    kernels = P._parse_raw_csv(text)
    assert [k["ID"] for k in kernels] == [0.0, 1.0]            # the units row and ncu's own lines are dropped
    s = P._summary(kernels)
    assert s["kernels"] == 2 and s["time_us"] == 4.0
    assert s["dram_read_gbps"] == 3.0 and s["dram_write_gbps"] == 1.0   # bytes / ns = GB/s over both kernels
    assert s["ld_sectors_per_request"] == 4.0
    # stall shares are weighted by kernel time (drain: (10*1 + 30*3) / 4 = 25) and sorted, largest first
    assert list(s["stalls_pct"].items()) == [("long_scoreboard", 30.0), ("drain", 25.0)]


def test_a_profiled_process_gives_its_counters_or_its_error(tmp_path):
    """profile.profiled runs one Python process under ncu (a stand-in here that prints ncu's raw CSV) and folds
    its kernels, or keeps the process's output where no counters came; both tables' cells come from it."""
    from kvlayout.bench import profile as P
    from kvlayout.bench import side_by_side

    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\n"
                    "case \"$*\" in *fail*) echo 'no kernels profiled' >&2; exit 3;; esac\n"
                    "echo '\"ID\",\"Kernel Name\",\"gpu__time_duration.sum\",\"launch__grid_size\"'\n"
                    "echo '\"\",\"\",\"nsecond\",\"\"'\n"
                    "echo '\"0\",\"copy_rows_kernel\",\"2,000\",\"132\"'\n")
    fake.chmod(0o755)
    metrics = [P.METRICS["time_ns"], P.METRICS["grid"]]
    row = P.profiled(str(fake), metrics, ["-c", "pass"])
    assert row["returncode"] == 0 and row["kernels"] == 1 and row["time_us"] == 2.0 and row["grid"] == 132.0
    cells = P.ncu_cells({"key": "L32_H8_D128 T=256 ps=16 a->b to_host all layers ctas=default", **row})
    assert cells[:3] == ["L32_H8_D128 T=256 to_host ctas=default", "2.0", "132"]
    assert side_by_side._ncu_cells({"case": "c", "call": "LMCache", **row})[:5] == ["c", "LMCache", "1", "2.0", "132"]
    failed = P.profiled(str(fake), metrics, ["-c", "fail"])
    assert failed["returncode"] == 3 and "no kernels profiled" in failed["error"]
    assert side_by_side._ncu_cells({"case": "c", "call": "kvlayout", **failed}) == \
        ["c", "kvlayout", "–", "no counters (exit 3)"] + ["–"] * (len(P.COUNTER_HEADER) - 1)


def test_readme_tables_come_from_the_recorded_run(capsys):
    """The README's performance tables are printed from the committed H200 run (kvlayout.bench.summary), with
    kvlayout's standing against the peers per timing."""
    from kvlayout.bench import summary

    assert summary.main([str(RESULTS / "h200.jsonl")]) == 0
    out = capsys.readouterr().out
    rows = [r for r in document(str(RESULTS / "h200.jsonl"))["results"] if r["group"] == "headline"]
    some = next(r for r in rows if r["shape"] == "L32_H8_D128" and r["T"] == 4096 and r["direction"] == "to_host")
    assert (f"| L32_H8_D128 | vllm_flash_attn_nhd->lmcache_kv_2ltd | 4096 | to_host | {some['gbps']:.1f} "
            f"({some['pct_of_limit']:.0f}%) |") in out
    assert "Against the best peer, kernel only vs the peers' overlapped figure: ahead on " in out
    assert "end to end vs the peers' idle figure: ahead on " in out
    assert "one prepared layer call" in out and "<!-- Staged -->" in out


def test_host_cost_calls_are_timed_in_turn_with_their_yardsticks():
    """The host_cost rows time kvlayout, one torch op and a bare launch in turn within each repetition (a
    machine whose speed drifts slows them alike), each callable warmup + reps times; an all-layer row repeats
    its call as often as a layer-wise one."""
    order = []
    timer = Timer(torch.device("cpu"), warmup=2, reps=5)
    medians = timer.host_side_by_side({"a": lambda: order.append("a"), "b": lambda: order.append("b")})
    assert order == ["a", "a", "b", "b"] + ["a", "b"] * 5
    assert set(medians) == {"a", "b"} and all(m >= 0 for m in medians.values())
    case = next(c for c in C.host_cost_cases("gather_device") if not c.layerwise)
    assert case.calls == C.SHAPES[case.shape].L
    data = C.build(case, C.Inputs(torch.device("cpu")), min_cache_slots=2 * case.T)   # (no 1 GiB cache to fill)
    row = measure_case(case, data, timer, timer, {}, None)
    assert row["bit_exact"] and row["x_torch_op"] == row["host_us_per_call"] / row["torch_op_host_us"]
    assert row["host_us"] == pytest.approx(row["host_us_per_call"] * case.calls)


def test_host_cost_rows_that_bind_per_call_move_what_the_plain_call_moves(monkeypatch):
    """The "bind-per-call" row binds both caches anew at every call and the "gather" row gathers into a view of
    the buffer made at every call; with rows to move (the same cases filled) both match the torch baseline byte
    for byte, as the plain all-layer row does."""
    timer = Timer(torch.device("cpu"), warmup=0, reps=1)
    binds, outs = [], []
    real_bind, real_gather = ops.bind, ops.gather
    monkeypatch.setattr(ops, "bind", lambda *a, **k: binds.append(a[1]) or real_bind(*a, **k))
    monkeypatch.setattr(ops, "gather", lambda *a, out, **k: outs.append(out) or real_gather(*a, out=out, **k))
    for call in ("bind-per-call", "gather"):
        case = next(c for c in C.host_cost_cases("gather_device") if c.call == call and not c.layerwise)
        full = dataclasses.replace(case, empty=False)
        data = C.build(full, C.Inputs(torch.device("cpu")), min_cache_slots=2 * case.T)
        binds.clear()
        outs.clear()
        assert check_bit_exact(full, data, timer), call
        buffer = data["buffer"].tensors[0]
        if call == "bind-per-call":
            assert len(binds) == 2 * case.calls and not outs
        else:
            assert len(outs) == case.calls and len({id(o) for o in outs}) == case.calls
            assert all(o is not buffer and o.data_ptr() == buffer.data_ptr() for o in outs)


def test_host_profile_script_times_a_bench_row_and_lists_its_events():
    """scripts/host_profile.py builds a bench row, times its calls on the host and lists profiler events per
    call (none of the copy's own on the CPU, where the call is one C++ call outside torch's operators)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kvlayout.bench import cases as C
    key = C.cpu_cases()[0].key
    script = Path(__file__).resolve().parents[1] / "scripts" / "host_profile.py"
    out = subprocess.run([sys.executable, str(script), key, "--device", "cpu", "--calls", "3"], capture_output=True,
                         text=True, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
    assert f"{key}: host " in out and "µs per call (median of 3" in out and "host µs per call" in out
    bad = subprocess.run([sys.executable, str(script), "no such row", "--device", "cpu"], capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "no bench case 'no such row' on cpu" in bad.stderr


def _script(name: str):
    """scripts/NAME.py loaded as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).resolve().parents[1] / "scripts" /
                                                  f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_binding_cost_script_times_calls_with_tensors_bound_per_call(capsys):
    """scripts/binding_cost.py times, beside one torch op, the calls an adapter makes with tensors it binds at
    every call (ops.transfer, ops.prepare and ops.gather, the LMCache and SGLang entry points) and the repeated
    call on kept caches; each moves nothing (every slot -1), so the caches are left as they were."""
    binding_cost = _script("binding_cost")
    fns = binding_cost.calls(torch.device("cpu"))
    assert list(fns)[-1] == "torch op" and len(fns) == 9
    assert binding_cost.main(["--reps", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-5:] == ["host", "µs", "×", "torch", "op"] and len(lines) == 1 + len(fns)
    assert [line[:34].strip() for line in lines[1:]] == list(fns)
    assert lines[-1].split()[-1] == "1.00×" and all(float(line.split()[-2]) > 0 for line in lines[1:])


def test_host_path_script_splits_an_all_layer_call_into_its_parts():
    """scripts/host_path.py times an all-layer call, its C++ call alone, that call launching nothing and a torch
    op, warm and idle, and gives the Python and launch parts as the differences of those figures; a row that
    is not an all-layer kernel row (the copy engine's, a layer-wise one) is refused with the reason."""
    host_path = _script("host_path")
    (key,) = host_path.DEFAULT_KEYS["cpu"]
    case = next(c for c in C.cpu_cases() if c.key == key)
    fns = host_path.parts(case, torch.device("cpu"))
    assert list(fns) == ["ops.transfer", "kernel engine", "C++ call", "C++ checks", "torch op"]
    assert fns["C++ call"]() is True and fns["C++ checks"]() is True     # (run_checking: done, not declined)
    warm, idle = host_path.measure(fns, torch.device("cpu"), reps=3)
    assert set(warm) == set(idle) == set(fns) and all(v > 0 for v in [*warm.values(), *idle.values()])
    text = host_path.report(key, {"ops.transfer": 2.0, "C++ call": 1.25, "C++ checks": 0.5, "torch op": 2.5},
                            {"ops.transfer": 3.0, "C++ call": 2.0, "C++ checks": 1.0, "torch op": 3.0})
    lines = text.splitlines()
    assert lines[0] == key and lines[-2].split()[:3] == ["Python", "0.75", "1.00"]
    assert lines[-1].split()[:3] == ["launch", "0.75", "1.00"]
    with_kernel = host_path.report(key, {"ops.transfer": 2.0, "kernel engine": 1.5, "C++ call": 1.25,
                                                "C++ checks": 0.5},
                                   {"ops.transfer": 3.0, "kernel engine": 2.0, "C++ call": 2.0, "C++ checks": 1.0})
    assert with_kernel.splitlines()[-3].split()[:3] == ["auto", "0.50", "1.00"]
    copy = C.Case("copy_engine", "L32_H8_D128", "vllm_flash_attn_nhd", "hicache_page_first_direct", 256, 16,
                  "gather_device", engine="copy")
    layerwise = next(c for c in C.cpu_cases() if c.layerwise)
    for row in (copy, layerwise):
        with pytest.raises(SystemExit, match="not an all-layer kernel row"):
            host_path.parts(row, torch.device("cpu"))


def test_host_path_script_times_autos_rule_alone_for_a_pair_that_could_be_staged(monkeypatch):
    """For a pair auto decides each call for (one that could be staged: no such pair on a CPU, so a CPU pair's
    choice is made to look like one, with a plan that cannot be staged), the script also times that decision."""
    from kvlayout.ops import staged
    from kvlayout.ops.arguments import CheckedChoice
    host_path = _script("host_path")
    (key,) = host_path.DEFAULT_KEYS["cpu"]
    case = next(c for c in C.cpu_cases() if c.key == key)
    made = []
    original = CheckedChoice.bind

    def looks_stageable(self, bound):      # (each choice as it binds: never_staged unknown, a plan kept)
        original(self, bound)
        self.never_staged, self.staged_plan = 0, (staged.STAGING_BYTES, staged.StagedPlan("cannot"))
        made.append(self)
    monkeypatch.setattr(CheckedChoice, "bind", looks_stageable)
    fns = host_path.parts(case, torch.device("cpu"))
    assert made and list(fns) == ["ops.transfer", "kernel engine", "C++ call", "C++ checks", "auto's rule",
                                  "torch op"]
    assert fns["auto's rule"]() is True           # (the kernel: the plan cannot be staged)


def test_host_profile_lists_the_calls_events_without_its_own_syncs():
    """The events listed are the largest by host self time, the script's synchronizations between the calls
    (which wait for the device) left out."""
    import types

    host_profile = _script("host_profile")
    event = lambda key, us: types.SimpleNamespace(key=key, count=1, self_cpu_time_total=us)   # noqa: E731
    averages = [event("cudaMemcpyAsync", 9.0), event("cudaDeviceSynchronize", 900.0),
                event("cudaGraphLaunch", 40.0), event("cudaStreamSynchronize", 50.0), event("aten::empty", 1.0)]
    assert [e.key for e in host_profile.host_events(averages, 2)] == ["cudaGraphLaunch", "cudaMemcpyAsync"]


def test_host_profile_timeline_splits_a_calls_device_time_around_its_copies():
    """scripts/host_profile.py --timeline: a call's device time split into before its first copy, the copies
    running (overlapping copies counted once), the gaps between them and after the last."""
    summary = _script("host_profile").timeline_summary

    def act(start, end, copy=False, nbytes=0):
        return {"name": "Memcpy DtoH" if copy else "kernel", "stream": 7, "start": start, "end": end,
                "bytes": nbytes, "copy": copy}

    acts = [act(0, 4), act(3, 10), act(10, 30, True, 2000), act(25, 40, True, 3000), act(45, 50, True, 500),
            act(50, 52)]
    assert summary(acts) == {"span": 52, "before_copies": 10, "copying": 35, "gaps": 5, "after_copies": 2,
                             "copy_bytes": 5500, "copies": 3}
    assert summary([act(0, 4)])["before_copies"] == 4 and summary([])["span"] == 0


def test_host_profile_picks_a_records_slowest_rows_over_the_bound(tmp_path):
    """scripts/host_profile.py --record: the rows of the group (and of --call, where given) whose host time per
    call was over the bound, slowest first, at most --rows of them; nothing else (other groups, other calls, rows
    at the bound, the header)."""
    host_profile = _script("host_profile")
    rows = [{"kind": "run"}, {"kind": "case", "group": "staged", "key": "a", "host_us_per_call": 60.0,
                              "call": "transfer"},
            {"kind": "case", "group": "staged", "key": "b", "host_us_per_call": 50.0, "call": "transfer"},
            {"kind": "case", "group": "staged", "key": "c", "host_us_per_call": 700.0, "call": "direct"},
            {"kind": "case", "group": "headline", "key": "d", "host_us_per_call": 900.0, "call": "transfer"},
            {"kind": "case", "group": "staged", "key": "e", "host_us_per_call": 80.0, "call": "transfer"}]
    record = tmp_path / "r.jsonl"
    record.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert host_profile.keys_over(str(record), "staged", 50.0, 8) == ["c", "e", "a"]
    assert host_profile.keys_over(str(record), "staged", 50.0, 2) == ["c", "e"]
    assert host_profile.keys_over(str(record), "staged", 50.0, 8, call="transfer") == ["e", "a"]   # replayed only


def test_copy_engine_rows_time_their_run_list_apart_from_the_call():
    """A copy-engine row also holds its run list's length and the host time to build it (the C++ the call runs
    before the driver's copy call), which the performance targets judge, and, where that list is shorter than
    the target's unit, the same for a list of at least 8,192 copies."""
    case = C.Case("copy_engine", "L32_H1_D128", "vllm_flash_attn_nhd", "hicache_page_first_direct", 64, 16,
                  "to_host", engine="copy")
    data = C.build(case, C.Inputs(torch.device("cpu")), min_cache_slots=256)
    timer = Timer(torch.device("cpu"), warmup=0, reps=1)
    row = measure_case(case, data, timer, timer, {"D2D": 1.0}, None)
    assert row["bit_exact"] and row["runs"] == (64 // 16) * 32 * 2 and row["run_list_us"] > 0
    assert row["run_list_spread"] >= 0        # (the builds' (p90 - p10) / median: a busy host's mark)
    # the row's list (256 copies) is shorter than the target's 8,192: the same case at 32x the tokens is timed
    assert row["runs_at_target"] == 8192 and row["run_list_at_target_us"] > 0
    assert row["run_list_at_target_spread"] >= 0


def test_staged_rows_show_their_chunks_and_graph_nodes():
    """The staged table gives each row's chunks and the nodes of the graph its calls replay ("direct" where it
    was issued directly; "–" for a record made before the bench counted them)."""
    from kvlayout.bench import summary

    base = {"group": "staged", "shape": "L32_H8_D128", "T": 4096, "direction": "to_host", "max_ctas": 0,
            "gbps": 50.0, "limit_gbps": 55.0, "kernel_gbps": 51.0, "host_us": 240.0}
    rows = [dict(base, chunks=16, graph_nodes=49), dict(base, call="direct", chunks=16, graph_nodes=0), dict(base)]
    table = summary.staged(rows).splitlines()
    assert "chunks / graph nodes" in table[0]
    assert [line.split(" | ")[8] for line in table[2:]] == ["16 / 49", "16 / direct", "–"]


def test_device_rows_under_every_sm_sit_beside_the_default_grid():
    """The device-grid table: each on-device ctas row (one 1024-thread CTA per SM) beside the headline row of
    the same case, the kernel-only ratio default / budgeted (above 1: the budgeted grid is faster); host rows
    of the ctas group are not in it. Without a CUDA device no such case is planned."""
    from kvlayout.bench import summary

    base = {"shape": "L32_H8_D128", "T": 256, "direction": "gather_device", "limit_gbps": 3000.0}
    rows = [dict(base, group="headline", max_ctas=0, gbps=1500.0, kernel_gbps=1600.0, kernel_us=20.0),
            dict(base, group="ctas", max_ctas=132, gbps=1650.0, kernel_gbps=1760.0, kernel_us=16.0),
            dict(base, group="ctas", max_ctas=4, direction="to_host", gbps=40.0, kernel_gbps=41.0, kernel_us=9.0)]
    table = summary.device_grid(rows).splitlines()
    assert len(table) == 3 and table[2].split(" | ")[3] == "132" and table[2].endswith("| 1.25× |")
    if not torch.cuda.is_available():
        assert not [c for c in C.plan_cases(quick=False) if c.group == "ctas" and c.direction.endswith("_device")]


def test_slot_chunk_rows_run_their_calls_in_slot_sized_chunks():
    """The staged rows in slot-sized chunks ("slot-chunks": L32 shapes, T = 4096, both directions, without a
    budget and under 4 SMs) run their call, and ops.explain's counts, under ops.set_staged_chunks(1), and
    leave the setting as it was; no peer is matched to them."""
    from kvlayout.bench import peers as P

    planned = [c for c in C.plan_cases(quick=False) if c.call == "slot-chunks"]
    assert len(planned) == 12 and {(c.T, c.max_ctas, c.engine) for c in planned} == {(4096, 0, "staged"),
                                                                                       (4096, 4, "staged")}
    assert all(c.key.endswith(" staged slot-chunks") for c in planned)
    seen = []
    call = C._with_setting(planned[0], lambda: seen.append(ops.cache_info()["staged_chunks"]))
    call()
    assert seen == [1] and ops.cache_info()["staged_chunks"] == 8
    assert P.load_peers().matching(planned[0]) == []


def test_device_launch_rows_replay_a_graph_launched_on_the_device():
    """The staged device-launch rows (the three L32 shapes, both host directions, T >= 4096 without a budget and
    T = 4096 under 4 SMs) run their call under ops.set_staged_graph_launch("device") and restore the setting,
    also when the call raises; no peer is matched to them; the staged table marks a graph run as a conditional
    node's body."""
    from kvlayout import _C
    from kvlayout.bench import peers as P
    from kvlayout.bench import summary

    planned = [c for c in C.plan_cases(quick=False) if c.call == "device-launch"]
    assert {(c.shape, c.T, c.direction, c.max_ctas) for c in planned} == {
        (shape, T, direction, ctas) for shape in ("L32_H8_D128", "L32_H1_D128", "L32_MLA_D576")
        for direction in ("to_host", "from_host") for T, ctas in ((4096, 0), (32768, 0), (4096, 4))}
    assert len(planned) == 18 and all(c.engine == "staged" and c.key.endswith(" staged device-launch")
                                      for c in planned)
    seen = []
    C._with_setting(planned[0], lambda: seen.append(_C.staged_graph_on_device()))()
    assert seen == [True] and not _C.staged_graph_on_device()

    def fails():
        raise RuntimeError("a failed call")
    with pytest.raises(RuntimeError, match="a failed call"):
        C._with_setting(planned[0], fails)()
    assert not _C.staged_graph_on_device()
    assert P.load_peers().matching(planned[0]) == []
    base = {"group": "staged", "shape": "L32_H8_D128", "T": 4096, "direction": "to_host", "max_ctas": 0,
            "gbps": 50.0, "limit_gbps": 55.0, "kernel_gbps": 51.0, "host_us": 20.0, "call": "device-launch"}
    rows = [dict(base, chunks=16, graph_nodes=49, graph_on_device=True),
            dict(base, chunks=16, graph_nodes=49, graph_on_device=False)]   # (the runtime refused the body)
    table = summary.staged(rows).splitlines()
    assert [line.split(" | ")[8] for line in table[2:]] == ["16 / 49 in a conditional", "16 / 49"]
    assert all("to_host, graph launched on the device" in line for line in table[2:])


def test_new_length_rows_call_lengths_the_engine_has_not_run_under_prefix_reuse(monkeypatch):
    """The staged new-length rows (the three L32 shapes, both host directions, T >= 4096 without a budget): each
    call moves the first T - i tokens, i = 1 ... NEW_LENGTHS in turn, more lengths than the engine remembers, under
    ops.set_staged_graph_reuse("prefix") (restored after, also when the call raises); the row's bytes are its
    calls' mean; no peer is matched to them; the staged table says the graph is a prefix's."""
    from kvlayout import _C
    from kvlayout.bench import peers as P
    from kvlayout.bench import summary

    planned = [c for c in C.plan_cases(quick=False) if c.call == "new-length"]
    assert {(c.shape, c.T, c.direction, c.max_ctas) for c in planned} == {
        (shape, T, direction, 0) for shape in ("L32_H8_D128", "L32_H1_D128", "L32_MLA_D576")
        for direction in ("to_host", "from_host") for T in (4096, 32768)}
    assert all(c.engine == "staged" and c.key.endswith(" staged new-length") for c in planned)
    assert C.NEW_LENGTHS > 16                     # (a staged engine remembers 16 shapes run once)
    case = planned[0]
    whole = dataclasses.replace(case, call="transfer")
    assert case.payload_bytes() * case.T == pytest.approx(whole.payload_bytes() * (case.T - (C.NEW_LENGTHS + 1) / 2))
    moved = []

    def transfer(src, dst, src_slots, dst_slots, **options):
        moved.append(((src_slots if src_slots is not None else dst_slots).shape[0], _C.staged_graph_prefixes(),
                      options))
    monkeypatch.setattr(C.ops, "transfer", transfer)
    slots = torch.arange(case.T)
    for to_host in (True, False):
        moved.clear()
        ss, ds = (slots, None) if to_host else (None, slots)
        call = C._with_setting(case, C._new_lengths_fn(case, "src", ss, "dst", ds))
        for _ in range(C.NEW_LENGTHS + 2):
            call()
        lengths = [n for n, _, _ in moved]
        assert lengths == [case.T - i for i in range(1, C.NEW_LENGTHS + 1)] + [case.T - 1, case.T - 2]
        assert all(prefixes and options == {"max_ctas": 0, "engine": "staged"} for _, prefixes, options in moved)
        assert not _C.staged_graph_prefixes()

    def fails():
        raise RuntimeError("a failed call")
    with pytest.raises(RuntimeError, match="a failed call"):
        C._with_setting(case, fails)()
    assert not _C.staged_graph_prefixes()
    assert P.load_peers().matching(case) == []
    base = {"group": "staged", "shape": "L32_H8_D128", "T": 4096, "direction": "to_host", "max_ctas": 0,
            "gbps": 50.0, "limit_gbps": 55.0, "kernel_gbps": 51.0, "host_us": 20.0, "call": "new-length"}
    rows = [dict(base, chunks=16, graph_nodes=46, graph_tokens=3840),
            dict(base, chunks=16, graph_nodes=0, graph_tokens=0)]    # (no prefix kept: issued directly)
    table = summary.staged(rows).splitlines()
    assert [line.split(" | ")[8] for line in table[2:]] == ["16 / 46 of 3840 tokens", "16 / direct"]
    assert all("to_host, new lengths" in line for line in table[2:])


def test_spread_rows_time_passes_over_lengths_of_three_octaves_with_more_prefixes_than_kept_graphs(monkeypatch):
    """The staged spread rows (the three L32 shapes, both host directions, T = 4096), under prefix reuse
    ("spread-length") and under "exact" ("spread-exact", every call issued directly): NEW_LENGTHS distinct lengths
    from T / 8 up, shuffled, none of them a check length or the length the row's counts explain; their reuse
    prefixes outnumber the graphs a transfer keeps, so the prefix row measures captures that evict each other.
    One timed repetition is a pass over every length (NEW_LENGTHS calls, each under the row's setting, restored
    after), its bytes the pass's, so that the row's rate and host time per call are those of the pass; no peer is
    matched to them, and the targets name them beside the new-length rows."""
    from kvlayout import _C
    from kvlayout.bench import peers as P
    from kvlayout.bench import targets

    planned = [c for c in C.plan_cases(quick=False) if c.call in C.SPREAD_CALLS]
    assert sorted((c.shape, c.T, c.direction, c.max_ctas, c.call) for c in planned) == sorted(
        (shape, 4096, direction, 0, call) for shape in ("L32_H8_D128", "L32_H1_D128", "L32_MLA_D576")
        for direction in ("to_host", "from_host") for call in C.SPREAD_CALLS)
    for case in planned[:2]:
        lengths = C.call_lengths(case)
        assert len(set(lengths)) == C.NEW_LENGTHS == case.calls and lengths != sorted(lengths)
        assert min(lengths) == case.T // 8 and max(lengths) < min(C.new_length_checks(case)) - 1
        prefixes = {_C.staged_reuse_prefix(n, 0) for n in lengths} - {0}
        assert len(prefixes) > 2 * _C.staged_graph_capacity()
        whole = dataclasses.replace(case, call="transfer")
        assert case.payload_bytes() == round(whole.payload_bytes() * sum(lengths) / case.T)
        moved = []
        monkeypatch.setattr(C.ops, "transfer", lambda src, dst, ss, ds, **options: moved.append(
            ((ss if ss is not None else ds).shape[0], _C.staged_graph_prefixes())))
        repetition = C._with_setting(case, C._new_lengths_fn(case, "src", torch.arange(case.T), "dst", None))
        repetition()
        repetition()
        prefix = case.call == "spread-length"
        assert moved == [(n, prefix) for n in lengths + lengths] and not _C.staged_graph_prefixes()
        assert P.load_peers().matching(case) == []
        row = {"group": "staged", "engine": "staged", "shape": case.shape, "T": case.T, "direction": case.direction,
               "max_ctas": 0, "call": case.call, "gbps": 50.0, "host_us_per_call": 80.0, "chunks": 16,
               "graph_nodes": 49, "graph_tokens": 3840}
        [check] = [c for c in targets.checks({"results": [row]}) if "over three octaves" in c.row]
        assert check.target == "staged host work, new length" and not check.met
        assert check.row.endswith(", own graphs only)") != prefix


def test_host_hint_rows_run_the_kernel_with_the_default_cache_operators():
    """The host_hints rows (L32 shapes, both host directions, T = 256 and 4096, without a budget and under 1 and
    4 SMs) run their call under ops.set_host_cache_hints("default") and restore the setting; no peer is
    matched to them, no torch baseline timed (their twins have it); the summary sets each beside its twin
    with streaming hints (the headline row, or the ctas row under a budget)."""
    from kvlayout.bench import peers as P
    from kvlayout.bench import summary
    from kvlayout.ops import _native

    planned = [c for c in C.plan_cases(quick=False) if c.group == "host_hints" and c.call == "default-hints"]
    assert len(planned) == 24 and all(c.engine == "kernel" for c in planned)
    seen = []
    C._with_setting(planned[0], lambda: seen.append(_native.host_cache_hints()))()
    assert seen == ["default"] and _native.host_cache_hints() == "streaming"
    assert P.load_peers().matching(planned[0]) == []
    base = {"shape": "L32_H8_D128", "T": 4096, "direction": "to_host", "limit_gbps": 55.0}
    rows = [dict(base, group="ctas", max_ctas=4, gbps=44.0, kernel_gbps=45.0, kernel_us=120.0),
            dict(base, group="host_hints", call="default-hints", max_ctas=4, gbps=48.0, kernel_gbps=50.0,
                 kernel_us=100.0),
            dict(base, group="host_hints", call="default-hints", max_ctas=0, gbps=52.0, kernel_gbps=52.0,
                 kernel_us=90.0)]
    table = summary.host_hints(rows).splitlines()
    assert len(table) == 4 and table[2].endswith("| 1.20× |") and table[3].endswith("| – |")


def test_walk_rows_run_the_host_transfers_moved_one_row_per_cta_in_the_walk_shape():
    """The host_hints rows of call "walk": every headline host case (L32 shapes, T = 256 and 4096, no budget)
    whose payload the kernel moves one row per CTA by default, run under ops.set_host_launch_shape("walk") with
    the setting restored after; the summary sets each beside its headline twin (above 1: one row per CTA is
    faster) and leaves the table out of a record without such rows."""
    from kvlayout.bench import peers as P
    from kvlayout.bench import summary
    from kvlayout.ops import _native

    walked = [c for c in C.plan_cases(quick=False) if c.call == "walk"]
    assert {(c.shape, c.T) for c in walked} == {("L32_H8_D128", 256), ("L32_H1_D128", 256), ("L32_H1_D128", 4096),
                                                 ("L32_MLA_D576", 256)}
    assert all(c.group == "host_hints" and c.max_ctas == 0 and c.engine == "kernel" and
               c.payload_bytes() <= _native.HOST_ROW_PER_CTA_MAX_BYTES for c in walked) and len(walked) == 8
    assert all(P.load_peers().matching(c) == [] for c in walked)     # (a diagnostic: no peer row is its job's)
    seen = []
    C._with_setting(walked[0], lambda: seen.append(_native.host_launch_shape()))()
    assert seen == ["walk"] and _native.host_launch_shape() == "row_per_cta"
    base = {"shape": "L32_H1_D128", "T": 256, "direction": "to_host", "limit_gbps": 55.0, "max_ctas": 0}
    rows = [dict(base, group="headline", gbps=46.0, kernel_gbps=50.0, kernel_us=84.0),
            dict(base, group="host_hints", call="default-hints", gbps=45.0, kernel_gbps=49.0, kernel_us=86.0),
            dict(base, group="host_hints", call="walk", gbps=42.0, kernel_gbps=46.0, kernel_us=92.4)]
    table = summary.host_launch_shape(rows).splitlines()
    assert len(table) == 3 and table[2].endswith("| 1.10× |")
    assert len(summary.host_hints(rows).splitlines()) == 3          # (the walk row is not a hints row)
    assert summary.host_launch_shape(rows[:2]) is None


def test_same_size_copies_are_timed_once_per_size_up_front_and_kept_in_the_record(monkeypatch):
    from kvlayout.bench import timing

    timed = []

    def fake_pinned_copy(timer, nbytes):
        timed.append(nbytes)
        return float(nbytes), float(2 * nbytes)

    monkeypatch.setattr(timing, "_pinned_copy_gbps", fake_pinned_copy)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    copies = timing.SameSizeCopies(timer=None)
    big = 4 * timing.SAME_SIZE_MAX
    copies.measure([4 << 20, 1 << 30, big, 4 << 20])
    assert timed == [4 << 20, timing.SAME_SIZE_MAX]          # each size once, above the cap the cap's copy
    assert copies.gbps("from_host", 4 << 20) == float(4 << 20)
    assert copies.gbps("to_host", big) == float(2 * timing.SAME_SIZE_MAX)
    assert timed == [4 << 20, timing.SAME_SIZE_MAX]          # nothing timed again between cases
    copies.gbps("from_host", 9 << 20)                         # a size not planned is timed when first asked
    assert timed[-1] == 9 << 20
    kept = timing.SameSizeCopies(timer=None, known=copies.table())   # a resumed run reads the record's table
    assert kept.gbps("to_host", 9 << 20) == float(2 * (9 << 20)) and timed[-1] == 9 << 20
    assert kept.table() == copies.table()
    doc = run(torch.device("cpu"), quick=True, only=ONE_CASE)
    doc["same_size"] = copies.table()
    assert "H2D 4 MiB 4194304.0" in markdown(doc) and "D2H 512 MiB" in markdown(doc)


def test_bind_per_call_loads_run_each_engine_between_caches_bound_anew():
    """The staged group's bind-per-call rows (loads of 32, 64 and 80 MiB, full runs only) bind both caches
    anew at every call and run the case's engine on them; the staged table sets each staged row beside the
    kernel row of the same call, lists no kernel row of its own, and neither is matched to a peer nor judged
    by the staged host-work target."""
    from kvlayout.bench import peers as P
    from kvlayout.bench import summary, targets

    planned = [c for c in C.plan_cases(quick=False) if c.group == "staged" and c.call == "bind-per-call"]
    assert {(c.shape, c.T, c.direction, c.engine) for c in planned} == {
        (shape, T, "from_host", engine) for shape, T in (("L32_H8_D128", 256), ("L32_H1_D128", 4096),
                                                         ("L80_H8_D128", 256)) for engine in ("staged", "kernel")}
    assert {c.payload_bytes() >> 20 for c in planned} == {32, 64, 80}
    assert not [c for c in C.plan_cases(quick=True) if c.call == "bind-per-call" and c.group == "staged"]
    assert all(P.load_peers().matching(c) == [] for c in planned)

    case = C.Case("staged", "L32_H1_D128", "vllm_flash_attn_nhd", "lmcache_kv_2ltd", 32, 16, "from_host",
                  engine="kernel", call="bind-per-call")
    data = C.build(case, C.Inputs(torch.device("cpu")), min_cache_slots=256)
    bound = []
    real_bind = ops.bind

    def counting_bind(layout, value, **kw):
        bound.append(layout)
        return real_bind(layout, value, **kw)
    fn = C.kvlayout_fn(case, data)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "bind", counting_bind)
        fn()
        fn()
    assert len(bound) == 4   # both caches, at each of the two calls
    # the call moved the chunk's rows into the cache's slots, as the kernel does between the caches themselves
    expected = C.build(case, C.Inputs(torch.device("cpu")), min_cache_slots=256)
    ops.transfer(expected["buffer"], expected["cache"], None, expected["cache_slots"], engine="kernel")
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16))   # (random bits: NaNs among them)
               for a, b in zip(data["cache"].tensors, expected["cache"].tensors))

    base = {"group": "staged", "shape": "L32_H8_D128", "T": 256, "direction": "from_host", "max_ctas": 0,
            "limit_gbps": 55.0, "host_us": 200.0, "host_us_per_call": 200.0, "call": "bind-per-call",
            "layerwise": False, "page_size": 16, "device_layout": "vllm_flash_attn_nhd",
            "buffer_layout": "lmcache_kv_2ltd", "payload_bytes": 32 << 20, "pct_of_limit": 90.0}
    rows = [dict(base, engine="staged", gbps=50.0, kernel_gbps=52.0, chunks=4, graph_nodes=0),
            dict(base, engine="kernel", gbps=49.0, kernel_gbps=51.0)]
    table = summary.staged(rows).splitlines()
    assert len(table) == 3 and "from_host, caches bound anew per call" in table[2]
    assert table[2].split(" | ")[6].startswith("49.0")   # the kernel's figure: the twin of the same call
    assert not [c for c in targets.checks({"results": rows}) if c.target.startswith("staged host work")]
    from kvlayout.bench.report import table_rows
    modes = [line[6] for line in table_rows({"results": [dict(r, bit_exact=True) for r in rows]})]
    assert modes == ["all layers, bind-per-call", "all layers, bind-per-call, kernel engine"]
