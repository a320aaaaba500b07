"""The decided rules (``kvlayout.reference.semantics``): the spec, the reference, the ops and compat agree.

For every rule that refuses an input there is a sample bad input per path:
the reference, the op library on the CPU and, where the compat layer has
an entry point of its own, compat.  Each must raise exactly the rule's
exception type (not a subclass standing in for another rule's type).  For
every behaviour rule the reference and the CPU op compute the same bytes on
a sample.  Test ids are the rule names, so a failure names the rule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlayout import ops
from kvlayout import reference as R
from kvlayout.conformance import strategies as S
from kvlayout.reference import Geometry, semantics

import torch_cases as TC

SRC, DST = "vllm_flash_attn_nhd", "hicache_page_first"
G = Geometry(P=2, L=2, NB=4, BS=4, H=2, E=8)             # 16 slots per layer and plane
CHUNK = "lmcache_kv_2ltd"
CG = Geometry(P=2, L=2, NB=6, BS=1, H=1, E=16)            # a 6-token chunk with the same row width


def _np(layout, geom, dtype="float16", seed=0):
    return S.random_cache(layout, geom, dtype, np.random.default_rng(seed))


def _torch(layout, geom, dtype="float16", seed=0, device="cpu"):
    return ops.bind(layout, TC.to_torch(layout, _np(layout, geom, dtype, seed), device),
                    page_size=None if R.get(layout).paged else geom.BS)


def _slots(values):
    return torch.tensor(values, dtype=torch.int64)


# ---------------------------------------------------------------------------------------
# one sample bad input per rule and path
# ---------------------------------------------------------------------------------------

def _ref_transfer(src_slots=(0, 1, 2), dst_slots=(3, 4, 5), *, dst_geom=G, dst_dtype="float16", **kw):
    return lambda: R.transfer(SRC, _np(SRC, G), DST, _np(DST, dst_geom, dst_dtype, 1),
                              np.asarray(src_slots), np.asarray(dst_slots), **kw)


def _ops_transfer(src_slots=(0, 1, 2), dst_slots=(3, 4, 5), *, dst_geom=G, dst_dtype="float16", **kw):
    def call():
        s = src_slots if isinstance(src_slots, torch.Tensor) else _slots(list(src_slots))
        d = dst_slots if isinstance(dst_slots, torch.Tensor) else _slots(list(dst_slots))
        ops.transfer(_torch(SRC, G), _torch(DST, dst_geom, dst_dtype, 1), s, d, **kw)
    return call


def _ref_rope(old=(0, 1), new=(2, 3), *, keys_dtype=np.float32, rot=8, max_pos=16, keys_shape=(2, 1, 8)):
    keys = np.zeros(keys_shape, keys_dtype)
    return lambda: R.rope_reposition(keys, np.asarray(old), np.asarray(new), np.zeros((max_pos, rot), np.float32),
                                     is_neox=True)


def _ops_rope(old=(0, 1), new=(2, 3), *, keys_dtype=torch.float32, rot=8, max_pos=16, keys_shape=(2, 1, 8)):
    keys = torch.zeros(keys_shape, dtype=keys_dtype)
    return lambda: ops.rope_reposition(keys, torch.as_tensor(old), torch.as_tensor(new),
                                       torch.zeros(max_pos, rot), is_neox=True)


def _ref_page(call):
    cache = _np(DST, G)
    return lambda: call(cache)


def _ops_page(call):
    cache = _torch(DST, G)
    return lambda: call(cache)


def _sglang_per_layer(src_indices, dst_indices):
    from kvlayout.compat import sglang as sg

    k = [torch.zeros(16, 2, 8) for _ in range(4)]
    return lambda: sg.transfer_kv_per_layer(k[0], k[1], k[2], k[3], torch.tensor(src_indices),
                                            torch.tensor(dst_indices), item_size=64)


def _lmcache_rope(old, new):
    from kvlayout.compat import lmcache as lm

    return lambda: lm.rotary_embedding_k_fused(torch.tensor(old), torch.tensor(new), torch.zeros(2, 8), 8,
                                               torch.zeros(16, 8), True)


def _meta_destination():
    dst = ops.bind(DST, torch.empty(2, 16, 2, 2, 8, dtype=torch.float16, device="meta"), page_size=4)
    return lambda: ops.transfer(_torch(SRC, G), dst, _slots([0]), _slots([1]))


def _leaf_requiring_grad():
    t = torch.zeros(2, 16, 2, 2, 8, requires_grad=True)
    return lambda: ops.transfer(_torch(SRC, G, "float32"), ops.bind(DST, t, page_size=4), _slots([0]), _slots([1]))


def _self_overlap():
    cache = _torch(SRC, G)
    return lambda: ops.transfer(cache, cache, _slots([0, 1]), _slots([2, 3]))


SAMPLES: dict[str, dict[str, object]] = {
    "skip_prefix": {
        "reference": lambda: _ref_transfer(skip_prefix=4),
        "ops": lambda: _ops_transfer(skip_prefix=4)},
    "slot_out_of_range": {
        "reference": lambda: _ref_transfer((0, 16, 2)),
        "ops": lambda: _ops_transfer((0, 16, 2)),
        "ops, None slots": lambda: lambda: ops.transfer(_torch(CHUNK, CG), _torch(DST, Geometry(2, 2, 1, 4, 2, 8)),
                                                        None, None),
        "compat sglang": lambda: _sglang_per_layer([0, 1], [2, 16])},
    "duplicate_destination_slot": {
        "reference": lambda: _ref_transfer(dst_slots=(3, -1, 3)),
        "ops": lambda: _ops_transfer(dst_slots=(3, -1, 3)),
        "compat sglang": lambda: _sglang_per_layer([0, 1], [5, 5])},
    "index_dtype": {
        "reference": lambda: _ref_transfer((0.0, 1.0, 2.0)),
        "ops": lambda: _ops_transfer(torch.tensor([0.0, 1.0, 2.0])),
        "ops, positions": lambda: _ops_rope(old=torch.tensor([0.0, 1.0]))},
    "index_shape": {
        "reference": lambda: _ref_transfer(dst_slots=(3, 4)),
        "ops": lambda: _ops_transfer(dst_slots=(3, 4))},
    "element_type": {
        "reference": lambda: _ref_transfer(dst_dtype="float32"),
        "ops": lambda: _ops_transfer(dst_dtype="float32"),
        "reference, same size": lambda: _ref_transfer(dst_dtype="bfloat16"),
        "ops, same size": lambda: _ops_transfer(dst_dtype="bfloat16"),
        "reference, rope keys": lambda: _ref_rope(keys_dtype=np.int32),
        "ops, rope keys": lambda: _ops_rope(keys_dtype=torch.int32)},
    "row_width": {
        "reference": lambda: _ref_transfer(dst_geom=Geometry(P=2, L=2, NB=4, BS=4, H=2, E=4)),
        "ops": lambda: _ops_transfer(dst_geom=Geometry(P=2, L=2, NB=4, BS=4, H=2, E=4))},
    "layout_shape": {
        "reference": lambda: lambda: R.geometry_of(SRC, [np.zeros((2, 4, 4, 16))]),
        "ops": lambda: lambda: ops.bind(SRC, [torch.zeros(2, 4, 4, 16)])},
    "layer_plane_out_of_range": {
        "reference": lambda: _ref_transfer(src_layers=[2], dst_layers=[0]),
        "ops": lambda: _ops_transfer(src_layers=[2], dst_layers=[0])},
    "layer_plane_pairing": {
        "reference": lambda: _ref_transfer(src_layers=[0, 1], dst_layers=[0, 0]),
        "ops": lambda: _ops_transfer(src_layers=[0, 1], dst_layers=[0, 0]),
        "reference, counts": lambda: _ref_transfer(src_layers=[0], dst_layers=[0, 1]),
        "ops, counts": lambda: _ops_transfer(src_layers=[0], dst_layers=[0, 1])},
    "integer_argument": {
        "reference": lambda: _ref_transfer(skip_prefix=1.0),
        "ops": lambda: _ops_transfer(skip_prefix=1.0),
        "reference, layers": lambda: _ref_transfer(src_layers=[True], dst_layers=[0]),
        "ops, layers": lambda: _ops_transfer(src_layers=[True], dst_layers=[0])},
    "argument_range": {
        "reference": lambda: lambda: R.transfer(CHUNK, _np(CHUNK, CG), DST, _np(DST, G), None, None, num_tokens=-1),
        "ops": lambda: lambda: ops.transfer(_torch(CHUNK, CG), _torch(DST, G), None, None, num_tokens=-1)},
    "page_out_of_range": {
        "reference": lambda: _ref_page(lambda c: R.get_page(DST, c, 4, page_size=4)),
        "ops": lambda: _ops_page(lambda c: ops.get_page(c, 4))},
    "flat_page_size": {
        "reference": lambda: _ref_page(lambda c: R.set_page(DST, c, 0, np.zeros(5, np.float16), page_size=4)),
        "ops": lambda: _ops_page(lambda c: ops.set_page(c, 0, torch.zeros(5, dtype=torch.float16)))},
    "position_out_of_range": {
        "reference": lambda: _ref_rope(new=(2, 16)),
        "ops": lambda: _ops_rope(new=(2, 16)),
        "compat lmcache": lambda: _lmcache_rope([0, 1], [2, 16])},
    "rope_geometry": {
        "reference": lambda: _ref_rope(rot=10),
        "ops": lambda: _ops_rope(rot=10),
        "reference, keys": lambda: _ref_rope(keys_shape=(2, 8)),
        "ops, keys": lambda: _ops_rope(keys_shape=(2, 8))},
    "memory_overlap": {"ops": _self_overlap},
    "devices": {"ops": _meta_destination},
    "in_place": {"ops": _leaf_requiring_grad},
}
"""Per refusal rule: path -> a factory of a zero-argument call that breaks the rule."""

CASES = [pytest.param(rule, path, id=f"{rule}-{path}") for rule, paths in SAMPLES.items() for path in paths]


def test_every_refusal_rule_has_samples_on_every_path_it_covers():
    assert set(SAMPLES) == {r.name for r in semantics.refusals()}
    for rule in semantics.refusals():
        paths = SAMPLES[rule.name]
        assert "ops" in paths, rule.name
        assert ("reference" in paths) != rule.ops_only, f"{rule.name}: ops_only and a reference sample disagree"


@pytest.mark.parametrize("rule,path", CASES)
def test_refusal_raises_the_rules_exception(rule, path):
    error = semantics.get(rule).error
    call = SAMPLES[rule][path]()
    with pytest.raises(Exception) as caught:
        call()
    # exactly the rule's type: IndexError must not arrive as ValueError, nor the reverse, on any path
    assert type(caught.value) is error, f"{path} raised {type(caught.value).__name__}: {caught.value}"


# ---------------------------------------------------------------------------------------
# the native op itself (below the Python checks)
# ---------------------------------------------------------------------------------------

def _native_call(src_slots, dst_slots, *, skip_prefix=0):
    """``copy_rows`` of the plan of a SRC -> DST transfer, with the slots as given (no Python checks)."""
    src, dst = _torch(SRC, G), _torch(DST, G, seed=1)
    launch = ops.plan(src, dst, [0, 1], [0, 1], [0, 1], [0, 1])[0]
    T = int(src_slots.shape[0]) if src_slots.dim() else 0
    return lambda: torch.ops.kvlayout.copy_rows(
        launch.src_tensors, launch.dst_tensors, src_slots, dst_slots, T, skip_prefix, launch.src_segments,
        launch.dst_segments, launch.src_geometry, launch.dst_geometry, launch.num_pieces, launch.piece_bytes, 0,
        torch.zeros(5, dtype=torch.int64), False)


NATIVE = [
    pytest.param("slot_out_of_range", lambda: _native_call(_slots([0, 16]), _slots([1, 2])), id="slot_out_of_range"),
    pytest.param("duplicate_destination_slot", lambda: _native_call(_slots([0, 1]), _slots([2, 2])),
                 id="duplicate_destination_slot"),
    pytest.param("index_dtype", lambda: _native_call(torch.tensor([0.0, 1.0]), _slots([1, 2])), id="index_dtype"),
    pytest.param("index_shape", lambda: _native_call(_slots([[0, 1]]).view(2, 1), _slots([1, 2])), id="index_shape"),
    pytest.param("skip_prefix", lambda: _native_call(_slots([0, 1]), _slots([1, 2]), skip_prefix=3),
                 id="skip_prefix"),
]


@pytest.mark.parametrize("rule,make", NATIVE)
def test_native_op_raises_the_rules_exception(rule, make):
    with pytest.raises(Exception) as caught:
        make()()
    assert type(caught.value) is semantics.get(rule).error, f"{type(caught.value).__name__}: {caught.value}"


# ---------------------------------------------------------------------------------------
# behaviour rules: the reference and the CPU op compute the same bytes
# ---------------------------------------------------------------------------------------

def _same_transfer(src_slots, dst_slots, **kw):
    """Reference and op of one SRC -> DST transfer on the same initial bytes; returns both destinations."""
    src_np, dst_np = _np(SRC, G), _np(DST, G, seed=1)
    want = R.transfer(SRC, src_np, DST, dst_np, None if src_slots is None else np.asarray(src_slots, np.int64),
                      None if dst_slots is None else np.asarray(dst_slots, np.int64), **kw)
    dst = ops.bind(DST, TC.to_torch(DST, dst_np, "cpu"), page_size=4)
    ops.transfer(ops.bind(SRC, TC.to_torch(SRC, src_np, "cpu")), dst,
                 None if src_slots is None else _slots(list(src_slots)),
                 None if dst_slots is None else _slots(list(dst_slots)), **kw)
    return want, dst, dst_np


def _check_same(want, dst):
    got = [t.numpy() for t in dst.tensors]
    want = [np.asarray(x) for x in R.flat_arrays(DST, want)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint16), S.bits(w))


def _rows():
    _check_same(*_same_transfer([0, 5, 9], [1, 2, 3], src_layers=[1], dst_layers=[0])[:2])


def _negative_slot():
    want, dst, before = _same_transfer([0, -1, 9, -(2 ** 62)], [1, 2, -7, 4])
    _check_same(want, dst)
    # only token 0 has two valid slots; the rows of destination slots 2 and 4 keep their bytes
    got = dst.tensors[0].numpy().view(np.uint16)                       # [P, N, L, H, E]: slots on axis 1
    np.testing.assert_array_equal(got[:, [2, 4]], S.bits(before)[:, [2, 4]])


def _empty():
    want, dst, before = _same_transfer([], [])
    _check_same(want, dst)
    np.testing.assert_array_equal(dst.tensors[0].numpy().view(np.uint16), S.bits(before))


def _byte_exact():
    src_np = _np(SRC, G, "float32")
    for layer in src_np:                              # quiet and signalling NaNs with payloads
        layer.reshape(-1).view(np.uint32)[:64] = np.arange(0x7FC00001, 0x7FC00041, dtype=np.uint32)
        layer.reshape(-1).view(np.uint32)[64:128] = np.arange(0xFF800001, 0xFF800041, dtype=np.uint32)
    dst_np = _np(DST, G, "float32", 1)
    s, d = np.arange(16), np.arange(16)[::-1].copy()
    want = R.transfer(SRC, src_np, DST, dst_np, s, d)
    dst = ops.bind(DST, TC.to_torch(DST, dst_np, "cpu"), page_size=4)
    ops.transfer(ops.bind(SRC, TC.to_torch(SRC, src_np, "cpu")), dst, torch.from_numpy(s), torch.from_numpy(d))
    np.testing.assert_array_equal(dst.tensors[0].numpy().view(np.uint32), S.bits(want))


def _skip_prefix():
    _check_same(*_same_transfer([0, 1, 2, 3], [4, 5, 6, 7], skip_prefix=2)[:2])


def _move_overlap():
    cache_np = _np(SRC, G)
    src, dst = np.array([0, 1, 2, 3]), np.array([1, 2, 3, 4])     # a shift: every read sees the old cache
    want = R.move(SRC, cache_np, src, dst)
    cache = ops.bind(SRC, TC.to_torch(SRC, cache_np, "cpu"))
    ops.move(cache, torch.from_numpy(src), torch.from_numpy(dst))
    for got, w in zip(cache.tensors, want):
        np.testing.assert_array_equal(got.numpy().view(np.uint16), S.bits(w))


BEHAVIOURS = {"rows": _rows, "negative_slot": _negative_slot, "empty": _empty, "byte_exact": _byte_exact,
              "skip_prefix": _skip_prefix, "move_overlap": _move_overlap}


def test_every_behaviour_rule_has_a_check():
    behaviour = {r.name for r in semantics.behaviours()}
    assert behaviour <= set(BEHAVIOURS), behaviour - set(BEHAVIOURS)


@pytest.mark.parametrize("rule", list(BEHAVIOURS))
def test_behaviour_reference_and_op_agree(rule):
    assert rule in semantics.RULES
    BEHAVIOURS[rule]()


def test_rules_are_stated_once():
    from kvlayout.commands import spec

    assert not hasattr(spec, "SEMANTICS"), "the spec command must render the rules, not state them"
    text = spec.render()
    for rule in semantics.RULES.values():
        assert text.count(f"**`{rule.name}`**") == 1, rule.name


# ---------------------------------------------------------------------------------------
# conformance cites the rules by name
# ---------------------------------------------------------------------------------------

COVERED_HERE_ONLY = {"argument_range", "in_place", "integer_argument", "layout_shape"}
"""Refusal rules no conformance error kind draws (their samples: above, tests/test_ops_errors.py, test_hardening.py)."""


def test_conformance_error_kinds_cite_rules():
    from kvlayout.conformance.families import FAMILIES

    cited = set()
    for family in FAMILIES.values():
        for kind in family.errors:
            rule = semantics.get(kind.rule)          # an unknown name raises KeyError
            assert rule.error is not None, f"{kind.name}: rule {rule.name} refuses nothing"
            assert kind.error_type is rule.error, kind.name
            cited.add(rule.name)
    assert cited | COVERED_HERE_ONLY == {r.name for r in semantics.refusals()}
