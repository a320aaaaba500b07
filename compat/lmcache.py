"""LMCache-compatible transfer surface on top of kvlayout.ops.

Same names, argument order, enum values and semantics as LMCache's native
transfer ops, with one difference: where LMCache takes a tensor of raw
pointers (one per layer), these functions take the structure the engine holds
(a list of per-layer tensors, ``[[K...], [V...]]`` lists, or one cross-layer
tensor).  Each function picks the catalog layout of the format, binds the
tensors with :func:`kvlayout.ops.bind` and calls :func:`kvlayout.ops.transfer`
(or :func:`kvlayout.ops.rope_reposition`).  No addresses are computed here.

Enums: kvlayout's :class:`GPUKVFormat`, :class:`MemoryFormat` and
:class:`TransferDirection` carry LMCache's integer values (``MemoryFormat``
is a plain ``Enum`` like LMCache's, the other two ``IntEnum``s like its
pybind enums); wherever one is
taken, LMCache's own members (Python or pybind enums) and plain ints are
accepted too (:func:`as_gpu_kv_format`, :func:`as_memory_format`).
LMCache's geometry helpers (``get_num_blocks``, ``get_block_size``,
``get_head_size``, ``get_num_heads``, ``get_hidden_dim_size``, ``is_mla``,
...) are here under their names, read as LMCache reads them from layer 0
(bound as a one-layer kvlayout cache: a hybrid model's layers may differ in
head size and dtype).  LMCache's older per-layer ops
(:func:`load_and_reshape_flash`, :func:`reshape_and_cache_back_flash`) are
here too.

Direction names follow LMCache: ``H2D`` = memory object -> paged engine cache
(retrieve), ``D2H`` = paged engine cache -> memory object (store), wherever
the memory object actually lives.

Semantics are kvlayout's decided rules (:mod:`kvlayout.reference.semantics`,
``docs/spec.md``): ``negative_slot``, ``slot_out_of_range``, ``empty``,
``byte_exact``, ...; where LMCache leaves a case open, the rule decides, with
the rule's exception type.

Out-of-range slots: on CPU they raise at once.  A CUDA kernel cannot raise:
it skips the row and records it, and :func:`kvlayout.ops.check_errors`
raises the record; the connectors (:mod:`kvlayout.compat.connectors`) call it
where LMCache synchronizes.  Every function here takes ``validate=`` and
forwards it to kvlayout: ``True`` checks every slot (and RoPE position) on
the host before anything is written, at the price of a synchronization;
``None`` leaves it to the ``KVLAYOUT_VALIDATE`` environment variable.
"""

from __future__ import annotations

import enum
import logging
import operator
from typing import Any, Mapping

import torch

from kvlayout import ops
from kvlayout.ops.arguments import validating
from kvlayout.reference import semantics as rules

from ._device import indices_on, launch_device

logger = logging.getLogger(__name__)

_warned_no_layout_hint = False


def _no_layout_hint() -> None:
    """vLLM caches came without a ``kv_layout`` hint, so NHD is assumed.  Said once per process at WARNING (an
    engine that registers its caches on every call would otherwise repeat it per call), then at DEBUG."""
    global _warned_no_layout_hint
    level = logging.DEBUG if _warned_no_layout_hint else logging.WARNING
    _warned_no_layout_hint = True
    logger.log(level, "no kv_layout hint for vLLM caches; assuming NHD (pass layout_hints={'kv_layout': ...} "
               "to choose)")

__all__ = [
    "GPUKVFormat", "EngineKVFormat", "MemoryFormat", "TransferDirection", "LAYOUT_OF_FORMAT",
    "MLA_FORMATS", "HND_FORMATS", "CROSS_LAYER_FORMATS", "layout_of", "bind_kv_caches",
    "discover_gpu_kv_format", "canonicalize_kv_caches", "permute_to_contiguous",
    "permute_kv_caches_to_contiguous", "ensure_contiguous_kv_caches", "normalize_and_discover",
    "multi_layer_kv_transfer", "multi_layer_kv_transfer_unilateral", "single_layer_kv_transfer",
    "single_layer_kv_transfer_sgl", "load_and_reshape_flash", "reshape_and_cache_back_flash", "LayerwiseKV",
    "rotary_embedding_k_fused", "as_gpu_kv_format", "as_memory_format",
    "get_num_layers", "get_num_blocks", "get_block_size", "get_page_buffer_size", "get_num_heads", "get_head_size",
    "get_hidden_dim_size", "get_tokens_per_layer", "get_elements_per_layer", "get_dtype", "get_kv_size",
    "get_kv_cache_data_ptrs", "is_mla", "is_hnd", "is_cross_layer_format",
]


# ---------------------------------------------------------------------------------------
# Enums
# ---------------------------------------------------------------------------------------

class GPUKVFormat(enum.IntEnum):
    """How an engine holds its paged KV cache (LMCache's integer values).

    Names spell the physical structure: ``_X_`` separates list levels, ``_``
    the dims of one tensor (NL layers, NB blocks, BS block size, NBBS = NB*BS,
    NH heads, HS head size).
    """

    NB_NL_TWO_BS_NH_HS = 0          # one tensor [NB, NL, 2, BS, NH, HS] (vLLM cross-layer)
    NL_X_TWO_NB_BS_NH_HS = 1        # list[NL] of [2, NB, BS, NH, HS] (vLLM FlashAttention)
    NL_X_NB_TWO_BS_NH_HS = 2        # list[NL] of [NB, 2, BS, NH, HS] (vLLM FlashInfer / Triton)
    NL_X_NB_BS_HS = 3               # list[NL] of [NB, BS, HS] (vLLM MLA)
    TWO_X_NL_X_NBBS_NH_HS = 4       # [[K_0..K_NL-1], [V_0..V_NL-1]], each [NBBS, NH, HS] (SGLang MHA)
    NL_X_NBBS_ONE_HS = 5            # list[NL] of [NBBS, 1, HS] (SGLang MLA)
    NL_X_TWO_NB_NH_BS_HS = 6        # list[NL] of [2, NB, NH, BS, HS] (vLLM FlashAttention, HND)
    NL_X_NB_TWO_NH_BS_HS = 7        # list[NL] of [NB, 2, NH, BS, HS] (vLLM FlashInfer, HND)
    NB_NL_TWO_NH_BS_HS = 8          # one tensor [NB, NL, 2, NH, BS, HS] (TRT-LLM cross-layer, HND)
    NL_X_NB_NH_BS_TWO_HS = 10       # list[NL] of [NB, NH, BS, 2, HS] (packed K/V, HND)
    NL_X_NB_BS_NH_TWO_HS = 11       # list[NL] of [NB, BS, NH, 2, HS] (packed K/V, NHD)


EngineKVFormat = GPUKVFormat


class MemoryFormat(enum.Enum):
    """Shape of an LMCache memory object's tensor.

    A plain ``Enum`` with LMCache's values, as LMCache's own: a member is not
    an int (``MemoryFormat.KV_2LTD != 1``); :func:`as_memory_format` takes
    ints and LMCache's members where a format is read.
    """

    UNDEFINED = 0
    KV_2LTD = 1         # [2, L, T, NH*HS]
    KV_T2D = 2          # one layer, [T, 2, NH*HS]
    KV_2TD = 3          # one layer, [2, T, NH*HS]
    BINARY = 4          # compressed bytes
    BINARY_BUFFER = 5   # raw bytes
    KV_MLA_FMT = 6      # [1, L, T, D] (layer-wise: [T, D])

    def token_dim(self) -> int:
        """The axis of the tensor that counts tokens."""
        return {MemoryFormat.KV_2LTD: 2, MemoryFormat.KV_T2D: 1, MemoryFormat.KV_MLA_FMT: 2}.get(self, 0)


class TransferDirection(enum.IntEnum):
    """``H2D``: memory object -> paged cache.  ``D2H``: paged cache -> memory object."""

    H2D = 0
    D2H = 1


F = GPUKVFormat

LAYOUT_OF_FORMAT: dict[GPUKVFormat, str] = {
    F.NB_NL_TWO_BS_NH_HS: "vllm_cross_layer",
    F.NL_X_TWO_NB_BS_NH_HS: "vllm_flash_attn_nhd",
    F.NL_X_NB_TWO_BS_NH_HS: "vllm_flashinfer_nhd",
    F.NL_X_NB_BS_HS: "vllm_mla",
    F.TWO_X_NL_X_NBBS_NH_HS: "sglang_mha",
    F.NL_X_NBBS_ONE_HS: "sglang_mla",
    F.NL_X_TWO_NB_NH_BS_HS: "vllm_flash_attn_hnd",
    F.NL_X_NB_TWO_NH_BS_HS: "vllm_flashinfer_hnd",
    F.NB_NL_TWO_NH_BS_HS: "trtllm_cross_layer_hnd",
    F.NL_X_NB_NH_BS_TWO_HS: "vllm_packed_hnd",
    F.NL_X_NB_BS_NH_TWO_HS: "vllm_packed_nhd",
}
"""GPUKVFormat -> kvlayout catalog layout name."""

MLA_FORMATS = frozenset({F.NL_X_NB_BS_HS, F.NL_X_NBBS_ONE_HS})
HND_FORMATS = frozenset({F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_TWO_NH_BS_HS, F.NB_NL_TWO_NH_BS_HS,
                         F.NL_X_NB_NH_BS_TWO_HS})
CROSS_LAYER_FORMATS = frozenset({F.NB_NL_TWO_BS_NH_HS, F.NB_NL_TWO_NH_BS_HS})
PAGED_FORMATS = frozenset(set(F) - {F.TWO_X_NL_X_NBBS_NH_HS, F.NL_X_NBBS_ONE_HS})
SINGLE_LAYER_FORMATS = frozenset({F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_TWO_BS_NH_HS, F.NL_X_NB_BS_HS,
                                  F.NL_X_NBBS_ONE_HS, F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_TWO_NH_BS_HS,
                                  F.NL_X_NB_NH_BS_TWO_HS, F.NL_X_NB_BS_NH_TWO_HS})


_SUPPORTED_GPU_KV_FORMATS = f"supported: {sorted(int(f) for f in LAYOUT_OF_FORMAT)}"
_SUPPORTED_MEMORY_FORMATS = f"supported: {[f.value for f in MemoryFormat]}"


def _enum_int(value, what: str) -> int:
    """The integer behind an enum member of any origin (kvlayout's, LMCache's pybind or Python enums) or an int."""
    raw = value.value if isinstance(value, enum.Enum) or (hasattr(value, "value") and hasattr(value, "name")) \
        else value
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be an enum member or its integer value, got {value!r}") from None


def _as_member(enum_type, value, what: str, unsupported: str):
    """``enum_type``'s member with the integer behind ``value`` (see :func:`_enum_int`); ``ValueError`` naming
    ``what`` and ``unsupported`` (the accepted values) when there is none."""
    if type(value) is enum_type:      # kvlayout's own member: a connector checks one per object and layer
        return value
    v = _enum_int(value, what)
    try:
        return enum_type(v)
    except ValueError:
        raise ValueError(f"unsupported {enum_type.__name__} {value!r} for {what}; {unsupported}") from None


def as_gpu_kv_format(gpu_kv_format) -> GPUKVFormat:
    """kvlayout's :class:`GPUKVFormat` for a member of LMCache's ``GPUKVFormat``/``EngineKVFormat`` (or an int)."""
    return _as_member(GPUKVFormat, gpu_kv_format, "gpu_kv_format", _SUPPORTED_GPU_KV_FORMATS)


def as_memory_format(fmt) -> MemoryFormat:
    """kvlayout's :class:`MemoryFormat` for a member of LMCache's ``MemoryFormat`` (or an int)."""
    return _as_member(MemoryFormat, fmt, "fmt", _SUPPORTED_MEMORY_FORMATS)


def as_direction(direction) -> TransferDirection:
    """kvlayout's :class:`TransferDirection` for a member of LMCache's (or 0 / 1)."""
    return _as_member(TransferDirection, direction, "direction", "it must be H2D (0) or D2H (1)")


def layout_of(gpu_kv_format) -> str:
    """The catalog layout name of a format (``ValueError`` for an unknown value)."""
    return LAYOUT_OF_FORMAT[as_gpu_kv_format(gpu_kv_format)]


# ---------------------------------------------------------------------------------------
# Binding the engine's structure
# ---------------------------------------------------------------------------------------

def bind_kv_caches(kv_caches, gpu_kv_format) -> ops.KVCache:
    """Bind the structure an engine holds to the format's catalog layout.

    Cross-layer formats take the bare tensor (a one-element list holding it is
    unwrapped); format 4 takes ``[[K...], [V...]]``; the others a list of
    per-layer tensors.
    """
    fmt = as_gpu_kv_format(gpu_kv_format)
    layout = layout_of(fmt)
    if fmt in CROSS_LAYER_FORMATS:
        if isinstance(kv_caches, (list, tuple)):
            if len(kv_caches) != 1:
                raise ValueError(f"format {fmt.name} expects one cross-layer tensor, got a list of {len(kv_caches)}")
            kv_caches = kv_caches[0]
        return ops.bind(layout, kv_caches)
    if fmt == F.TWO_X_NL_X_NBBS_NH_HS:
        if not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != 2:
            raise ValueError("format TWO_X_NL_X_NBBS_NH_HS expects [[K_0..K_L-1], [V_0..V_L-1]]")
        k, v = kv_caches
        return ops.bind(layout, (list(k), list(v)))
    if isinstance(kv_caches, torch.Tensor):
        raise ValueError(f"format {fmt.name} expects a list of per-layer tensors, got one tensor")
    return ops.bind(layout, list(kv_caches))


def _bind_chunk(key_value: torch.Tensor, mla: bool) -> ops.KVCache:
    """Bind a multi-layer memory object: ``[2, L, T, D]`` (KV_2LTD) or ``[1, L, T, D]`` (MLA)."""
    if key_value.dim() != 4 or key_value.shape[0] != (1 if mla else 2):
        want = "[1, L, T, D] (KV_MLA_FMT)" if mla else "[2, L, T, D] (KV_2LTD)"
        raise ValueError(f"key_value must be {want}, got shape {tuple(key_value.shape)}")
    return ops.bind("lmcache_kv_mla" if mla else "lmcache_kv_2ltd", key_value)


def _move_rows(chunk: ops.KVCache, paged: ops.KVCache, slot_mapping, direction, skip: int = 0,
               num_tokens: int | None = None, validate: bool | None = None) -> None:
    """The one composition every op here reduces to: chunk position t <-> paged slot slot_mapping[t]."""
    direction = as_direction(direction)
    slots = indices_on(slot_mapping, launch_device(chunk, paged))
    if num_tokens is not None and slots.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slots.shape[0]} entries, the memory object {num_tokens} tokens")
    if direction == TransferDirection.H2D:
        ops.transfer(chunk, paged, None, slots, skip_prefix=skip, validate=validate)
    else:
        ops.transfer(paged, chunk, slots, None, skip_prefix=skip, validate=validate)


# ---------------------------------------------------------------------------------------
# Multi-layer transfers
# ---------------------------------------------------------------------------------------

def multi_layer_kv_transfer(key_value: torch.Tensor, kv_caches, slot_mapping: torch.Tensor,
                            paged_memory_device=None, page_buffer_size: int = 0,
                            direction=TransferDirection.D2H, gpu_kv_format=F.NL_X_TWO_NB_BS_NH_HS,
                            block_size: int = 0, head_size: int = 0, skip_prefix_n_tokens: int = 0, *,
                            validate: bool | None = None) -> None:
    """Move one chunk of T tokens, all layers, between a memory object and the paged cache.

    ``key_value``: ``[2, L, T, NH*HS]`` (KV_2LTD) or, for MLA formats (3, 5),
    ``[1, L, T, D]``.  ``kv_caches``: the engine's structure for
    ``gpu_kv_format`` (where LMCache takes a pointer tensor).
    ``slot_mapping [T]``: the paged slot of each chunk position.
    ``direction``: H2D (memory object -> cache) or D2H.
    ``skip_prefix_n_tokens``: positions ``< skip`` are neither read nor written;
    positions stay absolute on both sides.

    ``paged_memory_device`` is accepted for signature compatibility; the launch
    device follows the tensors.  ``page_buffer_size``, ``block_size`` and
    ``head_size`` are checked against the bound geometry when non-zero (kvlayout
    reads the geometry from the tensors themselves).

    Format 0 (``NB_NL_TWO_BS_NH_HS``) is transferred with the true strides of
    a ``[NB, NL, 2, BS, NH, HS]`` tensor, as kvlayout's ``vllm_cross_layer``
    layout defines it (LMCache's token kernel instead reads format 0 like
    format 1, one ``[2, NBBS, ...]`` region per layer pointer).  Formats 10/11
    (packed K/V) take a split ``[2, L, T, NH*HS]`` memory object: K and V are
    de-interleaved into the two planes.
    """
    fmt = as_gpu_kv_format(gpu_kv_format)
    paged = bind_kv_caches(kv_caches, fmt)
    chunk = _bind_chunk(key_value, fmt in MLA_FORMATS)
    g = paged.geometry
    if page_buffer_size and page_buffer_size != g.N:
        raise ValueError(f"page_buffer_size = {page_buffer_size} but the caches hold {g.N} slots per layer")
    if block_size and fmt in PAGED_FORMATS and fmt not in MLA_FORMATS and block_size != g.BS:
        raise ValueError(f"block_size = {block_size} but the caches have blocks of {g.BS} slots")
    if head_size and fmt not in MLA_FORMATS and head_size != g.E:
        raise ValueError(f"head_size = {head_size} but the caches have heads of {g.E} elements")
    if chunk.geometry.L != g.L:
        raise ValueError(f"key_value has {chunk.geometry.L} layers, kv_caches {g.L}")
    _move_rows(chunk, paged, slot_mapping, direction, int(skip_prefix_n_tokens), num_tokens=key_value.shape[2],
               validate=validate)


def _sglang_kv_lists(k_caches_and_v_caches):
    """``[K_0..K_L-1, V_0..V_L-1]`` or ``[[K...], [V...]]`` -> (k_list, v_list) of 3-D ``[PBS, NH, HS]``."""
    items = list(k_caches_and_v_caches)
    if len(items) == 2 and isinstance(items[0], (list, tuple)):
        k, v = list(items[0]), list(items[1])
    else:
        if len(items) % 2:
            raise ValueError(f"expected 2*L tensors [K_0..K_L-1, V_0..V_L-1], got {len(items)}")
        k, v = items[:len(items) // 2], items[len(items) // 2:]
    def as3(t):
        return t.unsqueeze(1) if t.dim() == 2 else t   # [PBS, D] is one head of D
    return [as3(t) for t in k], [as3(t) for t in v]


def multi_layer_kv_transfer_unilateral(key_value: torch.Tensor, k_caches_and_v_caches, slot_mapping: torch.Tensor,
                                       device=None, page_buffer_size: int = 0,
                                       direction=TransferDirection.D2H,
                                       gpu_kv_format=F.TWO_X_NL_X_NBBS_NH_HS, *,
                                       validate: bool | None = None) -> None:
    """SGLang MHA form of :func:`multi_layer_kv_transfer` (K and V in separate per-layer tensors).

    ``k_caches_and_v_caches``: ``[K_0..K_L-1, V_0..V_L-1]`` (LMCache's 2L
    pointer order) or ``[[K...], [V...]]``, each ``[PBS, NH, HS]``.  MLA
    formats (3, 5) delegate to :func:`multi_layer_kv_transfer` with the
    per-layer list.  No skip prefix, as in LMCache.
    """
    fmt = as_gpu_kv_format(gpu_kv_format)
    if fmt in MLA_FORMATS:
        multi_layer_kv_transfer(key_value, k_caches_and_v_caches, slot_mapping, device, page_buffer_size,
                                direction, fmt, validate=validate)
        return
    k, v = _sglang_kv_lists(k_caches_and_v_caches)
    multi_layer_kv_transfer(key_value, [k, v], slot_mapping, device, page_buffer_size, direction,
                            F.TWO_X_NL_X_NBBS_NH_HS, validate=validate)


# ---------------------------------------------------------------------------------------
# Single-layer transfers
# ---------------------------------------------------------------------------------------

def _bind_layer_chunk(lmc: torch.Tensor, token_major: bool, mla: bool) -> ops.KVCache:
    if mla:
        if lmc.dim() != 2:
            raise ValueError(f"an MLA layer chunk is [T, D], got shape {tuple(lmc.shape)}")
        return ops.bind("lmcache_kv_mla_layer", lmc)
    if lmc.dim() != 3 or lmc.shape[1 if token_major else 0] != 2:
        want = "[T, 2, D] (KV_T2D)" if token_major else "[2, T, D] (KV_2TD)"
        raise ValueError(f"with token_major={token_major} the layer chunk must be {want}, got {tuple(lmc.shape)}")
    return ops.bind("lmcache_kv_t2d" if token_major else "lmcache_kv_2td", lmc)


def _check_single_layer_format(fmt: GPUKVFormat) -> None:
    if fmt not in SINGLE_LAYER_FORMATS:
        raise ValueError(f"single_layer_kv_transfer supports per-layer formats "
                         f"{sorted(int(f) for f in SINGLE_LAYER_FORMATS)}, got {fmt.name}")


def _bind_sgl_layer(k: torch.Tensor, v: torch.Tensor) -> ops.KVCache:
    """One SGLang layer's K and V: ``[PBS, NH, HS]``, ``[NB, BS, NH, HS]`` (block and slot axes merged) or
    ``[PBS, D]`` (one head of D)."""
    def as3(t):
        # a view, never a copy: rows written into a copy would be lost
        return t.view(-1, *t.shape[2:]) if t.dim() == 4 else (t.unsqueeze(1) if t.dim() == 2 else t)

    return ops.bind("sglang_mha", ([as3(k)], [as3(v)]))


def single_layer_kv_transfer(lmc_key_value_cache: torch.Tensor, vllm_key_value_cache: torch.Tensor,
                             slot_mapping: torch.Tensor, direction=TransferDirection.D2H,
                             gpu_kv_format=F.NL_X_TWO_NB_BS_NH_HS, token_major: bool = False, *,
                             validate: bool | None = None) -> None:
    """Move one layer between a layer chunk and one layer of the paged cache.

    ``lmc_key_value_cache``: ``[T, 2, D]`` when ``token_major`` (KV_T2D), else
    ``[2, T, D]`` (KV_2TD); MLA formats ``[T, D]``.  Strided views are fine
    (kvlayout addresses by strides).  ``vllm_key_value_cache``: one layer's
    tensor of a per-layer format (1, 2, 3, 5, 6, 7, 10, 11).  T is
    ``slot_mapping``'s length.  (A layer-wise pipeline over the same caches:
    :class:`LayerwiseKV` binds them once.)
    """
    fmt = as_gpu_kv_format(gpu_kv_format)
    _check_single_layer_format(fmt)
    chunk = _bind_layer_chunk(lmc_key_value_cache, token_major, fmt in MLA_FORMATS)
    paged = ops.bind(layout_of(fmt), [vllm_key_value_cache])
    _move_rows(chunk, paged, slot_mapping, direction, validate=validate)


def single_layer_kv_transfer_sgl(lmc_key_value_cache: torch.Tensor, sgl_key_cache: torch.Tensor,
                                 sgl_value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                 direction=TransferDirection.D2H, token_major: bool = False, *,
                                 validate: bool | None = None) -> None:
    """Like :func:`single_layer_kv_transfer` for one SGLang layer (separate K and V tensors).

    ``sgl_key_cache``/``sgl_value_cache``: ``[PBS, NH, HS]``, or
    ``[NB, BS, NH, HS]`` whose block and slot axes merge into one slot axis
    (e.g. SGLang's ``[PBS, 1, NH, HS]`` views).
    """
    chunk = _bind_layer_chunk(lmc_key_value_cache, token_major, False)
    paged = _bind_sgl_layer(sgl_key_cache, sgl_value_cache)
    _move_rows(chunk, paged, slot_mapping, direction, validate=validate)


def _flash_layer(key_value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, layer_idx,
                 slot_mapping, what: str) -> tuple[ops.KVCache, ops.KVCache, int, torch.Tensor]:
    """(chunk, one-layer cache, layer index, slots) for the two per-layer flash ops, checked."""
    if not isinstance(key_value, torch.Tensor) or key_value.dim() != 4 or key_value.shape[0] != 2:
        raise ValueError(f"{what}: key_value must be [2, L, T, NH*HS], got "
                         f"{tuple(getattr(key_value, 'shape', ()))}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{what}: {name} must be one layer's [NB, BS, NH, HS], got "
                             f"{tuple(getattr(t, 'shape', ()))}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"{what}: key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} "
                         "differ in shape")
    if isinstance(layer_idx, bool):
        raise TypeError(f"{what}: layer_idx must be an int, got {layer_idx!r}")
    try:
        layer = operator.index(layer_idx)
    except TypeError:
        raise TypeError(f"{what}: layer_idx must be an int, got {type(layer_idx).__name__}") from None
    layers = key_value.shape[1]
    if not 0 <= layer < layers:
        raise IndexError(f"{what}: layer_idx = {layer} is out of range: key_value holds {layers} layers")
    chunk = _bind_chunk(key_value, False)
    paged = _bind_sgl_layer(key_cache, value_cache)
    slots = indices_on(slot_mapping, launch_device(chunk, paged))
    if slots.dim() != 1 or slots.shape[0] != key_value.shape[2]:
        raise ValueError(f"{what}: slot_mapping has {tuple(slots.shape)} entries, key_value {key_value.shape[2]} "
                         "tokens")
    return chunk, paged, layer, slots


def load_and_reshape_flash(key_value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, layer_idx: int, *, validate: bool | None = None) -> None:
    """Paged cache -> memory object, one layer (LMCache's older per-layer op, still exported).

    ``key_value [2, L, T, NH*HS]``; ``key_cache`` / ``value_cache``: one
    layer's K and V ``[NB, BS, NH, HS]`` (vLLM FlashAttention's
    ``kv_cache[layer][0]`` / ``[1]``); ``slot_mapping [T]``.  For each ``t``
    with ``slot_mapping[t] >= 0``: ``key_value[0, layer_idx, t]`` = K row and
    ``key_value[1, layer_idx, t]`` = V row of that slot; the other layers of
    ``key_value`` are untouched.
    """
    chunk, paged, layer, slots = _flash_layer(key_value, key_cache, value_cache, layer_idx, slot_mapping,
                                              "load_and_reshape_flash")
    ops.transfer(paged, chunk, slots, None, src_layers=[0], dst_layers=[layer], validate=validate)


def reshape_and_cache_back_flash(key_value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                 slot_mapping: torch.Tensor, layer_idx: int, *,
                                 validate: bool | None = None) -> None:
    """Memory object -> paged cache, one layer: the inverse of :func:`load_and_reshape_flash`."""
    chunk, paged, layer, slots = _flash_layer(key_value, key_cache, value_cache, layer_idx, slot_mapping,
                                              "reshape_and_cache_back_flash")
    ops.transfer(chunk, paged, None, slots, src_layers=[layer], dst_layers=[0], validate=validate)


class LayerwiseKV:
    """An engine's per-layer caches bound once, for layer-by-layer transfers with one-layer chunks.

    :func:`single_layer_kv_transfer` (and :func:`single_layer_kv_transfer_sgl`)
    check the format and bind the layer on every call.  A layer-wise pipeline
    moves every layer of every step over the same caches, so this does the
    cache side once (each layer is bound when first used):

    * :meth:`move` is the per-call function for a chunk met once (a memory
      object): one :func:`kvlayout.ops.transfer`, same checks and errors;
    * :meth:`prepare` checks and plans, once, the transfer between the caches
      and a chunk tensor that serves layer after layer (a staging buffer):
      a load is one prepared transfer of every layer (``t.layer(l)`` loads
      layer l from the chunk); a store writes the chunk, and one transfer may
      write a destination layer only once, so each layer's store is its own
      one-layer transfer (``t.layer(0)``).  :meth:`set_slots` rebinds the slots.

    ``kv_caches``: the structure of ``gpu_kv_format``: a list of per-layer
    tensors of a per-layer format (1, 2, 3, 5, 6, 7, 10, 11), or SGLang MHA's
    ``[[K_0..K_L-1], [V_0..V_L-1]]`` (format 4, moved as
    :func:`single_layer_kv_transfer_sgl` moves it).  ``token_major``: chunks
    are ``[T, 2, D]`` (KV_T2D), else ``[2, T, D]`` (KV_2TD); format 4 chunks
    are token-major; MLA chunks are ``[T, D]``.
    """

    def __init__(self, kv_caches, gpu_kv_format, token_major: bool):
        fmt = as_gpu_kv_format(gpu_kv_format)
        self.sgl = fmt == F.TWO_X_NL_X_NBBS_NH_HS
        if not self.sgl:
            _check_single_layer_format(fmt)
        self.format, self.kv_caches = fmt, kv_caches
        self.token_major = bool(token_major) or self.sgl
        self.mla = fmt in MLA_FORMATS
        self.tensors = self._leaves(kv_caches)
        self._layers: dict[int, ops.KVCache] = {}
        self._all: ops.KVCache | None = None

    def _leaves(self, kv_caches) -> tuple:
        return tuple(kv_caches[0]) + tuple(kv_caches[1]) if self.sgl else tuple(kv_caches)

    @property
    def num_layers(self) -> int:
        return len(self.tensors) // 2 if self.sgl else len(self.tensors)

    def serves(self, kv_caches, gpu_kv_format) -> bool:
        """Whether ``kv_caches`` of ``gpu_kv_format`` are still the bound caches: the same structure holding the
        same tensors (a tensor put into the engine's list in place of another is a new cache)."""
        if kv_caches is not self.kv_caches or gpu_kv_format != self.format:
            return False
        now = self._leaves(kv_caches)
        return len(now) == len(self.tensors) and all(a is b for a, b in zip(now, self.tensors))

    def layer(self, l: int) -> ops.KVCache:
        """Layer ``l`` bound alone, as the per-call functions bind it."""
        bound = self._layers.get(l)
        if bound is None:
            if self.sgl:
                bound = _bind_sgl_layer(self.kv_caches[0][l], self.kv_caches[1][l])
            else:
                bound = ops.bind(layout_of(self.format), [self.kv_caches[l]])
            self._layers[l] = bound
        return bound

    def all_layers(self) -> ops.KVCache:
        """Every layer bound as one cache (what a load of every layer from one chunk reads into)."""
        if self._all is None:
            self._all = bind_kv_caches(self.kv_caches, self.format)
        return self._all

    def chunk(self, tensor: torch.Tensor) -> ops.KVCache:
        """A one-layer chunk tensor bound (shape checked as the per-call functions check it)."""
        return _bind_layer_chunk(tensor, self.token_major, self.mla)

    def move(self, l: int, tensor: torch.Tensor, slots, direction, validate: bool | None = None) -> None:
        """Layer ``l`` <-> ``tensor`` (one layer, ``[T, ...]`` as :meth:`chunk` says) at ``slots [T]``: H2D
        writes the layer, D2H the chunk."""
        paged = self.layer(l)
        _move_rows(self.chunk(tensor), paged, slots, direction, validate=validate)

    def prepare(self, tensor: torch.Tensor, slots, direction, layer: int = 0,
                validate: bool | None = None) -> ops.PreparedTransfer:
        """The transfer between the caches and ``tensor`` at ``slots [T]``, checked and planned once.

        H2D: every layer from ``tensor`` (``t.layer(l)`` loads layer l);
        D2H: layer ``layer`` into ``tensor`` (``t.layer(0)``).
        """
        chunk = self.chunk(tensor)
        if as_direction(direction) == TransferDirection.H2D:
            paged = self.all_layers()
            return ops.prepare(chunk, paged, None, indices_on(slots, launch_device(chunk, paged)),
                               src_layers=[0] * paged.geometry.L, validate=validate)
        paged = self.layer(layer)
        return ops.prepare(paged, chunk, indices_on(slots, launch_device(chunk, paged)), None, validate=validate)

    @staticmethod
    def set_slots(t: ops.PreparedTransfer, slots, direction) -> None:
        """Give a transfer of :meth:`prepare` other slots ``[T']`` (its chunk must hold ``T'`` tokens)."""
        s = indices_on(slots, launch_device(t.src, t.dst))
        if as_direction(direction) == TransferDirection.H2D:
            t.set_slots(None, s)
        else:
            t.set_slots(s, None)


# ---------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------

def rotary_embedding_k_fused(old_positions: torch.Tensor, new_positions: torch.Tensor, key: torch.Tensor,
                             head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool, *,
                             validate: bool | None = None) -> None:
    """Re-rotate cached keys in place from ``old_positions`` to ``new_positions``.

    ``key``: ``[T, NH*HS]`` or ``[T, NH, HS]`` (a view with a contiguous last
    dim).  ``cos_sin_cache [max_pos, rot_dim]``: cos half then sin half.  NeoX
    pairs ``(i, i + rot/2)``, GPT-J ``(2i, 2i + 1)``; math in fp32.  A
    negative position leaves the token as it is.  ``validate=True`` checks on
    the host that every position is below ``max_pos`` (``IndexError``).
    """
    keys = key if key.dim() == 3 else key.view(key.shape[0], -1, int(head_size))
    if keys.shape[-1] != head_size:
        rules.ROPE_GEOMETRY.fail(f"key heads have {keys.shape[-1]} elements, head_size = {head_size}")
    dev = keys.device
    old, new = indices_on(old_positions, dev), indices_on(new_positions, dev)
    if validating(validate):
        for name, pos in (("old_positions", old), ("new_positions", new)):
            bad = torch.nonzero(pos.detach().cpu() >= cos_sin_cache.shape[0])
            if bad.numel():
                i = int(bad[0, 0])
                rules.POSITION_OUT_OF_RANGE.fail(f"{name}[{i}] = {int(pos[i])} is out of range: cos_sin_cache "
                                                 f"holds {cos_sin_cache.shape[0]} positions")
    ops.rope_reposition(keys, old, new, cos_sin_cache.to(dev), is_neox=bool(is_neox))


# ---------------------------------------------------------------------------------------
# Format discovery and contiguity recovery
# ---------------------------------------------------------------------------------------

def _engine_name(engine) -> str:
    name = getattr(engine, "name", None) or getattr(engine, "value", None) or engine
    name = str(name).lower().replace("-", "").replace("_", "")
    aliases = {"vllm": "vllm", "sglang": "sglang", "trtllm": "trtllm", "tensorrtllm": "trtllm"}
    if name not in aliases:
        raise ValueError(f"unknown serving engine {engine!r}; expected vllm, sglang or trtllm")
    return aliases[name]


def _walk(kv_caches) -> tuple[int, torch.Tensor]:
    """(list depth, first leaf tensor), following element [0] of each list level."""
    depth, node = 0, kv_caches
    while isinstance(node, (list, tuple)):
        if not node:
            raise ValueError("kv_caches contains an empty list")
        node, depth = node[0], depth + 1
    if not isinstance(node, torch.Tensor):
        raise ValueError(f"kv_caches leaves must be tensors, got {type(node).__name__}")
    return depth, node


def _assert_contiguous(t: torch.Tensor) -> None:
    if t.storage_offset() != 0 or not t.is_contiguous():
        raise ValueError("kv_caches must be contiguous with storage offset 0 before format discovery "
                         f"(shape {tuple(t.shape)}, strides {t.stride()}, offset {t.storage_offset()}); "
                         "call ensure_contiguous_kv_caches first")


def discover_gpu_kv_format(kv_caches, engine, layout_hints: Mapping[str, Any] | None = None) -> GPUKVFormat:
    """LMCache's format detection from the structure and shapes of ``kv_caches``.

    Rules: list depth and rank of the first leaf decide; the first leaf must be
    contiguous with offset 0 (recover permuted HND views with
    :func:`ensure_contiguous_kv_caches` first).

    * TRT-LLM: a bare 6-D tensor -> 8.
    * vLLM (``layout_hints["kv_layout"]``, default ``"NHD"``): a bare tensor ->
      0; a list of 5-D tensors -> ``shape[0] == 2``: 1 (HND: 6), else
      ``shape[1] == 2``: 2 (HND: 7) - so ``shape[0] == 2`` wins when NB == 2 -
      else ``shape[3] == 2``: packed 11 (HND: 10); a list of 3-D tensors -> 3.
    * SGLang: a list of tensors with ``shape[1] == 1`` -> 5; a list of two lists -> 4.

    Anything else raises ``ValueError``.
    """
    hints = dict(layout_hints or {})
    depth, leaf = _walk(kv_caches)
    _assert_contiguous(leaf)
    eng = _engine_name(engine)
    shape, ndim = tuple(leaf.shape), leaf.dim()
    fmt = None
    if eng == "trtllm":
        if depth == 0 and ndim == 6:
            fmt = F.NB_NL_TWO_NH_BS_HS
    elif eng == "vllm":
        if "kv_layout" not in hints:
            _no_layout_hint()
        hnd = str(hints.get("kv_layout", "NHD")).upper() == "HND"
        if depth == 0 and ndim == 6:
            fmt = F.NB_NL_TWO_BS_NH_HS
        elif depth == 1 and ndim == 5:
            if shape[0] == 2:
                fmt = F.NL_X_TWO_NB_NH_BS_HS if hnd else F.NL_X_TWO_NB_BS_NH_HS
            elif shape[1] == 2:
                fmt = F.NL_X_NB_TWO_NH_BS_HS if hnd else F.NL_X_NB_TWO_BS_NH_HS
            elif shape[3] == 2:
                fmt = F.NL_X_NB_NH_BS_TWO_HS if hnd else F.NL_X_NB_BS_NH_TWO_HS
        elif depth == 1 and ndim == 3:
            fmt = F.NL_X_NB_BS_HS
    elif eng == "sglang":
        if depth == 1 and ndim == 3 and shape[1] == 1:
            fmt = F.NL_X_NBBS_ONE_HS
        elif depth == 2:
            fmt = F.TWO_X_NL_X_NBBS_NH_HS
    if fmt is None:
        raise ValueError(f"currently unsupported kv_caches format for {eng}: list depth {depth}, "
                         f"leaf shape {list(shape)}")
    logger.info("kv_caches: %s (%s) -> kvlayout layout %s", fmt.name, int(fmt), LAYOUT_OF_FORMAT[fmt])
    return fmt


def canonicalize_kv_caches(kv_caches, layout_hints: Mapping[str, Any] | None = None):
    """Zero-copy normalisation of cross-layer inputs before discovery.

    A one-element list holding a 6-D tensor is unwrapped (a 6-D tensor is
    always cross-layer).  A one-element list holding a 4-D TRT-LLM tensor
    ``[NB, NL, 2, NH*BS*HS]`` is viewed as ``[NB, NL, 2, NH, BS, HS]`` using the
    hints ``num_kv_heads``, ``tokens_per_block`` and ``head_dim``.
    """
    hints = dict(layout_hints or {})
    if isinstance(kv_caches, (list, tuple)) and len(kv_caches) == 1 and isinstance(kv_caches[0], torch.Tensor):
        t = kv_caches[0]
        if t.dim() == 6:
            return t
        if t.dim() == 4 and {"num_kv_heads", "tokens_per_block", "head_dim"} <= hints.keys():
            nh, bs, hs = (int(hints[k]) for k in ("num_kv_heads", "tokens_per_block", "head_dim"))
            if t.shape[3] != nh * bs * hs:
                raise ValueError(f"last dim {t.shape[3]} != num_kv_heads*tokens_per_block*head_dim = {nh * bs * hs}")
            return t.view(*t.shape[:3], nh, bs, hs)
    return kv_caches


def permute_to_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a contiguous tensor: dims sorted by decreasing stride (no copy).

    Raises ``ValueError`` if that still is not contiguous (padding, slicing).
    """
    if t.is_contiguous():
        return t
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    p = t.permute(order)
    if not p.is_contiguous():
        raise ValueError(f"tensor of shape {tuple(t.shape)} strides {t.stride()} is non-contiguous "
                         "for reasons other than permutation")
    return p


def permute_kv_caches_to_contiguous(kv_caches):
    """:func:`permute_to_contiguous` over a list (or nested lists) of tensors."""
    if isinstance(kv_caches, torch.Tensor):
        return permute_to_contiguous(kv_caches)
    return type(kv_caches)(permute_kv_caches_to_contiguous(x) for x in kv_caches)


def _leaves(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, Mapping):
        for v in x.values():
            yield from _leaves(v)
    else:
        for v in x:
            yield from _leaves(v)


def ensure_contiguous_kv_caches(kv_caches, kv_layout: str | None = None):
    """Return ``kv_caches`` with permuted views (vLLM's NHD view of HND memory) made contiguous.

    Metadata only: data pointers are unchanged.  A list or a dict of tensors;
    returned unchanged when every tensor is already contiguous.
    """
    if all(t.is_contiguous() for t in _leaves(kv_caches)):
        return kv_caches
    if str(kv_layout).upper() == "HND":
        logger.info("recovering the physical HND layout of permuted kv_caches views")
    else:
        logger.warning("kv_caches are non-contiguous but kv_layout is %r; permuting to contiguous", kv_layout)
    if isinstance(kv_caches, Mapping):
        return {k: permute_kv_caches_to_contiguous(v) for k, v in kv_caches.items()}
    return permute_kv_caches_to_contiguous(kv_caches)


def normalize_and_discover(kv_caches, engine, layout_hints: Mapping[str, Any] | None = None):
    """Contiguity recovery, canonicalisation and discovery in one call: ``(format, kv_caches)``.

    Callers must use the returned structure.  Packed caches handed out as
    rank-4 ``[NB, BS, NH, 2*HS]`` (NHD) or ``[NB, NH, BS, 2*HS]`` (HND) are
    viewed as rank 5 with a trailing ``[2, HS]`` and are packed formats (11,
    HND: 10) whatever their sizes: the rank-5 shape rules of
    :func:`discover_gpu_kv_format` would read 2 blocks as format 1, or a
    block size (HND: head count) of 2 as format 2.
    """
    hints = dict(layout_hints or {})
    kv = canonicalize_kv_caches(ensure_contiguous_kv_caches(kv_caches, hints.get("kv_layout")), hints)
    if _engine_name(engine) == "vllm" and isinstance(kv, (list, tuple)) and kv \
            and isinstance(kv[0], torch.Tensor) and kv[0].dim() == 4:
        for i, t in enumerate(kv):
            if t.dim() != 4 or t.shape[3] % 2:
                raise ValueError(f"packed kv_caches[{i}] must be [NB, *, *, 2*HS], got shape {tuple(t.shape)}")
        _assert_contiguous(kv[0])
        kv = [t.view(*t.shape[:3], 2, t.shape[3] // 2) for t in kv]
        if "kv_layout" not in hints:
            _no_layout_hint()
        hnd = str(hints.get("kv_layout", "NHD")).upper() == "HND"
        fmt = F.NL_X_NB_NH_BS_TWO_HS if hnd else F.NL_X_NB_BS_NH_TWO_HS
        logger.info("kv_caches: %s (%s) -> kvlayout layout %s", fmt.name, int(fmt), LAYOUT_OF_FORMAT[fmt])
        return fmt, kv
    return discover_gpu_kv_format(kv, engine, hints), kv


# ---------------------------------------------------------------------------------------
# Geometry getters (LMCache's names), read from layer 0's bound kvlayout geometry
# ---------------------------------------------------------------------------------------

SGLANG_FORMATS = frozenset({F.TWO_X_NL_X_NBBS_NH_HS, F.NL_X_NBBS_ONE_HS})


def _first_layer(kv_caches, gpu_kv_format):
    """The engine's structure cut down to its first layer (the whole tensor for cross-layer formats).

    LMCache's geometry helpers read layer 0: a hybrid model's layer groups may
    differ in head size and dtype, and the helpers must still answer.
    """
    fmt = as_gpu_kv_format(gpu_kv_format)
    if fmt in CROSS_LAYER_FORMATS:
        return kv_caches
    if isinstance(kv_caches, torch.Tensor):
        raise ValueError(f"format {fmt.name} expects a list of per-layer tensors, got one tensor")
    if fmt == F.TWO_X_NL_X_NBBS_NH_HS:
        if not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != 2:
            raise ValueError("format TWO_X_NL_X_NBBS_NH_HS expects [[K_0..K_L-1], [V_0..V_L-1]]")
        k, v = kv_caches
        if not len(k) or not len(v):
            raise ValueError("kv_caches holds no layers")
        return [[k[0]], [v[0]]]
    if not len(kv_caches):
        raise ValueError("kv_caches holds no layers")
    return [kv_caches[0]]


def _geometry(kv_caches, gpu_kv_format):
    """The geometry of layer 0 (see :func:`_first_layer`)."""
    return bind_kv_caches(_first_layer(kv_caches, gpu_kv_format), gpu_kv_format).geometry


def _paged_only(gpu_kv_format, what: str) -> GPUKVFormat:
    fmt = as_gpu_kv_format(gpu_kv_format)
    if fmt in SGLANG_FORMATS:
        raise ValueError(f"{what} is not defined for {fmt.name}: SGLang pools have one flat slot axis")
    return fmt


def get_num_layers(kv_caches, gpu_kv_format) -> int:
    """Layers of the engine's caches (layers may differ in shape and dtype: each is counted, none is bound)."""
    fmt = as_gpu_kv_format(gpu_kv_format)
    if fmt in CROSS_LAYER_FORMATS:
        return bind_kv_caches(kv_caches, fmt).geometry.L
    _first_layer(kv_caches, fmt)          # checks the structure
    return len(kv_caches[0]) if fmt == F.TWO_X_NL_X_NBBS_NH_HS else len(kv_caches)


def get_num_blocks(kv_caches, gpu_kv_format) -> int:
    """Blocks (pages) per layer; ``ValueError`` for the SGLang formats 4 and 5."""
    return _geometry(kv_caches, _paged_only(gpu_kv_format, "get_num_blocks")).NB


def get_block_size(kv_caches, gpu_kv_format) -> int:
    """Slots per block; ``ValueError`` for the SGLang formats 4 and 5."""
    return _geometry(kv_caches, _paged_only(gpu_kv_format, "get_block_size")).BS


def get_page_buffer_size(kv_caches, gpu_kv_format) -> int:
    """Token slots of one layer's K (or V) plane: ``NB * BS``, or the SGLang pools' ``size + page_size``."""
    return _geometry(kv_caches, gpu_kv_format).N


get_tokens_per_layer = get_page_buffer_size


def get_num_heads(kv_caches, gpu_kv_format) -> int:
    """KV heads (1 for the MLA formats)."""
    return _geometry(kv_caches, gpu_kv_format).H


def get_head_size(kv_caches, gpu_kv_format) -> int:
    """Elements per head (the latent width for MLA)."""
    return _geometry(kv_caches, gpu_kv_format).E


def get_hidden_dim_size(kv_caches, gpu_kv_format) -> int:
    """Elements per token row of one plane: ``num_heads * head_size``."""
    g = _geometry(kv_caches, gpu_kv_format)
    return g.H * g.E


def get_elements_per_layer(kv_caches, gpu_kv_format) -> int:
    """Elements of one layer, K and V together (one plane for MLA): sizes a layer-wise staging buffer."""
    g = _geometry(kv_caches, gpu_kv_format)
    return g.P * g.N * g.H * g.E


def get_dtype(kv_caches, gpu_kv_format) -> torch.dtype:
    """Layer 0's dtype."""
    return bind_kv_caches(_first_layer(kv_caches, gpu_kv_format), gpu_kv_format).dtype


def get_kv_size(gpu_kv_format) -> int:
    """Planes of a token row as the kernels see them: 1 for MLA and packed K/V (10, 11), else 2."""
    fmt = as_gpu_kv_format(gpu_kv_format)
    return 1 if fmt in MLA_FORMATS or fmt in (F.NL_X_NB_NH_BS_TWO_HS, F.NL_X_NB_BS_NH_TWO_HS) else 2


def is_mla(gpu_kv_format) -> bool:
    return as_gpu_kv_format(gpu_kv_format) in MLA_FORMATS


def is_hnd(gpu_kv_format) -> bool:
    return as_gpu_kv_format(gpu_kv_format) in HND_FORMATS


def is_cross_layer_format(gpu_kv_format) -> bool:
    return as_gpu_kv_format(gpu_kv_format) in CROSS_LAYER_FORMATS


def get_kv_cache_data_ptrs(kv_caches, gpu_kv_format) -> list[int]:
    """LMCache's pointer list (for registration with transports; kvlayout's ops take the tensors).

    Cross-layer formats: one pointer; format 4: ``[K_0..K_L-1, V_0..V_L-1]``;
    the others one per layer.  Layers are not bound together (they may differ
    in shape and dtype).
    """
    fmt = as_gpu_kv_format(gpu_kv_format)
    _first_layer(kv_caches, fmt)          # checks the structure
    if fmt in CROSS_LAYER_FORMATS:
        tensors = [kv_caches[0] if isinstance(kv_caches, (list, tuple)) else kv_caches]
    elif fmt == F.TWO_X_NL_X_NBBS_NH_HS:
        tensors = list(kv_caches[0]) + list(kv_caches[1])
    else:
        tensors = list(kv_caches)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"kv_caches[{i}] must be a tensor, got {type(t).__name__}")
    return [t.data_ptr() for t in tensors]
