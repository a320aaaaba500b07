"""The device kernel's work walk (torch_ext/include/kvlayout/copy_rows_kernel.h),
run on the host.

Every GPU backend (CUDA, SYCL) moves rows with `copy_rows_walk`; the
`walk_lib` fixture (conftest.py) compiles that header with the host compiler
into a small library (tests/native/walk_emulator.cpp) that runs every thread of a launch one after
the other, and checks the bytes it writes against the address formula of
address.h computed here in numpy, for random geometries: pages, pieces laid
out inside or outside the slots, negative and out-of-range slots, int32 and
int64 slots with strides, skip_prefix, every vector width, every count of
loads in flight a launch walks with (kWalkUnrolls), grids of many sizes. It
also checks the precomputed division.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest


def _ptr(a: np.ndarray | None):
    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def _side(rng, num_slots: int, num_pieces: int, piece_bytes: int, vec: int) -> list[int]:
    """[num_slots, page_size, stride_page, stride_in_page, stride_piece] of one side:
    pieces inside a slot's row (NHD-like) or slots inside a piece (HND-like),
    with random vec-aligned gaps; distinct (slot, piece) never overlap."""
    page = int(rng.choice([1, 2, 3, 4, 16]))
    gap = lambda: vec * int(rng.integers(0, 3))  # noqa: E731
    if rng.random() < 0.5:  # pieces inside the row
        sp = piece_bytes + gap()
        sip = num_pieces * sp + gap()
        spage = page * sip + gap()
    else:  # the page holds piece-major blocks of slots
        sip = piece_bytes + gap()
        sp = page * sip + gap()
        spage = num_pieces * sp + gap()
    return [num_slots, page, spage, sip, sp]


def _row_offset(g, slot):
    return (slot // g[1]) * g[2] + (slot % g[1]) * g[3]


def _slots(rng, count, num_slots, *, unique, allow_bad):
    if unique:
        s = rng.permutation(num_slots)[:count].astype(np.int64)
    else:
        s = rng.integers(0, num_slots, count).astype(np.int64)
    if allow_bad:
        s[rng.random(count) < 0.1] = -1
        bad = rng.random(count) < 0.05
        s[bad] = num_slots + rng.integers(0, 3, int(bad.sum()))
    return s


def _case(rng, walk_lib, *, num_segments=None):
    vec = int(rng.choice([1, 2, 4, 8, 16]))
    num_pieces = int(rng.choice([1, 1, 2, 3, 8]))
    piece_bytes = vec * int(rng.choice([1, 2, 3, 5, 16, 72]))
    num_tokens = int(rng.integers(1, 48))
    skip = int(rng.integers(0, num_tokens))
    S = num_segments or int(rng.choice([1, 2, 3, 8, 64]))
    src_n = int(rng.integers(1, 80))
    dst_n = int(rng.integers(num_tokens, num_tokens + 40))
    sg = _side(rng, src_n, num_pieces, piece_bytes, vec)
    dg = _side(rng, dst_n, num_pieces, piece_bytes, vec)

    def region(g):
        pages = -(-g[0] // g[1])
        return pages * g[2] + vec * 2

    src_off = np.array([j * region(sg) + vec for j in range(S)], np.int64)
    dst_off = np.array([j * region(dg) + vec for j in range(S)], np.int64)
    src_buf = rng.integers(0, 256, int(src_off[-1] + region(sg)), dtype=np.uint8)
    dst_buf = rng.integers(0, 256, int(dst_off[-1] + region(dg)), dtype=np.uint8)

    slot_dtype = np.int32 if rng.random() < 0.5 else np.int64
    stride = int(rng.choice([1, 1, 2]))
    identity_src = rng.random() < 0.2
    src_s = None if identity_src and num_tokens <= src_n else _slots(
        rng, num_tokens, src_n, unique=False, allow_bad=True)
    dst_s = _slots(rng, num_tokens, dst_n, unique=True, allow_bad=True)

    def strided(s):
        if s is None:
            return None
        a = np.zeros(len(s) * stride, slot_dtype)
        a[::stride] = s
        return a

    src_arr, dst_arr = strided(src_s), strided(dst_s)
    expected = dst_buf.copy()
    invalid = []
    for t in range(skip, num_tokens):
        s = t if src_s is None else int(src_s[t])
        d = int(dst_s[t])
        if s < 0 or d < 0:
            continue
        if s >= src_n:
            invalid.append((t, s, src_n, 0))
            continue
        if d >= dst_n:
            invalid.append((t, d, dst_n, 1))
            continue
        for j in range(S):
            for h in range(num_pieces):
                so = int(src_off[j]) + _row_offset(sg, s) + h * sg[4]
                do = int(dst_off[j]) + _row_offset(dg, d) + h * dg[4]
                expected[do:do + piece_bytes] = src_buf[so:so + piece_bytes]
    return dict(vec=vec, num_pieces=num_pieces, piece_bytes=piece_bytes, num_tokens=num_tokens,
                skip=skip, S=S, sg=np.array(sg, np.int64), dg=np.array(dg, np.int64),
                src_off=src_off, dst_off=dst_off, src_buf=src_buf, dst_buf=dst_buf,
                src_arr=src_arr, dst_arr=dst_arr, stride=stride,
                slot_bytes=np.dtype(slot_dtype).itemsize, expected=expected, invalid=invalid)


def _emulate_rc(walk_lib, c, unroll, num_threads, dst=None, status=None) -> int:
    """kvl_emulate_walk on the case (into ``dst`` and ``status`` where given): its return code."""
    dst = c["dst_buf"].copy() if dst is None else dst
    status = np.zeros(5, np.int64) if status is None else status
    return walk_lib.kvl_emulate_walk(
        _ptr(c["sg"]), _ptr(c["dg"]), _ptr(c["src_arr"]), c["stride"], _ptr(c["dst_arr"]),
        c["stride"], c["slot_bytes"], c["skip"], c["num_tokens"], c["S"], _ptr(c["src_off"]),
        _ptr(c["dst_off"]), _ptr(c["src_buf"]), _ptr(dst), c["num_pieces"], c["piece_bytes"],
        c["vec"], unroll, num_threads, _ptr(status))


def _emulate(walk_lib, c, unroll, num_threads):
    """The case's launch emulated (unroll 0: one row per CTA, ``num_threads`` lanes each): its
    destination and status; the source is left as it was."""
    status = np.zeros(5, np.int64)
    dst = c["dst_buf"].copy()
    src_before = c["src_buf"].copy()
    assert _emulate_rc(walk_lib, c, unroll, num_threads, dst, status) == 0
    assert np.array_equal(c["src_buf"], src_before), "the copy wrote its source"
    return dst, status


def _run(walk_lib, c, unroll, num_threads):
    dst, status = _emulate(walk_lib, c, unroll, num_threads)
    waits, writes_before, loads_before = _wait_counts(walk_lib)
    # every thread waits once (an early-loads grid ends after the previous kernel), and nothing is
    # written before its wait
    assert waits == num_threads and writes_before == 0
    return dst, status


def _unrolls(walk_lib) -> tuple[int, ...]:
    """kWalkUnrolls: the loads in flight of the device and host variants, and of each under an SM budget."""
    out = np.zeros(4, np.int32)
    walk_lib.kvl_walk_unrolls(_ptr(out))
    assert len(set(out.tolist())) == 4 and out.min() >= 1
    return tuple(int(x) for x in out)


def _wait_counts(walk_lib) -> tuple[int, int, int]:
    out = np.zeros(3, np.int64)
    walk_lib.kvl_wait_counts(_ptr(out))
    return tuple(int(x) for x in out)


def _assert_the_formulas_rows(c, dst, status, label):
    """``dst`` holds exactly the case's expected bytes, and ``status`` records one of its out-of-range tokens,
    each token once."""
    bad = np.flatnonzero(dst != c["expected"])
    assert bad.size == 0, f"{label}: {bad.size} bytes differ, first at {bad[:4]}"
    assert status[0] == len(c["invalid"]), "each out-of-range token is recorded once"
    if c["invalid"]:
        assert tuple(int(x) for x in status[1:5]) in c["invalid"]


@pytest.mark.parametrize("seed", range(60))
def test_walk_moves_exactly_the_rows_of_the_formula(walk_lib, seed):
    rng = np.random.default_rng(seed)
    c = _case(rng, walk_lib)
    for unroll in _unrolls(walk_lib):
        for num_threads in (32, 96, 256, 32 * int(rng.integers(1, 70))):
            _assert_the_formulas_rows(c, *_run(walk_lib, c, unroll, num_threads),
                                      f"unroll {unroll}, {num_threads} threads")


@pytest.mark.parametrize("seed", range(60))
def test_one_row_per_cta_moves_exactly_the_rows_of_the_formula(walk_lib, seed):
    """copy_one_row (the CUDA device variant's wide rows, one per CTA): the same bytes and records as the
    walk, whatever the number of lanes per row."""
    rng = np.random.default_rng(seed)
    c = _case(rng, walk_lib)
    for lanes in (1, 32, 128, int(rng.integers(2, 200))):
        _assert_the_formulas_rows(c, *_emulate(walk_lib, c, 0, lanes), f"{lanes} lanes")


@pytest.mark.parametrize("seed", range(40))
def test_one_row_per_cta_in_narrower_words_moves_the_same_rows(walk_lib, seed):
    """copy_one_row in words narrower than the launch's vectors (the CUDA host variant moves 16-byte vectors as
    8-byte words): each vector's words at consecutive addresses, the same bytes and records as the formula."""
    rng = np.random.default_rng(1000 + seed)
    c = _case(rng, walk_lib)
    words = [w for w in (1, 2, 4, 8) if w < c["vec"]]
    try:
        for word in words:
            walk_lib.kvl_set_row_word(word)
            for lanes in (1, 32, 128, int(rng.integers(2, 200))):
                _assert_the_formulas_rows(c, *_emulate(walk_lib, c, 0, lanes), f"{word}-byte words, {lanes} lanes")
        walk_lib.kvl_set_row_word(2 * c["vec"])   # wider than a vector: refused
        assert _emulate_rc(walk_lib, c, 0, 32) == -1
    finally:
        walk_lib.kvl_set_row_word(0)


def test_a_threads_first_batch_loads_before_its_wait(walk_lib):
    """The early-loads kernel's point: a thread issues its first UNROLL loads, then waits, then writes."""
    tokens, row = 64, 16
    geometry = np.array([tokens, 1, row, row, row], np.int64)
    src = np.arange(tokens * row, dtype=np.uint8)
    dst = np.zeros_like(src)
    offsets = np.zeros(1, np.int64)
    status = np.zeros(5, np.int64)
    # identity slots, one segment, 32 threads: each lane moves 2 of the 64 rows, both in its first batch
    # (early loads run in the host variant, with and without an SM budget)
    _, host, _, budget_host = _unrolls(walk_lib)
    for unroll in (host, budget_host):
        dst[:] = 0
        rc = walk_lib.kvl_emulate_walk(_ptr(geometry), _ptr(geometry), None, 1, None, 1, 8, 0, tokens, 1,
                                       _ptr(offsets), _ptr(offsets), _ptr(src), _ptr(dst), 1, row, 16, unroll,
                                       32, _ptr(status))
        assert rc == 0 and np.array_equal(dst, src) and status[0] == 0
        assert _wait_counts(walk_lib) == (32, 0, tokens)


def test_walk_with_a_thousand_segments(walk_lib):
    rng = np.random.default_rng(7)
    c = _case(rng, walk_lib, num_segments=1024)
    for unroll in _unrolls(walk_lib):
        dst, status = _run(walk_lib, c, unroll, 256 * 5)
        assert np.array_equal(dst, c["expected"])
        assert status[0] == len(c["invalid"])


def test_fast_divmod_matches_integer_division(walk_lib):
    rng = np.random.default_rng(3)
    q, r = ctypes.c_int64(), ctypes.c_int64()
    divisors = [1, 2, 3, 5, 7, 16, 72, 127, 1000, 65537, 2**20 + 1, 2**30, 2**31 - 1]
    divisors += [int(x) for x in rng.integers(1, 2**31 - 1, 40)]
    for d in divisors:
        for wide in (False, True):
            max_n = 2**40 if wide else 2**31 - 1
            ns = [0, 1, d - 1, d, d + 1, 2**31 - 1, 2 * d - 1]
            ns += [int(x) for x in rng.integers(0, max_n, 50)]
            for n in ns:
                if n > max_n:
                    continue
                walk_lib.kvl_fast_divmod(d, max_n, n, ctypes.byref(q), ctypes.byref(r))
                assert (q.value, r.value) == divmod(n, d), (d, n, wide)
