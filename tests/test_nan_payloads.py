"""NaN payloads survive every byte-moving path, for every fp8 format (and bf16/fp16), on every device.

A float conversion (even to the same dtype) may rewrite a NaN's payload or
sign into the canonical NaN; kvlayout copies bytes, so every bit pattern of
the input must come out unchanged — in the reference as in the ops.
"""

import numpy as np
import pytest

from kvlayout import reference as R
from kvlayout.conformance import strategies as S
from kvlayout.conformance.families.pages import PageSample
from kvlayout.conformance.families.transfer import TransferSample
from kvlayout.reference import Geometry

FLOAT_TYPES = list(S.NAN_DTYPES)


@pytest.mark.parametrize("dtype", FLOAT_TYPES)
def test_reference_page_helpers_keep_nan_payloads(dtype):
    layout, g = "sglang_mla", Geometry(P=1, L=3, NB=2, BS=8, H=1, E=16)
    cache = S.nan_cache(layout, g, dtype)
    flat = S.nan_patterns(dtype, g.P * g.L * g.BS * g.H * g.E)[::-1].copy()
    out = R.set_page(layout, cache, 1, flat, page_size=g.BS)
    assert np.array_equal(S.bits(np.asarray(R.get_page(layout, out, 1, page_size=g.BS))), S.bits(flat))
    assert np.array_equal(S.bits(np.asarray(R.get_page(layout, out, 0, page_size=g.BS))),
                          S.bits(np.asarray(R.get_page(layout, cache, 0, page_size=g.BS))))


@pytest.mark.parametrize("dtype", FLOAT_TYPES)
@pytest.mark.parametrize("layout", ["sglang_mla", "sglang_mha", "hicache_page_first", "vllm_flash_attn_hnd"])
def test_page_helpers_keep_nan_payloads(device, layout, dtype):
    """The database's page samples with NaN-pattern caches and flat pages (drawn there too, a third of the time)."""
    mla = R.get(layout).is_mla
    g = Geometry(P=1 if mla else 2, L=2, NB=3, BS=4, H=1 if mla else 2, E=16)
    PageSample(layout, g, dtype, "get_page", (2,), fill="nan").run(device)
    PageSample(layout, g, dtype, "set_page", (1,), fill="nan").run(device)


@pytest.mark.parametrize("dtype", FLOAT_TYPES)
@pytest.mark.parametrize("engine", ["kernel", "copy"])
def test_transfers_keep_nan_payloads(device, dtype, engine):
    """The database's transfer sample with a NaN-pattern source, into host memory (pinned facing CUDA)."""
    g = Geometry(P=2, L=2, NB=4, BS=4, H=2, E=16)
    case = S.TransferCase("vllm_flash_attn_nhd", g, "hicache_page_first", g, dtype, (4, 5, 6, 7, 13, 2),
                          (8, 9, 10, 11, 0, 15))
    TransferSample(case, placement="pinned dst", dst_fill="random", engine=engine, src_fill="nan").run(device)
