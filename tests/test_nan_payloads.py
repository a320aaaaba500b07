"""NaN payloads survive every byte-moving path, for every fp8 format (and bf16/fp16), on every device.

A float conversion (even to the same dtype) may rewrite a NaN's payload or
sign into the canonical NaN; kvlayout copies bytes, so every bit pattern of
the input must come out unchanged — in the reference as in the ops.
"""

import numpy as np
import pytest
import torch

from kvlayout import ops
from kvlayout import reference as R
from kvlayout.conformance import strategies as S
from kvlayout.reference import Geometry

import torch_cases as TC

FLOAT_TYPES = ["float8_e4m3fn", "float8_e5m2", "bfloat16", "float16"]


def nan_patterns(dtype: str, n: int) -> np.ndarray:
    """``n`` elements cycling through every NaN bit pattern of ``dtype`` (both signs, every payload)."""
    dt = S.numpy_dtype(dtype)
    width = dt.itemsize * 8
    every = np.arange(2 ** min(width, 16), dtype=np.uint64).astype(f"u{dt.itemsize}")
    nans = every[np.isnan(every.view(dt).astype(np.float32))]
    assert nans.size >= 2, dtype
    return np.resize(nans, n).view(dt)


def nan_cache(layout, g, dtype):
    """A physical cache whose every element is a NaN (all payloads, both signs)."""
    count = [0]

    def make(shape):
        count[0] += 1
        return np.roll(nan_patterns(dtype, int(np.prod(shape))), count[0]).reshape(shape)

    return S._build(layout, g, make)


@pytest.mark.parametrize("dtype", FLOAT_TYPES)
def test_reference_page_helpers_keep_nan_payloads(dtype):
    layout, g = "sglang_mla", Geometry(P=1, L=3, NB=2, BS=8, H=1, E=16)
    cache = nan_cache(layout, g, dtype)
    flat = nan_patterns(dtype, g.P * g.L * g.BS * g.H * g.E)[::-1].copy()
    out = R.set_page(layout, cache, 1, flat, page_size=g.BS)
    assert np.array_equal(S.bits(np.asarray(R.get_page(layout, out, 1, page_size=g.BS))), S.bits(flat))
    assert np.array_equal(S.bits(np.asarray(R.get_page(layout, out, 0, page_size=g.BS))),
                          S.bits(np.asarray(R.get_page(layout, cache, 0, page_size=g.BS))))


@pytest.mark.parametrize("dtype", FLOAT_TYPES)
@pytest.mark.parametrize("layout", ["sglang_mla", "sglang_mha", "hicache_page_first", "vllm_flash_attn_hnd"])
def test_page_helpers_keep_nan_payloads(device, layout, dtype):
    mla = R.get(layout).is_mla
    g = Geometry(P=1 if mla else 2, L=2, NB=3, BS=4, H=1 if mla else 2, E=16)
    cache_np = nan_cache(layout, g, dtype)
    cache = ops.bind(layout, TC.to_torch(layout, cache_np, device), page_size=g.BS)
    TC.assert_same_bytes(ops.get_page(cache, 2), R.get_page(layout, cache_np, 2, page_size=g.BS), "get_page")
    flat = nan_patterns(dtype, g.P * g.L * g.BS * g.H * g.E)[::-1].copy()
    ops.set_page(cache, 1, TC.tensor(flat, device))
    want = R.set_page(layout, cache_np, 1, flat, page_size=g.BS)
    TC.assert_same_bytes(cache.tensors, TC.flat(layout, want), "set_page")


@pytest.mark.parametrize("dtype", FLOAT_TYPES)
@pytest.mark.parametrize("engine", ["kernel", "copy"])
def test_transfers_keep_nan_payloads(device, dtype, engine):
    g = Geometry(P=2, L=2, NB=4, BS=4, H=2, E=16)
    src_np = nan_cache("vllm_flash_attn_nhd", g, dtype)
    dst_np = S.random_cache("hicache_page_first", g, dtype, np.random.default_rng(0))
    src = ops.bind("vllm_flash_attn_nhd", TC.to_torch("vllm_flash_attn_nhd", src_np, device))
    dst = ops.bind("hicache_page_first", TC.to_torch("hicache_page_first", dst_np, "cpu", pin=device == "cuda"),
                   page_size=g.BS)
    s, d = np.array([4, 5, 6, 7, 13, 2]), np.array([8, 9, 10, 11, 0, 15])
    ops.transfer(src, dst, torch.from_numpy(s).to(device if engine == "kernel" else "cpu"),
                 torch.from_numpy(d).to(device if engine == "kernel" else "cpu"), engine=engine)
    TC.sync(device)
    want = R.transfer("vllm_flash_attn_nhd", src_np, "hicache_page_first", dst_np, s, d)
    TC.assert_same_bytes(dst.tensors, TC.flat("hicache_page_first", want), "transfer")
