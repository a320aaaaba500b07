"""Binding tensors of a structure bound before: one shared shape, the tensors still each binding's own.

An engine's adapter binds fresh views of its buffers call after call (``ops.gather(cache, slots, out=view)``,
the compat entry points): what binding derives from sizes, strides, element type and device is kept per
structure (``kvlayout.ops.views.SHAPES``), and so are the checked arguments and program key of a transfer
between two such shapes.  These tests hold that reuse to exactness: every structural difference gets its own
shape, a bad binding still raises, no tensor is kept, the cache stays bounded, and transfers between fresh
bindings move exactly the rows they name.
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

from kvlayout import _C, ops

import torch_cases as TC

L, NB, BS, H, E = 3, 8, 4, 2, 8
CACHE, CHUNK = "vllm_flash_attn_nhd", "lmcache_kv_2ltd"


def _layers(device="cpu", dtype=torch.float32, layers=L):
    return [torch.randn(2, NB, BS, H, E, device=device).to(dtype) for _ in range(layers)]


def test_fresh_bindings_of_one_structure_share_a_shape_and_keep_their_own_tensors():
    first, second = _layers(), _layers()
    a, b = ops.bind(CACHE, first), ops.bind(CACHE, second)
    assert a._shape is b._shape and a.geometry == b.geometry
    assert all(x is y for x, y in zip(b.tensors, second))
    assert all(pv.tensors[0] is t for pv, t in zip(b.parts, [second[0]]))
    assert b.value == second and ops.bind(CACHE, b.value)._shape is a._shape
    # views of the same memory made anew each call are the same structure too
    chunk = torch.zeros(2, L, 16, H * E)
    assert ops.bind(CHUNK, chunk.view(2, L, 16, H * E))._shape is ops.bind(CHUNK, chunk[:])._shape


def test_every_structural_difference_gets_its_own_shape():
    base = ops.bind(CACHE, _layers())
    hnd = [torch.randn(2, NB, H, BS, E).transpose(2, 3) for _ in range(L)]    # same sizes, other strides
    others = {
        "strides": ops.bind(CACHE, hnd),
        "dtype": ops.bind(CACHE, _layers(dtype=torch.float16)),
        "layers": ops.bind(CACHE, _layers(layers=L + 1)),
        "device": ops.bind(CACHE, [t.to("meta") for t in _layers()]),
    }
    for what, cache in others.items():
        assert cache._shape is not base._shape, what
    hnd_cache = others["strides"]
    assert hnd_cache.parts[0].strides["h"] == BS * E and base.parts[0].strides["h"] == E
    assert others["dtype"].dtype == torch.float16 and others["layers"].geometry.L == L + 1
    # a flat slot axis: the page size is part of the structure
    pool = torch.zeros(2, L, NB * BS, H, E)
    by_page = {ps: ops.bind("hicache_layer_first", pool, page_size=ps) for ps in (1, 4)}
    assert by_page[1]._shape is not by_page[4]._shape and by_page[4].geometry.BS == 4


def test_a_structure_is_equal_exactly_for_equal_sequences_and_short_for_a_per_layer_list():
    """The structure bytes name a list of tensors' structures in order: lists that differ in any tensor, or in
    order, or in length, differ; lists of equal structures (other tensors, other values) are equal. A tensor of
    the structure of the one before it adds one word, so a per-layer list hashes in little time."""
    from kvlayout import _C

    a, b, c = torch.zeros(2, 3, 4), torch.zeros(2, 3, 5), torch.zeros(2, 3, 4, dtype=torch.float16)
    lists = {"A": [a], "AA": [a, a], "AAA": [a, a, a], "AAB": [a, a, b], "ABB": [a, b, b], "ABA": [a, b, a],
             "BAA": [b, a, a], "AAC": [a, a, c], "A A^T": [a, a.transpose(0, 1).contiguous().transpose(0, 1)]}
    structures = {name: _C.tensors_structure(ts) for name, ts in lists.items()}
    assert len(set(structures.values())) == len(structures), structures
    assert _C.tensors_structure([torch.ones(2, 3, 4), torch.empty(2, 3, 4), torch.ones(2, 3, 5)]) == structures["AAB"]
    one = len(_C.tensors_structure([a]))
    assert len(_C.tensors_structure([a] * 32)) == one + 31 * 8


def test_bad_bindings_still_raise_after_good_ones_of_the_same_layout():
    ops.bind(CACHE, _layers())
    mixed = _layers()
    mixed[1] = torch.randn(2, NB, H, BS, E).transpose(2, 3)     # one layer with other strides
    with pytest.raises(ValueError, match="layer 1 has strides"):
        ops.bind(CACHE, mixed)
    mixed = _layers()
    mixed[2] = mixed[2].half()
    with pytest.raises(TypeError, match="tensor 2 has dtype"):
        ops.bind(CACHE, mixed)
    with pytest.raises(ValueError, match="must have 5 dims"):
        ops.bind(CACHE, [t[0] for t in _layers()])
    with pytest.raises((TypeError, AttributeError)):
        ops.bind(CACHE, [*_layers()[:2], "not a tensor"])
    sparse = torch.zeros(2, L, 3, H * E).to_sparse()
    with pytest.raises(ValueError, match="needs contiguous elements"):     # (no strides: read the long way)
        ops.bind(CHUNK, sparse)


def test_the_shape_cache_is_bounded_and_keeps_no_tensor():
    saved = ops.cache_info()["shapes_capacity"]
    try:
        ops.set_cache_capacity(shapes=4)
        for T in range(1, 11):
            ops.bind(CHUNK, torch.zeros(2, L, T, H * E))
            assert ops.cache_info()["shapes"] <= 4
        assert ops.cache_info()["shapes_capacity"] == 4
        chunk = torch.zeros(2, L, 99, H * E)
        kv = ops.bind(CACHE, _layers())
        ops.transfer(kv, ops.bind(CHUNK, chunk), torch.arange(99) % (NB * BS))
        gone = weakref.ref(chunk)
        del chunk
        gc.collect()
        assert gone() is None       # neither the shape nor the choices it keeps hold the chunk
        for bad in (0, -1, 2.5, True):
            with pytest.raises(ValueError, match="shape cache capacity must be a positive int"):
                ops.set_cache_capacity(shapes=bad)
    finally:
        ops.set_cache_capacity(shapes=saved)


def test_transfers_between_fresh_bindings_move_exactly_the_named_rows(device):
    """Gathers into a view made per call and all-layer / one-layer transfers both ways between caches bound anew
    per call, with random slots, token counts and layers: every row where the slots put it, the checked
    choice made once per pair of shapes and choice, no program added when the calls come again."""
    tensors = _layers(device)
    kv = ops.bind(CACHE, tensors)
    flat = [t.reshape(2, NB * BS, H, E).cpu() for t in tensors]

    def calls():
        rng = random.Random(7)
        for call in range(40):
            T = rng.choice((5, 16))
            slots = rng.sample(range(NB * BS), T)
            s = torch.tensor(slots, device=device)
            layers = sorted(rng.sample(range(L), rng.randint(1, L))) if call % 3 == 0 else list(range(L))
            buf = torch.full((2, len(layers), T, H * E), float("nan"), device=device)
            if call % 2:
                ops.gather(ops.bind(CACHE, tensors), s, out=buf.view(2, len(layers), T, H, E), layers=layers)
            else:
                ops.transfer(ops.bind(CACHE, tensors), ops.bind(CHUNK, buf.view(2, len(layers), T, H * E)), s,
                             src_layers=layers)
            TC.sync(device)
            want = torch.stack([torch.stack([flat[layer][p][slots].reshape(T, H * E) for layer in layers])
                                for p in range(2)])
            assert torch.equal(buf.cpu(), want), call

    calls()
    planned = (ops.cache_info()["programs"], len(kv._shape.choices))
    calls()     # the same calls again: every pair of shapes and choice known, nothing planned or checked anew
    assert (ops.cache_info()["programs"], len(kv._shape.choices)) == planned
    # back into the cache, through fresh bindings on both sides, one layer per call
    rows = torch.randn(2, 1, 6, H * E, device=device)
    slots = [3, 9, 17, 4, 30, 0]
    for layer in range(L):
        ops.transfer(ops.bind(CHUNK, rows[:]), ops.bind(CACHE, list(tensors)), None,
                     torch.tensor(slots, device=device), src_layers=[0], dst_layers=[layer])
    TC.sync(device)
    for layer in range(L):
        got = tensors[layer].reshape(2, NB * BS, H * E)[:, slots].cpu()
        assert torch.equal(got, rows[:, 0].cpu())


def test_a_pair_of_shapes_keeps_one_checked_choice_per_choice():
    """The checked arguments of a choice are made once per pair of shapes; another destination shape, or another
    choice, gets its own (never one of another pair)."""
    tensors = _layers()
    src = ops.bind(CACHE, tensors)
    src._shape.choices.clear()
    slots = torch.tensor([1, 2, 3])
    for _ in range(3):
        ops.transfer(ops.bind(CACHE, tensors), ops.bind(CHUNK, torch.zeros(2, L, 3, H * E)), slots)
    assert len(src._shape.choices) == 1
    ops.transfer(ops.bind(CACHE, tensors), ops.bind(CHUNK, torch.zeros(2, 1, 3, H * E)), slots, src_layers=[2])
    ops.transfer(ops.bind(CACHE, tensors), ops.bind(CHUNK, torch.zeros(2, L, 4, H * E)), torch.arange(4))
    assert len(src._shape.choices) == 3
    keys = list(src._shape.choices)
    assert len({k[0] for k in keys}) == 3      # three destination shapes
    with pytest.raises(ValueError, match="destination takes 1 layer"):
        ops.transfer(ops.bind(CACHE, tensors), ops.bind(CHUNK, torch.zeros(2, 1, 3, H * E)), slots)


def test_the_shape_cache_bound_is_read_from_the_environment_at_import():
    import os
    import subprocess
    import sys

    probe = "from kvlayout import ops; print(ops.cache_info()['shapes_capacity'])"
    for value, ok in (("3", True), ("0", False), ("many", False)):
        run = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "KVLAYOUT_SHAPE_CACHE": value},
                             capture_output=True, text=True, timeout=120)
        if ok:
            assert run.returncode == 0 and run.stdout.strip() == value, run.stderr
        else:
            assert run.returncode != 0 and f"KVLAYOUT_SHAPE_CACHE = {value!r}: it must be a positive integer" \
                in run.stderr


def test_a_cache_bound_once_reads_its_tensors_as_they_are_now():
    """An engine binds its cache once and each call's chunk anew: the cache's tensors travel to C++ as one group
    made once (``KVCache.native_tensors``), whose binding lookup uses the structure the group recorded; a tensor re-set,
    resized or freed since must be read as it is now, never through the recorded addresses."""
    tensors = _layers()
    kv = ops.bind(CACHE, tensors)
    slots = torch.tensor([5, 0, 17, 30])
    chunks = [torch.zeros(2, L, 4, H * E) for _ in range(4)]

    def gathered(chunk):
        ops.transfer(kv, ops.bind(CHUNK, chunk), slots)
        return chunk

    def want():
        return torch.stack([torch.stack([t.reshape(2, NB * BS, H * E)[p][slots] for t in tensors])
                            for p in range(2)])

    for chunk in chunks:
        assert torch.equal(gathered(chunk), want())
    group = kv.native_tensors()
    assert isinstance(group, _C.TensorGroup) and kv.native_tensors() is group
    assert len(group) == L and group.unchanged()
    bindings = ops.cache_info()["bindings"]
    for chunk in chunks:                       # the same four chunks again: no binding made anew
        assert torch.equal(gathered(chunk), want())
    assert ops.cache_info()["bindings"] == bindings

    tensors[1].set_(torch.randn(2, NB, BS, H, E))   # re-set in place to other memory of the same structure
    assert not group.unchanged()
    assert torch.equal(gathered(chunks[0]), want())
    tensors[2].resize_(2, NB // 2, BS, H, E)         # now too small for the layout's slots
    with pytest.raises((ValueError, RuntimeError), match=r"tensor 2|\[2\]"):
        gathered(chunks[1])
    tensors[2].resize_(2, NB, BS, H, E)
    tensors[0].untyped_storage().resize_(0)          # freed
    with pytest.raises((ValueError, RuntimeError), match=r"tensor 0|\[0\]"):
        gathered(chunks[2])


def test_a_choice_whose_program_was_evicted_registers_it_again():
    """The choice of two shapes keeps its program's handle (a repeated call pins it without hashing the program
    key); when the registry evicted that program meanwhile the next call registers it again and runs."""
    from kvlayout.ops import programs

    tensors = _layers()
    slots = torch.tensor([3, 1])
    saved = programs.program_cache_capacity()
    try:
        chunk = ops.bind(CHUNK, torch.zeros(2, L, 2, H * E))
        ops.transfer(ops.bind(CACHE, tensors), chunk, slots)
        choice = next(c for key, c in ops.bind(CACHE, tensors)._shape.choices.items()
                      if key[0] == chunk._shape.serial)
        first = choice.handle
        assert first is not None
        programs.clear_unpinned()                 # evicted: the kept handle names no program now
        assert not programs.pin_registered(first)
        out = torch.zeros(2, L, 2, H * E)
        ops.transfer(ops.bind(CACHE, tensors), ops.bind(CHUNK, out), slots)
        assert choice.handle != first and programs.pin_registered(choice.handle)
        programs.unpin(choice.handle)
        want = torch.stack([torch.stack([t.reshape(2, NB * BS, H * E)[p][slots] for t in tensors])
                            for p in range(2)])
        assert torch.equal(out, want)
    finally:
        programs.set_program_cache_capacity(saved)


def test_prepared_copies_share_the_binding_of_tensors_bound_again_but_not_of_another_storage_there():
    """A prepared copy takes its checked binding from the native binding cache: the same tensors prepared again
    (an adapter binding its caches at every call) move exactly, and so do tensors of another storage at the same
    addresses (here numpy's view of the memory; in an engine, a freed buffer's memory handed out again), which
    get a binding of their own rather than one whose tensors they are not."""
    layers = _layers()
    chunk = torch.zeros(2, L, 6, H * E)
    slots = torch.tensor([5, 0, 17, 30, 2, 9])
    expected = torch.zeros_like(chunk)
    ops.transfer(ops.bind(CACHE, layers), ops.bind(CHUNK, expected), slots)
    for round_ in range(3):
        # the same tensors bound anew, then the same memory through other storages
        same = layers if round_ < 2 else [torch.from_numpy(t.numpy()) for t in layers]
        assert all(a.data_ptr() == b.data_ptr() for a, b in zip(same, layers))
        out = torch.zeros_like(chunk)
        t = ops.prepare(ops.bind(CACHE, same), ops.bind(CHUNK, out), slots)
        t()
        assert torch.equal(out, expected), round_
        out.zero_()
        for i in range(L):              # the layer calls, each checking its tensors are the ones bound
            t.layer(i)
        assert torch.equal(out, expected), round_
