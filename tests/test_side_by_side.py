"""The side-by-side script's own checks (its CUDA timings run where LMCache is at hand)."""

import json
import sys
import zipfile

import pytest
import torch

from kvlayout import ops
from kvlayout.bench import side_by_side
from kvlayout.bench.cases import Case, Inputs, build, endpoints
from kvlayout.ops import _native


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


def test_a_built_extension_finds_the_lmcache_package_built_beside_it(tmp_path, monkeypatch):
    """scripts/build_lmcache_ops.py puts lmcache.lmcache_native in DIR/lmcache/, which cuda_ops imports as it
    loads: loading DIR's extension puts DIR on sys.path first (here the stand-in .so then fails to load)."""
    (tmp_path / "lmcache").mkdir()
    (tmp_path / "lmcache" / "__init__.py").write_text("")
    (tmp_path / "cuda_ops.so").write_bytes(b"not an ELF file")
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ImportError):
        side_by_side.load_lmcache(str(tmp_path))
    assert sys.path[0] == str(tmp_path)


def test_the_table_compares_with_the_best_lmcache_call_in_each_timing():
    header = {"limits": {"D2H_256MiB": 55.0}, "gpu": "G", "torch": "t"}
    row = dict(shape="L32_H8_D128", T=256, direction="to_host", bytes=1)
    rows = [dict(row, call="kvlayout", overlapped_gbps=50.0, idle_gbps=48.0),
            dict(row, call="LMCache", overlapped_gbps=40.0, idle_gbps=50.0),
            dict(row, call="LMCache staging", overlapped_gbps=52.0, idle_gbps=30.0)]
    line = [x for x in side_by_side.markdown(header, rows).splitlines() if x.startswith("| L32_H8_D128")][0]
    assert line.endswith("| 0.96x | 0.96x |"), line


def test_the_launch_shapes_compare_the_rows_moved_one_per_cta():
    """launch_shapes: kvlayout's kernel against its walk and LMCache's kernel per timing, on the host rows whose
    payload the default moves one row per CTA; a larger row (walked by both calls) and a row without a walk call
    are left out."""
    limit = _native.HOST_ROW_PER_CTA_MAX_BYTES

    def case(T, nbytes, walk=True):
        row = dict(shape="L32_H1_D128", T=T, direction="to_host", bytes=nbytes)
        calls = [("kvlayout", 50.0, 48.0), ("kvlayout kernel", 50.0, 48.0), ("LMCache", 40.0, 60.0)]
        calls += [("kvlayout walk", 25.0, 24.0)] if walk else []
        return [dict(row, call=c, overlapped_gbps=o, idle_gbps=i) for c, o, i in calls]
    text = side_by_side.launch_shapes(case(256, limit) + case(4096, limit + 1) + case(512, 1, walk=False))
    assert "L32_H1_D128 T=256 to_host 2.00x / 2.00x the walk, 1.25x / 0.80x LMCache" in text
    assert "T=4096" not in text and "T=512" not in text and f"up to {limit >> 20} MiB" in text


def test_each_round_starts_from_another_call():
    """time_calls visits every call in every round, round r from the r-th call on, and keeps each call's
    medians: a stand-in timer records the order and returns a time per call."""
    order = []

    class Stamp:
        def __init__(self, s):
            self.median, self.host = s, s / 10

    def timer(call, kernel_only=False, host_s=None):
        if not kernel_only:
            order.append(call())
        return Stamp(0.5 if kernel_only else 1.0)
    calls = {name: (lambda name=name: name) for name in ("kvlayout", "kvlayout kernel", "LMCache")}
    times = side_by_side.time_calls(timer, calls, rounds=3)
    assert order == ["kvlayout", "kvlayout kernel", "LMCache", "kvlayout kernel", "LMCache", "kvlayout",
                     "LMCache", "kvlayout", "kvlayout kernel"]
    assert times["LMCache"] == {"idle": 1.0, "overlapped": 0.5, "host": 0.1}


def test_the_standing_counts_each_timing_and_names_the_rows_behind(tmp_path):
    """A ratio of at least 1 is ahead; the rows behind are named with their ratios, lowest first; the record's
    file reads back as (header, rows)."""
    def case(T, ours, peer):
        row = dict(shape="L32_H1_D128", T=T, direction="to_host", bytes=1)
        return [dict(row, call="kvlayout", overlapped_gbps=ours[0], idle_gbps=ours[1]),
                dict(row, call="LMCache", overlapped_gbps=peer[0], idle_gbps=peer[1])]
    rows = case(256, (46.0, 40.0), (50.0, 40.0)) + case(4096, (52.0, 50.0), (52.0, 51.0))
    path = tmp_path / "side_by_side.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"limits": {}, "gpu": "G", "torch": "t"}] + rows) + "\n")
    header, read_rows = side_by_side.read(str(path))
    assert header["gpu"] == "G" and read_rows == rows
    assert side_by_side.standing(rows) == (
        "overlapped (kvlayout's kernel only): ahead on 1 of 2 rows, behind on 1 (L32_H1_D128 T=256 to_host 0.920x); "
        "idle (end to end): ahead on 1 of 2 rows, behind on 1 (L32_H1_D128 T=4096 to_host 0.980x)")


class _LMCacheDouble:
    """A stand-in for LMCache's ``multi_layer_kv_transfer`` on CPU tensors, written from its documented
    semantics (each layer's paged tensor found by its address; format 1: a layer is ``[2, slots, row]``,
    format 3: ``[slots, row]``; direction 1 copies paged rows into the chunk ``[K, L, T, row]``, 0 back; a
    negative slot is skipped), so that the script's mapping of a case onto LMCache's arguments is checked
    against kvlayout here; on a GPU the real extension is."""

    def __init__(self, tensors):
        self.by_address = {t.data_ptr(): t for t in tensors}

    def multi_layer_kv_transfer(self, key_value, key_value_ptrs, slot_mapping, paged_memory_device,
                                page_buffer_size, direction, engine_kv_format, block_size=0, head_size=0,
                                skip_prefix_n_tokens=0):
        assert engine_kv_format in (1, 3) and direction in (0, 1)
        planes, layers, tokens = key_value.shape[:3]
        for layer, address in enumerate(key_value_ptrs.tolist()):
            paged = self.by_address[address].reshape(planes, page_buffer_size, -1)
            for plane in range(planes):
                for token in range(skip_prefix_n_tokens, tokens):
                    slot = int(slot_mapping[token])
                    if slot < 0:
                        continue
                    if direction == 1:
                        key_value[plane, layer, token].copy_(paged[plane, slot].reshape(key_value.shape[3:]))
                    else:
                        paged[plane, slot].copy_(key_value[plane, layer, token].reshape(-1))


@pytest.mark.parametrize("shape", ["L32_H1_D128", "L32_MLA_D576"])
@pytest.mark.parametrize("direction", side_by_side.DIRECTIONS)
def test_the_lmcache_calls_do_the_cases_job(shape, direction):
    from kvlayout.bench.cases import SHAPES, _default_layouts

    dev, buf = _default_layouts(SHAPES[shape])
    case = Case("headline", shape, dev, buf, 24, 16, direction)
    data = build(case, Inputs(torch.device("cpu")), min_cache_slots=128)
    lmc = _LMCacheDouble(data["cache"].tensors)
    calls = {**side_by_side.kvlayout_calls(case, data), **side_by_side.lmcache_calls(lmc, case, data)}
    assert list(calls) == side_by_side.call_names(case)
    side_by_side.check_same_output(case, data, calls)
    # (the walk call sets the host launch shape for its call only)
    assert ("kvlayout walk" in calls) == (direction in ("to_host", "from_host"))
    assert _native.host_launch_shape() == "row_per_cta"


def test_the_timeline_is_written_row_by_row_and_tabled(tmp_path):
    rows = [{"gpu": "a GPU", "torch": "2.x", "reps": 5},
            {"case": "L32_MLA_D576,256,scatter_device", "call": "kvlayout", "event_us": 10.6, "launch_gap": 1.25,
             "span": 9.0, "busy": 9.0, "kernel": 9.0, "activities": 1, "names": ["copy_row_per_cta_kernel"]}]
    assert side_by_side.write_record(iter(rows), side_by_side.timeline_markdown, str(tmp_path),
                                     "side_by_side_timeline") == 0
    written = [json.loads(line) for line in (tmp_path / "side_by_side_timeline.jsonl").read_text().splitlines()]
    assert written == rows
    table = (tmp_path / "side_by_side_timeline.md").read_text()
    assert "medians of 5 calls" in table
    assert "| L32_MLA_D576,256,scatter_device | kvlayout | 10.60 | 1.25 | 9.00 | 9.00 | 9.00 | 1 |" in table
