"""The profile reader that cuts a trace into each call's device activities (kvlayout.bench.trace)."""

import pytest
import torch

from kvlayout.bench import trace


def _activity(name, start, end, kind="kernel"):
    return {"name": name, "kind": kind, "stream": 7, "start": start, "end": end, "bytes": 0, "copy": False}


SPIN = "at::cuda::(anonymous namespace)::spin_kernel(long)"


def test_each_call_is_the_activities_between_its_hold_and_its_marker():
    acts = [_activity("reduce_kernel", 0, 5), _activity(SPIN, 5, 100),       # set-up, hold
            _activity("copy_rows", 101.5, 110), _activity("copy_rows", 109, 112),   # the call: two kernels
            _activity(SPIN, 113, 113.5),                                    # marker
            _activity("reduce_kernel", 120, 125), _activity(SPIN, 125, 200),
            _activity("Memcpy DtoH", 203, 204, kind="gpu_memcpy"), _activity("copy_rows", 206, 210),
            _activity(SPIN, 211, 211.5)]
    first, second = trace.call_windows(acts)
    assert first == {"launch_gap": 1.5, "span": 10.5, "busy": 10.5, "kernel": 11.5, "activities": 2,
                     "names": ["copy_rows"]}
    assert second["launch_gap"] == 3 and second["span"] == 7 and second["busy"] == 5 and second["kernel"] == 4
    assert second["names"] == ["Memcpy DtoH", "copy_rows"]


def test_a_call_that_launched_nothing_is_left_out_and_an_unpaired_spin_is_refused():
    acts = [_activity(SPIN, 0, 10), _activity(SPIN, 11, 12), _activity(SPIN, 20, 30), _activity("k", 31, 32),
            _activity(SPIN, 33, 34)]
    assert [w["launch_gap"] for w in trace.call_windows(acts)] == [1]
    with pytest.raises(ValueError, match="3 spin kernels"):
        trace.call_windows(acts[:3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_profiled_run_of_calls_gives_one_window_per_call():
    from torch.profiler import ProfilerActivity, profile

    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            x.sum()                          # (set-up: no call's)
            torch.cuda._sleep(100_000)
            x.mul_(1.0)
            x.add_(1.0)
            torch.cuda._sleep(0)
        torch.cuda.synchronize()
    windows = trace.call_windows(trace.device_activities(prof))
    assert len(windows) == 4
    for w in windows:
        assert w["activities"] == 2 and 0 < w["kernel"] and w["busy"] <= w["span"] and w["launch_gap"] >= 0
