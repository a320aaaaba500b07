"""kvlayout bench on the CPU: cases run, are checked bit-exact against the torch baseline, every finished case
is on disk at once, an interrupted run resumes, reports are written."""

import json

import pytest
import torch

from kvlayout.bench import cases as C
from kvlayout.bench.peers import load_peers
from kvlayout.bench.report import markdown, terminal_table, write_reports
from kvlayout.bench.run import check_bit_exact, document, run, selected
from kvlayout.bench.timing import Timer, drifted

ONLY = "T=256 ps=16 vllm_flash_attn_hnd"


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
    doc = run(torch.device("cpu"), quick=True, only=ONLY + " gather_device")
    doc["limits_drift"] = {"D2D": (100.0, 90.0)}
    assert "WARNING: limit D2D moved from 100.0 to 90.0" in terminal_table(doc)
    assert "**Warning:** limit D2D moved" in markdown(doc)


def test_peer_figures_match_the_same_job():
    peers = load_peers()
    head = C.Case("headline", "L32_H8_D128", "vllm_flash_attn_nhd", "lmcache_kv_2ltd", 4096, 16, "to_host")
    names = {(r["peer"], r["op"]) for r in peers.matching(head)}
    assert ("LMCache", "multi_layer_kv_transfer") in names and all(r["T"] == 4096 for r in peers.matching(head))
    pool = C.Case("layouts", "L32_H8_D128", "sglang_mha", "hicache_page_first", 4096, 64, "to_host")
    assert {r["peer"] for r in peers.matching(pool)} == {"SGLang"}
    assert all("ps=64" in r["op"] for r in peers.matching(pool))
    assert peers.matching(C.Case("ctas", "L32_H8_D128", "vllm_flash_attn_nhd", "lmcache_kv_2ltd", 4096, 16,
                                 "to_host", max_ctas=4)) == []


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
    assert all(c.key in planned for c in P.profile_cases())   # every profiled case is a measured bench row
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


def test_readme_tables_come_from_the_recorded_run(capsys):
    """The README's performance tables are printed from the committed H200 run (kvlayout.bench.summary)."""
    import pathlib

    from kvlayout.bench import summary

    results = pathlib.Path(__file__).resolve().parents[1] / "bench" / "results"
    assert summary.main([str(results / "h200.jsonl")]) == 0
    out = capsys.readouterr().out
    rows = [r for r in document(str(results / "h200.jsonl"))["results"] if r["group"] == "headline"]
    some = next(r for r in rows if r["shape"] == "L32_H8_D128" and r["T"] == 4096 and r["direction"] == "to_host")
    assert f"| L32_H8_D128 | 4096 | to_host | {some['gbps']:.1f} ({some['pct_of_limit']:.0f}%) |" in out
    assert "one prepared layer call" in out and "<!-- Staged -->" in out
