"""Independent oracles for the layout catalog: plain index arithmetic, no einops.

For each catalog layout, ``where(g, p, l, s, h, e)`` says where logical element
``(plane, layer, slot, head, e)`` of a cache with geometry ``g`` lives:
``(part name, list index or (), index inside the tensor)``.  These are written
from the physical structures engines document (e.g. vLLM FlashAttention HND is
``list[L] of [2, NB, H, BS, D]``), not from the reference's patterns, so the
tests can check the reference against them.

The helpers below read and write whole rows (all ``E`` elements of one head)
through ``where``: ``e`` is the innermost axis of every tensor, contiguous
inside a column block.
"""

from __future__ import annotations

import numpy as np

from kvlayout.reference import get


def _pg(g, s):
    return s // g.BS, s % g.BS


def _vllm_fa_nhd(g, p, l, s, h, e):
    nb, bs = _pg(g, s)
    return "kv", (l,), (p, nb, bs, h, e)            # list[L] of [2, NB, BS, H, D]


def _vllm_fa_hnd(g, p, l, s, h, e):
    nb, bs = _pg(g, s)
    return "kv", (l,), (p, nb, h, bs, e)            # list[L] of [2, NB, H, BS, D]


def _vllm_fi_nhd(g, p, l, s, h, e):
    nb, bs = _pg(g, s)
    return "kv", (l,), (nb, p, bs, h, e)            # list[L] of [NB, 2, BS, H, D]


def _vllm_fi_hnd(g, p, l, s, h, e):
    nb, bs = _pg(g, s)
    return "kv", (l,), (nb, p, h, bs, e)            # list[L] of [NB, 2, H, BS, D]


def _vllm_mla(g, p, l, s, h, e):
    nb, bs = _pg(g, s)
    return "latent", (l,), (nb, bs, e)              # list[L] of [NB, BS, D]


def _vllm_cross(g, p, l, s, h, e):
    nb, bs = _pg(g, s)
    return "kv", (), (nb, l, p, bs, h, e)           # [NB, L, 2, BS, H, D]


def _trtllm_cross(g, p, l, s, h, e):
    nb, bs = _pg(g, s)
    return "kv", (), (nb, l, p, h, bs, e)           # [NB, L, 2, H, BS, D]


def _packed_nhd(g, p, l, s, h, e):
    nb, bs = _pg(g, s)
    return "kv", (l,), (nb, bs, h, p, e)            # list[L] of [NB, BS, H, 2, D]


def _packed_hnd(g, p, l, s, h, e):
    nb, bs = _pg(g, s)
    return "kv", (l,), (nb, h, bs, p, e)            # list[L] of [NB, H, BS, 2, D]


def _sglang_mha(g, p, l, s, h, e):
    return ("k" if p == 0 else "v"), (l,), (s, h, e)  # K list[L] + V list[L] of [N, H, D]


def _sglang_mla(g, p, l, s, h, e):
    return "latent", (l,), (s, h, e)                # list[L] of [N, 1, D]


def _kv_2ltd(g, p, l, s, h, e):
    return "kv", (), (p, l, s, h * g.E + e)         # [2, L, T, H*D]


def _kv_t2d(g, p, l, s, h, e):
    return "kv", (), (s, p, h * g.E + e)            # [T, 2, H*D]


def _kv_2td(g, p, l, s, h, e):
    return "kv", (), (p, s, h * g.E + e)            # [2, T, H*D]


def _kv_mla(g, p, l, s, h, e):
    return "latent", (), (0, l, s, e)               # [1, L, T, D]


def _kv_mla_layer(g, p, l, s, h, e):
    return "latent", (), (s, e)                     # [T, D]


def _hc_layer_first(g, p, l, s, h, e):
    return "kv", (), (p, l, s, h, e)                # [2, L, N, H, D]


def _hc_page_first(g, p, l, s, h, e):
    return "kv", (), (p, s, l, h, e)                # [2, N, L, H, D]


def _hc_page_first_direct(g, p, l, s, h, e):
    nb, bs = _pg(g, s)
    return "kv", (), (p, nb, l, bs, h, e)           # [2, NP, L, P, H, D]


def _hc_page_head(g, p, l, s, h, e):
    nb, bs = _pg(g, s)
    return "kv", (), (p, nb, h, bs, l, e)           # [2, NP, H, P, L, D]


def _hc_mla_layer_first(g, p, l, s, h, e):
    return "latent", (), (l, s, h, e)               # [L, N, 1, D]


def _hc_mla_page_first(g, p, l, s, h, e):
    return "latent", (), (s, l, h, e)               # [N, L, 1, D]


def _hc_mla_page_first_direct(g, p, l, s, h, e):
    nb, bs = _pg(g, s)
    return "latent", (), (nb, l, bs, h, e)          # [NP, L, P, 1, D]


def _hc_mla_kv_split(g, p, l, s, h, e):
    nb, bs = _pg(g, s)
    nope = g.columns[0]                             # nope [NP, L, P, 1, R] + rope [NP, L, P, 1, Dr]
    if e < nope:
        return "nope", (), (nb, l, bs, h, e)
    return "rope", (), (nb, l, bs, h, e - nope)


def _hc_page_first_halves(g, p, l, s, h, e):
    return ("k" if p == 0 else "v"), (), (s, l, h, e)          # K [N, L, H, D] + V [N, L, H, D]


def _hc_page_first_direct_halves(g, p, l, s, h, e):
    nb, bs = _pg(g, s)
    return ("k" if p == 0 else "v"), (), (nb, l, bs, h, e)     # K [NP, L, P, H, D] + V [NP, L, P, H, D]


def _hc_page_head_halves(g, p, l, s, h, e):
    nb, bs = _pg(g, s)
    return ("k" if p == 0 else "v"), (), (nb, h, bs, l, e)     # K [NP, H, P, L, D] + V [NP, H, P, L, D]


def _rows(g, p, l, s, h, e):
    return "rows", (), (p, l, s, h, e)              # [P, L, T, H, E]


ORACLES = {
    "vllm_flash_attn_nhd": _vllm_fa_nhd,
    "vllm_flash_attn_hnd": _vllm_fa_hnd,
    "vllm_flashinfer_nhd": _vllm_fi_nhd,
    "vllm_flashinfer_hnd": _vllm_fi_hnd,
    "vllm_mla": _vllm_mla,
    "vllm_cross_layer": _vllm_cross,
    "trtllm_cross_layer_hnd": _trtllm_cross,
    "vllm_packed_nhd": _packed_nhd,
    "vllm_packed_hnd": _packed_hnd,
    "sglang_mha": _sglang_mha,
    "sglang_mla": _sglang_mla,
    "lmcache_kv_2ltd": _kv_2ltd,
    "lmcache_kv_t2d": _kv_t2d,
    "lmcache_kv_2td": _kv_2td,
    "lmcache_kv_mla": _kv_mla,
    "lmcache_kv_mla_layer": _kv_mla_layer,
    "hicache_layer_first": _hc_layer_first,
    "hicache_page_first": _hc_page_first,
    "hicache_page_first_direct": _hc_page_first_direct,
    "hicache_page_head": _hc_page_head,
    "hicache_mla_layer_first": _hc_mla_layer_first,
    "hicache_mla_page_first": _hc_mla_page_first,
    "hicache_mla_page_first_direct": _hc_mla_page_first_direct,
    "hicache_mla_page_first_kv_split": _hc_mla_kv_split,
    "hicache_page_first_kv_halves": _hc_page_first_halves,
    "hicache_page_first_direct_kv_halves": _hc_page_first_direct_halves,
    "hicache_page_head_kv_halves": _hc_page_head_halves,
    "rows": _rows,
}


def tensor(name, physical, part: str, outer: tuple) -> np.ndarray:
    """The numpy tensor of ``part`` (``outer`` = (layer,) for per-layer lists)."""
    layout = get(name)
    parts = (physical,) if len(layout.parts) == 1 else tuple(physical)
    index = [p.name for p in layout.parts].index(part)
    value = parts[index]
    return value[outer[0]] if outer else value


def element(name, g, physical, p, l, s, h, e):
    """The element at a logical coordinate, read through the oracle."""
    part, outer, idx = ORACLES[name](g, p, l, s, h, e)
    return tensor(name, physical, part, outer)[idx]


def _blocks(g):
    if g.columns:
        starts = np.cumsum((0,) + tuple(g.columns[:-1]))
        return list(zip(starts.tolist(), g.columns))
    return [(0, g.E)]


def row_slices(name, g, physical, p, l, s):
    """The ``H * E`` row of (plane, layer, slot) as a list of 1-D views, head by head."""
    out = []
    for h in range(g.H):
        for start, width in _blocks(g):
            part, outer, idx = ORACLES[name](g, p, l, s, h, start)
            t = tensor(name, physical, part, outer)
            out.append((t, idx[:-1] + (slice(idx[-1], idx[-1] + width),)))
    return out


def get_row(name, g, physical, p, l, s) -> np.ndarray:
    return np.concatenate([t[i] for t, i in row_slices(name, g, physical, p, l, s)])


def set_row(name, g, physical, p, l, s, row) -> None:
    start = 0
    for t, i in row_slices(name, g, physical, p, l, s):
        width = i[-1].stop - i[-1].start
        t[i] = row[start:start + width]
        start += width


def logical(name, g, physical) -> np.ndarray:
    """The whole ``[P, L, N, H*E]`` logical array, read row by row through the oracle."""
    first = tensor(name, physical, get(name).parts[0].name, (0,) if get(name).parts[0].per_layer else ())
    out = np.empty((g.P, g.L, g.N, g.H * g.E), first.dtype)
    for p in range(g.P):
        for l in range(g.L):
            for s in range(g.N):
                out[p, l, s] = get_row(name, g, physical, p, l, s)
    return out
