"""LMCache's GPU/XPU connectors as one device-agnostic implementation on kvlayout.

A connector moves token chunks between an engine's paged KV cache and
*memory objects*.  Every data movement is a call into
:mod:`kvlayout.compat.lmcache` (hence ``kvlayout.ops``) or a plain
``Tensor.copy_`` into/out of a staging buffer; the connectors only choose
formats, slice slot mappings, compute skip counts and sequence the work.  The
same classes serve CUDA, XPU and CPU caches: the device is wherever the
engine's tensors live.

Conventions shared by all connectors:

* Constructors and ``from_metadata`` take LMCache's arguments (each class
  says which); kvlayout adds the keywords ``kv_layout`` (same as
  ``layout_hints={"kv_layout": ...}``), ``kvcaches`` and ``validate``.
* Memory objects are read as LMCache shapes them: ``tensor`` (or
  ``get_tensor(i)`` per layer group), ``metadata.fmt``,
  ``metadata.cached_positions``; LMCache's own ``MemoryFormat`` members (or
  their integer values) are accepted, and a store writes ``metadata.fmt``
  back as a member of the enum the object already holds.  kvlayout's
  :class:`MemoryObj` offers the same surface.
* ``kwargs["slot_mapping"]`` is the full-sequence slot mapping; chunk
  ``[start, end)`` uses ``slot_mapping[start:end]``.
* The engine's caches come from ``kwargs["kvcaches"]`` or from
  :meth:`register_kv_caches` (also spelled ``initialize_kvcaches_ptr``); the
  format is discovered once per cache structure with LMCache's rules.
* Streams as LMCache's: on an accelerator each connector has a
  ``load_stream`` and a ``store_stream`` (``None`` on the host, where work is
  synchronous).  Each class documents where it waits; wherever it waits on
  the host it also calls :func:`kvlayout.ops.check_errors`, so a slot a
  device kernel skipped as out of range raises ``IndexError`` there.  Every
  tensor work on a connector's own stream uses (the caller's slots and
  memory objects, staging buffers) is kept for that stream
  (:class:`~kvlayout.compat._device.InFlight`): the caller may free what it
  passed as soon as a call returns.
  ``validate=`` (constructor default, or ``kwargs["validate"]`` per call) is
  forwarded to kvlayout: ``True`` checks every slot on the host first.
* ``use_gpu=True`` stages memory objects that do not live on the cache's
  device through a device buffer (``Tensor.copy_`` + one kvlayout transfer);
  the buffer grows to the largest chunk seen.  Without it, host memory
  objects are read/written by the kernel directly and must be pinned when
  the cache is on an accelerator.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
from typing import Any, Generator, Mapping

import torch

from kvlayout import ops

from ._device import InFlight, current_stream, new_stream, on_stream, synchronize_stream, wait_stream
from .lmcache import (
    CROSS_LAYER_FORMATS,
    MLA_FORMATS,
    GPUKVFormat,
    LayerwiseKV,
    MemoryFormat,
    TransferDirection,
    as_memory_format,
    bind_kv_caches,
    discover_gpu_kv_format,
    ensure_contiguous_kv_caches,
    multi_layer_kv_transfer,
    multi_layer_kv_transfer_unilateral,
    rotary_embedding_k_fused,
)

logger = logging.getLogger(__name__)

H2D, D2H = TransferDirection.H2D, TransferDirection.D2H

__all__ = [
    "MemoryObj", "MemoryFormat", "VLLMPagedMemGPUConnectorV2", "VLLMPagedMemGPUConnectorV3",
    "VLLMPagedMemLayerwiseGPUConnector", "VLLMBufferLayerwiseGPUConnector", "SGLangGPUConnector",
    "SGLangLayerwiseGPUConnector", "VLLMPagedMemXPUConnectorV2", "VLLMPagedMemXPUConnectorV3",
    "VLLMPagedMemLayerwiseXPUConnector", "VLLMBufferLayerwiseXPUConnector", "SGLangXPUConnector",
    "SGLangLayerwiseXPUConnector", "skip_tokens",
]


# ---------------------------------------------------------------------------------------
# Memory objects
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class MemoryObj:
    """kvlayout's memory object: a tensor plus its :class:`MemoryFormat` tag.

    The connectors read any object shaped like LMCache's (``tensor``,
    ``raw_tensor``, ``get_tensor(i)``, ``metadata.fmt``,
    ``metadata.cached_positions``); this class offers the same surface.
    ``tensors`` holds one tensor per layer group for
    :class:`VLLMPagedMemGPUConnectorV3` (groups may differ in dtype and row
    width); ``tensor`` is then the first group's tensor.
    """

    tensor: torch.Tensor | None
    fmt: MemoryFormat = MemoryFormat.UNDEFINED
    tensors: list | None = None
    cached_positions: torch.Tensor | None = None

    @property
    def metadata(self) -> "MemoryObj":
        """LMCache keeps ``fmt`` and ``cached_positions`` in ``metadata``; here the object is its own metadata."""
        return self

    @property
    def raw_tensor(self) -> torch.Tensor | None:
        return self.tensor

    def get_tensor(self, index: int) -> torch.Tensor:
        """Layer group ``index``'s tensor (``[2, L_g, T, D_g]``, MLA ``[1, L_g, T, D_g]``)."""
        return self.group_tensors[index]

    @property
    def group_tensors(self) -> list:
        return list(self.tensors) if self.tensors is not None else [self.tensor]

    @property
    def shape(self):
        return self.tensor.shape

    @property
    def dtype(self):
        return self.tensor.dtype


def _tensor(obj, group: int | None = None) -> torch.Tensor:
    """The object's tensor (group ``group``'s through ``get_tensor`` when given)."""
    t = obj.get_tensor(group) if group is not None else getattr(obj, "tensor", None)
    if t is None:
        raise ValueError("memory object has no tensor")
    return t


def _meta(obj):
    return getattr(obj, "metadata", obj)


def _fmt(obj) -> MemoryFormat:
    return as_memory_format(getattr(_meta(obj), "fmt", MemoryFormat.UNDEFINED))


def _set_fmt(obj, fmt: MemoryFormat) -> None:
    """Tag the object; an LMCache enum member stays a member of LMCache's enum."""
    meta = _meta(obj)
    cur = getattr(meta, "fmt", None)
    if cur is not None and not isinstance(cur, (MemoryFormat, int)) and hasattr(cur, "value"):
        try:
            meta.fmt = type(cur)(fmt.value)
            return
        except (TypeError, ValueError):
            pass
    meta.fmt = fmt


def _tag_stored(obj, fmt: MemoryFormat, mla: bool) -> None:
    """LMCache's stores tag MLA objects only (its allocator tags the others); an untagged object is tagged too."""
    if mla or _fmt(obj) == MemoryFormat.UNDEFINED:
        _set_fmt(obj, fmt)


def _check_fmt(obj, *allowed: MemoryFormat) -> None:
    _tensor(obj)
    got = _fmt(obj)
    if got not in allowed:
        raise ValueError(f"memory object format is {got.name}, expected {' or '.join(f.name for f in allowed)}")


def skip_tokens(start: int, end: int, cached_tokens: int) -> int:
    """Chunk positions already in the engine's prefix cache: ``min(end - start, max(0, cached - start))``."""
    return min(end - start, max(0, int(cached_tokens) - start))


def _synchronize(device: torch.device) -> None:
    """Wait for ``device``, then raise any out-of-range slot one of its kernels skipped since the last check."""
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)
    ops.check_errors(device)


def _pin(t: torch.Tensor) -> torch.Tensor:
    try:
        return t.pin_memory()
    except RuntimeError:   # no accelerator to pin for
        return t


def _kv_shape(metadata) -> tuple[int, int, int, int]:
    """(num_layers, chunk_size, num_kv_heads, head_size) of LMCache metadata's ``kv_shape``
    ``(num_layers, 2 or 1, chunk_size, num_kv_heads, head_size)``."""
    shape = tuple(int(x) for x in metadata.kv_shape)
    if len(shape) != 5:
        raise ValueError(f"metadata.kv_shape must be (num_layers, 2 or 1, chunk_size, num_kv_heads, head_size), "
                         f"got {shape}")
    return shape[0], shape[2], shape[3], shape[4]


def _structure(kvcaches):
    """The identity of an engine's cache structure: its nesting, with each tensor by identity.

    Two structures compare equal when they hold the very same tensor objects in
    the same places, whatever list objects carry them (an engine may build a
    new list of the same tensors for every call).
    """
    if isinstance(kvcaches, torch.Tensor):
        return id(kvcaches)
    if isinstance(kvcaches, Mapping):
        return tuple((k, _structure(v)) for k, v in kvcaches.items())
    if isinstance(kvcaches, (list, tuple)):
        return tuple(_structure(x) for x in kvcaches)
    return ("object", id(kvcaches))


def _tensors_of(kvcaches):
    """Every tensor of an engine's cache structure, in order."""
    if isinstance(kvcaches, torch.Tensor):
        yield kvcaches
    elif isinstance(kvcaches, Mapping):
        for v in kvcaches.values():
            yield from _tensors_of(v)
    elif isinstance(kvcaches, (list, tuple)):
        for v in kvcaches:
            yield from _tensors_of(v)


class StagingBuffers:
    """The device buffers a connector stages memory objects through: LMCache's ``gpu_buffer_allocator``.

    kvlayout's connectors hold whole buffers (one per use: a load or store
    slot, CacheBlend's two ping-pong buffers) and hand out views of them, so
    nothing is allocated or freed per call.  :meth:`memcheck` checks that
    bookkeeping: every buffer lives on the connector's device, no two buffers
    share memory, and every view last handed out lies inside its own buffer.
    """

    def __init__(self, connector: "_Connector"):
        self._connector = connector

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer held now."""
        c = self._connector
        return list(c._staging.values()) + list(getattr(c, "_pingpong", None) or [])

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return sum(b.nbytes for b in self.buffers())

    def memcheck(self) -> bool:
        """True when the buffers are consistent (see the class); False names nothing but is logged."""
        c = self._connector
        spans = []
        for b in self.buffers():
            if c.device is not None and b.device != c.device:
                logger.error("staging buffer on %s, the connector's caches on %s", b.device, c.device)
                return False
            start = b.untyped_storage().data_ptr() + b.storage_offset() * b.element_size()
            spans.append((start, start + b.nbytes))
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            if start < end:
                logger.error("two staging buffers share memory")
                return False
        for slot, (_, view) in c._staging_views.items():
            buf = c._staging.get(slot)
            if buf is None:
                logger.error("a view of staging slot %r outlived its buffer", slot)
                return False
            lo = buf.data_ptr()
            if view.numel() and not (lo <= view.data_ptr() and view.data_ptr() + view.nbytes <= lo + buf.nbytes):
                logger.error("a view of staging slot %r lies outside its buffer", slot)
                return False
        return True


# ---------------------------------------------------------------------------------------
# Shared machinery
# ---------------------------------------------------------------------------------------

class _Connector:
    """Cache registration, format discovery, geometry, streams and staging buffers shared by every connector."""

    engine = "vllm"
    sync_after_batched_load = True      # paged V2/V3: batched_to_gpu returns when the loads have landed
    lazy_geometry = False               # XPU V2: hidden size, layers and MLA come from the caches

    def _setup(self, hidden_dim_size: int, num_layers: int, use_gpu: bool = False, *, chunk_size=None,
               dtype: torch.dtype | None = None, device=None, use_mla: bool = False, kv_layout: str | None = None,
               layout_hints: Mapping[str, Any] | None = None, kvcaches=None, validate: bool | None = None,
               **_ignored) -> None:
        self.layout_hints = dict(layout_hints or {})
        hinted = self.layout_hints.get("kv_layout")
        if kv_layout is not None and hinted is not None and str(kv_layout).upper() != str(hinted).upper():
            raise ValueError(f"kv_layout = {kv_layout!r} contradicts layout_hints['kv_layout'] = {hinted!r}")
        self.kv_layout = kv_layout if kv_layout is not None else hinted
        self.validate = validate
        self.hidden_dim_size = int(hidden_dim_size or 0)
        self.num_layers = int(num_layers or 0)
        self.use_gpu = bool(use_gpu)
        self.chunk_size = int(chunk_size) if chunk_size is not None else 256
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self.use_mla = bool(use_mla)
        self.kvcaches = None
        self.geometry = None
        self.gpu_kv_format: GPUKVFormat | None = None
        self._staging: dict[int, torch.Tensor] = {}
        self._staging_views: dict = {}      # slot -> ((shape, dtype), the last view of it handed out)
        self.gpu_buffer_allocator = StagingBuffers(self)
        self._in_flight = InFlight()        # what work on a stream other than its own still uses
        self._registered = self._registered_structure = None
        self.load_stream = self.store_stream = None
        self._make_streams()
        if kvcaches is not None:
            self.register_kv_caches(kvcaches)

    def _make_streams(self) -> None:
        """A load and a store stream on the caches' accelerator (none on the host, where work is synchronous)."""
        if self.load_stream is None and self.device is not None:
            self.load_stream, self.store_stream = new_stream(self.device), new_stream(self.device)

    # -- caches -------------------------------------------------------------------------
    def register_kv_caches(self, kvcaches, kv_layout: str | None = None) -> GPUKVFormat:
        """Take the engine's caches (recovering permuted HND views), discover their format and geometry."""
        layout = kv_layout or self.kv_layout
        kv = ensure_contiguous_kv_caches(kvcaches, layout) if self.engine == "vllm" else kvcaches
        fmt = discover_gpu_kv_format(kv, self.engine, self._hints(layout))
        if self.lazy_geometry:
            self.use_mla = fmt in MLA_FORMATS
        elif self.use_mla != (fmt in MLA_FORMATS):
            raise ValueError(f"use_mla={self.use_mla} but the caches are {fmt.name}")
        self.gpu_kv_format = fmt
        self.kvcaches = kv
        bound = bind_kv_caches(kv, fmt)
        self._set_geometry(bound)
        self._note_registered(kvcaches, layout)
        return fmt

    def _note_registered(self, kvcaches, layout) -> None:
        """Remember what was registered: the structure as given and the layout it was read with.  Its tensors
        are held as well (not only the list, which the engine may change in place), so no other tensor can
        take the identity of one of them in :func:`_structure`."""
        self._registered = kvcaches
        self._registered_tensors = tuple(_tensors_of(kvcaches))
        self._registered_structure = (_structure(kvcaches), layout)

    def _set_geometry(self, bound: ops.KVCache) -> None:
        """LMCache's connector attributes, read from the bound geometry."""
        g = bound.geometry
        self.geometry = g
        self.device = bound.device
        self.dtype = self.dtype or bound.dtype
        self.num_blocks, self.block_size = g.NB, g.BS
        self.page_buffer_size = self.tokens_per_layer = g.N
        self.num_heads, self.head_size = g.H, g.E
        self.elements_per_layer = g.P * g.N * g.H * g.E
        if self.lazy_geometry or not self.hidden_dim_size:
            self.hidden_dim_size = g.H * g.E
        if self.lazy_geometry or not self.num_layers:
            self.num_layers = g.L
        self._make_streams()

    def initialize_kvcaches_ptr(self, kvcaches=None, **kwargs):
        """LMCache's spelling: ``initialize_kvcaches_ptr(kvcaches=...)`` (also positional)."""
        if kvcaches is not None:
            return self.register_kv_caches(kvcaches, kwargs.get("kv_layout"))
        return self.gpu_kv_format

    def _hints(self, layout: str | None) -> dict:
        """The constructor's layout hints with ``kv_layout`` set to ``layout`` (when given)."""
        return {**self.layout_hints, "kv_layout": layout} if layout else dict(self.layout_hints)

    def _validate(self, kwargs):
        return kwargs.get("validate", self.validate)

    def _caches(self, kwargs):
        """The registered caches; ``kwargs["kvcaches"]`` registers others first.  The same tensors in the same
        places (in a new list or the same one) are not registered again: only a tensor replaced, moved or
        added, or another ``kv_layout``, binds afresh."""
        kv = kwargs.get("kvcaches")
        if kv is not None:
            layout = kwargs.get("kv_layout") or self.kv_layout
            if self._registered_structure != (_structure(kv), layout):
                self.register_kv_caches(kv, kwargs.get("kv_layout"))
        if self.kvcaches is None:
            raise ValueError("no kv caches: pass kvcaches=... or call register_kv_caches first")
        return self.kvcaches

    def _current(self):
        return current_stream(self.device)

    def _keep(self, *tensors) -> None:
        """The work just enqueued on the current stream uses ``tensors`` (slots, memory objects, staging
        buffers; ``None`` entries are ignored): none may be reused before it has run, even when its owner frees
        it right after the call (see :class:`~kvlayout.compat._device.InFlight`).  Called *after* that work is
        enqueued: a host tensor is held until an event recorded here has passed."""
        stream = self._current()
        if stream is not None:
            self._in_flight.keep(stream, *tensors)

    # -- staging ------------------------------------------------------------------------
    def _stages(self, tensor: torch.Tensor) -> bool:
        """Whether a memory object's tensor goes through a device buffer: ``use_gpu`` and it lives elsewhere
        than the caches."""
        return self.use_gpu and self.device is not None and tensor.device != self.device

    def _staging_view(self, like: torch.Tensor, slot=0) -> torch.Tensor | None:
        """A device buffer shaped like ``like``, or ``None`` when no staging is wanted or needed.

        Stores use ``("store", i)`` slots, loads plain ints: they run on different streams and must not
        share a buffer."""
        if not self._stages(like):
            return None
        return self._device_buffer(like.shape, like.dtype, slot)

    def _device_buffer(self, shape, dtype: torch.dtype, slot=0) -> torch.Tensor:
        """A contiguous ``shape``/``dtype`` view of staging buffer ``slot`` (grown when too small).

        Layer after layer asks for the same view: the last one of each slot is handed out again."""
        want = (tuple(shape), dtype)
        last = self._staging_views.get(slot)
        if last is not None and last[0] == want:
            return last[1]
        numel = torch.Size(shape).numel()
        nbytes = max(1, int(numel) * dtype.itemsize)
        buf = self._staging.get(slot)
        if buf is None or buf.numel() < nbytes:
            if buf is not None:
                self._buffers_replaced()
            buf = self._staging[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        view = buf[:nbytes].view(dtype)[:numel].view(shape)
        self._staging_views[slot] = (want, view)
        return view

    def _buffers_replaced(self) -> None:
        """A staging buffer was replaced by a larger one (the layer-wise connectors let go of what bound it)."""

    @staticmethod
    def _slots(kwargs, start: int, end: int) -> torch.Tensor:
        if "slot_mapping" not in kwargs:
            raise ValueError("slot_mapping is required")
        return kwargs["slot_mapping"][start:end]


# ---------------------------------------------------------------------------------------
# Paged, all layers at once (V2, V3, SGLang)
# ---------------------------------------------------------------------------------------

class _ChunkConnector(_Connector):
    """to_gpu / from_gpu of whole chunks (all layers), and their batched forms."""

    store_on_stream = True      # V2/V3 store on their store stream; SGLang's connector on the current one

    def _memory_format(self) -> MemoryFormat:
        return MemoryFormat.KV_MLA_FMT if self.use_mla else MemoryFormat.KV_2LTD

    def _load_slots(self, kwargs, start: int, end: int) -> torch.Tensor:
        return self._slots(kwargs, start, end)

    def _pairs(self, memory_obj):
        """``(group caches, format, memory-object tensor)`` per transfer: one pair here, one per group in V3."""
        return [(self.kvcaches, self.gpu_kv_format, _tensor(memory_obj))]

    def _transfer(self, tensor, kv, fmt, slots, direction, skip=0, validate=None):
        multi_layer_kv_transfer(tensor, kv, slots, self.device, 0, direction, fmt, skip_prefix_n_tokens=skip,
                                validate=validate)

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        """Memory object (chunk ``[start, end)``) -> paged cache, on the current stream.

        Positions below ``kwargs["vllm_cached_tokens"]`` are skipped (vLLM
        already holds them): ``skip = min(end - start, max(0, cached - start))``.
        """
        self._caches(kwargs)
        _check_fmt(memory_obj, self._memory_format())
        slots = self._load_slots(kwargs, start, end)
        skip = skip_tokens(start, end, kwargs.get("vllm_cached_tokens", 0))
        self._load(memory_obj, itertools.repeat(slots), skip, kwargs)

    def _load(self, memory_obj, slots_per_pair, skip: int, kwargs) -> None:
        """Each (cache, format, chunk tensor) pair of ``memory_obj`` into its cache at its slots, through the
        staging buffer where there is one."""
        for i, ((kv, fmt, src), slots) in enumerate(zip(self._pairs(memory_obj), slots_per_pair)):
            staged = self._staging_view(src, slot=i)
            used = (src, staged, slots if isinstance(slots, torch.Tensor) else None)
            if staged is not None:
                staged.copy_(src, non_blocking=True)
                src = staged
            self._transfer(src, kv, fmt, slots, H2D, skip, self._validate(kwargs))
            self._keep(*used)

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        """Paged cache -> memory object (chunk ``[start, end)``), on the store stream.

        The store stream first waits for the current stream (the forward pass
        that wrote the KV).  When the object is not on the cache's device the
        call returns after the copy has landed.  MLA objects are tagged
        ``KV_MLA_FMT`` (and untagged objects with the connector's format).
        """
        self._caches(kwargs)
        slots = self._slots(kwargs, start, end)
        self._store(memory_obj, itertools.repeat(slots), self.store_stream if self.store_on_stream else None,
                    kwargs)

    def _store(self, memory_obj, slots_per_pair, stream, kwargs) -> None:
        """Each cache into its (cache, format, chunk tensor) pair of ``memory_obj`` on ``stream`` (``None``: the
        current one), through the staging buffer where there is one; waits when the host reads the result next."""
        wait_stream(stream, self._current())
        dsts = []
        with on_stream(stream):
            for i, ((kv, fmt, dst), slots) in enumerate(zip(self._pairs(memory_obj), slots_per_pair)):
                staged = self._staging_view(dst, slot=("store", i))
                self._transfer(staged if staged is not None else dst, kv, fmt, slots, D2H,
                               validate=self._validate(kwargs))
                if staged is not None:
                    dst.copy_(staged, non_blocking=True)
                self._keep(dst, staged, slots if isinstance(slots, torch.Tensor) else None)
                dsts.append(dst)
        if any(t.device.type == "cpu" for t in dsts):      # the host reads it next: wait
            if stream is not None:
                synchronize_stream(stream)
                ops.check_errors(self.device)
            else:
                _synchronize(self.device)
        _tag_stored(memory_obj, self._memory_format(), self.use_mla)

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        """Every chunk's :meth:`to_gpu` on the load stream; returns when the loads have landed
        (LMCache frees the memory objects right after).  The load stream first waits (device side) for the
        caller's stream: the caches it writes may have just been filled or zeroed there."""
        stream = self.load_stream if self.sync_after_batched_load else None
        if stream is not None:
            wait_stream(stream, self._current())
        with on_stream(stream):
            for obj, start, end in zip(memory_objs, starts, ends):
                self.to_gpu(obj, start, end, **kwargs)
        if self.sync_after_batched_load and self.device is not None:
            if stream is not None:
                synchronize_stream(stream)
                ops.check_errors(self.device)
            else:
                _synchronize(self.device)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)


class VLLMPagedMemGPUConnectorV2(_ChunkConnector):
    """vLLM paged cache <-> ``KV_2LTD`` ``[2, L, T, D]`` (MLA: ``KV_MLA_FMT`` ``[1, L, T, D]``) objects.

    ``VLLMPagedMemGPUConnectorV2(hidden_dim_size, num_layers, use_gpu=False,
    **kwargs)`` with LMCache's keywords ``chunk_size``, ``dtype``, ``device``,
    ``use_mla``, ``layout_hints`` (kvlayout adds ``kv_layout``, ``kvcaches``,
    ``validate``).  After the caches are seen, ``gpu_kv_format``,
    ``num_blocks``, ``block_size``, ``page_buffer_size``, ``head_size`` and
    ``num_heads`` describe them.
    """

    def __init__(self, hidden_dim_size: int, num_layers: int, use_gpu: bool = False, **kwargs):
        self._setup(hidden_dim_size, num_layers, use_gpu, **kwargs)

    @classmethod
    def from_metadata(cls, metadata, use_gpu: bool = False, device=None, layout_hints=None):
        """From LMCache metadata: ``kv_shape = (layers, 2 or 1, chunk_size, kv_heads, head_size)``,
        ``kv_dtype``, ``use_mla``."""
        layers, chunk, heads, head_size = _kv_shape(metadata)
        return cls(hidden_dim_size=heads * head_size, num_layers=layers, use_gpu=use_gpu, chunk_size=chunk,
                   dtype=metadata.kv_dtype, device=device, use_mla=bool(metadata.use_mla),
                   layout_hints=layout_hints)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([1 if self.use_mla else 2, self.num_layers, num_tokens, self.hidden_dim_size])


class VLLMPagedMemGPUConnectorV3(_ChunkConnector):
    """V2 over the *layer groups* of LMCache metadata (groups may differ in shape and dtype).

    ``VLLMPagedMemGPUConnectorV3(metadata, device, use_gpu=False,
    layout_hints=None)``.  The groups are
    ``metadata.kv_layer_groups_manager.kv_layer_groups`` (each with
    ``layer_indices``); group ``i`` of the engine's per-layer caches moves
    to/from ``memory_obj.get_tensor(i)`` (``[2, L_g, T, D_g]``, MLA
    ``[1, L_g, T, D_g]``, in the group's dtype).  Every group uses the slot
    mapping (``kwargs["slot_groups"]``, one slot mapping per group, overrides it).
    """

    def __init__(self, metadata, device=None, use_gpu: bool = False, layout_hints=None, **kwargs):
        self.metadata = metadata
        self.groups: list[tuple[list[int], GPUKVFormat, list]] = []
        kwargs.setdefault("chunk_size", getattr(metadata, "chunk_size", None))
        self._setup(0, 0, use_gpu, device=device, use_mla=bool(getattr(metadata, "use_mla", False)),
                    layout_hints=layout_hints, **kwargs)

    @classmethod
    def from_metadata(cls, metadata, use_gpu: bool = False, device=None, layout_hints=None):
        return cls(metadata, device, use_gpu, layout_hints=layout_hints)

    def _layer_groups(self, num_layers: int) -> list[list[int]]:
        manager = getattr(self.metadata, "kv_layer_groups_manager", None)
        groups = getattr(manager, "kv_layer_groups", None)
        if not groups:
            raise ValueError("metadata.kv_layer_groups_manager.kv_layer_groups is empty: V3 moves layer groups")
        out = []
        for g, group in enumerate(groups):
            layers = [int(i) for i in group.layer_indices]
            for i in layers:
                if not 0 <= i < num_layers:
                    raise ValueError(f"kv_layer_groups[{g}].layer_indices holds layer {i}; the caches have "
                                     f"{num_layers} layers")
            out.append(layers)
        return out

    def register_kv_caches(self, kvcaches, kv_layout: str | None = None):
        layout = kv_layout or self.kv_layout
        kv = list(ensure_contiguous_kv_caches(list(kvcaches), layout))
        hints = self._hints(layout)
        self.groups = []
        for g, layers in enumerate(self._layer_groups(len(kv))):
            tensors = [kv[i] for i in layers]
            for i, t in zip(layers, tensors):
                if t.shape != tensors[0].shape or t.dtype != tensors[0].dtype:
                    raise ValueError(f"kv_layer_groups[{g}]: layer {i} is {tuple(t.shape)} {t.dtype}, layer "
                                     f"{layers[0]} {tuple(tensors[0].shape)} {tensors[0].dtype}")
            self.groups.append((layers, discover_gpu_kv_format(tensors, "vllm", hints), tensors))
        self.kvcaches = kv
        self.gpu_kv_format = self.groups[0][1]
        self._set_geometry(bind_kv_caches(self.groups[0][2], self.gpu_kv_format))
        self.num_layers = len(kv)
        self._note_registered(kvcaches, layout)
        return self.gpu_kv_format

    initialize_kvcaches_ptr = _Connector.initialize_kvcaches_ptr

    def get_shape(self, num_tokens: int) -> torch.Size:
        raise NotImplementedError("V3 objects hold one tensor per layer group: see get_shapes")

    def get_shapes(self, num_tokens: int) -> list[torch.Size]:
        """Per group ``[2, L_g, T, D_g]`` (MLA ``[1, L_g, T, D_g]``), from the registered caches."""
        out = []
        for layers, fmt, tensors in self.groups:
            g = bind_kv_caches(tensors, fmt).geometry
            out.append(torch.Size([1 if fmt in MLA_FORMATS else 2, len(layers), num_tokens, g.H * g.E]))
        return out

    def get_dtypes(self) -> list[torch.dtype]:
        return [tensors[0].dtype for _, _, tensors in self.groups]

    def allocate(self, num_tokens: int, device="cpu", pin_memory: bool = False) -> MemoryObj:
        """A memory object for ``num_tokens`` tokens with one zeroed tensor per group."""
        tensors = [torch.zeros(s, dtype=d, device=device) for s, d in zip(self.get_shapes(num_tokens),
                                                                          self.get_dtypes())]
        tensors = [_pin(t) for t in tensors] if pin_memory else tensors
        return MemoryObj(tensors[0], MemoryFormat.UNDEFINED, tensors)

    def _memory_format(self) -> MemoryFormat:
        return MemoryFormat.KV_MLA_FMT if all(f in MLA_FORMATS for _, f, _ in self.groups) else MemoryFormat.KV_2LTD

    def _pairs(self, memory_obj):
        out = []
        for i, (_, fmt, tensors) in enumerate(self.groups):
            out.append((tensors, fmt, _tensor(memory_obj, i)))
        return out

    def _group_slots(self, kwargs, start, end):
        per_group = kwargs.get("slot_groups")
        if per_group is not None:
            if len(per_group) != len(self.groups):
                raise ValueError(f"slot_groups has {len(per_group)} slot mappings, the caches {len(self.groups)} "
                                 "groups")
            return [s[start:end] for s in per_group]
        return [self._slots(kwargs, start, end)] * len(self.groups)

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        self._caches(kwargs)
        _check_fmt(memory_obj, self._memory_format())
        skip = skip_tokens(start, end, kwargs.get("vllm_cached_tokens", 0))
        self._load(memory_obj, self._group_slots(kwargs, start, end), skip, kwargs)

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        self._caches(kwargs)
        self._store(memory_obj, self._group_slots(kwargs, start, end), self.store_stream, kwargs)


class SGLangGPUConnector(_ChunkConnector):
    """SGLang pools (``[[K...], [V...]]`` lists, or MLA ``[PBS, 1, D]`` list) <-> ``KV_2LTD``/``KV_MLA_FMT``.

    ``SGLangGPUConnector(hidden_dim_size, num_layers, use_gpu=False,
    **kwargs)``.  Uses
    :func:`~kvlayout.compat.lmcache.multi_layer_kv_transfer_unilateral`;
    like LMCache's SGLang connector it applies no prefix skip, works on the
    current stream (``batched_to_gpu`` does not wait), and ``to_gpu`` reads
    ``slot_mapping[start - offset:end - offset]`` (``kwargs["offset"]``,
    default 0: the slot mapping then covers only the tokens from ``offset``
    on); ``from_gpu`` reads ``slot_mapping[start:end]`` and waits for the
    device when the object is in host memory.
    """

    engine = "sglang"
    sync_after_batched_load = False
    store_on_stream = False

    def __init__(self, hidden_dim_size: int, num_layers: int, use_gpu: bool = False, **kwargs):
        self._setup(hidden_dim_size, num_layers, use_gpu, **kwargs)

    from_metadata = classmethod(VLLMPagedMemGPUConnectorV2.from_metadata.__func__)

    def get_shape(self, num_tokens: int) -> torch.Size:
        """``[2, L, T, D]``, MLA included, as LMCache's SGLang connector sizes its objects (an MLA object's
        second plane is not used); MLA objects of ``[1, L, T, D]`` are accepted too."""
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim_size])

    def _pairs(self, memory_obj):
        """MLA rows live in plane 0 of a ``[2, L, T, D]`` object (LMCache's SGLang shape)."""
        pairs = super()._pairs(memory_obj)
        if self.use_mla:
            pairs = [(kv, fmt, t[:1] if t.dim() == 4 and t.shape[0] == 2 else t) for kv, fmt, t in pairs]
        return pairs

    def _transfer(self, tensor, kv, fmt, slots, direction, skip=0, validate=None):
        multi_layer_kv_transfer_unilateral(tensor, kv, slots, self.device, 0, direction, fmt, validate=validate)

    def _load_slots(self, kwargs, start: int, end: int) -> torch.Tensor:
        offset = int(kwargs.get("offset", 0))
        if "slot_mapping" not in kwargs:
            raise ValueError("slot_mapping is required")
        n = int(kwargs["slot_mapping"].shape[0])
        if not 0 <= start - offset <= end - offset <= n:
            raise ValueError(f"offset = {offset}: chunk [{start}, {end}) maps to slot_mapping[{start - offset}:"
                             f"{end - offset}], outside its {n} entries")
        return kwargs["slot_mapping"][start - offset:end - offset]

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        kwargs.pop("vllm_cached_tokens", None)
        super().to_gpu(memory_obj, start, end, **kwargs)


# ---------------------------------------------------------------------------------------
# Layer-wise generators
# ---------------------------------------------------------------------------------------

class _CallSlots(list):
    """A generator call's slots, one tensor per chunk; :meth:`joined` concatenates them once per call
    (``[sum of T]``, for the loads that stage every chunk in one buffer)."""

    _joined = None

    def joined(self) -> torch.Tensor:
        if self._joined is None:
            self._joined = torch.cat(list(self))
        return self._joined


class _LayerTransfers:
    """The layer-by-layer transfers of one registration of the engine's caches.

    A memory object is a new tensor at every call: it moves with one
    ``ops.transfer`` (:meth:`LayerwiseKV.move`, the cache side bound once per
    registration).  The connector's own buffers (device staging, CacheBlend's
    ping-pong buffers) serve layer after layer and call after call: they move
    with prepared transfers (:meth:`run`), one prepared layer call per layer.
    A prepared transfer is kept by what it binds - direction, layer (a
    store's transfer is one layer's), the buffer's address, device, dtype,
    shape and strides, validation; past ``capacity`` the least recently used
    one goes.  A call whose slots are other tensors than the ones a transfer
    holds rebinds them (``set_slots``: once per transfer and call).
    """

    def __init__(self, kv: LayerwiseKV):
        self.kv = kv
        # loads: one per ping-pong buffer; stores: one per layer and chunk shape (full chunks, the last one)
        self.capacity = 4 * kv.num_layers + 4
        self._held: collections.OrderedDict = collections.OrderedDict()

    def forget(self) -> None:
        """Drop every prepared transfer (they hold their buffers: a replaced buffer is freed)."""
        self._held.clear()

    def run(self, layer: int, buffer: torch.Tensor, slots, direction, validate=None) -> None:
        """A connector's buffer (one layer: ``[T, 2, D]``, ``[2, T, D]`` or MLA ``[T, D]``) <-> layer ``layer``
        at ``slots [T]``, as :meth:`LayerwiseKV.move` moves it, with a prepared transfer."""
        if not 0 <= layer < self.kv.num_layers or (validate is not None and type(validate) is not bool):
            self.kv.move(layer, buffer, slots, direction, validate)     # it raises what the per-call path raises
            return
        load = direction == H2D
        # validate=None reads KVLAYOUT_VALIDATE at each call: the value read is part of what is prepared
        key = (load, None if load else layer, buffer.data_ptr(), buffer.device, buffer.dtype, buffer.shape,
               buffer.stride(), validate, os.environ.get("KVLAYOUT_VALIDATE") if validate is None else None)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = [self.kv.prepare(buffer, slots, direction, layer, validate), slots]
            if len(self._held) > self.capacity:
                self._held.popitem(last=False)
        else:
            self._held.move_to_end(key)
            if held[1] is not slots:
                self.kv.set_slots(held[0], slots, direction)
                held[1] = slots
        held[0].layer(layer if load else 0)


class _LayerwiseConnector(_Connector):
    """The generator contract of LMCache's layer-wise connectors (see each class for its yield counts).

    Layer ``l``'s memory objects (one per chunk) are sent into the load
    generator (``gen.send(objs)``), or come from ``kwargs["memory_objs"][l]``
    when ``None`` is sent::

        gen = connector.batched_to_gpu(starts, ends, slot_mapping=sm, sync=True)
        next(gen)                          # nothing loaded yet
        for l in range(L):
            gen.send(objs_of_layer[l])     # layer l is loaded
        for _ in gen: pass                 # the remaining yields

    Stores: ``batched_from_gpu(memory_objs, starts, ends, **kwargs)`` with
    ``memory_objs[l][chunk]``.
    """

    layer_format = MemoryFormat.KV_T2D
    requires_sync = True

    def __init__(self, hidden_dim_size: int, num_layers: int, use_gpu: bool = False, **kwargs):
        self._setup(hidden_dim_size, num_layers, use_gpu, **kwargs)

    @classmethod
    def from_metadata(cls, metadata, use_gpu: bool = False, device=None, layout_hints=None):
        layers, chunk, heads, head_size = _kv_shape(metadata)
        return cls(hidden_dim_size=heads * head_size, num_layers=layers, use_gpu=use_gpu, chunk_size=chunk,
                   dtype=metadata.kv_dtype, device=device, use_mla=bool(metadata.use_mla),
                   layout_hints=layout_hints)

    def _expected_format(self) -> MemoryFormat:
        return MemoryFormat.KV_MLA_FMT if self.use_mla else self.layer_format

    def get_shape(self, num_tokens: int) -> torch.Size:
        if self.use_mla:
            return torch.Size([num_tokens, self.hidden_dim_size])
        if self.layer_format == MemoryFormat.KV_2TD:
            return torch.Size([2, num_tokens, self.hidden_dim_size])
        return torch.Size([num_tokens, 2, self.hidden_dim_size])

    @property
    def _token_dim(self) -> int:
        return 1 if (self.layer_format == MemoryFormat.KV_2TD and not self.use_mla) else 0

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs):
        raise NotImplementedError("layer-wise connectors load through the batched_to_gpu generator")

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs):
        raise NotImplementedError("layer-wise connectors store through the batched_from_gpu generator")

    def register_kv_caches(self, kvcaches, kv_layout: str | None = None) -> GPUKVFormat:
        self._layer_transfers = None      # prepared transfers bind the caches: a new registration starts afresh
        return super().register_kv_caches(kvcaches, kv_layout)

    def _transfers(self) -> _LayerTransfers:
        """The registered caches' layer transfers (made at the first transfer after a registration)."""
        transfers = getattr(self, "_layer_transfers", None)
        if transfers is None:
            if self.gpu_kv_format in CROSS_LAYER_FORMATS:
                raise ValueError(f"layer-wise transfers need a per-layer format, got {self.gpu_kv_format.name}")
            kv = LayerwiseKV(self.kvcaches, self.gpu_kv_format, token_major=self.layer_format == MemoryFormat.KV_T2D)
            transfers = self._layer_transfers = _LayerTransfers(kv)
        return transfers

    def _buffers_replaced(self) -> None:
        if getattr(self, "_layer_transfers", None) is not None:
            self._layer_transfers.forget()

    def _move_layer(self, layer: int, tensor: torch.Tensor, slots: torch.Tensor, direction, validate=None,
                    owned: bool = False) -> None:
        """One layer, one token-indexed tensor <-> the paged cache.  ``owned``: ``tensor`` is one of the
        connector's buffers (a prepared transfer, kept across layers and calls); else a memory object."""
        transfers = self._transfers()
        if owned:
            transfers.run(layer, tensor, slots, direction, validate)
        else:
            transfers.kv.move(layer, tensor, slots, direction, validate)

    def _begin(self, kwargs):
        self._caches(kwargs)
        transfers = getattr(self, "_layer_transfers", None)
        if transfers is not None and not transfers.kv.serves(self.kvcaches, self.gpu_kv_format):
            self._layer_transfers = None      # the engine's list holds other tensors now: bind them afresh
        if "slot_mapping" not in kwargs:
            raise ValueError("slot_mapping is required")
        if self.requires_sync and "sync" not in kwargs:
            raise ValueError("sync is required (True: the caller's stream waits for each layer's load)")
        return bool(kwargs.get("sync", False))

    def _chunk_slots(self, kwargs, starts, ends) -> _CallSlots:
        """Per chunk: its slots.  Every position of every chunk is written (no prefix skip, as LMCache's
        layer-wise loads)."""
        return _CallSlots(self._slots(kwargs, s, e) for s, e in zip(starts, ends))

    @staticmethod
    def _layer_objs(objs, given, layer: int):
        if objs is None:
            if given is None:
                raise ValueError(f"no memory objects for layer {layer}: send them or pass memory_objs=")
            objs = given[layer]
        return objs

    def _load_layer(self, layer: int, objs, starts, ends, chunk_slots: _CallSlots, validate=None) -> None:
        for obj in objs:
            _check_fmt(obj, self._expected_format())
        tensors = [_tensor(o) for o in objs]
        if any(self._stages(t) for t in tensors):
            # one ping-pong device buffer per layer parity: copy the chunks in, one transfer out
            dim = self._token_dim
            total = sum(t.shape[dim] for t in tensors)
            staged = self._device_buffer(self.get_shape(total), tensors[0].dtype, slot=layer % 2)
            off = 0
            for t in tensors:
                staged.narrow(dim, off, t.shape[dim]).copy_(t, non_blocking=True)
                off += t.shape[dim]
            self._move_layer(layer, staged, chunk_slots.joined(), H2D, validate, owned=True)
            # (the chunks' slots too: joining them read the caller's slot tensor on this stream)
            self._keep(staged, chunk_slots.joined(), *chunk_slots, *tensors)
        else:
            for t, slots in zip(tensors, chunk_slots):
                self._move_layer(layer, t, slots, H2D, validate)
            self._keep(*tensors, *chunk_slots)

    def _store_layer(self, layer: int, objs, chunk_slots, validate=None) -> None:
        for obj, slots in zip(objs, chunk_slots):
            dst = _tensor(obj)
            staged = self._staging_view(dst, slot=("store", layer % 2))
            if staged is None:
                self._move_layer(layer, dst, slots, D2H, validate)
            else:
                self._move_layer(layer, staged, slots, D2H, validate, owned=True)
                dst.copy_(staged, non_blocking=True)
            self._keep(dst, staged, slots)
            _tag_stored(obj, self._expected_format(), self.use_mla)

    def batched_to_gpu(self, starts, ends, **kwargs) -> Generator:
        """Yields ``L + 2`` times.  Each layer is loaded on the load stream; with
        ``sync=True`` the caller's stream waits for the load stream when the
        next layer is sent and once more before the last yield (a device-side
        wait: the host is not blocked)."""
        sync = self._begin(kwargs)
        chunk_slots = self._chunk_slots(kwargs, starts, ends)
        given, cur = kwargs.get("memory_objs"), self._current()
        for layer in range(self.num_layers):
            objs = self._layer_objs((yield), given, layer)
            if sync:
                wait_stream(cur, self.load_stream)
            with on_stream(self.load_stream):
                self._load_layer(layer, objs, starts, ends, chunk_slots, self._validate(kwargs))
        yield
        if sync:
            wait_stream(cur, self.load_stream)
        yield

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> Generator:
        """Yields ``L + 1`` times: after enqueuing each layer's store on the
        store stream (which first waits for the caller's stream), and once at
        the end.  With ``sync=True`` each resumption waits on the host for the
        previous layer's store (and reports skipped slots)."""
        sync = self._begin(kwargs)
        chunk_slots = [self._slots(kwargs, s, e) for s, e in zip(starts, ends)]
        cur = self._current()
        for layer in range(self.num_layers):
            with on_stream(self.store_stream):
                wait_stream(self.store_stream, cur)
                self._store_layer(layer, memory_objs[layer], chunk_slots, self._validate(kwargs))
            yield
            if sync:
                synchronize_stream(self.store_stream)
                ops.check_errors(self.device)
        yield


class VLLMPagedMemLayerwiseGPUConnector(_LayerwiseConnector):
    """vLLM paged cache <-> per-layer ``KV_T2D`` ``[T, 2, D]`` objects (MLA: ``[T, D]``), layer by layer.

    ``VLLMPagedMemLayerwiseGPUConnector(hidden_dim_size, num_layers,
    use_gpu=False, **kwargs)`` (LMCache's keywords ``chunk_size``, ``dtype``,
    ``device``, ``use_mla``, ``layout_hints``); ``kwargs["sync"]`` is
    required by both generators, as in LMCache.  Loads write every position
    of every chunk (``vllm_cached_tokens`` is not consulted, as in LMCache).
    """


class SGLangLayerwiseGPUConnector(_LayerwiseConnector):
    """SGLang pools <-> per-layer ``KV_T2D`` objects (MLA: ``[T, D]``), layer by layer.

    Both generators yield ``L + 1`` times and work on the current stream
    (``sync`` is required and otherwise unused, as in LMCache).
    """

    engine = "sglang"

    def batched_to_gpu(self, starts, ends, **kwargs) -> Generator:
        """Yields ``L + 1`` times: once per layer (the layer's objects are sent in), once at the end."""
        self._begin(kwargs)
        chunk_slots = self._chunk_slots(kwargs, starts, ends)
        given = kwargs.get("memory_objs")
        for layer in range(self.num_layers):
            objs = self._layer_objs((yield), given, layer)
            self._load_layer(layer, objs, starts, ends, chunk_slots, self._validate(kwargs))
        yield

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> Generator:
        """Yields ``L + 1`` times: after each layer's store, once at the end (no synchronization)."""
        self._begin(kwargs)
        chunk_slots = [self._slots(kwargs, s, e) for s, e in zip(starts, ends)]
        for layer in range(self.num_layers):
            self._store_layer(layer, memory_objs[layer], chunk_slots, self._validate(kwargs))
            yield
        yield


class VLLMBufferLayerwiseGPUConnector(_LayerwiseConnector):
    """CacheBlend: per-layer ``KV_2TD`` ``[2, T, D]`` objects through two device buffers, in three stages.

    ``VLLMBufferLayerwiseGPUConnector(hidden_dim_size, num_layers,
    use_gpu=False, use_double_buffer=True, **kwargs)``; ``use_gpu`` must be
    True (as in LMCache).  RoPE: ``fused_rotary_emb`` (a callable
    ``(old_positions, new_positions, keys [n, D]) -> keys``, LMCache's
    blender hook), or a table: ``rotary_emb`` (an object with
    ``cos_sin_cache``, ``head_size``, ``is_neox_style``) or
    ``cos_sin_cache=``/``is_neox_style=``/``head_size=``.  Keys are rotated
    head by head with the caches' head size (a ``head_size`` that contradicts
    the caches raises).

    ``batched_to_gpu(starts, ends, slot_mapping=...)`` yields ``L + 2`` times.
    The buffers cover positions ``starts[0] .. ends[-1]`` (row ``i`` is
    position ``starts[0] + i``).  After layer ``l``'s objects are sent:

    1. they are copied into the load buffer on the load stream (with layer
       0, each object's ``metadata.cached_positions`` - the positions its
       keys were computed at - is recorded; an object without them counts as
       computed where it is now);
    2. the device is synchronized, the buffers swap, layer ``l``'s keys are
       rotated from the recorded positions to their positions now, rows of
       positions no chunk covers (gaps) are zeroed, and the buffer becomes
       ``get_kv(l)`` - a blender may read and edit it until the next send;
    3. layer ``l - 1``'s buffer is written to the paged cache at
       ``slot_mapping[starts[0]:ends[-1]]`` - every position, gaps (zeros)
       included.

    The last ``next`` writes layer ``L - 1``.  ``batched_from_gpu`` yields
    ``L + 1`` times; each layer is gathered into a device buffer on the store
    stream, copied into the objects, and every object gets
    ``metadata.cached_positions = arange(start, end)``; each resumption waits
    for the store stream.
    """

    layer_format = MemoryFormat.KV_2TD
    requires_sync = False

    def __init__(self, hidden_dim_size: int, num_layers: int, use_gpu: bool = False, use_double_buffer: bool = True,
                 **kwargs):
        if not use_gpu:
            raise ValueError("use_gpu must be True for VLLMBufferLayerwiseGPUConnector (it works in device buffers)")
        rope = {k: kwargs.pop(k, None) for k in ("cos_sin_cache", "head_size", "rotary_emb", "fused_rotary_emb")}
        is_neox_style = kwargs.pop("is_neox_style", True)
        self._setup(hidden_dim_size, num_layers, use_gpu, **kwargs)
        self.use_double_buffer = bool(use_double_buffer)
        if rope["rotary_emb"] is not None:
            rope["cos_sin_cache"] = rope["rotary_emb"].cos_sin_cache
            is_neox_style = rope["rotary_emb"].is_neox_style
            rope["head_size"] = rope["rotary_emb"].head_size
        self.cos_sin_cache = rope["cos_sin_cache"]
        self.is_neox_style = bool(is_neox_style)
        self.head_size_hint = rope["head_size"]
        self.fused_rotary_emb = rope["fused_rotary_emb"]
        self.cache_positions = True
        self.buffer_mapping: dict[int, torch.Tensor] = {}
        self.current_gap_positions: torch.Tensor | None = None
        self.last_buffer: torch.Tensor | None = None
        self._pingpong: list[torch.Tensor] | None = None

    @classmethod
    def from_metadata(cls, metadata, use_gpu: bool = False, device=None, layout_hints=None):
        layers, _, heads, head_size = _kv_shape(metadata)
        return cls(hidden_dim_size=heads * head_size, num_layers=layers, use_gpu=use_gpu, dtype=metadata.kv_dtype,
                   device=device, layout_hints=layout_hints)

    def _rope_head_size(self) -> int:
        """Elements per head, from the caches' geometry (RoPE rotates each head on its own)."""
        e = self.geometry.E
        if self.head_size_hint is not None and int(self.head_size_hint) != e:
            raise ValueError(f"head_size = {self.head_size_hint} but the caches have heads of {e} elements")
        return e

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s K and V rows ``[n, D]`` in the device buffer, between its load and its flush."""
        if layer_id not in self.buffer_mapping:
            raise ValueError(f"layer {layer_id} is not in a device buffer (loaded layers: "
                             f"{sorted(self.buffer_mapping)})")
        buf = self.buffer_mapping[layer_id]
        return buf[0], buf[1]

    def _buffers(self, dtype, n) -> list[torch.Tensor]:
        bufs = self._pingpong
        if bufs is None or bufs[0].shape[1] < n or bufs[0].dtype != dtype:
            if bufs is not None:
                self._buffers_replaced()
            shape = (2, max(n, self.chunk_size), self.hidden_dim_size)
            bufs = self._pingpong = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(2)]
        return [b[:, :n] for b in bufs]

    def _rotate(self, keys: torch.Tensor, old: torch.Tensor, new: torch.Tensor, validate) -> None:
        if self.fused_rotary_emb is not None:
            keys.copy_(self.fused_rotary_emb(old, new, keys))
        elif self.cos_sin_cache is not None:
            rotary_embedding_k_fused(old, new, keys, self._rope_head_size(), self.cos_sin_cache, self.is_neox_style,
                                     validate=validate)

    def batched_to_gpu(self, starts, ends, **kwargs) -> Generator:
        self._begin(kwargs)
        validate = self._validate(kwargs)
        given = kwargs.get("memory_objs")
        base, end_all = int(starts[0]), int(ends[-1])
        n = end_all - base
        slots_all = self._slots(kwargs, base, end_all)
        dev = self.device
        gap = torch.ones(n, dtype=torch.bool, device=dev)
        for s, e in zip(starts, ends):
            gap[s - base:e - base] = False
        self.current_gap_positions = torch.nonzero(gap).flatten()
        new_positions = torch.arange(base, end_all, dtype=torch.int64, device=dev)
        old_positions = torch.zeros(n, dtype=torch.int64, device=dev)
        compute, load = self._buffers(self.dtype or self.kvcaches[0].dtype, n)
        # The load stream writes the buffers and old_positions, made (zeroed) on the caller's stream just now
        # or last call; from layer 1 on, each stage 2 synchronizes the device before the buffers swap.
        wait_stream(self.load_stream, self._current())
        self.buffer_mapping.clear()
        for step in range(self.num_layers + 2):
            if step > 1:                                     # stage 3: flush layer step - 2
                self._move_layer(step - 2, self.buffer_mapping.pop(step - 2), slots_all, H2D, validate, owned=True)
            if 0 < step <= self.num_layers:                  # stage 2: layer step - 1 is in the load buffer
                _synchronize(dev)
                compute, load = load, compute
                if self.cache_positions:
                    self._rotate(compute[0], old_positions, new_positions, validate)
                if self.current_gap_positions.numel():
                    compute[:, self.current_gap_positions] = 0
                self.buffer_mapping[step - 1] = self.last_buffer = compute
            if step < self.num_layers:                       # stage 1: receive and load layer step
                objs = self._layer_objs((yield), given, step)
                with on_stream(self.load_stream):
                    for s, e, obj in zip(starts, ends, objs):
                        _check_fmt(obj, MemoryFormat.KV_2TD)
                        load[:, s - base:e - base].copy_(_tensor(obj), non_blocking=True)
                        cached = None
                        if self.cache_positions and step == 0:
                            cached = getattr(_meta(obj), "cached_positions", None)
                            old_positions[s - base:e - base] = cached if cached is not None else \
                                torch.arange(s, e, dtype=torch.int64, device=dev)
                        self._keep(_tensor(obj), cached)
                    self._keep(load, old_positions)
            elif step == self.num_layers:
                yield
        yield

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> Generator:
        self._begin(kwargs)
        validate = self._validate(kwargs)
        chunk_slots = [self._slots(kwargs, s, e) for s, e in zip(starts, ends)]
        slots_all = torch.cat(chunk_slots)
        lengths = [e - s for s, e in zip(starts, ends)]
        dtype = self.dtype or self.kvcaches[0].dtype
        cur = self._current()
        for layer in range(self.num_layers):
            tmp = self._device_buffer(self.get_shape(int(slots_all.shape[0])), dtype, slot=("store", 0))
            # made on the caller's stream, which reads them (a tensor made on the store stream and freed by the
            # caller could be handed out again there while the caller's work still reads it)
            positions = [torch.arange(s, e, dtype=torch.int64, device=self.device) if self.cache_positions
                         else None for s, e in zip(starts, ends)]
            with on_stream(self.store_stream):
                wait_stream(self.store_stream, cur)
                self._move_layer(layer, tmp, slots_all, D2H, validate, owned=True)
                self._keep(tmp, slots_all)
                off = 0
                for obj, pos, length in zip(memory_objs[layer], positions, lengths):
                    _tensor(obj).copy_(tmp[:, off:off + length], non_blocking=True)
                    self._keep(_tensor(obj))
                    off += length
                    if pos is not None:
                        _meta(obj).cached_positions = pos
                    _tag_stored(obj, MemoryFormat.KV_2TD, False)
            yield
            synchronize_stream(self.store_stream)
            ops.check_errors(self.device)
        yield


# ---------------------------------------------------------------------------------------
# XPU classes
# ---------------------------------------------------------------------------------------

class VLLMPagedMemXPUConnectorV2(VLLMPagedMemGPUConnectorV2):
    """LMCache's XPU V2: ``VLLMPagedMemXPUConnectorV2(use_gpu=False, **kwargs)``.

    Layers, hidden size, MLA and the geometry are discovered from the first
    caches it sees; :meth:`get_shape` raises ``RuntimeError`` before that.
    """

    lazy_geometry = True

    def __init__(self, use_gpu: bool = False, **kwargs):
        kwargs.pop("hidden_dim_size", None)
        kwargs.pop("num_layers", None)
        self._setup(0, 0, use_gpu, **kwargs)

    @classmethod
    def from_metadata(cls, metadata, use_gpu: bool = False, device=None, layout_hints=None):
        return cls(use_gpu=use_gpu, device=device, layout_hints=layout_hints)

    def get_shape(self, num_tokens: int) -> torch.Size:
        if self.gpu_kv_format is None:
            raise RuntimeError("the shape is known once the connector has seen the kv caches "
                               "(to_gpu / from_gpu with kvcaches=, or register_kv_caches)")
        return super().get_shape(num_tokens)


class VLLMPagedMemLayerwiseXPUConnector(VLLMPagedMemLayerwiseGPUConnector):
    """LMCache's XPU layer-wise connector: ``(hidden_dim_size, num_layers, use_xpu=False, **kwargs)``.

    ``use_xpu`` is the device staging switch (``use_gpu`` of the GPU class).
    ``batched_to_gpu(memory_objs=None, starts=None, ends=None, **kwargs)``
    takes ``starts``/``ends`` by keyword; called positionally as
    ``(starts, ends)`` the two lists are read as such.
    """

    def __init__(self, hidden_dim_size: int, num_layers: int, use_xpu: bool = False, **kwargs):
        kwargs.pop("use_gpu", None)
        super().__init__(hidden_dim_size, num_layers, use_xpu, **kwargs)
        self.use_xpu = bool(use_xpu)

    @classmethod
    def from_metadata(cls, metadata, use_xpu: bool = False, device=None):
        layers, chunk, heads, head_size = _kv_shape(metadata)
        return cls(hidden_dim_size=heads * head_size, num_layers=layers, use_xpu=use_xpu, chunk_size=chunk,
                   dtype=metadata.kv_dtype, device=device, use_mla=bool(metadata.use_mla))

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> Generator:
        if ends is None and memory_objs is not None and starts is not None:
            starts, ends = memory_objs, starts
        return super().batched_to_gpu(list(starts or []), list(ends or []), **kwargs)


# The other XPU names are the same classes: the device is wherever the caches live.
VLLMPagedMemXPUConnectorV3 = VLLMPagedMemGPUConnectorV3
VLLMBufferLayerwiseXPUConnector = VLLMBufferLayerwiseGPUConnector
SGLangXPUConnector = SGLangGPUConnector
SGLangLayerwiseXPUConnector = SGLangLayerwiseGPUConnector
