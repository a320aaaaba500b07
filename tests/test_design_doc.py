"""docs/design.md's worked example, recomputed: every number the page quotes comes from the planner.

If the planner changes how it cuts rows into segments and pieces, this test
fails and the page is updated with it.
"""

from __future__ import annotations

import pathlib

import torch

from kvlayout import ops
from kvlayout import reference as R
from kvlayout.ops import programs

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "design.md"
L, NB, BS, H, D, T = 2, 4, 16, 8, 128, 40


def _caches(src_layout="vllm_flash_attn_nhd"):
    shape = (2, NB, BS, H, D) if src_layout.endswith("nhd") else (2, NB, H, BS, D)
    kv = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(L)]
    chunk = torch.zeros(2, L, T, H * D, dtype=torch.bfloat16)
    return kv, chunk, ops.bind(src_layout, kv), ops.bind("lmcache_kv_2ltd", chunk)


def _pairs(flat):
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(len(flat) // 2)]


def test_strides_segments_pieces_and_geometry():
    _, _, src, dst = _caches()
    s, d = src.parts[0].strides, dst.parts[0].strides
    assert (s["p"], s["nb"], s["bs"], s["h"], s["e"]) == (65536, 16384, 1024, 128, 1)
    assert (d["p"], d["l"], d["nb"], d["bs"], d["h"]) == (81920, 40960, 1024, 1024, 0)
    (launch,) = ops.plan(src, dst, [0, 1], [0, 1], [0, 1], [0, 1])
    assert (launch.num_pieces, launch.piece_bytes) == (1, 2048)
    assert launch.src_geometry == [64, 16, 32768, 2048, 0]
    assert launch.dst_geometry == [40, 1, 2048, 2048, 0]
    assert _pairs(launch.src_segments) == [(0, 0), (1, 0), (0, 131072), (1, 131072)]
    assert _pairs(launch.dst_segments) == [(0, 0), (0, 81920), (0, 163840), (0, 245760)]


def test_hnd_rows_are_eight_pieces():
    _, _, src, dst = _caches("vllm_flash_attn_hnd")
    (launch,) = ops.plan(src, dst, [0, 1], [0, 1], [0, 1], [0, 1])
    assert (launch.num_pieces, launch.piece_bytes) == (8, 256)
    assert (launch.src_geometry[4], launch.dst_geometry[4]) == (4096, 256)


def test_program_steps():
    _, _, src, dst = _caches()
    handle = programs.program_handle(programs.program_key(src, dst, [0, 1], [0, 1], [0, 1], [0, 1]))
    got = [[(_pairs(la.src_segments), _pairs(la.dst_segments)) for la in programs.resolve(handle, step, src, dst)]
           for step in range(3)]
    assert got == [
        [([(0, 0), (1, 0), (0, 131072), (1, 131072)], [(0, 0), (0, 81920), (0, 163840), (0, 245760)])],
        [([(0, 0), (0, 131072)], [(0, 0), (0, 163840)])],
        [([(1, 0), (1, 131072)], [(0, 81920), (0, 245760)])],
    ]


def test_worked_token():
    g = R.make_geometry("vllm_flash_attn_nhd", L=L, N=NB * BS, H=H, E=D, page_size=BS)
    assert R.element_location("vllm_flash_attn_nhd", g, 1, 1, 37, 3, 5) == ("kv", (1,), (1, 2, 5, 3, 5))
    gc = R.make_geometry("lmcache_kv_2ltd", L=L, N=T, H=1, E=H * D)
    assert R.element_location("lmcache_kv_2ltd", gc, 1, 1, 7, 0, 389) == ("kv", (), (1, 1, 7, 389))
    kv, chunk, src, dst = _caches()
    for layer, t in enumerate(kv):
        t.view(torch.int16).view(-1).copy_(torch.arange(t.numel(), dtype=torch.int32).to(torch.int16) + layer)
    slots = torch.full((T,), -1, dtype=torch.int64)
    slots[7] = 37
    ops.transfer(src, dst, slots, None)
    src_bytes, dst_bytes = kv[1].view(torch.uint8).view(-1), chunk.view(torch.uint8).view(-1)
    assert 131072 + (37 // 16) * 32768 + (37 % 16) * 2048 == 206848 and 245760 + 7 * 2048 == 260096
    assert torch.equal(dst_bytes[260096:260096 + 2048], src_bytes[206848:206848 + 2048])
    # the element of section 1, byte for byte
    assert torch.equal(dst_bytes[260096 + 389 * 2:][:2], src_bytes[206848 + (3 * 128 + 5) * 2:][:2])


def test_the_page_quotes_these_numbers():
    text = DOC.read_text(encoding="utf-8")
    for quoted in ("| source | 64 | 16 | 32768 | 2048 | 0 |", "| destination | 40 | 1 | 2048 | 2048 | 0 |",
                   "| 3 | V | 1 | (1, 131072) | (0, 245760) |", "= 206848", "260096", "8 pieces of 256 bytes",
                   "1 piece of 2048 bytes", "`kv[1][1, 2, 5, 3, 5]`", "`kv[1, 1, 7, 389]`"):
        assert quoted in text, quoted
