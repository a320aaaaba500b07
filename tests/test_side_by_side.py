"""The side-by-side script's own checks (its CUDA timings run where LMCache is at hand)."""

import zipfile

import pytest
import torch

from kvlayout import ops
from kvlayout.bench import side_by_side
from kvlayout.bench.cases import Case, Inputs, build, endpoints


def _case_and_data():
    case = Case("headline", "L32_H1_D128", "vllm_flash_attn_nhd", "lmcache_kv_2ltd", 32, 16, "gather_device")
    return case, build(case, Inputs(torch.device("cpu")), min_cache_slots=256)


def test_calls_that_write_alike_pass_the_check():
    case, data = _case_and_data()
    src, ss, dst, ds = endpoints(case, data)
    calls = {**side_by_side.kvlayout_calls(case, data),
             "kvlayout kernel": lambda: ops.transfer(src, dst, ss, ds, engine="kernel")}
    side_by_side.check_same_output(case, data, calls)


def test_a_call_that_writes_one_row_unlike_the_first_is_named():
    case, data = _case_and_data()
    src, ss, dst, ds = endpoints(case, data)

    def off_by_one_token():
        ops.transfer(src, dst, ss, ds)
        dst.tensors[0][1, 5, 7].add_(1)        # (plane 1, layer 5, token 7)
    calls = {**side_by_side.kvlayout_calls(case, data), "LMCache": off_by_one_token}
    with pytest.raises(AssertionError, match="LMCache wrote tensor 0"):
        side_by_side.check_same_output(case, data, calls)


def test_a_wheel_without_the_extension_is_refused(tmp_path):
    wheel = tmp_path / "lmcache-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("lmcache/__init__.py", "")
    with pytest.raises(SystemExit, match="holds no cuda_ops"):
        side_by_side.load_lmcache(str(wheel))


def test_the_table_compares_with_the_best_lmcache_call_in_each_timing():
    header = {"limits": {"D2H_256MiB": 55.0}, "gpu": "G", "torch": "t"}
    row = dict(shape="L32_H8_D128", T=256, direction="to_host", bytes=1)
    rows = [dict(row, call="kvlayout", overlapped_gbps=50.0, idle_gbps=48.0),
            dict(row, call="LMCache", overlapped_gbps=40.0, idle_gbps=50.0),
            dict(row, call="LMCache staging", overlapped_gbps=52.0, idle_gbps=30.0)]
    line = [x for x in side_by_side.markdown(header, rows).splitlines() if x.startswith("| L32_H8_D128")][0]
    assert line.endswith("| 0.96x | 0.96x |"), line
