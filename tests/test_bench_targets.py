"""kvlayout.bench.targets: each target judged on the row of the engine auto picks, met and missed at its bound."""
from __future__ import annotations

from kvlayout.bench import targets
from kvlayout.ops import staged as staged_mod

MiB = 1 << 20


def _row(group="headline", shape="L32_H8_D128", T=4096, direction="to_host", max_ctas=0, engine="kernel", **more):
    r = {"group": group, "shape": shape, "T": T, "direction": direction, "max_ctas": max_ctas, "engine": engine,
         "payload_bytes": 512 * MiB, "gbps": 50.0, "pct_of_limit": 95.0, "host_us_per_call": 10.0, "page_size": 16}
    r["key"] = f"{shape} T={T} {direction} ctas={max_ctas} {engine} {group}"
    r.update(more)
    return r


def _by_target(found):
    out = {}
    for c in found:
        out.setdefault(c.target, []).append(c)
    return out


def test_auto_rows_take_the_staged_twin_where_auto_stages_the_case():
    small = staged_mod.AUTO_MIN_BYTES["to_host"] - 1
    rows = [_row(), _row(engine="staged", group="staged", pct_of_limit=98.0),
            _row(engine="staged", group="staged", call="direct", pct_of_limit=90.0),   # not what auto repeats
            _row(T=256, payload_bytes=small), _row(T=256, payload_bytes=small, engine="staged", group="staged"),
            _row(group="ctas", max_ctas=4), _row(group="ctas", max_ctas=4, engine="staged")]
    rows[-1]["group"] = "staged"
    load = staged_mod.AUTO_MIN_BYTES_MOVED_BEFORE["from_host"]    # a load the bench repeats between its caches
    rows += [_row(T=1024, direction="from_host", payload_bytes=load),
             _row(T=1024, direction="from_host", payload_bytes=load, engine="staged", group="staged")]
    picked = targets.auto_rows(rows)
    assert [(r["T"], r["max_ctas"], r["engine"]) for r in picked] == [
        (4096, 0, "staged"), (256, 0, "kernel"), (4096, 4, "kernel"), (1024, 0, "staged")]  # (budget to host: kernel)
    assert picked[0]["pct_of_limit"] == 98.0
    # on a device whose SMs store to the host slowly (the record's calibration) auto stages the smaller row too
    slow = {"to_host": {"sm_slow": True}, "from_host": {"sm_slow": False}}
    picked = targets.auto_rows(rows, slow)
    assert [(r["T"], r["engine"]) for r in picked] == [(4096, "staged"), (256, "staged"), (4096, "kernel"),
                                                       (1024, "staged")]


def test_the_command_judges_a_record_as_on_a_device_calibrated_slow(tmp_path, capsys):
    """``python -m kvlayout.bench.targets RECORD --sm-slow from_host``: auto's picks as on a device whose SMs load
    from the host slowly, for a record made before the bench recorded the calibration."""
    import pathlib
    record = pathlib.Path(__file__).resolve().parents[1] / "bench" / "results" / "h100.jsonl"
    assert targets.main([str(record)]) == 0
    fixed = capsys.readouterr().out
    assert targets.main([str(record), "--sm-slow", "from_host"]) == 0
    slow = capsys.readouterr().out
    # 9 MiB: staged only where the SMs load slowly (under every threshold of the fixed rule)
    row = "L32_MLA_D576 T=256 from_host"
    assert f"| {row} |" in fixed and f"| {row} (staged) |" not in fixed
    assert f"| {row} (staged) |" in slow and f"| {row} |" not in slow


def test_each_target_is_met_at_its_bound_and_missed_past_it():
    rows = [
        _row(pct_of_limit=97.0, vs_peer_kernel="ahead", x_peer_kernel=1.01, peer_kernel="P"),   # met, met
        _row(direction="from_host", pct_of_limit=96.9, vs_peer_end_to_end="behind", x_peer_end_to_end=0.9,
             peer_end_to_end="P"),                                                               # missed, missed
        _row(T=256, direction="gather_device", pct_of_limit=10.0),                               # no peer, no ceiling
        _row(group="staged", engine="staged", T=256, host_us_per_call=50.0),
        _row(group="staged", engine="staged", T=32768, host_us_per_call=50.1, chunks=128, graph_nodes=385),
        _row(group="staged", engine="staged", T=32768, host_us_per_call=400.0, call="direct", chunks=128,
             graph_nodes=0),
        _row(group="staged", engine="staged", T=32768, host_us_per_call=45.0, call="new-length", chunks=127,
             graph_nodes=382, graph_tokens=32512),
        _row(group="staged", engine="staged", T=32768, host_us_per_call=900.0, call="slot-chunks"),  # not judged
        _row(group="staged", engine="staged", T=32768, host_us_per_call=60.0, call="device-launch", chunks=128,
             graph_nodes=513, graph_on_device=True),
        _row(group="copy_engine", engine="copy", host_us_per_call=9000.0, runs=16384, run_list_us=200.0),
        _row(group="copy_engine", engine="copy", host_us_per_call=9000.0, runs=16384, run_list_us=200.2,
             run_list_spread=1.5),
        _row(group="copy_engine", engine="copy", host_us_per_call=90.0, runs=2048, run_list_us=30.0,   # 120 scaled
             runs_at_target=8192, run_list_at_target_us=100.0),                                  # judged: 100
        _row(group="copy_engine", engine="copy", host_us_per_call=90.0, runs=2048, run_list_us=20.0,   # 80 scaled
             runs_at_target=8192, run_list_at_target_us=100.5,                                   # judged: 100.5
             run_list_spread=0.01, run_list_at_target_spread=0.25),
        _row(group="copy_engine", engine="copy", host_us_per_call=100.0),                        # older record
        _row(group="copy_engine", engine="kernel", host_us_per_call=1e6),                        # not the copy engine
        _row(group="ctas", max_ctas=4, pct_of_limit=90.0),
        _row(group="ctas", max_ctas=4, direction="from_host", payload_bytes=MiB, pct_of_limit=89.9),
    ]
    found = _by_target(targets.checks({"results": rows}))
    assert [c.met for c in found["host ceiling"]] == [True, False]
    assert [c.met for c in found["peers, kernel only"]] == [True]
    assert [c.met for c in found["peers, end to end"]] == [False]
    assert [c.met for c in found["staged host work"]] == [True, False]
    assert [c.met for c in found["staged host work, new shape"]] == [False]
    assert [c.met for c in found["staged host work, new length"]] == [True]
    assert [c.met for c in found["staged host work, graph launched on the device"]] == [False]
    assert [c.met for c in found["copy engine run list"]] == [True, False, True, False, True]
    # the spread of the builds judged, where the record kept it (a busy host's mark)
    assert [c.measured for c in found["copy engine run list"]][:4] == [
        "100.0 µs (16,384 copies in 200.0 µs)", "100.1 µs (16,384 copies in 200.2 µs; spread 150%)",
        "100.0 µs (8,192 copies in 100.0 µs)", "100.5 µs (8,192 copies in 100.5 µs; spread 25%)"]
    assert [c.met for c in found["SM budget"]] == [True, False]
    text = targets.markdown(targets.checks({"results": rows}))
    assert "| host ceiling | 1 of 2 |" in text and "| staged host work | 1 of 2 |" in text
    # a staged miss says what its host time grows with: the chunks, and the nodes of the graph it replays
    assert ("| staged host work | L32_H8_D128 T=32768 to_host (staged) | 50.1 µs (128 chunks, graph of 385 "
            "nodes) | ≤ 50 µs |") in text
    assert ("| staged host work, new shape | L32_H8_D128 T=32768 to_host (staged, issued directly) | 400.0 µs "
            "(128 chunks, issued directly) | ≤ 50 µs |") in text
    # a new-length row names the prefix whose graph its calls replay
    new_length = [c for c in targets.checks({"results": rows}) if c.target == "staged host work, new length"]
    assert [(c.row, c.measured) for c in new_length] == [
        ("L32_H8_D128 T=32768 to_host (staged, new lengths)",
         "45.0 µs (127 chunks, graph of 382 nodes, of its first 32512 tokens)")]
    assert ("| staged host work, graph launched on the device | L32_H8_D128 T=32768 to_host (staged, graph "
            "launched on the device) | 60.0 µs (128 chunks, graph of 513 nodes, the body of a conditional node) "
            "| ≤ 50 µs |") in text


def test_the_report_opens_with_the_hosts_yardsticks_from_its_host_cost_rows():
    """Host-work targets are absolute µs: the report says how fast the record's host was (the host_cost rows' bare
    launch and torch op, lowest to highest), and says nothing where the record has no such rows."""
    rows = [_row(group="host_cost", launch_host_us=4.46, torch_op_host_us=9.4),
            _row(group="host_cost", launch_host_us=4.94, torch_op_host_us=10.17),
            _row(group="host_cost", launch_host_us=4.7), _row()]
    line = targets.host_speed(rows)
    assert line == ("This host: one bare kernel launch 4.46-4.94 µs, one torch op 9.40-10.17 µs of host time "
                    "(the record's 2 host_cost rows).")
    assert targets.markdown(targets.checks({"results": rows}), line).startswith(line + "\n\n| target |")
    assert targets.host_speed(rows[:1]) == ("This host: one bare kernel launch 4.46 µs, one torch op 9.40 µs of "
                                            "host time (the record's 1 host_cost row).")
    assert targets.host_speed([_row()]) is None
    assert targets.markdown(targets.checks({"results": [_row()]})).startswith("| target |")
