"""LMCache's GPU/XPU connectors as one device-agnostic implementation on kvlayout.

A connector moves token chunks between an engine's paged KV cache and
*memory objects* (a tensor tagged with a :class:`MemoryFormat`).  Every data
movement is a call into :mod:`kvlayout.compat.lmcache` (hence
``kvlayout.ops``) or a plain ``Tensor.copy_`` into/out of a staging buffer;
the connectors only choose formats, slice slot mappings, compute skip counts
and sequence the work.  The same classes serve CUDA, XPU and CPU caches: the
device is wherever the engine's tensors live.  ``*XPUConnector*`` names are
aliases of the same classes.

Conventions shared by all connectors:

* ``kwargs["slot_mapping"]`` is the full-sequence slot mapping; chunk
  ``[start, end)`` uses ``slot_mapping[start:end]``.
* The engine's caches come from ``kwargs["kvcaches"]`` or from
  :meth:`register_kv_caches` (also spelled ``initialize_kvcaches_ptr``); the
  format is discovered once per cache structure with LMCache's rules
  (``kv_layout`` hint from the constructor or ``kwargs["kv_layout"]``).
* The format is discovered with the ``layout_hints`` given to the
  constructor (LMCache's keyword; ``{"kv_layout": "HND"}`` selects the HND
  formats), or ``kv_layout=`` directly.
* Work is enqueued on the current stream.  The connectors synchronize where
  LMCache's do: when a store ends in host memory (the host would otherwise
  read unfinished data), at the end of ``batched_to_gpu`` of the paged
  V2/V3 connectors, and at the end of layer-wise loads/stores with
  ``kwargs["sync"]``.  At each of these points they also call
  :func:`kvlayout.ops.check_errors`, so a slot a device kernel skipped as out
  of range raises ``IndexError`` there.  ``validate=`` (constructor default,
  or ``kwargs["validate"]`` per call) is forwarded to kvlayout: ``True``
  checks every slot on the host before anything moves.
* ``use_gpu=True`` stages memory objects that do not live on the cache's
  device through a device buffer (``Tensor.copy_`` + one kvlayout transfer);
  the buffer grows to the largest chunk seen.  Without it, host memory
  objects are read/written by the kernel directly and must be pinned when
  the cache is on an accelerator.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generator, Mapping, Sequence

import torch

from kvlayout import ops
from .lmcache import (CROSS_LAYER_FORMATS, MLA_FORMATS, GPUKVFormat, MemoryFormat, TransferDirection,
                      bind_kv_caches, discover_gpu_kv_format, ensure_contiguous_kv_caches,
                      multi_layer_kv_transfer, multi_layer_kv_transfer_unilateral, rotary_embedding_k_fused,
                      single_layer_kv_transfer, single_layer_kv_transfer_sgl)

H2D, D2H = TransferDirection.H2D, TransferDirection.D2H

__all__ = [
    "MemoryObj", "MemoryFormat", "VLLMPagedMemGPUConnectorV2", "VLLMPagedMemGPUConnectorV3",
    "VLLMPagedMemLayerwiseGPUConnector", "VLLMBufferLayerwiseGPUConnector", "SGLangGPUConnector",
    "SGLangLayerwiseGPUConnector", "VLLMPagedMemXPUConnectorV2", "VLLMPagedMemXPUConnectorV3",
    "VLLMPagedMemLayerwiseXPUConnector", "VLLMBufferLayerwiseXPUConnector", "SGLangXPUConnector",
    "SGLangLayerwiseXPUConnector", "skip_tokens",
]


@dataclasses.dataclass
class MemoryObj:
    """A memory object: a tensor plus its :class:`MemoryFormat` tag.

    ``tensors`` holds one tensor per layer group for objects of
    :class:`VLLMPagedMemGPUConnectorV3` (groups may differ in dtype and row
    width); ``tensor`` is then the first group's tensor.
    """

    tensor: torch.Tensor | None
    fmt: MemoryFormat = MemoryFormat.UNDEFINED
    tensors: list | None = None

    @property
    def metadata(self) -> "MemoryObj":
        """LMCache reads ``memory_obj.metadata.fmt``; the object is its own metadata here."""
        return self

    @property
    def group_tensors(self) -> list:
        return list(self.tensors) if self.tensors is not None else [self.tensor]

    @property
    def shape(self):
        return self.tensor.shape

    @property
    def dtype(self):
        return self.tensor.dtype


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


# ---------------------------------------------------------------------------------------
# Shared machinery
# ---------------------------------------------------------------------------------------

class _Connector:
    """Cache registration, format discovery and staging buffers shared by every connector."""

    engine = "vllm"
    sync_after_batched_load = True      # LMCache's paged V2/V3 wait for their load stream after batched_to_gpu

    def __init__(self, hidden_dim_size: int, num_layers: int, use_gpu: bool = False, *, chunk_size: int = 256,
                 dtype: torch.dtype | None = None, device=None, use_mla: bool = False, kv_layout: str | None = None,
                 layout_hints: Mapping[str, Any] | None = None, kvcaches=None, validate: bool | None = None,
                 **_ignored):
        self.layout_hints = dict(layout_hints or {})
        hinted = self.layout_hints.get("kv_layout")
        if kv_layout is not None and hinted is not None and str(kv_layout).upper() != str(hinted).upper():
            raise ValueError(f"kv_layout = {kv_layout!r} contradicts layout_hints['kv_layout'] = {hinted!r}")
        kv_layout = kv_layout if kv_layout is not None else hinted
        self.validate = validate
        self.hidden_dim_size = int(hidden_dim_size)
        self.num_layers = int(num_layers)
        self.use_gpu = bool(use_gpu)
        self.chunk_size = int(chunk_size)
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self.use_mla = bool(use_mla)
        self.kv_layout = kv_layout
        self.kvcaches = None
        self.geometry = None
        self.gpu_kv_format: GPUKVFormat | None = None
        self._staging: dict[int, torch.Tensor] = {}
        if kvcaches is not None:
            self.register_kv_caches(kvcaches)

    # -- caches -------------------------------------------------------------------------
    def register_kv_caches(self, kvcaches, kv_layout: str | None = None) -> GPUKVFormat:
        """Take the engine's caches (recovering permuted HND views) and discover their format."""
        layout = kv_layout or self.kv_layout
        kv = ensure_contiguous_kv_caches(kvcaches, layout) if self.engine == "vllm" else kvcaches
        self.gpu_kv_format = discover_gpu_kv_format(kv, self.engine, self._hints(layout))
        if self.use_mla != (self.gpu_kv_format in MLA_FORMATS):
            raise ValueError(f"use_mla={self.use_mla} but the caches are {self.gpu_kv_format.name}")
        self.kvcaches = kv
        self._registered = kvcaches
        bound = bind_kv_caches(kv, self.gpu_kv_format)
        self.geometry = bound.geometry
        self.device = bound.device
        self.dtype = self.dtype or bound.dtype
        return self.gpu_kv_format

    initialize_kvcaches_ptr = register_kv_caches

    def _hints(self, layout: str | None) -> dict:
        """The constructor's layout hints with ``kv_layout`` set to ``layout`` (when given)."""
        return {**self.layout_hints, "kv_layout": layout} if layout else dict(self.layout_hints)

    def _validate(self, kwargs):
        return kwargs.get("validate", self.validate)

    def _caches(self, kwargs):
        kv = kwargs.get("kvcaches")
        if kv is not None and kv is not getattr(self, "_registered", None):
            self.register_kv_caches(kv, kwargs.get("kv_layout"))
        if self.kvcaches is None:
            raise ValueError("no kv caches: pass kvcaches=... or call register_kv_caches first")
        return self.kvcaches

    def _layer(self, l: int):
        """One layer's cache tensor(s) of a per-layer format."""
        if self.gpu_kv_format in CROSS_LAYER_FORMATS:
            raise ValueError(f"layer-wise transfers need a per-layer format, got {self.gpu_kv_format.name}")
        if self.gpu_kv_format == GPUKVFormat.TWO_X_NL_X_NBBS_NH_HS:
            return self.kvcaches[0][l], self.kvcaches[1][l]
        return self.kvcaches[l]

    # -- staging ------------------------------------------------------------------------
    def _staging_view(self, like: torch.Tensor, slot: int = 0) -> torch.Tensor | None:
        """A device buffer shaped like ``like``, or ``None`` when no staging is wanted or needed."""
        if not self.use_gpu or self.device is None or like.device == self.device:
            return None
        return self._device_buffer(like.shape, like.dtype, slot)

    def _device_buffer(self, shape, dtype: torch.dtype, slot: int = 0) -> torch.Tensor:
        """A contiguous ``shape``/``dtype`` view of staging buffer ``slot`` (grown when too small)."""
        nbytes = max(1, int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size())
        buf = self._staging.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = self._staging[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes].view(dtype)[:torch.Size(shape).numel()].view(shape)

    def _host_done(self, tensors: Sequence[torch.Tensor]) -> None:
        """Synchronize (and check for skipped slots) when a store wrote host memory."""
        if self.device is not None and any(t.device.type == "cpu" for t in tensors):
            _synchronize(self.device)

    @staticmethod
    def _slots(kwargs, start: int, end: int) -> torch.Tensor:
        if "slot_mapping" not in kwargs:
            raise ValueError("slot_mapping is required")
        return kwargs["slot_mapping"][start:end]


def _check_fmt(memory_obj: MemoryObj, *allowed: MemoryFormat) -> None:
    if memory_obj.tensor is None:
        raise ValueError("memory object has no tensor")
    if memory_obj.fmt not in allowed:
        raise ValueError(f"memory object format is {MemoryFormat(memory_obj.fmt).name}, expected "
                         f"{' or '.join(f.name for f in allowed)}")


# ---------------------------------------------------------------------------------------
# Paged, all layers at once (V2, V3, SGLang)
# ---------------------------------------------------------------------------------------

class VLLMPagedMemGPUConnectorV2(_Connector):
    """vLLM paged cache <-> ``KV_2LTD`` ``[2, L, T, D]`` (MLA: ``KV_MLA_FMT`` ``[1, L, T, D]``) objects.

    ``to_gpu`` skips the chunk positions vLLM already holds
    (``kwargs["vllm_cached_tokens"]``): ``skip = min(end - start, max(0,
    cached - start))``; ``from_gpu`` copies every position.
    """

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([1 if self.use_mla else 2, self.num_layers, num_tokens, self.hidden_dim_size])

    @property
    def _memory_format(self) -> MemoryFormat:
        return MemoryFormat.KV_MLA_FMT if self.use_mla else MemoryFormat.KV_2LTD

    def _transfer(self, tensor, kv, slots, direction, skip=0, validate=None):
        multi_layer_kv_transfer(tensor, kv, slots, self.device, 0, direction, self.gpu_kv_format,
                                skip_prefix_n_tokens=skip, validate=validate)

    def _load_slots(self, kwargs, start: int, end: int) -> torch.Tensor:
        return self._slots(kwargs, start, end)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        """Memory object (chunk ``[start, end)``) -> paged cache."""
        _check_fmt(memory_obj, self._memory_format)
        kv = self._caches(kwargs)
        skip = skip_tokens(start, end, kwargs.get("vllm_cached_tokens", 0))
        slots = self._load_slots(kwargs, start, end)
        src = memory_obj.tensor
        staged = self._staging_view(src)
        if staged is not None:
            staged.copy_(src, non_blocking=True)
            src = staged
        self._transfer(src, kv, slots, H2D, skip, self._validate(kwargs))

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        """Paged cache -> memory object (chunk ``[start, end)``); tags the object's format."""
        if memory_obj.tensor is None:
            raise ValueError("memory object has no tensor")
        kv = self._caches(kwargs)
        dst = memory_obj.tensor
        staged = self._staging_view(dst)
        self._transfer(staged if staged is not None else dst, kv, self._slots(kwargs, start, end), D2H,
                       validate=self._validate(kwargs))
        if staged is not None:
            dst.copy_(staged, non_blocking=True)
        memory_obj.fmt = self._memory_format
        self._host_done([dst])

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(obj, start, end, **kwargs)
        if self.sync_after_batched_load and self.device is not None:
            _synchronize(self.device)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)


class VLLMPagedMemGPUConnectorV3(_Connector):
    """V2 over *layer groups*: layers whose caches differ in shape or dtype are moved group by group.

    The engine's per-layer caches are grouped by (shape, dtype) in order of
    first appearance; each group gets its own format and its own tensor in the
    memory object (``MemoryObj.tensors``: per group ``[2, L_g, T, D_g]``, MLA
    ``[1, L_g, T, D_g]``, in the group's dtype).  Every group shares the slot
    mapping (``kwargs["slot_groups"]``, one slot mapping per group, overrides
    it).  ``hidden_dim_size``/``num_layers`` are taken from the caches.
    """

    def __init__(self, hidden_dim_size: int = 0, num_layers: int = 0, use_gpu: bool = False, **kwargs):
        self.groups: list[tuple[list[int], GPUKVFormat, list]] = []
        super().__init__(hidden_dim_size, num_layers, use_gpu, **kwargs)

    def register_kv_caches(self, kvcaches, kv_layout: str | None = None):
        layout = kv_layout or self.kv_layout
        kv = list(ensure_contiguous_kv_caches(list(kvcaches), layout))
        hints = self._hints(layout)
        by_key: dict = {}
        for i, t in enumerate(kv):
            by_key.setdefault((tuple(t.shape), t.dtype), []).append(i)
        self.groups = []
        for layers in by_key.values():
            tensors = [kv[i] for i in layers]
            self.groups.append((layers, discover_gpu_kv_format(tensors, "vllm", hints), tensors))
        self.kvcaches, self._registered = kv, kvcaches
        self.num_layers = len(kv)
        self.device = kv[0].device
        self.gpu_kv_format = self.groups[0][1]
        return self.gpu_kv_format

    initialize_kvcaches_ptr = register_kv_caches

    def get_shapes(self, num_tokens: int) -> list[torch.Size]:
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

    @property
    def _memory_format(self) -> MemoryFormat:
        return MemoryFormat.KV_MLA_FMT if all(f in MLA_FORMATS for _, f, _ in self.groups) else MemoryFormat.KV_2LTD

    def _group_slots(self, kwargs, start, end):
        per_group = kwargs.get("slot_groups")
        if per_group is not None:
            return [s[start:end] for s in per_group]
        return [self._slots(kwargs, start, end)] * len(self.groups)

    def _objects(self, memory_obj: MemoryObj) -> list:
        tensors = memory_obj.group_tensors
        if len(tensors) != len(self.groups):
            raise ValueError(f"memory object has {len(tensors)} group tensors, the caches {len(self.groups)} groups")
        return tensors

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        _check_fmt(memory_obj, self._memory_format)
        self._caches(kwargs)
        skip = skip_tokens(start, end, kwargs.get("vllm_cached_tokens", 0))
        for i, ((_, fmt, tensors), src, slots) in enumerate(zip(self.groups, self._objects(memory_obj),
                                                                 self._group_slots(kwargs, start, end))):
            staged = self._staging_view(src, slot=i)
            if staged is not None:
                staged.copy_(src, non_blocking=True)
                src = staged
            multi_layer_kv_transfer(src, tensors, slots, self.device, 0, H2D, fmt, skip_prefix_n_tokens=skip,
                                    validate=self._validate(kwargs))

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        self._caches(kwargs)
        dsts = self._objects(memory_obj)
        for i, ((_, fmt, tensors), dst, slots) in enumerate(zip(self.groups, dsts,
                                                                 self._group_slots(kwargs, start, end))):
            staged = self._staging_view(dst, slot=i)
            multi_layer_kv_transfer(staged if staged is not None else dst, tensors, slots, self.device, 0, D2H, fmt,
                                    validate=self._validate(kwargs))
            if staged is not None:
                dst.copy_(staged, non_blocking=True)
        memory_obj.fmt = self._memory_format
        self._host_done(dsts)

    batched_to_gpu = VLLMPagedMemGPUConnectorV2.batched_to_gpu
    batched_from_gpu = VLLMPagedMemGPUConnectorV2.batched_from_gpu


class SGLangGPUConnector(VLLMPagedMemGPUConnectorV2):
    """SGLang pools (``[[K...], [V...]]`` lists, or MLA ``[PBS, 1, D]`` list) <-> ``KV_2LTD``/``KV_MLA_FMT``.

    Uses :func:`~kvlayout.compat.lmcache.multi_layer_kv_transfer_unilateral`;
    like LMCache's SGLang connector it applies no prefix skip, and ``to_gpu``
    reads ``slot_mapping[start - offset:end - offset]`` (``kwargs["offset"]``,
    default 0: the slot mapping then covers only the tokens from ``offset``
    on); ``from_gpu`` reads ``slot_mapping[start:end]``.
    """

    engine = "sglang"
    sync_after_batched_load = False     # LMCache's SGLang connector does not wait after its loads

    def _transfer(self, tensor, kv, slots, direction, skip=0, validate=None):
        multi_layer_kv_transfer_unilateral(tensor, kv, slots, self.device, 0, direction, self.gpu_kv_format,
                                           validate=validate)

    def _load_slots(self, kwargs, start: int, end: int) -> torch.Tensor:
        offset = int(kwargs.get("offset", 0))
        if "slot_mapping" not in kwargs:
            raise ValueError("slot_mapping is required")
        n = int(kwargs["slot_mapping"].shape[0])
        if not 0 <= start - offset <= end - offset <= n:
            raise ValueError(f"offset = {offset}: chunk [{start}, {end}) maps to slot_mapping[{start - offset}:"
                             f"{end - offset}], outside its {n} entries")
        return kwargs["slot_mapping"][start - offset:end - offset]

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        kwargs.pop("vllm_cached_tokens", None)
        super().to_gpu(memory_obj, start, end, **kwargs)


# ---------------------------------------------------------------------------------------
# Layer-wise generators
# ---------------------------------------------------------------------------------------

class _LayerwiseConnector(_Connector):
    """The generator contract of LMCache's layer-wise connectors.

    ``batched_to_gpu(starts, ends, **kwargs)`` yields ``L + 2`` times.  Layer
    ``l``'s memory objects (one per chunk) are sent into the generator
    (``gen.send(objs)``), or come from ``kwargs["memory_objs"][l]`` when
    ``None`` is sent::

        gen = connector.batched_to_gpu(starts, ends, slot_mapping=sm)
        next(gen)                          # 1: set up, nothing loaded yet
        for l in range(L):
            gen.send(objs_of_layer[l])     # 2..L+1: layer l is loaded
        next(gen)                          # L+2: all loads finished (synchronized if sync=True)

    ``batched_from_gpu(memory_objs, starts, ends, **kwargs)`` with
    ``memory_objs[l][chunk]`` yields ``L + 1`` times: after storing each
    layer, then once more when every store has finished (synchronized when
    the objects live in host memory or ``sync=True``).
    """

    layer_format = MemoryFormat.KV_T2D

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

    def _move_layer(self, layer: int, tensor: torch.Tensor, slots: torch.Tensor, direction, validate=None) -> None:
        """One layer, one token-indexed tensor <-> the paged cache."""
        single_layer_kv_transfer(tensor, self._layer(layer), slots, direction, self.gpu_kv_format,
                                 token_major=self.layer_format == MemoryFormat.KV_T2D, validate=validate)

    def _chunk_slots(self, kwargs, starts, ends) -> list[torch.Tensor]:
        """Per chunk: its slots, with positions vLLM already holds set to -1."""
        cached = kwargs.get("vllm_cached_tokens", 0)
        out = []
        for s, e in zip(starts, ends):
            slots = self._slots(kwargs, s, e)
            skip = skip_tokens(s, e, cached)
            out.append(ops.skip_prefix(slots, skip) if skip else slots)
        return out

    def _load_layer(self, layer: int, objs, starts, ends, chunk_slots, validate=None) -> None:
        for obj in objs:
            _check_fmt(obj, self._expected_format())
        if self.use_gpu and any(o.tensor.device != self.device for o in objs):
            # one ping-pong device buffer per layer parity: copy the chunks in, one transfer out
            dim = self._token_dim
            total = sum(o.tensor.shape[dim] for o in objs)
            staged = self._device_buffer(self.get_shape(total), objs[0].tensor.dtype, slot=layer % 2)
            for off, o in zip(_offsets(objs, dim), objs):
                staged.narrow(dim, off, o.tensor.shape[dim]).copy_(o.tensor, non_blocking=True)
            self._move_layer(layer, staged, torch.cat(chunk_slots), H2D, validate)
        else:
            for obj, slots in zip(objs, chunk_slots):
                self._move_layer(layer, obj.tensor, slots, H2D, validate)

    def batched_to_gpu(self, starts, ends, **kwargs) -> Generator:
        self._caches(kwargs)
        chunk_slots = self._chunk_slots(kwargs, starts, ends)
        given = kwargs.get("memory_objs")
        for layer in range(self.num_layers):
            objs = yield
            if objs is None:
                if given is None:
                    raise ValueError(f"no memory objects for layer {layer}: send them or pass memory_objs=")
                objs = given[layer]
            self._load_layer(layer, objs, starts, ends, chunk_slots, self._validate(kwargs))
        yield
        if kwargs.get("sync", False) and self.device is not None:
            _synchronize(self.device)
        yield

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> Generator:
        self._caches(kwargs)
        chunk_slots = [self._slots(kwargs, s, e) for s, e in zip(starts, ends)]
        touched = []
        for layer in range(self.num_layers):
            for obj, slots in zip(memory_objs[layer], chunk_slots):
                dst = obj.tensor
                staged = self._staging_view(dst, slot=layer % 2)
                self._move_layer(layer, staged if staged is not None else dst, slots, D2H, self._validate(kwargs))
                if staged is not None:
                    dst.copy_(staged, non_blocking=True)
                obj.fmt = self._expected_format()
                touched.append(dst)
            yield
        if kwargs.get("sync", False) and self.device is not None:
            _synchronize(self.device)
        else:
            self._host_done(touched)
        yield

    # single-chunk conveniences (load / store every layer of one chunk)
    def to_gpu(self, memory_objs, start: int, end: int, **kwargs) -> None:
        """All layers of one chunk: ``memory_objs[l]`` is layer l's object."""
        gen = self.batched_to_gpu([start], [end], memory_objs=[[o] for o in memory_objs], **kwargs)
        for _ in gen:
            pass

    def from_gpu(self, memory_objs, start: int, end: int, **kwargs) -> None:
        for _ in self.batched_from_gpu([[o] for o in memory_objs], [start], [end], **kwargs):
            pass


def _offsets(objs, dim: int) -> list[int]:
    out, acc = [], 0
    for o in objs:
        out.append(acc)
        acc += o.tensor.shape[dim]
    return out


class VLLMPagedMemLayerwiseGPUConnector(_LayerwiseConnector):
    """vLLM paged cache <-> per-layer ``KV_T2D`` ``[T, 2, D]`` objects (MLA: ``[T, D]``), layer by layer.

    Loads skip the chunk positions vLLM already holds
    (``kwargs["vllm_cached_tokens"]``, same rule as V2), by turning their
    slots into -1.
    """


class SGLangLayerwiseGPUConnector(_LayerwiseConnector):
    """SGLang pools <-> per-layer ``KV_T2D`` objects (MLA: ``[T, D]``), layer by layer."""

    engine = "sglang"

    def _move_layer(self, layer, tensor, slots, direction, validate=None):
        if self.use_mla:
            single_layer_kv_transfer(tensor, self._layer(layer), slots, direction, self.gpu_kv_format,
                                     validate=validate)
        else:
            k, v = self._layer(layer)
            single_layer_kv_transfer_sgl(tensor, k, v, slots, direction, token_major=True, validate=validate)

    def _chunk_slots(self, kwargs, starts, ends):
        return [self._slots(kwargs, s, e) for s, e in zip(starts, ends)]


class VLLMBufferLayerwiseGPUConnector(_LayerwiseConnector):
    """CacheBlend: per-layer ``KV_2TD`` ``[2, T, D]`` objects through a ping-pong device buffer.

    Loading layer ``l`` (same generator contract as the other layer-wise
    connectors):

    1. buffer ``l % 2`` (``[2, n, D]`` on the cache's device, ``n = ends[-1] -
       starts[0]``; row ``i`` is sequence position ``starts[0] + i``) gets each
       chunk's rows; rows of positions no chunk covers (gaps between chunks)
       are zeroed;
    2. when a RoPE table is known (``cos_sin_cache`` / ``rotary_emb`` at
       construction) and ``kwargs`` carry ``old_positions`` (where the keys
       were computed) and ``positions`` (where they are used now), both
       full-sequence tensors, the K rows of covered positions are rotated from
       old to new positions (:func:`rotary_embedding_k_fused`), head by head:
       the head size is the caches' (``head_size``, when given, must agree);
    3. the covered rows are written to the paged cache; gap positions are not
       written (their slots become -1): the engine recomputes them.

    ``last_buffer`` is the buffer of the most recently loaded layer.  Stores
    (``batched_from_gpu``) copy paged rows straight into the ``KV_2TD`` objects.
    """

    layer_format = MemoryFormat.KV_2TD

    def __init__(self, hidden_dim_size: int, num_layers: int, use_gpu: bool = True, *, cos_sin_cache=None,
                 is_neox_style: bool = True, head_size: int | None = None, rotary_emb=None, **kwargs):
        super().__init__(hidden_dim_size, num_layers, use_gpu, **kwargs)
        if rotary_emb is not None:
            cos_sin_cache = rotary_emb.cos_sin_cache
            is_neox_style = rotary_emb.is_neox_style
            head_size = rotary_emb.head_size
        self.cos_sin_cache = cos_sin_cache
        self.is_neox_style = bool(is_neox_style)
        self.head_size = head_size
        self.last_buffer: torch.Tensor | None = None

    def _chunk_slots(self, kwargs, starts, ends):
        return [self._slots(kwargs, s, e) for s, e in zip(starts, ends)]

    def _rope_head_size(self) -> int:
        """Elements per head, from the caches' geometry (RoPE rotates each head on its own)."""
        e = self.geometry.E
        if self.head_size is not None and int(self.head_size) != e:
            raise ValueError(f"head_size = {self.head_size} but the caches have heads of {e} elements")
        return e

    def _load_layer(self, layer, objs, starts, ends, chunk_slots, validate=None):
        for obj in objs:
            _check_fmt(obj, MemoryFormat.KV_2TD)
        base, n = int(starts[0]), int(ends[-1]) - int(starts[0])
        first = objs[0].tensor
        buf = self._buffers(first.dtype, n)[layer % 2][:, :n]
        covered = torch.zeros(n, dtype=torch.bool, device=self.device)
        buf.zero_()                                                    # gaps stay zero
        for obj, s, e in zip(objs, starts, ends):
            buf[:, s - base:e - base].copy_(obj.tensor, non_blocking=True)
            covered[s - base:e - base] = True
        if self.cos_sin_cache is not None and "positions" in self._kw and "old_positions" in self._kw:
            minus = torch.full((n,), -1, dtype=torch.int64, device=self.device)
            old = torch.where(covered, self._kw["old_positions"][base:base + n].to(self.device), minus)
            new = torch.where(covered, self._kw["positions"][base:base + n].to(self.device), minus)
            rotary_embedding_k_fused(old, new, buf[0], self._rope_head_size(), self.cos_sin_cache,
                                     self.is_neox_style, validate=validate)
        slots = self._slots(self._kw, base, base + n).to(self.device)
        slots = torch.where(covered, slots, torch.full_like(slots, -1))
        self._move_layer(layer, buf, slots, H2D, validate)
        self.last_buffer = buf

    def _buffers(self, dtype, n):
        bufs = getattr(self, "_pingpong", None)
        if bufs is None or bufs[0].shape[1] < n or bufs[0].dtype != dtype:
            shape = (2, max(n, self.chunk_size), self.hidden_dim_size)
            bufs = self._pingpong = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(2)]
        return bufs

    def batched_to_gpu(self, starts, ends, **kwargs):
        self._kw = kwargs
        yield from super().batched_to_gpu(starts, ends, **kwargs)


# XPU connectors are the same classes: the device is wherever the caches live.
VLLMPagedMemXPUConnectorV2 = VLLMPagedMemGPUConnectorV2
VLLMPagedMemXPUConnectorV3 = VLLMPagedMemGPUConnectorV3
VLLMPagedMemLayerwiseXPUConnector = VLLMPagedMemLayerwiseGPUConnector
VLLMBufferLayerwiseXPUConnector = VLLMBufferLayerwiseGPUConnector
SGLangXPUConnector = SGLangGPUConnector
SGLangLayerwiseXPUConnector = SGLangLayerwiseGPUConnector
