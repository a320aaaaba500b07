"""Prepared transfers under hostile use: copies, pickling, layer indices, compiled slot swaps, re-strided caches.

Each test fails without the behaviour it states (a shallow copy sharing the native binding, a pickling error
about weakrefs, a ValueError "must be <= -1", a fatal graph break, the old geometry written).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from kvlayout import ops

NB, BS, H, D = 4, 4, 2, 8                # vllm_flash_attn_nhd layers [2, NB, BS, H, D]: 16 slots


def _caches(device, layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = ops.bind("vllm_flash_attn_nhd", [torch.randn(2, NB, BS, H, D, generator=g).half().to(device)
                                           for _ in range(layers)])
    dst = ops.bind("vllm_flash_attn_nhd", [torch.zeros(2, NB, BS, H, D, dtype=torch.float16, device=device)
                                           for _ in range(layers)])
    return src, dst


def _expected(src, dst, s, d, **kw):
    """What ops.transfer writes into a copy of ``dst``."""
    want = ops.bind("vllm_flash_attn_nhd", [t.clone() for t in dst.tensors])
    ops.transfer(src, want, s, d, **kw)
    return want.tensors


def _slots(values, device):
    return torch.tensor(values, dtype=torch.int64, device=device)


def test_copy_copy_is_an_independent_transfer(device):
    src, dst = _caches(device)
    t = ops.prepare(src, dst, _slots([0, 1, 2], device), _slots([5, 6, 7], device))
    u = copy.copy(t)
    assert u is not t and u.num_layers == t.num_layers
    u.set_slots(_slots([3, 4], device), _slots([9, 10], device))
    t()                                   # the original still moves its own slots
    want = _expected(src, ops.bind("vllm_flash_attn_nhd", [torch.zeros_like(x) for x in dst.tensors]),
                     _slots([0, 1, 2], device), _slots([5, 6, 7], device))
    for got, w in zip(dst.tensors, want):
        assert torch.equal(got, w), "set_slots on the copy changed the original's slots"
    u()
    want = _expected(src, ops.bind("vllm_flash_attn_nhd", list(want)), _slots([3, 4], device),
                     _slots([9, 10], device))
    for got, w in zip(dst.tensors, want):
        assert torch.equal(got, w)
    with pytest.raises(TypeError, match="cannot be deep-copied"):
        copy.deepcopy(t)


def test_pickling_says_prepared_transfers_are_process_local():
    src, dst = _caches("cpu")
    t = ops.prepare(src, dst, _slots([0, 1], "cpu"), _slots([2, 3], "cpu"))
    with pytest.raises(TypeError, match="process-local"):
        pickle.dumps(t)


def test_layer_of_a_transfer_without_layers_says_so():
    src, dst = _caches("cpu")
    t = ops.prepare(src, dst, _slots([0], "cpu"), _slots([1], "cpu"), src_layers=[], dst_layers=[])
    assert t.num_layers == 0
    with pytest.raises(IndexError, match="copies no layers") as e:
        t.layer(0)
    assert "<= -1" not in str(e.value)
    t()                                   # all (no) layers: nothing moves
    assert all(int(x.count_nonzero()) == 0 for x in dst.tensors)
    c = ops.prepare(src, dst, _slots([0], "cpu"), _slots([1], "cpu"), src_layers=[], dst_layers=[], engine="copy")
    c()
    with pytest.raises(IndexError, match="copies no layers"):
        c.layer(0)
    assert all(int(x.count_nonzero()) == 0 for x in dst.tensors)


@pytest.mark.parametrize("bad", [2, 7, -1, -3])
def test_layer_out_of_range_is_an_index_error_naming_the_range(bad):
    src, dst = _caches("cpu")
    t = ops.prepare(src, dst, _slots([0], "cpu"), _slots([1], "cpu"))
    snap = [x.clone() for x in dst.tensors]
    with pytest.raises(IndexError, match=rf"layer = {bad} is out of range: the transfer copies 2 layers"):
        t.layer(bad)
    with pytest.raises(TypeError):
        t.layer(1.0)
    with pytest.raises(TypeError):
        t.layer(True)
    assert all(torch.equal(a, b) for a, b in zip(dst.tensors, snap))


def test_set_slots_in_fullgraph_compiled_code_is_a_clear_eager_only_error():
    src, dst = _caches("cpu")
    t = ops.prepare(src, dst, _slots([0, 1], "cpu"), _slots([2, 3], "cpu"))
    new_src, new_dst = _slots([4, 5], "cpu"), _slots([6, 7], "cpu")

    @torch.compile(fullgraph=True, backend="eager")
    def swap_and_copy(s, d):
        t.set_slots(s, d)
        t.layer(0)

    with pytest.raises(Exception, match="set_slots is eager-only") as e:
        swap_and_copy(new_src, new_dst)
    assert "call it outside the compiled function" in str(e.value)
    # outside compiled code it works, and compiled layer calls use the new slots
    t.set_slots(new_src, new_dst)

    @torch.compile(fullgraph=True, backend="eager")
    def copy_layer():
        t.layer(0)

    copy_layer()
    want = _expected(src, ops.bind("vllm_flash_attn_nhd", [torch.zeros_like(x) for x in dst.tensors]),
                     new_src, new_dst, src_layers=[0], dst_layers=[0])
    for got, w in zip(dst.tensors, want):
        assert torch.equal(got, w)
