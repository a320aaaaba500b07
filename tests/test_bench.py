"""kvlayout bench on the CPU: cases run, are checked bit-exact against the torch baseline, reports are written."""

import json

import torch

from kvlayout.bench import cases as C
from kvlayout.bench.report import write_reports
from kvlayout.bench.run import check_bit_exact, run
from kvlayout.bench.timing import Timer


def test_bench_cpu_short_run_writes_reports(tmp_path):
    doc = run(torch.device("cpu"), quick=True, only="T=256 ps=16 vllm_flash_attn_hnd")
    assert doc["results"] and all(r["bit_exact"] and r["gbps"] > 0 for r in doc["results"])
    paths = write_reports(doc, str(tmp_path), "cpu")
    assert json.loads((tmp_path / "cpu.json").read_text())["results"][0]["key"] == doc["results"][0]["key"]
    assert any(p.endswith("cpu.md") for p in paths)


def test_every_planned_case_builds_and_matches_the_baseline_on_small_data():
    """Each layout pair and direction of the GPU plan, shrunk: kvlayout and the baseline agree byte for byte."""
    timer = Timer(torch.device("cpu"), warmup=0, reps=1)
    seen = set()
    for case in C.plan_cases(quick=False):
        small = C.Case(case.group, "L32_H1_D128" if not C.SHAPES[case.shape].mla else case.shape,
                       case.device_layout, case.buffer_layout, 32, min(case.page_size, 16), case.direction,
                       case.layerwise, engine=case.engine)
        key = (small.shape, small.device_layout, small.buffer_layout, small.page_size, small.direction, small.layerwise,
               small.engine)
        if key in seen:
            continue
        seen.add(key)
        data = C.build(small, torch.device("cpu"), torch.Generator().manual_seed(len(seen)))
        assert check_bit_exact(small, data, timer), small.key
