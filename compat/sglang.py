"""SGLang-compatible KV movement on top of kvlayout.ops.

* The ``transfer_kv_*`` family with SGLang's argument lists, taking tensors
  (or lists of per-layer tensors) where SGLang takes raw pointers and pointer
  tables.  Each function views the given tensors as rows of ``item_size``
  bytes (``Tensor.view``, no copy), binds them to a layout and makes one
  :func:`kvlayout.ops.transfer` call.
* :func:`move_kv_cache` (overlap-safe at any size: kvlayout gathers first).
* Device pools :class:`MHATokenToKVPool` / :class:`MLATokenToKVPool` with
  SGLang 0.4.8's constructors and API (one ``[size + page_size, H, D]``
  tensor per layer, K and V lists; ``set_kv_buffer``, buffer getters that wait
  on a registered layer-transfer counter, address tables) and the HiCache
  host pool :class:`HostKVPool`, also named ``MHATokenToKVPoolHost`` /
  ``MLATokenToKVPoolHost`` (SGLang's constructor and getters, kvlayout's or
  SGLang's own device pools, every host layout, io backends ``kernel`` and
  ``direct``, page-aligned allocator, page helpers).
* The direct paths move rows with kvlayout's copy engine
  (``engine="copy"``: no SMs), as SGLang uses them to keep the SMs for the
  forward pass.

Semantics are kvlayout's decided rules where SGLang leaves them open
(:mod:`kvlayout.reference.semantics`): a negative index means "no token"
(``negative_slot``), ``N = 0`` is a no-op (``empty``), an index beyond the
cache raises ``IndexError`` instead of touching memory (``slot_out_of_range``).  ``block_quota`` maps to
kvlayout's ``max_ctas`` (how many CTAs a transfer may occupy beside the
forward pass); ``num_warps_per_block`` is accepted and ignored (kvlayout picks
its own block shape).

Out-of-range indices: every function takes ``validate=`` and forwards it to
kvlayout (``True``: every index is checked on the host before anything moves;
``None``: the ``KVLAYOUT_VALIDATE`` environment variable decides).  Without
it a CUDA kernel skips such rows and records them; the record is raised by
:func:`kvlayout.ops.check_errors`, which this module calls wherever SGLang
synchronizes with the host anyway (the direct paths, which read their
indices on the host, and the device pools' CPU copies).  The direct paths
check their indices on the host by default (``validate=None`` means ``True``
there), because SGLang already reads them there.

The page-granular functions (``*_direct_pf_lf`` / ``*_direct_lf_pf``) read
only the first index of each page, like SGLang's, and move the page's
``page_size`` consecutive slots (:func:`page_slots`); the host side must be
page-aligned.  :func:`transfer_kv_direct` moves exactly the listed indices.
"""

from __future__ import annotations

import logging
import math
import operator
import threading
import weakref
from typing import Sequence

import numpy as np
import torch

from kvlayout import ops
from kvlayout.ops.views import as_int
from kvlayout.reference import layouts as catalog

from ._device import indices_on, launch_device

logger = logging.getLogger(__name__)

__all__ = [
    "transfer_kv_per_layer", "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf", "transfer_kv_all_layer",
    "transfer_kv_all_layer_lf_pf", "transfer_kv_all_layer_lf_ph", "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf",
    "move_kv_cache", "page_slots", "MHATokenToKVPool", "MLATokenToKVPool", "HostKVPool",
    "MHATokenToKVPoolHost", "MLATokenToKVPoolHost", "HOST_LAYOUTS", "HostPoolError", "HostPoolCorruption",
    "host_memory_reserve_for", "HOST_MEMORY_RESERVE_BYTES", "ALLOCATOR_TYPES",
]

# SGLang's kernels take the K and V halves of a host buffer as two separate
# tensors: the catalog's ``*_kv_halves`` layouts of the MHA host layouts.
_HALVES = {name: f"hicache_{name}_kv_halves" for name in ("page_first", "page_first_direct", "page_head")}

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n))


# ---------------------------------------------------------------------------------------
# Views and indices
# ---------------------------------------------------------------------------------------

def _width(t: torch.Tensor, item_size: int, what: str) -> int:
    es = t.element_size()
    if item_size % es:
        raise ValueError(f"{what}: item_size = {item_size} bytes is not a multiple of the element size {es}")
    return item_size // es


def _rows(t: torch.Tensor, item_size: int | None = None, what: str = "tensor") -> torch.Tensor:
    """``[N, ...]`` -> ``[N, 1, W]``: one row of ``item_size`` bytes per slot (a view)."""
    v = t.view(t.shape[0], 1, -1)
    if item_size is not None and v.shape[2] * t.element_size() != item_size:
        raise ValueError(f"{what}: rows are {v.shape[2] * t.element_size()} bytes, item_size = {item_size}")
    return v


def _pool(layout: str, parts: tuple, item_size: int, names: tuple) -> ops.KVCache:
    """A device pool's per-layer ``[N, ...]`` tensors (one list per part: K and V, or the MLA buffers) bound
    to ``layout`` as rows of ``item_size`` bytes: as they are where they bind so (the pools' ``[N, H, D]``
    buffers: binding tensors of a structure bound before is one lookup, where a view per tensor costs a
    microsecond each), else each viewed as ``[N, 1, W]`` (whose checks say what is wrong)."""
    value = parts if len(parts) > 1 else parts[0]
    try:
        cache = ops.bind(layout, value)
        if cache.row_width * cache.itemsize == item_size:
            return cache
    except (TypeError, ValueError, IndexError):
        pass    # (not such buffers: the views below take them, or say why they cannot)
    viewed = tuple([_rows(t, item_size, name) for t in lst] for lst, name in zip(parts, names))
    return ops.bind(layout, viewed if len(viewed) > 1 else viewed[0])


def _mha(k_layers, v_layers, item_size: int, side: str) -> ops.KVCache:
    """K and V lists of per-layer buffers as ``sglang_mha`` (``side``: "src" or "dst", for messages)."""
    return _pool("sglang_mha", (k_layers, v_layers), item_size, (f"{side}_k", f"{side}_v"))


def _mla(layers, item_size: int, side: str) -> ops.KVCache:
    """A list of per-layer MLA buffers as ``sglang_mla``."""
    return _pool("sglang_mla", (layers,), item_size, (side,))


def _layers(item_size: int, layout_dim: int, what: str, dim_name: str) -> int:
    if item_size <= 0 or layout_dim <= 0 or layout_dim % item_size:
        raise ValueError(f"{what}: {dim_name} = {layout_dim} is not a positive multiple of item_size = {item_size}")
    return layout_dim // item_size


def _page_first(t: torch.Tensor, item_size: int, layout_dim: int, what: str,
                dim_name: str = "layout_dim") -> torch.Tensor:
    """Host page_first half ``[N, L, ...]`` -> ``[N, L, 1, W]``."""
    layers = _layers(item_size, layout_dim, what, dim_name)
    if t.dim() >= 3 and t.shape[1] != layers:
        raise ValueError(f"{what}: {dim_name} = {layout_dim} means {layers} layers of item_size = {item_size}, "
                         f"but {what} is [N, L, ...] = {tuple(t.shape)}")
    return t.view(t.shape[0], layers, 1, _width(t, item_size, what))


def _page_head(t: torch.Tensor, item_size: int, layout_dim: int, page_size: int, head_num: int,
               what: str, dim_name: str = "layout_dim") -> torch.Tensor:
    """Host page_head half ``[NP, H, P, L, hd]`` -> that 5-D view.

    A 5-D tensor must have exactly that shape for the given ``head_num``,
    ``page_size``, layer count and head width (a view with other factors of
    the same bytes would scramble rows); any other rank is viewed as such.
    """
    width = _width(t, item_size, what)
    layers = _layers(item_size, layout_dim, what, dim_name)
    if head_num <= 0 or width % head_num:
        raise ValueError(f"{what}: head_num = {head_num} does not divide item_size = {item_size} bytes "
                         f"({width} elements)")
    if page_size <= 0:
        raise ValueError(f"{what}: page_size = {page_size} must be positive")
    want = (head_num, page_size, layers, width // head_num)
    if t.dim() == 5:
        for axis, arg, value in ((1, f"head_num = {head_num}", head_num), (2, f"page_size = {page_size}", page_size),
                                 (3, f"{dim_name} = {layout_dim} ({layers} layers)", layers),
                                 (4, f"item_size = {item_size} over {head_num} heads", width // head_num)):
            if t.shape[axis] != value:
                raise ValueError(f"{arg} contradicts {what}, [NP, H, P, L, hd] = {tuple(t.shape)}: "
                                 f"axis {axis} is {t.shape[axis]}, not {value}")
    elif t.numel() % (head_num * page_size * layers * (width // head_num)):
        raise ValueError(f"{what} ({t.numel()} elements) is not whole pages of head_num = {head_num} x "
                         f"page_size = {page_size} x {layers} layers x {width // head_num}")
    return t.view(-1, *want)


def _page_first_direct(t: torch.Tensor, page_size: int, what: str) -> torch.Tensor:
    """Host page_first_direct half ``[NP, L, P, ...]`` -> ``[NP, L, P, 1, W]``."""
    if t.dim() < 3 or t.shape[2] != page_size:
        raise ValueError(f"{what}: expected [pages, layers, page_size={page_size}, ...], got {tuple(t.shape)}")
    return t.view(t.shape[0], t.shape[1], page_size, 1, -1)


def _pair(src_indices, dst_indices, device):
    s, d = indices_on(src_indices, device), indices_on(dst_indices, device)
    if s.numel() != d.numel():
        raise ValueError(f"src_indices has {s.numel()} entries, dst_indices {d.numel()}")
    return s, d


def page_slots(indices, page_size: int, *, name: str = "indices", aligned: bool = False) -> torch.Tensor:
    """The slots SGLang's page-granular paths move for ``indices [n * page_size]`` -> ``[n * page_size]``.

    Only ``indices[p * page_size]`` is read for each page p; the page's slots
    are that index and the ``page_size - 1`` slots after it.  A negative index
    means "no token": its own entry stays negative, and so does every entry of
    a page whose first index is negative (nothing is read or written there).
    ``aligned=True`` requires every non-negative first index to be a multiple
    of ``page_size`` (host pages: SGLang addresses them by page number).
    """
    idx = torch.as_tensor(indices).reshape(-1)
    if page_size <= 0 or idx.numel() % page_size:
        raise ValueError(f"{name}: {idx.numel()} indices do not form whole pages of page_size = {page_size}")
    pages = idx.view(-1, page_size)
    first = pages[:, :1]
    if aligned:
        bad = torch.nonzero((first[:, 0] >= 0) & (first[:, 0] % page_size != 0))
        if bad.numel():
            p = int(bad[0, 0])
            raise ValueError(f"{name}[{p * page_size}] = {int(first[p, 0])} is not the first slot of a page "
                             f"(page_size = {page_size})")
    slots = first + torch.arange(page_size, dtype=idx.dtype, device=idx.device)
    none = (first < 0) | (pages < 0)
    return torch.where(none, torch.full_like(slots, -1), slots).reshape(-1)


def _go(src: ops.KVCache, dst: ops.KVCache, src_indices, dst_indices, block_quota=0, validate=None,
        engine: str = "kernel", **layers) -> None:
    """One kvlayout transfer.  ``engine="copy"`` (the direct paths): the copy engine moves the rows, no SMs
    are used, and the indices are read on the host, where SGLang's direct paths read them too."""
    device = torch.device("cpu") if engine == "copy" else launch_device(src, dst)
    s, d = _pair(src_indices, dst_indices, device)
    if s.numel() == 0:
        return
    ops.transfer(src, dst, s, d, max_ctas=int(block_quota or 0), validate=validate, engine=engine, **layers)


def _host_read(device: torch.device, validate):
    """Where SGLang reads indices on the host: report earlier kernels' skipped rows, check these indices there."""
    ops.check_errors(device)
    return True if validate is None else validate


def _check_layers(lists, num_layers: int) -> None:
    for name, lst in lists:
        if len(lst) != num_layers:
            raise ValueError(f"{name} has {len(lst)} layers, num_layers = {num_layers}")


# ---------------------------------------------------------------------------------------
# transfer_kv_* (MHA)
# ---------------------------------------------------------------------------------------

def transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size: int,
                          block_quota: int = 2, num_warps_per_block: int = 32, *, validate=None) -> None:
    """One layer, slot rows to slot rows: ``dst_k[d] = src_k[s]``, ``dst_v[d] = src_v[s]``."""
    src = _mha([src_k], [src_v], item_size, "src")
    dst = _mha([dst_k], [dst_v], item_size, "dst")
    _go(src, dst, src_indices, dst_indices, block_quota, validate)


def transfer_kv_per_layer_pf_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id: int,
                                item_size: int, src_layout_dim: int, block_quota: int = 2,
                                num_warps_per_block: int = 32, *, validate=None) -> None:
    """Host page_first halves (``[N, L, H, D]``) -> one device layer: ``dst[d] = src[s, layer_id]``."""
    src = ops.bind(_HALVES["page_first"], (_page_first(src_k, item_size, src_layout_dim, "src_k", "src_layout_dim"),
                                           _page_first(src_v, item_size, src_layout_dim, "src_v", "src_layout_dim")))
    dst = _mha([dst_k], [dst_v], item_size, "dst")
    _go(src, dst, src_indices, dst_indices, block_quota, validate, src_layers=[layer_id], dst_layers=[0])


def transfer_kv_per_layer_ph_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id: int,
                                item_size: int, src_layout_dim: int, page_size: int, head_num: int,
                                block_quota: int = 2, num_warps_per_block: int = 32, *, validate=None) -> None:
    """Host page_head halves (``[NP, H, P, L, hd]``) -> one device layer."""
    src = ops.bind(_HALVES["page_head"],
                   (_page_head(src_k, item_size, src_layout_dim, page_size, head_num, "src_k", "src_layout_dim"),
                    _page_head(src_v, item_size, src_layout_dim, page_size, head_num, "src_v", "src_layout_dim")))
    dst = _mha([dst_k], [dst_v], item_size, "dst")
    _go(src, dst, src_indices, dst_indices, block_quota, validate, src_layers=[layer_id], dst_layers=[0])


def transfer_kv_all_layer(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices, dst_indices,
                          item_size: int, num_layers: int, block_quota: int = 2,
                          num_warps_per_block: int = 32, *, validate=None) -> None:
    """Every layer, per-layer tensors to per-layer tensors (lists instead of pointer tables)."""
    _check_layers((("src_k_layers", src_k_layers), ("dst_k_layers", dst_k_layers), ("src_v_layers", src_v_layers),
                   ("dst_v_layers", dst_v_layers)), num_layers)
    src = _mha(src_k_layers, src_v_layers, item_size, "src")
    dst = _mha(dst_k_layers, dst_v_layers, item_size, "dst")
    _go(src, dst, src_indices, dst_indices, block_quota, validate)


def transfer_kv_all_layer_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices,
                                item_size: int, dst_layout_dim: int, num_layers: int, block_quota: int = 2,
                                num_warps_per_block: int = 32, *, validate=None) -> None:
    """Every device layer -> host page_first halves: ``dst[d, l] = src_l[s]``."""
    _check_layers((("src_k_layers", src_k_layers), ("src_v_layers", src_v_layers)), num_layers)
    src = _mha(src_k_layers, src_v_layers, item_size, "src")
    dst = ops.bind(_HALVES["page_first"], (_page_first(dst_k, item_size, dst_layout_dim, "dst_k", "dst_layout_dim"),
                                           _page_first(dst_v, item_size, dst_layout_dim, "dst_v", "dst_layout_dim")))
    _go(src, dst, src_indices, dst_indices, block_quota, validate, dst_layers=list(range(num_layers)))


def transfer_kv_all_layer_lf_ph(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices,
                                item_size: int, dst_layout_dim: int, num_layers: int, page_size: int,
                                head_num: int, block_quota: int = 2, num_warps_per_block: int = 32, *,
                                validate=None) -> None:
    """Every device layer -> host page_head halves."""
    _check_layers((("src_k_layers", src_k_layers), ("src_v_layers", src_v_layers)), num_layers)
    src = _mha(src_k_layers, src_v_layers, item_size, "src")
    dst = ops.bind(_HALVES["page_head"],
                   (_page_head(dst_k, item_size, dst_layout_dim, page_size, head_num, "dst_k", "dst_layout_dim"),
                    _page_head(dst_v, item_size, dst_layout_dim, page_size, head_num, "dst_v", "dst_layout_dim")))
    _go(src, dst, src_indices, dst_indices, block_quota, validate, dst_layers=list(range(num_layers)))


# ---------------------------------------------------------------------------------------
# transfer_kv_* (MLA: one buffer per layer)
# ---------------------------------------------------------------------------------------

def transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size: int, block_quota: int = 2,
                              num_warps_per_block: int = 32, *, validate=None) -> None:
    """One MLA layer: ``dst[d] = src[s]``."""
    _go(_mla([src], item_size, "src"), _mla([dst], item_size, "dst"),
        src_indices, dst_indices, block_quota, validate)


def transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id: int, item_size: int,
                                    src_layout_dim: int, block_quota: int = 2, num_warps_per_block: int = 32, *,
                                    validate=None) -> None:
    """Host MLA page_first ``[N, L, 1, kd]`` -> one device layer."""
    _go(ops.bind("hicache_mla_page_first", _page_first(src, item_size, src_layout_dim, "src", "src_layout_dim")),
        _mla([dst], item_size, "dst"), src_indices, dst_indices, block_quota, validate,
        src_layers=[layer_id], dst_layers=[0])


def transfer_kv_all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size: int, num_layers: int,
                              block_quota: int = 2, num_warps_per_block: int = 32, *, validate=None) -> None:
    """Every MLA layer, per-layer tensors to per-layer tensors."""
    _check_layers((("src_layers", src_layers), ("dst_layers", dst_layers)), num_layers)
    _go(_mla(src_layers, item_size, "src"),
        _mla(dst_layers, item_size, "dst"), src_indices, dst_indices,
        block_quota, validate)


def transfer_kv_all_layer_mla_lf_pf(src_layers, dst, src_indices, dst_indices, item_size: int,
                                    dst_layout_dim: int, num_layers: int, block_quota: int = 2,
                                    num_warps_per_block: int = 32, *, validate=None) -> None:
    """Every MLA device layer -> host page_first ``[N, L, 1, kd]``."""
    _check_layers((("src_layers", src_layers),), num_layers)
    _go(_mla(src_layers, item_size, "src"),
        ops.bind("hicache_mla_page_first", _page_first(dst, item_size, dst_layout_dim, "dst", "dst_layout_dim")),
        src_indices, dst_indices, block_quota, validate, dst_layers=list(range(num_layers)))


# ---------------------------------------------------------------------------------------
# "direct" functions
# ---------------------------------------------------------------------------------------

def transfer_kv_direct(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor], src_indices,
                       dst_indices, page_size: int, *, validate=None) -> None:
    """``dst_layers[j][d] = src_layers[j][s]`` for every pair of tensors (K and V lists, or [k, v]).

    Exactly the listed indices, token by token (SGLang copies maximal runs of
    consecutive indices; kvlayout coalesces the same runs).  ``page_size`` is
    only checked: the index count must be a multiple of it.  The indices are
    checked on the host unless ``validate=False`` (SGLang reads them there).
    """
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source tensors, {len(dst_layers)} destination tensors")
    n = torch.as_tensor(src_indices).numel()
    if page_size <= 0 or n % page_size or n != torch.as_tensor(dst_indices).numel():
        raise ValueError(f"indices ({n}, {torch.as_tensor(dst_indices).numel()}) must be equal in number "
                         f"and whole pages of {page_size}")
    src = [_rows(t) for t in src_layers]
    dst = [_rows(t) for t in dst_layers]
    validate = _host_read(launch_device(*src, *dst), validate)
    uniform = len({(tuple(t.shape[1:]), t.stride()) for t in src}) == 1 and \
        len({(tuple(t.shape[1:]), t.stride()) for t in dst}) == 1 and len({t.shape[0] for t in src}) == 1 \
        and len({t.shape[0] for t in dst}) == 1
    groups = [(src, dst)] if uniform else [([s], [d]) for s, d in zip(src, dst)]
    for s, d in groups:
        _go(ops.bind("sglang_mla", s), ops.bind("sglang_mla", d), src_indices, dst_indices, validate=validate,
            engine="copy")


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id: int,
                                       page_size: int, *, validate=None) -> None:
    """Host page_first_direct (``[pages, L, P, ...]``; ``[k, v]`` or ``[kv]``) -> one device layer, page by page.

    ``src_indices`` (host) must start each page at a page boundary.
    """
    s = page_slots(src_indices, page_size, name="src_indices", aligned=True)
    d = page_slots(dst_indices, page_size, name="dst_indices")
    if len(src_ptrs) == 2:
        src = ops.bind(_HALVES["page_first_direct"], tuple(_page_first_direct(t, page_size, "src") for t in src_ptrs))
        k, v = dst_ptrs
        dst = ops.bind("sglang_mha", ([_rows(k)], [_rows(v)]))
    else:
        src = ops.bind("hicache_mla_page_first_direct", _page_first_direct(src_ptrs[0], page_size, "src"))
        dst = ops.bind("sglang_mla", [_rows(dst_ptrs[0])])
    validate = _host_read(launch_device(src, dst), validate)
    _go(src, dst, s, d, validate=validate, engine="copy", src_layers=[layer_id], dst_layers=[0])


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size: int, *,
                                       validate=None) -> None:
    """Every device layer (``[K_0.., V_0..]`` or ``[KV_0..]``) -> host page_first_direct, page by page.

    ``dst_indices`` (host) must start each page at a page boundary.
    """
    s = page_slots(src_indices, page_size, name="src_indices")
    d = page_slots(dst_indices, page_size, name="dst_indices", aligned=True)
    if len(dst_ptrs) == 2:
        half = len(src_ptrs) // 2
        src = ops.bind("sglang_mha", ([_rows(t) for t in src_ptrs[:half]], [_rows(t) for t in src_ptrs[half:]]))
        dst = ops.bind(_HALVES["page_first_direct"], tuple(_page_first_direct(t, page_size, "dst") for t in dst_ptrs))
    else:
        src = ops.bind("sglang_mla", [_rows(t) for t in src_ptrs])
        dst = ops.bind("hicache_mla_page_first_direct", _page_first_direct(dst_ptrs[0], page_size, "dst"))
    validate = _host_read(launch_device(src, dst), validate)
    _go(src, dst, s, d, validate=validate, engine="copy")


def move_kv_cache(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor] | None, tgt_loc,
                  src_loc, *, validate=None) -> None:
    """Within a device pool, every layer (and K and V): ``buf[tgt_loc[i]] = old_buf[src_loc[i]]``.

    Overlapping ``src_loc``/``tgt_loc`` (shifts, chains, swaps) are safe at any
    size: kvlayout gathers every source row before writing.  ``v_buffers=None``
    for MLA pools.  Pairs with a negative location are skipped; repeated
    targets raise (on CPU, or with kvlayout validation).
    """
    cache = ops.bind("sglang_mla", [_rows(t) for t in k_buffers]) if v_buffers is None else \
        ops.bind("sglang_mha", ([_rows(t) for t in k_buffers], [_rows(t) for t in v_buffers]))
    s, d = _pair(src_loc, tgt_loc, cache.device)
    if s.numel():
        ops.move(cache, s, d, validate=validate)


# ---------------------------------------------------------------------------------------
# Device pools
# ---------------------------------------------------------------------------------------

def _store_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype in FP8_DTYPES else dtype


def _as_layer_id(layer_id, name: str = "layer_id") -> int:
    """A layer id as a Python int: ints and numpy / torch integer scalars are taken, ``bool`` is refused (``True``
    would silently mean layer 1), as is anything else (``TypeError`` naming ``name``): the ops' integer rule."""
    return as_int(f"{name} (an integer layer id)", layer_id)


def _layer_id(layer) -> int:
    """SGLang passes its attention layer object (``layer.layer_id``); an int is taken as the id itself."""
    if hasattr(layer, "layer_id"):
        return _as_layer_id(layer.layer_id, "layer.layer_id")
    try:
        return _as_layer_id(layer, "layer")
    except TypeError:
        got = repr(layer) if isinstance(layer, (bool, np.bool_)) else type(layer).__name__
        raise TypeError(f"layer must be an attention layer with .layer_id or an integer layer id, got {got}") \
            from None


def _whole(value, name: str, minimum: int = 0) -> int:
    """An integer pool argument (an integral float such as ``4.0`` is taken; ``2.5`` or a bool is refused)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value) or not float(value).is_integer():
            raise ValueError(f"{name} = {value!r} must be a whole number")
        value = int(value)
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name} = {value} must be >= {minimum}")
    return value


def _ptr_table(tensors, device) -> torch.Tensor:
    """SGLang's per-buffer base addresses: a uint64 tensor on the pool's device (for kernels of its own)."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device=device)


class _DevicePool:
    """Common part of the device pools: layer range, transfer counter, bound cache, move, CPU copies.

    SGLang 0.4.8's constructor keywords: ``enable_memory_saver`` is accepted
    (kvlayout allocates plain tensors), ``start_layer`` (default 0) and
    ``end_layer`` (default ``start_layer + layer_num - 1``) give the global
    ids of the pool's layers: ``get_key_buffer(layer_id)`` and
    ``set_kv_buffer(layer, ...)`` take global ids.
    """

    CPU_COPY_CHUNK = 8192
    cpu_offloading_chunk_size = CPU_COPY_CHUNK

    def _init_common(self, size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer):
        self.size, self.page_size, self.dtype = _whole(size, "size"), _whole(page_size, "page_size", 1), dtype
        self.store_dtype = _store_dtype(dtype)
        self.layer_num = _whole(layer_num, "layer_num", 1)
        self.device = torch.device(device)
        self.enable_memory_saver = bool(enable_memory_saver)
        self.start_layer = _whole(start_layer or 0, "start_layer")
        self.end_layer = _whole(end_layer, "end_layer") if end_layer is not None else \
            self.start_layer + self.layer_num - 1
        self.layer_transfer_counter = None
        self.mem_usage = 0

    def _bind_page_size(self) -> int | None:
        """The page size the page helpers need, when the padded rows (``size + page_size``) are whole pages."""
        return self.page_size if (self.size + self.page_size) % self.page_size == 0 else None

    def _local(self, layer_id: int) -> int:
        layer_id = _as_layer_id(layer_id)
        local = layer_id - self.start_layer
        if not 0 <= local < self.layer_num:
            raise IndexError(f"layer_id = {layer_id} is outside this pool's layers {self.start_layer}.."
                             f"{self.start_layer + self.layer_num - 1}")
        return local

    def register_layer_transfer_counter(self, layer_transfer_counter) -> None:
        """HiCache's per-layer load counter: buffer getters call ``wait_until(layer_id - start_layer)`` first."""
        self.layer_transfer_counter = layer_transfer_counter

    def _wait_for_layer(self, layer_id: int) -> None:
        """Wait for the layer's load (a registered counter); the id is checked first, so a bad one waits for
        nothing."""
        local = self._local(layer_id)
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(local)

    def _cast(self, t: torch.Tensor, scale=None) -> torch.Tensor:
        """Rows in the pool's dtype, then viewed as the stored dtype (fp8 pools store uint8)."""
        if t.dtype != self.dtype:
            if scale is not None:
                t = t / scale            # out of place: the caller's tensor stays as it was
            t = t.to(self.dtype)
        return t.view(self.store_dtype) if self.store_dtype != self.dtype else t

    def move_kv_cache(self, tgt_loc, src_loc, *, validate=None) -> None:
        """``buf[tgt_loc] = old_buf[src_loc]`` for every layer (overlap-safe)."""
        s, d = _pair(src_loc, tgt_loc, self.device)
        if s.numel():
            ops.move(self.cache, s, d, validate=validate)

    def _chunks(self, indices):
        idx = indices_on(indices, self.device)
        return [idx[i:i + self.CPU_COPY_CHUNK] for i in range(0, idx.numel(), self.CPU_COPY_CHUNK)]

    def get_cpu_copy(self, indices, *, validate=None) -> list:
        """Host copy of the rows at ``indices``: ``[layer][chunk]`` = ``[k, v]`` (MLA: the row tensor)."""
        _sync(self.device)
        per_layer = [[] for _ in range(self.layer_num)]
        for chunk in self._chunks(indices):
            rows = ops.gather(self.cache, chunk, validate=validate).to("cpu")           # [P, L, n, H, E]
            for l in range(self.layer_num):
                per_layer[l].append(self._unpack(rows[:, l]))
        _sync(self.device)
        return per_layer

    def load_cpu_copy(self, kv_cache_cpu, indices, *, validate=None) -> None:
        """Inverse of :meth:`get_cpu_copy`: write the host rows back at ``indices``.

        ``kv_cache_cpu[layer][chunk]`` must hold exactly the rows of its chunk
        of ``indices`` (``ValueError`` otherwise, before anything is written),
        as SGLang's shape check demands.
        """
        chunks = self._chunks(indices)
        if len(kv_cache_cpu) != self.layer_num:
            raise ValueError(f"kv_cache_cpu has {len(kv_cache_cpu)} layers, the pool {self.layer_num}")
        packed = []
        for c, chunk in enumerate(chunks):
            per_layer = []
            for l in range(self.layer_num):
                if len(kv_cache_cpu[l]) != len(chunks):
                    raise ValueError(f"kv_cache_cpu[{l}] has {len(kv_cache_cpu[l])} chunks, indices make "
                                     f"{len(chunks)} of {self.CPU_COPY_CHUNK}")
                per_layer.append(self._pack(kv_cache_cpu[l][c], int(chunk.numel()), f"kv_cache_cpu[{l}][{c}]"))
            packed.append(torch.stack(per_layer, dim=1))
        _sync(self.device)
        for rows, chunk in zip(packed, chunks):
            ops.scatter(self.cache, rows.to(self.device), chunk, validate=validate)
        _sync(self.device)

    def _row_shape(self) -> tuple[int, int]:
        """``(heads, elements per head)`` of one stored row."""
        g = self.cache.geometry
        return g.H, g.E

    def _check_rows(self, t: torch.Tensor, count: int, what: str) -> None:
        """``t`` must be ``[count, H, E]`` rows of this pool (SGLang raises on a shape mismatch too)."""
        want = (count, *self._row_shape())
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            raise ValueError(f"{what} must be {list(want)} ([tokens, heads, head size] of this pool), got "
                             f"{list(getattr(t, 'shape', ()))}")

    def _scatter_layer(self, layer_id: int, rows: torch.Tensor, loc, validate) -> None:
        """``rows [P, 1, T, H, E]`` -> layer ``layer_id`` at slots ``loc [T]``."""
        local = self._local(layer_id)
        idx = indices_on(loc, self.device)
        ops.scatter(self.cache, rows, idx, layers=[local], validate=validate)

    def _locations(self, loc) -> torch.Tensor:
        idx = indices_on(loc, self.device)
        if idx.dim() != 1:
            raise ValueError(f"loc must be 1-D slots [T], got shape {tuple(idx.shape)}")
        return idx

    # -- SGLang 0.4.8's flat-data helpers ----------------------------------------------------
    def get_flat_data(self, indices, *, validate=None) -> torch.Tensor:
        """Every layer's rows at ``indices [n]`` as one new tensor: MHA ``[2, L, n, H, D]`` (K then V), MLA
        ``[L, n, 1, kd]``, in the stored dtype, on the pool's device."""
        rows = ops.gather(self.cache, self._locations(indices), validate=validate)     # [P, L, n, H, E]
        return self._flat(rows)

    def transfer(self, indices, flat_data: torch.Tensor, *, validate=None) -> None:
        """Inverse of :meth:`get_flat_data`: write ``flat_data`` (any device) at ``indices`` in every layer."""
        idx = self._locations(indices)
        rows = self._unflat(flat_data, int(idx.numel()), self.layer_num, "flat_data")
        ops.scatter(self.cache, rows.to(self.device), idx, validate=validate)

    def transfer_per_layer(self, indices, flat_data: torch.Tensor, layer_id: int, *, validate=None) -> None:
        """One layer's rows: ``flat_data`` MHA ``[2, n, H, D]``, MLA ``[n, 1, kd]`` -> layer ``layer_id`` (a global
        id) at ``indices [n]``."""
        idx = self._locations(indices)
        rows = self._unflat(flat_data, int(idx.numel()), None, "flat_data")
        ops.scatter(self.cache, rows.to(self.device), idx, layers=[self._local(layer_id)], validate=validate)

    def _buffers(self) -> list:
        return list(self.cache.tensors)

    def get_contiguous_buf_infos(self):
        """``(ptrs, lens, item_lens)``: per buffer its address, bytes, and bytes per page (PD registration)."""
        bufs = self._buffers()
        return ([t.data_ptr() for t in bufs], [t.nbytes for t in bufs],
                [t[0].nbytes * self.page_size for t in bufs])

    def maybe_get_custom_mem_pool(self):
        return None


def _sync(device: torch.device) -> None:
    """SGLang synchronizes here: wait for the device, then raise any out-of-range index a kernel skipped."""
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)
    ops.check_errors(device)


class MHATokenToKVPool(_DevicePool):
    """SGLang's MHA device pool: per layer K and V tensors ``[size + page_size, H, D]`` (page 0 is padding).

    ``MHATokenToKVPool(size, page_size, dtype, head_num, head_dim, layer_num,
    device, enable_memory_saver, start_layer=None, end_layer=None)`` as in
    SGLang 0.4.8.  ``k_buffer``/``v_buffer`` are the per-layer lists,
    ``k_data_ptrs``/``v_data_ptrs``/``data_ptrs`` and ``data_strides`` SGLang's
    uint64 address tables and row bytes.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                 device="cpu", enable_memory_saver: bool = False, start_layer: int | None = None,
                 end_layer: int | None = None, **_ignored):
        self._init_common(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer)
        self.head_num, self.head_dim = _whole(head_num, "head_num", 1), _whole(head_dim, "head_dim", 1)
        shape = (self.size + self.page_size, self.head_num, self.head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=self.store_dtype, device=self.device) for _ in range(self.layer_num)]
        self.v_buffer = [torch.zeros(shape, dtype=self.store_dtype, device=self.device) for _ in range(self.layer_num)]
        self.cache = ops.bind("sglang_mha", (self.k_buffer, self.v_buffer), page_size=self._bind_page_size())
        self.k_data_ptrs = _ptr_table(self.k_buffer, self.device)
        self.v_data_ptrs = _ptr_table(self.v_buffer, self.device)
        self.data_ptrs = torch.cat([self.k_data_ptrs, self.v_data_ptrs])
        self.data_strides = torch.tensor([t[0].nbytes for t in self.k_buffer + self.v_buffer], device=self.device)
        k_size, v_size = self.get_kv_size_bytes()
        self.mem_usage = (k_size + v_size) / (1 << 30)

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """Bytes of all K buffers and of all V buffers."""
        return sum(t.nbytes for t in self.k_buffer), sum(t.nbytes for t in self.v_buffer)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s K ``[size + page_size, H, D]`` in the pool's dtype (after its load, when a
        transfer counter is registered)."""
        self._wait_for_layer(layer_id)
        return self.k_buffer[self._local(layer_id)].view(self.dtype)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        self._wait_for_layer(layer_id)
        return self.v_buffer[self._local(layer_id)].view(self.dtype)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer, loc, cache_k: torch.Tensor, cache_v: torch.Tensor, k_scale=None, v_scale=None,
                      *, validate=None, **_ignored) -> None:
        """Write one layer's K/V rows ``[T, H, D]`` at slots ``loc [T]``.

        ``layer``: the attention layer (``layer.layer_id``) or its id.  Rows of
        another dtype are divided by ``k_scale``/``v_scale`` (when given) and
        cast to the pool's dtype (fp8 pools store the bytes as uint8).
        """
        layer_id = _layer_id(layer)
        idx = self._locations(loc)
        self._check_rows(cache_k, idx.numel(), "cache_k")
        self._check_rows(cache_v, idx.numel(), "cache_v")
        rows = torch.stack([self._cast(cache_k, k_scale), self._cast(cache_v, v_scale)])[:, None]
        self._scatter_layer(layer_id, rows, idx, validate)

    def _unpack(self, rows):                     # [2, n, H, E] -> [k, v]
        return [rows[0].contiguous(), rows[1].contiguous()]

    def _pack(self, kv, count: int, what: str):
        """``[k, v]`` of ``count`` rows each -> ``[2, count, H, E]`` (checked)."""
        if len(kv) != 2:
            raise ValueError(f"{what} must be [k, v], got {len(kv)} tensors")
        self._check_rows(kv[0], count, f"{what}[0]")
        self._check_rows(kv[1], count, f"{what}[1]")
        return torch.stack([kv[0], kv[1]])

    def _flat(self, rows):                       # [2, L, n, H, E]
        return rows

    def _unflat(self, flat, count: int, layers: int | None, what: str):
        """MHA ``[2, L, n, H, D]`` (``layers`` given) or ``[2, n, H, D]`` -> ``[2, L or 1, n, H, D]``."""
        want = (2, *((layers,) if layers is not None else ()), count, *self._row_shape())
        if not isinstance(flat, torch.Tensor) or tuple(flat.shape) != want:
            raise ValueError(f"{what} must be {list(want)}, got {list(getattr(flat, 'shape', ()))}")
        return flat if layers is not None else flat[:, None]


class MLATokenToKVPool(_DevicePool):
    """SGLang's MLA device pool: per layer one ``[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]`` tensor.

    ``MLATokenToKVPool(size, page_size, dtype, kv_lora_rank,
    qk_rope_head_dim, layer_num, device, enable_memory_saver,
    start_layer=None, end_layer=None)`` as in SGLang 0.4.8.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, kv_lora_rank: int, qk_rope_head_dim: int,
                 layer_num: int, device="cpu", enable_memory_saver: bool = False, start_layer: int | None = None,
                 end_layer: int | None = None, **_ignored):
        self._init_common(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer)
        self.kv_lora_rank = _whole(kv_lora_rank, "kv_lora_rank", 1)
        self.qk_rope_head_dim = _whole(qk_rope_head_dim, "qk_rope_head_dim")
        self.kv_cache_dim = self.kv_lora_rank + self.qk_rope_head_dim
        shape = (self.size + self.page_size, 1, self.kv_cache_dim)
        self.kv_buffer = [torch.zeros(shape, dtype=self.store_dtype, device=self.device) for _ in range(self.layer_num)]
        self.cache = ops.bind("sglang_mla", self.kv_buffer, page_size=self._bind_page_size())
        self.data_ptrs = _ptr_table(self.kv_buffer, self.device)
        self.mem_usage = self.get_kv_size_bytes() / (1 << 30)

    def get_kv_size_bytes(self) -> int:
        return sum(t.nbytes for t in self.kv_buffer)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        self._wait_for_layer(layer_id)
        return self.kv_buffer[self._local(layer_id)].view(self.dtype)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The latent part ``[..., :kv_lora_rank]`` of the layer's rows."""
        return self.get_key_buffer(layer_id)[..., :self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer, loc, cache_k: torch.Tensor, cache_v=None, k_scale=None, v_scale=None, *,
                      validate=None, **_ignored) -> None:
        """Write one layer's rows ``[T, 1, kd]`` at ``loc`` (cast to the pool's dtype; ``cache_v`` unused)."""
        layer_id = _layer_id(layer)
        idx = self._locations(loc)
        self._check_rows(cache_k, idx.numel(), "cache_k")
        self._scatter_layer(layer_id, self._cast(cache_k, k_scale)[None, None], idx, validate)

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor, *,
                          validate=None) -> None:
        """Write rows whose first ``kv_lora_rank`` elements are ``cache_k_nope [T, 1, rank]`` and the rest
        ``cache_k_rope [T, 1, rope]``."""
        if cache_k_nope.shape[-1] != self.kv_lora_rank or cache_k_rope.shape[-1] != self.qk_rope_head_dim:
            raise ValueError(f"cache_k_nope / cache_k_rope end in {cache_k_nope.shape[-1]} / "
                             f"{cache_k_rope.shape[-1]} elements; the pool's rows are kv_lora_rank = "
                             f"{self.kv_lora_rank} + qk_rope_head_dim = {self.qk_rope_head_dim}")
        layer_id = _layer_id(layer)
        idx = self._locations(loc)
        n = idx.numel()
        for name, t, width in (("cache_k_nope", cache_k_nope, self.kv_lora_rank),
                               ("cache_k_rope", cache_k_rope, self.qk_rope_head_dim)):
            if tuple(t.shape) != (n, 1, width):
                raise ValueError(f"{name} must be [{n}, 1, {width}], got {list(t.shape)}")
        rows = torch.cat([cache_k_nope.to(self.dtype), cache_k_rope.to(self.dtype)], dim=-1)
        self._scatter_layer(layer_id, self._cast(rows)[None, None], idx, validate)

    def _unpack(self, rows):                     # [1, n, 1, E] -> tensor
        return rows[0].contiguous()

    def _pack(self, kv, count: int, what: str):
        """The row tensor ``[count, 1, kd]`` -> ``[1, count, 1, kd]`` (checked)."""
        self._check_rows(kv, count, what)
        return kv[None]

    def _flat(self, rows):                       # [1, L, n, 1, E] -> [L, n, 1, E]
        return rows[0]

    def _unflat(self, flat, count: int, layers: int | None, what: str):
        """MLA ``[L, n, 1, kd]`` (``layers`` given) or ``[n, 1, kd]`` -> ``[1, L or 1, n, 1, kd]``."""
        want = (*((layers,) if layers is not None else ()), count, *self._row_shape())
        if not isinstance(flat, torch.Tensor) or tuple(flat.shape) != want:
            raise ValueError(f"{what} must be {list(want)}, got {list(getattr(flat, 'shape', ()))}")
        return flat[None] if layers is not None else flat[None, None]


# ---------------------------------------------------------------------------------------
# HiCache host pool
# ---------------------------------------------------------------------------------------

HOST_LAYOUTS = {
    kind: {lay.engine_name: lay.name for lay in catalog.CATALOG.values()
           if lay.family == "hicache" and lay.engine_name and lay.planes == planes}
    for kind, planes in (("mha", 2), ("mla", 1))
}
"""SGLang's host ``layout`` names -> catalog layouts, for MHA and MLA pools (read from the catalog)."""
IO_BACKENDS = ("kernel", "direct")
ALLOCATOR_TYPES = ("default",)
HOST_MEMORY_RESERVE_BYTES = 10 * (1 << 30)
"""SGLang's host-memory reserve: a host pool must leave this much of the available host memory free.  kvlayout
keeps it for pools of this size or more and scales it down to the pool's own size for smaller ones (see
:func:`host_memory_reserve_for`)."""


def host_memory_reserve_for(pool_bytes: int) -> int:
    """The host memory a pool of ``pool_bytes`` leaves free by default: ``min(10 GiB, pool_bytes)``.

    SGLang reserves 10 GiB whatever the pool's size, so a pool of a few KiB is
    refused on a machine with less than ~10 GiB free.  Here a pool of 10 GiB or
    more keeps SGLang's reserve, and a smaller one leaves at least its own size
    free (it takes at most half of what is available).
    """
    return min(HOST_MEMORY_RESERVE_BYTES, max(0, int(pool_bytes)))


def _available_host_memory() -> int | None:
    """Memory the host can still hand out (MemAvailable: free plus reclaimable page cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:
        return None


class HostPoolError(ValueError, AssertionError):
    """A host-pool request SGLang rejects with an assertion (kvlayout raises it as a ValueError too): a size that
    is not whole pages, a double free (the message starts with ``Double-free``)."""


class HostPoolCorruption(RuntimeError, AssertionError):
    """The host pool's free list hands out a slot that is in use (``Double-alloc``): SGLang asserts it, kvlayout
    raises it as a RuntimeError too; nothing is taken."""


def _is_mla_pool(device_pool) -> bool:
    """SGLang's MLA pools carry ``kv_lora_rank``; MHA pools ``head_num``/``head_dim``."""
    return hasattr(device_pool, "kv_lora_rank")


def _bind_device_pool(device_pool) -> ops.KVCache:
    """The device pool as a kvlayout cache: kvlayout's pools are bound already; SGLang's pools (``k_buffer``/
    ``v_buffer`` lists, MLA ``kv_buffer`` list) are bound here."""
    cache = getattr(device_pool, "cache", None)
    if isinstance(cache, ops.KVCache):
        return cache
    if _is_mla_pool(device_pool):
        return ops.bind("sglang_mla", list(device_pool.kv_buffer))
    return ops.bind("sglang_mha", (list(device_pool.k_buffer), list(device_pool.v_buffer)))


_HOST_PAGE = 4096


def _collect_cuda_error() -> None:
    """Take the error a failed runtime call left as CUDA's "last error" (the next kernel launch of any library
    would report it as its own): a tiny launch reads and clears it."""
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass


def _page_locked_bytes(nbytes: int) -> torch.Tensor | None:
    """``uint8 [nbytes]`` of host memory page-locked with ``cudaHostRegister``; ``None`` when CUDA refuses.

    The memory is whole pages of its own (start aligned, length rounded up to
    a page, at most one page more than asked): ``cudaHostRegister`` locks
    whole pages, so a range sharing a page with another allocation could not
    be registered twice. It is unregistered when the last tensor using it is
    freed (before the memory goes back to the allocator, which may hand it out
    again), so registrations never outlive their memory.
    """
    span = -(-max(nbytes, 1) // _HOST_PAGE) * _HOST_PAGE
    raw = np.empty(span + _HOST_PAGE, dtype=np.uint8)
    start = (-raw.ctypes.data) % _HOST_PAGE
    owned = raw[start:start + span]
    ptr = owned.ctypes.data
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, span, 0)
    if int(getattr(err, "value", err)) != 0:
        logger.warning("host pool: cudaHostRegister of %.2f GB failed (CUDA error %d); the buffer stays pageable, "
                       "so device kernels cannot read it directly", span / 1e9, int(getattr(err, "value", err)))
        _collect_cuda_error()
        return None
    # numpy clears weak references before it frees an array's data: unregister first, then free
    weakref.finalize(raw, cudart.cudaHostUnregister, ptr).atexit = False
    return torch.from_numpy(owned)[:nbytes]


def _layer_index(layer_id, num_layers: int) -> int:
    """``layer_id`` (an int or numpy/torch integer scalar; not a bool) checked against ``num_layers``."""
    layer = _as_layer_id(layer_id)
    if not 0 <= layer < num_layers:
        raise IndexError(f"layer_id = {layer_id!r} is out of range: the pool holds {num_layers} layers")
    return layer


class HostKVPool:
    """SGLang's HiCache host pool (MHA or MLA, following the device pool) on kvlayout.

    ``HostKVPool(device_pool, host_to_device_ratio, host_size, page_size,
    layout, pin_memory=True, device="cpu")`` - the constructor of SGLang's
    ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` (both names are this
    class; MLA is chosen when the device pool has ``kv_lora_rank``).  The
    device pool may be kvlayout's or SGLang's own (``k_buffer``/``v_buffer``
    lists, MLA ``kv_buffer`` list, with ``size``, ``page_size``,
    ``store_dtype``, ``layer_num``, ``head_num``/``head_dim`` or
    ``kv_lora_rank``/``qk_rope_head_dim``, ``device``, ``start_layer``).

    Sizing as SGLang: ``get_size_per_token()`` = ``2*L*H*D*es`` (MHA) or
    ``L*kd*es`` (MLA); ``size`` = ``host_size`` GB / size_per_token when
    ``host_size > 0``, else ``device_pool.size * host_to_device_ratio``; then
    one extra page: ``page_num = size // page_size + 1``, ``size = page_num *
    page_size``.  ``host_to_device_ratio`` must be finite and > 0 (when it
    sizes the pool), ``host_size`` finite and >= 0.

    Host-memory reserve: a pool larger than the available host memory
    (``MemAvailable``) minus ``host_memory_reserve`` bytes raises
    ``ValueError``.  The default reserve is ``min(10 GiB, the pool's bytes)``:
    SGLang's 10 GiB for pools of 10 GiB or more, and for a smaller pool its
    own size (it may take at most half of what is available), so a pool of a
    few KiB works on a machine with little free memory.  Pass
    ``host_memory_reserve=10 * 2**30`` for SGLang's rule exactly, or another
    byte count.  A pool no larger than the device pool only warns.

    ``token_stride_size`` = bytes of one token of one layer (and plane),
    ``layout_dim`` = ``token_stride_size * layer_num``.

    Buffers (one tensor; MHA K = ``kv_buffer[0]``, V = ``kv_buffer[1]``):

    ========================  ===========================  ================================
    layout                    MHA                          MLA
    ========================  ===========================  ================================
    layer_first               ``[2, L, size, H, D]``        ``[L, size, 1, kd]``
    page_first                ``[2, size, L, H, D]``        ``[size, L, 1, kd]``
    page_first_direct         ``[2, pages, L, P, H, D]``    ``[pages, L, P, 1, kd]``
    page_head                 ``[2, pages, H, P, L, D]``    -
    page_first_kv_split       -                            ``[pages, L, P, 1, rank]`` + ``[..., rope]``
    ========================  ===========================  ================================

    ``pin_memory=True`` with a device pool on a GPU: the buffer is allocated
    at its exact size (whole pages of its own) and page-locked with
    ``cudaHostRegister`` (as SGLang; a pinned allocation from torch's caching
    host allocator would round it up to a power of two), and unregistered
    when the last tensor using it is freed; ``pinned`` says whether that
    worked, and a failure is logged as a warning.

    io backends, for every layout: ``kernel`` moves token rows at the given
    indices with kvlayout's kernel.  ``direct`` uses the copy engine (no SMs,
    as SGLang uses it) and does what SGLang's direct path of the layout does:
    ``page_first_direct`` is page-granular (only the first index of each page
    is read, host pages must start at a page boundary, see
    :func:`page_slots`); every other layout moves exactly the listed indices
    (SGLang's ``transfer_kv_direct``).  ``direct`` checks the indices on the
    host unless ``validate=False`` (SGLang reads them there); ``validate``
    (constructor default, or per call) is forwarded to kvlayout.

    ``allocator_type``: SGLang's keyword; ``"default"`` (plain host memory)
    is the one supported, any other value raises ``ValueError``.

    Allocator: ``alloc`` hands out whole, page-aligned pages; ``free`` takes
    slots back, and a page becomes allocatable again once all of its slots
    are free.  ``free`` raises ``ValueError`` for a negative or out-of-range
    slot, and :class:`HostPoolError` (a ``ValueError`` and, as SGLang's, an
    ``AssertionError``; message ``Double-free of host slots [...]``) for a
    repeated or unallocated one, before changing anything.  An ``alloc``
    whose free list holds a slot in use raises :class:`HostPoolCorruption`
    (``RuntimeError`` and ``AssertionError``, ``Double-alloc: host slots
    [...]``) and takes nothing.
    """

    def __init__(self, device_pool, host_to_device_ratio: float = 2.0, host_size: float = 0,
                 page_size: int | None = None, layout: str = "layer_first", pin_memory: bool = True,
                 device: str = "cpu", allocator_type: str = "default", *, max_ctas: int = 0,
                 host_memory_reserve: int | None = None, validate: bool | None = None):
        if allocator_type not in ALLOCATOR_TYPES:
            raise ValueError(f"allocator_type = {allocator_type!r} is not supported; supported: {ALLOCATOR_TYPES}")
        self.allocator_type = allocator_type
        for name, value in (("host_to_device_ratio", host_to_device_ratio), ("host_size", host_size)):
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        if not math.isfinite(host_size) or host_size < 0:
            raise ValueError(f"host_size = {host_size!r} GB must be finite and >= 0 (0: size by "
                             "host_to_device_ratio)")
        if host_size <= 0 and (not math.isfinite(host_to_device_ratio) or host_to_device_ratio <= 0):
            raise ValueError(f"host_to_device_ratio = {host_to_device_ratio!r} must be a finite number > 0 "
                             "(the host pool's size in device-pool sizes)")
        self.device_pool = device_pool
        self.validate = validate
        self.is_mla = _is_mla_pool(device_pool)
        table = HOST_LAYOUTS["mla" if self.is_mla else "mha"]
        if layout not in table:
            raise ValueError(f"unsupported layout {layout!r} for a {'MLA' if self.is_mla else 'MHA'} pool; "
                             f"supported: {sorted(table)}")
        self.host_layout = catalog.get(table[layout])
        if torch.device(device).type != "cpu":
            raise ValueError(f"device = {device!r}: the host pool lives in host memory ('cpu')")
        self.layout = layout
        self.device = str(device)
        self.page_size = _whole(page_size or device_pool.page_size, "page_size", 1)
        self.dtype = device_pool.store_dtype
        self.max_ctas = max_ctas
        self._prepared_load = None   # (key, what the key names, prepared transfer): see _load_key
        self.size_per_token = self.get_size_per_token()
        size = int(host_size * 1e9 // self.size_per_token) if host_size > 0 else \
            int(device_pool.size * host_to_device_ratio)
        self.page_num = size // self.page_size + 1
        self.size = self.page_num * self.page_size
        self.start_layer = int(getattr(device_pool, "start_layer", 0) or 0)
        self.end_layer = getattr(device_pool, "end_layer", None)
        if self.end_layer is None:
            self.end_layer = self.start_layer + self.layer_num - 1
        if self.size <= device_pool.size:
            logger.warning("host pool (%d tokens) is not larger than the device pool (%d tokens)",
                           self.size, device_pool.size)
        # the pool must leave host_memory_reserve bytes available: by default min(10 GiB, its own size)
        need = self.size * self.size_per_token
        reserve = host_memory_reserve_for(need) if host_memory_reserve is None else \
            _whole(host_memory_reserve, "host_memory_reserve")
        self.host_memory_reserve = reserve
        available = _available_host_memory()
        if available is not None and need > available - reserve:
            raise ValueError(f"not enough host memory for the host pool: need {need / 1e9:.2f} GB, "
                             f"{available / 1e9:.2f} GB available, {reserve / 1e9:.2f} GB reserved "
                             f"(host_memory_reserve=; by default min(10 GiB, the pool's size)); lower "
                             "host_to_device_ratio or host_size")
        # page-locking only serves a device pool on a GPU (the kernels and the copy engine reach it directly)
        self.pin_memory = bool(pin_memory) and torch.device(getattr(device_pool, "device", "cpu")).type == "cuda"
        self.pinned = self.pin_memory
        # elements of one token's row of one layer (and plane): SGLang's element_dim
        self.element_dim = self.kv_cache_dim if self.is_mla else self.head_num * self.head_dim
        self.token_stride_size = self.element_dim * torch.empty((), dtype=self.dtype).element_size()
        self.layout_dim = self.token_stride_size * self.layer_num
        self._alloc_buffers()
        self.cache = ops.bind(self.host_layout, self._physical(), page_size=self.page_size)
        self._data_tables()
        self.lock = threading.RLock()
        self.clear()

    # -- sizes (SGLang's getters) ---------------------------------------------------------
    def get_size_per_token(self) -> int:
        """Host bytes per token: every layer, K and V (MLA: the latent row)."""
        pool = self.device_pool
        self.layer_num = int(pool.layer_num)
        es = torch.empty((), dtype=self.dtype).element_size()
        if self.is_mla:
            self.kv_lora_rank, self.qk_rope_head_dim = int(pool.kv_lora_rank), int(pool.qk_rope_head_dim)
            self.kv_cache_dim = self.kv_lora_rank + self.qk_rope_head_dim
            return self.kv_cache_dim * es * self.layer_num
        self.head_num, self.head_dim = int(pool.head_num), int(pool.head_dim)
        return self.head_dim * self.head_num * self.layer_num * es * 2

    def get_ksize_per_token(self) -> int:
        """Bytes per token of the K half (MHA: half of :meth:`get_size_per_token`; MLA: all of it)."""
        return self.get_size_per_token() if self.is_mla else self.get_size_per_token() // 2

    # -- buffers --------------------------------------------------------------------------
    def _empty(self, shape) -> torch.Tensor:
        """A zeroed host tensor of exactly its size, page-locked when the pool pins (``pinned`` turns False
        when page-locking fails)."""
        if self.pinned:
            nbytes = math.prod(shape) * torch.empty((), dtype=self.dtype).element_size()
            raw = _page_locked_bytes(nbytes)
            if raw is not None:
                return raw.view(self.dtype).view(shape).zero_()
            self.pinned = False
        return torch.zeros(shape, dtype=self.dtype)

    def _data_tables(self) -> None:
        """SGLang's per-layer references and uint64 address tables (built on the device pool's device)."""
        dev = getattr(self.device_pool, "device", "cpu")
        if self.is_mla:
            self.data_refs = [self.kv_buffer[i] for i in range(min(self.layer_num, self.kv_buffer.shape[0]))]
            self.data_ptrs = _ptr_table(self.data_refs, dev)
            return
        # as SGLang: index 0 of each half (a layer for layer_first, the table's only meaningful layout)
        n = min(self.layer_num, self.k_buffer.shape[0])
        self.k_data_refs = [self.k_buffer[i] for i in range(n)]
        self.v_data_refs = [self.v_buffer[i] for i in range(n)]
        self.k_data_ptrs = _ptr_table(self.k_data_refs, dev)
        self.v_data_ptrs = _ptr_table(self.v_data_refs, dev)
        self.data_ptrs = torch.cat([self.k_data_ptrs, self.v_data_ptrs])

    def _catalog_geometry(self, slots: int) -> catalog.Geometry:
        """The geometry of ``slots`` host slots (whole pages) in the pool's catalog layout."""
        if self.is_mla:
            columns = (self.kv_lora_rank, self.qk_rope_head_dim) if self.host_layout.parts[0].column is not None \
                else ()
            return catalog.make_geometry(self.host_layout, L=self.layer_num, N=slots, H=1, E=self.kv_cache_dim,
                                         page_size=self.page_size, columns=columns)
        return catalog.make_geometry(self.host_layout, L=self.layer_num, N=slots, H=self.head_num, E=self.head_dim,
                                     page_size=self.page_size)

    def _alloc_buffers(self) -> None:
        """One buffer per part of the catalog layout, shaped as the catalog says (SGLang's shapes)."""
        geom = self._catalog_geometry(self.size)
        buffers = [self._empty(geom.part_shape(part)) for part in self.host_layout.parts]
        if len(buffers) > 1:                  # MLA page_first_kv_split: the nope and rope buffers
            self.k_buffer, self.v_buffer = buffers
            self.kv_buffer = self.k_buffer
        else:
            self.kv_buffer = buffers[0]
            if not self.is_mla:
                self.k_buffer, self.v_buffer = self.kv_buffer[0], self.kv_buffer[1]
        self._buffers = tuple(buffers)

    def _physical(self):
        """The buffers in the catalog's convention: one tensor, or a tuple with one per part."""
        return self._buffers if len(self._buffers) > 1 else self._buffers[0]

    # -- allocator ------------------------------------------------------------------------
    def clear(self) -> None:
        with self.lock:
            self.free_slots = torch.arange(self.size, dtype=torch.int64)
            self.slot_used = torch.zeros(self.size, dtype=torch.bool)

    def available_size(self) -> int:
        """Slots ``alloc`` can hand out (slots of partly freed pages are not among them)."""
        return int(self.free_slots.numel())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """The first ``need_size`` free slots ``[need_size]`` (whole pages), or ``None`` when too few are free."""
        need_size = operator.index(need_size)
        if need_size < 0:
            raise ValueError(f"need_size = {need_size} must be >= 0")
        if need_size % self.page_size:   # SGLang asserts this: the error is an AssertionError too
            raise HostPoolError(f"need_size = {need_size} is not a multiple of page_size = {self.page_size}")
        with self.lock:
            if need_size > self.free_slots.numel():
                return None
            select = self.free_slots[:need_size]
            used = self.slot_used[select]
            if used.any():    # checked before anything is taken: a failed alloc loses no slot
                raise HostPoolCorruption(f"Double-alloc: host slots {select[used].tolist()} are in use but on the "
                                         "free list (the allocator would hand them out twice); nothing was taken")
            self.free_slots = self.free_slots[need_size:]
            self.slot_used[select] = True
            return select

    def free(self, indices) -> int:
        """Return allocated slots ``[n]`` to the pool; returns n.

        Every slot must be allocated and appear once (else ``ValueError``, and
        nothing is freed).  A page whose slots are all free again goes to the
        tail of the free list as a whole, so ``alloc`` stays page-aligned.
        """
        idx = torch.as_tensor(indices)
        if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise TypeError(f"indices must be integers, got {idx.dtype}")
        idx = idx.reshape(-1).to("cpu", torch.int64)
        with self.lock:
            for bad, why in ((idx < 0, f"is negative: host slots are 0..{self.size - 1}"),
                             (idx >= self.size, f"is out of range: the host pool holds {self.size} slots")):
                hit = torch.nonzero(bad)
                if hit.numel():
                    i = int(hit[0, 0])
                    raise ValueError(f"indices[{i}] = {int(idx[i])} {why}")
            uniq, counts = torch.unique(idx, return_counts=True)
            if (counts > 1).any():
                twice = uniq[counts > 1]
                raise HostPoolError(f"Double-free of host slots {twice.tolist()}: indices repeats slot "
                                    f"{int(twice[0])}; nothing was freed")
            free_now = ~self.slot_used[idx]
            hit = torch.nonzero(free_now)
            if hit.numel():
                i = int(hit[0, 0])
                raise HostPoolError(f"Double-free of host slots {idx[free_now].tolist()}: indices[{i}] = "
                                    f"{int(idx[i])} is not allocated (never handed out, or freed already); "
                                    "nothing was freed")
            self.slot_used[idx] = False
            # the touched pages in order of first appearance; only those now entirely free return
            pages = torch.tensor(list(dict.fromkeys((idx // self.page_size).tolist())), dtype=torch.int64)
            whole = pages[~self.slot_used.view(-1, self.page_size)[pages].any(dim=1)]
            back = (whole[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
            self.free_slots = torch.cat([self.free_slots, back])
            return int(idx.numel())

    # -- transfers ------------------------------------------------------------------------
    def _slots(self, host_indices, device_indices, io_backend: str):
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"io_backend must be one of {IO_BACKENDS}, got {io_backend!r}")
        if io_backend == "direct" and self.layout == "page_first_direct":
            return (page_slots(host_indices, self.page_size, name="host_indices", aligned=True),
                    page_slots(device_indices, self.page_size, name="device_indices"))
        return host_indices, device_indices

    @staticmethod
    def _engine(io_backend: str) -> str:
        """``direct`` moves rows with the copy engine (no SMs), as SGLang uses it; ``kernel`` with kvlayout's kernel."""
        return "copy" if io_backend == "direct" else "kernel"

    def _validate(self, io_backend: str, validate, device: torch.device):
        validate = self.validate if validate is None else validate
        return _host_read(device, validate) if io_backend == "direct" else validate

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id: int,
                                 io_backend: str = "kernel", *, validate=None) -> None:
        """H2D of one layer: ``device[layer_id][device_indices] = host[layer_id][host_indices]``.

        SGLang calls it once per layer with the same index tensors: the first
        call of a step prepares the transfer of every layer
        (:func:`kvlayout.ops.prepare`; ``direct``: the copy engine's, whose
        indices - page slots for ``page_first_direct`` - are then made once
        too), the others reuse it (one launch, or the layer's copies, each).
        """
        layer_id = _as_layer_id(layer_id)        # numpy / torch integers as ints, on every backend; no bools
        key = self._load_key(device_pool, host_indices, device_indices, io_backend, validate)
        held = self._prepared_load
        if key is None or held is None or held[0] != key:
            h, d = self._slots(host_indices, device_indices, io_backend)
            validate = self._validate(io_backend, validate, torch.device(device_pool.device))
            if key is None:
                _go(self.cache, _bind_device_pool(device_pool), h, d, self.max_ctas, validate,
                    self._engine(io_backend), src_layers=[layer_id], dst_layers=[layer_id])
                return
            held = self._prepared_load = (key, (device_pool, host_indices, device_indices),
                                          self._prepare_load(device_pool, h, d, io_backend, validate))
        else:   # the same indices as the held load's: _slots found them fine then
            validate = self._validate(io_backend, validate, torch.device(device_pool.device))
        load = held[2]
        if load is None:      # no tokens
            return
        if io_backend == "kernel":
            load.layer(_layer_index(layer_id, self.layer_num))
        elif type(layer_id) is int and 0 <= layer_id < load.num_layers:
            load.layer(layer_id)
        else:                 # refused as the per-layer copy refuses it
            h, d = self._slots(host_indices, device_indices, io_backend)
            _go(self.cache, _bind_device_pool(device_pool), h, d, self.max_ctas, validate, "copy",
                src_layers=[layer_id], dst_layers=[layer_id])

    def _load_key(self, device_pool, host_indices, device_indices, io_backend: str, validate):
        """What a prepared per-layer load depends on, or None where loads are not prepared (indices that are
        not tensors, an unknown backend): the pool, the identity and version of the index tensors (held with
        the load, so the identities stay theirs: indices rewritten in place, or new ones, prepare again),
        the backend and the validation asked for."""
        if io_backend not in IO_BACKENDS or not isinstance(host_indices, torch.Tensor) \
                or not isinstance(device_indices, torch.Tensor):
            return None
        validate = self.validate if validate is None else validate
        if io_backend == "direct" and validate is None:
            validate = True                              # as _host_read makes it
        return (id(device_pool), id(host_indices), host_indices._version, id(device_indices),
                device_indices._version, io_backend, validate)

    def _prepare_load(self, device_pool, h: torch.Tensor, d: torch.Tensor, io_backend: str, validate):
        """The load of every layer at slots ``h`` -> ``d`` (None: no tokens).  ``direct``: the copy engine's,
        with the slots on the host, over the layers both pools have."""
        dst = _bind_device_pool(device_pool)
        if io_backend == "kernel":
            s, dd = _pair(h, d, launch_device(self.cache, dst))
            return None if s.numel() == 0 else ops.prepare(self.cache, dst, s, dd, max_ctas=self.max_ctas,
                                                             validate=validate)
        s, dd = _pair(h, d, torch.device("cpu"))
        layers = list(range(min(self.cache.geometry.L, dst.geometry.L)))
        return None if s.numel() == 0 else ops.prepare(self.cache, dst, s, dd, src_layers=layers, dst_layers=layers,
                                                         max_ctas=int(self.max_ctas or 0), validate=validate,
                                                         engine="copy")

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices,
                                     io_backend: str = "kernel", *, validate=None) -> None:
        """D2H of every layer: ``host[:, host_indices] = device[:, device_indices]``."""
        h, d = self._slots(host_indices, device_indices, io_backend)
        validate = self._validate(io_backend, validate, torch.device(device_pool.device))
        _go(_bind_device_pool(device_pool), self.cache, d, h, self.max_ctas, validate, self._engine(io_backend))

    # -- page helpers (L3 storage) ----------------------------------------------------------
    def _page(self, index) -> int:
        index = int(index)
        if index % self.page_size:
            raise ValueError(f"index {index} is not the first slot of a page (page_size {self.page_size})")
        return index // self.page_size

    def _page_shape(self) -> tuple:
        """The shape of one page as :meth:`get_data_page` (``flat=False``) gives it: the catalog shape of one
        page's slots (``(-1,)`` for a layout of several buffers, which has no single view)."""
        if len(self.host_layout.parts) > 1:
            return (-1,)
        return self._catalog_geometry(self.page_size).part_shape(self.host_layout.parts[0])

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        """The page starting at slot ``index``.

        ``flat=True``: its bytes in the layout's order, as a new 1-D tensor.
        ``flat=False``: a view of the pool (writing it writes the pool), shaped
        like SGLang's: MHA ``layer_first`` ``[2, L, P, H, D]``, ``page_first``
        ``[2, P, L, H, D]``, ``page_first_direct``/``page_head`` the page's
        ``[2, 1, ...]`` slice; MLA the same without the leading 2.
        """
        page = self._page(index)
        if flat:
            return ops.get_page(self.cache, page)
        if len(self.host_layout.parts) > 1:
            raise ValueError(f"get_data_page(flat=False) is not defined for {self.layout} (two buffers)")
        # the page on the catalog pattern's slot axis: its slots on a flat one, the page itself on a paged one
        axes = self.host_layout.parts[0].pattern.split()
        if "n" in axes:
            return self.kv_buffer.narrow(axes.index("n"), page * self.page_size, self.page_size)
        return self.kv_buffer.narrow(axes.index("nb"), page, 1)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A zero flat page (pinned when the pool is)."""
        return ops.dummy_flat_page(self.cache, device="cpu").pin_memory() if self.pinned \
            else ops.dummy_flat_page(self.cache, device="cpu")

    def set_from_flat_data_page(self, index, data_page: torch.Tensor) -> None:
        """Inverse of :meth:`get_data_page`."""
        ops.set_page(self.cache, self._page(index), data_page.reshape(-1).to("cpu"))

    def get_page_buffer_meta(self, indices) -> tuple[list[int], list[int]]:
        """``(pointers, byte sizes)`` of the contiguous spans of the pages (zero-copy storage I/O).

        Only ``indices[p * page_size]`` is read per page.  Order as SGLang:
        MHA ``layer_first``: per page, per layer, K then V (``2L`` spans of
        ``P*H*D*es`` bytes); MHA ``page_first``/``page_first_direct``/
        ``page_head``: per page K then V (``L*P*H*D*es`` bytes each); MLA
        ``layer_first``: per page one span per layer; MLA
        ``page_first``/``page_first_direct``: one span per page.
        """
        idx = torch.as_tensor(indices).reshape(-1)
        if idx.numel() % self.page_size:
            raise ValueError(f"{idx.numel()} indices are not whole pages of {self.page_size}")
        pages = [self._page(i) for i in idx[::self.page_size].tolist()]
        ptrs, sizes = [], []
        for page in pages:
            p, s = ops.page_buffer_meta(self.cache, [page])
            if not self.is_mla and self.layout == "layer_first":   # kvlayout lists K0..K(L-1), V0..; SGLang K0, V0, ..
                L = self.layer_num
                order = [j for l in range(L) for j in (l, L + l)]
                p, s = [p[j] for j in order], [s[j] for j in order]
            ptrs += p
            sizes += s
        return ptrs, sizes


MHATokenToKVPoolHost = HostKVPool
MLATokenToKVPoolHost = HostKVPool
