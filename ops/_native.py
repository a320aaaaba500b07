"""Thin Python face of kvlayout's native ops (``torch.ops.kvlayout.*``).

The ops are defined in C++ (``torch_ext/registration.cpp``) and implemented
per device (``torch_ext/{cpu,cuda,sycl}``). This module loads the extension,
registers the fake (meta) implementations used by ``torch.compile`` and
export, and offers thin wrappers plus the device status tensor helpers.

Status tensor: device kernels cannot raise, so an out-of-range slot or
position is skipped on the device and recorded in a per-device int64 tensor
``[count, token, value, bound, which]`` (``which``: 0 ``src_slots``,
1 ``dst_slots``, 2 ``old_positions``, 3 ``new_positions``).
``raise_on_device_errors(device)`` reads it (this synchronises), raises
``IndexError`` naming the first recorded index, and zeroes it. The CPU
kernels raise directly, before writing anything.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

try:
    from kvlayout import _C  # (loading it also registers torch.ops.kvlayout)
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "kvlayout's native extension kvlayout._C is not built or cannot be loaded "
        f"({exc}). Build it from the repository root with "
        "`pip install --no-build-isolation -e .` (needs a C++ compiler; CUDA "
        "kernels are built when torch has CUDA and nvcc is found)."
    ) from exc

from . import compiler_marks  # noqa: E402
from .settings import NativeChoice  # noqa: E402  (after the extension's clear import error)

__all__ = [
    "copy_rows",
    "rope_reposition",
    "status_tensor",
    "raise_on_device_errors",
    "built_backends",
    "cuda_available",
    "xpu_available",
    "STATUS_NUMEL",
]

# The status word's layout and argument order are the native library's (kvlayout/status.h).
STATUS_NUMEL = _C.STATUS_NUMEL
_BOUND_OF = {"src_slots": "the source holds {bound} slots", "dst_slots": "the destination holds {bound} slots",
             "old_positions": "cos_sin_cache holds {bound} positions",
             "new_positions": "cos_sin_cache holds {bound} positions"}
_STATUS_WHAT = {i: (name, _BOUND_OF[name]) for i, name in enumerate(_C.STATUS_ARGUMENTS)}


def _no_meta_mixed_with_data(op: str, named: dict) -> None:
    """The fake (meta) kernels also run when real meta tensors reach an op: mixed with tensors
    that hold data, that would be a silent no-op, so it is an error (all-meta calls trace shapes)."""
    flat = []
    for name, value in named.items():
        if isinstance(value, torch.Tensor):
            flat.append((name, value))
        elif isinstance(value, (list, tuple)):
            flat.extend((f"{name}[{i}]", t) for i, t in enumerate(value) if isinstance(t, torch.Tensor))
    meta = [n for n, t in flat if t.device.type == "meta"]
    real = [(n, t.device) for n, t in flat if t.device.type != "meta"]
    if meta and real:
        raise ValueError(f"kvlayout::{op}: {meta[0]} is a meta tensor but {real[0][0]} is on {real[0][1]}; "
                         "meta tensors hold no data, so nothing would be copied")


@torch.library.register_fake("kvlayout::copy_rows")
def _copy_rows_fake(src, dst, src_slots, dst_slots, num_tokens, skip_prefix, src_segments,
                    dst_segments, src_geometry, dst_geometry, num_pieces, piece_bytes,
                    max_ctas, status, validate=False):
    _no_meta_mixed_with_data("copy_rows", dict(src=src, dst=dst, src_slots=src_slots, dst_slots=dst_slots,
                                               status=status))
    return None


@torch.library.register_fake("kvlayout::copy_runs")
def _copy_runs_fake(src, dst, src_slots, dst_slots, num_tokens, skip_prefix, src_segments,
                    dst_segments, src_geometry, dst_geometry, num_pieces, piece_bytes):
    _no_meta_mixed_with_data("copy_runs", dict(src=src, dst=dst, src_slots=src_slots, dst_slots=dst_slots))
    return None


@torch.library.register_fake("kvlayout::copy_program")
def _copy_program_fake(program, src, dst, src_slots, dst_slots, step, num_tokens, skip_prefix, max_ctas, status,
                       validate=False):
    _no_meta_mixed_with_data("copy_program", dict(src=src, dst=dst, src_slots=src_slots, dst_slots=dst_slots,
                                                  status=status))
    return None


@torch.library.register_fake("kvlayout::rope_reposition")
def _rope_reposition_fake(key, old_positions, new_positions, cos_sin_cache, is_neox,
                          max_ctas, status):
    _no_meta_mixed_with_data("rope_reposition", dict(key=key, old_positions=old_positions,
                                                     new_positions=new_positions, cos_sin_cache=cos_sin_cache,
                                                     status=status))
    return None


def built_backends() -> list[str]:
    """Backends compiled into this build of kvlayout._C: "cpu", "cuda", "xpu"."""
    return list(torch.ops.kvlayout.built_backends())


def cuda_available() -> bool:
    """Whether the CUDA kernels are built and a CUDA device is present."""
    return "cuda" in built_backends() and torch.cuda.is_available()


def xpu_available() -> bool:
    """Whether the SYCL kernels are built and an XPU device is present."""
    xpu = getattr(torch, "xpu", None)
    return "xpu" in built_backends() and xpu is not None and xpu.is_available()


# The cache operators of kernel launches that read or write pinned host memory (CUDA): "streaming"
# (evict-first loads and stores, the default) or "default" (the hardware's default operators, as LMCache's and
# sgl-kernel's copy kernels use). The bench's host_hints rows measure both beside each other.
HOST_CACHE_HINTS = ("streaming", "default")


def set_host_cache_hints(hints: str) -> None:
    """The cache operators of copy-kernel launches that touch pinned host memory: ``"streaming"`` (evict-first
    loads and stores: the default, ``KVLAYOUT_HOST_CACHE_HINTS``) or ``"default"`` (the hardware's default
    operators). Process-wide (:func:`host_cache_hints` reads it), read by every run of a launch; a launch
    captured in a CUDA graph keeps the hints it was captured with. Results are the same bytes either way."""
    _HOST_CACHE_HINTS.set(hints)


def host_cache_hints() -> str:
    """The setting of :func:`set_host_cache_hints`."""
    return _HOST_CACHE_HINTS.get()


_HOST_CACHE_HINTS = NativeChoice("host cache hints", HOST_CACHE_HINTS, _C.set_host_cache_hints, _C.host_cache_hints,
                                 "KVLAYOUT_HOST_CACHE_HINTS")

# How the CUDA kernel moves a transfer that reads or writes pinned host memory without an SM budget:
# "row_per_cta" (the default: one CTA per row of a token and segment, in 8-byte words, for launches of up to 64 MiB
# whose rows hold 256 bytes or more in 8- or 16-byte words; larger ones walk) or "walk" (one CTA per SM, each
# walking its share of every row). The side-by-side's "kvlayout walk" call measures the second beside the first.
HOST_LAUNCH_SHAPES = ("row_per_cta", "walk")
HOST_ROW_PER_CTA_MAX_BYTES = _C.HOST_ROW_PER_CTA_MAX_BYTES   # the largest launch moved one row per CTA


def set_host_launch_shape(shape: str) -> None:
    """The shape of CUDA copy-kernel launches that touch pinned host memory without an SM budget:
    ``"row_per_cta"`` (the default, ``KVLAYOUT_HOST_LAUNCH_SHAPE``) or ``"walk"``. Process-wide
    (:func:`host_launch_shape` reads it), read by every run of a launch; a launch captured in a CUDA graph keeps
    the shape it was captured with. Results are the same bytes either way."""
    _HOST_LAUNCH_SHAPE.set(shape)


def host_launch_shape() -> str:
    """The setting of :func:`set_host_launch_shape`."""
    return _HOST_LAUNCH_SHAPE.get()


_HOST_LAUNCH_SHAPE = NativeChoice("a host launch shape", HOST_LAUNCH_SHAPES, _C.set_host_launch_shape,
                                  _C.host_launch_shape, "KVLAYOUT_HOST_LAUNCH_SHAPE")

_status: dict[torch.device, torch.Tensor] = {}


def _normalize_device(device) -> torch.device:
    device = torch.device(device)
    if device.type in ("cuda", "xpu") and device.index is None:
        mod = getattr(torch, device.type)
        device = torch.device(device.type, mod.current_device())
    return device


def status_tensor(device) -> torch.Tensor:
    """The cached int64 status tensor of `device` (created zeroed on first use)."""
    device = _normalize_device(device)
    t = _status.get(device)
    if t is None and torch.compiler.is_compiling():
        # First use inside a traced region (no lock there): dict.setdefault is atomic.
        t = _status.setdefault(device, torch.zeros(STATUS_NUMEL, dtype=torch.int64, device=device))
    if t is None:
        # made outside inference mode even when first asked for inside it: the ops write it
        # in place, which an inference tensor refuses outside inference mode
        with torch.inference_mode(False):
            made = torch.zeros(STATUS_NUMEL, dtype=torch.int64, device=device)
        # static to compiled code: its size (5) is no symbol a token count of 5 could be tied to; and so is its
        # address: every op writes it, and inductor skips CUDA graphs (reduce-overhead), with a warning only,
        # for a graph that writes an input it does not know to stay at one address
        compiler_marks.mark_static(made)
        # threads asking at once each make one and all keep the first stored (dict.setdefault is atomic): no
        # lock, so none that a fork could leave held, and none held while allocating (where the garbage
        # collector may run a finalizer that takes the program registry's lock)
        t = _status.setdefault(device, made)
    return t


def raise_on_device_errors(device=None) -> None:
    """Raise IndexError if a device kernel recorded an out-of-range index.

    Reads the status tensor of `device` (a host synchronisation), then zeroes
    it, so each recorded error is reported once. `device=None` checks every
    device that has a status tensor.
    """
    if device is None:
        for d in list(_status):
            if d.type != "meta":        # tracing (fake tensors, opcheck) makes meta status words holding no data
                raise_on_device_errors(d)
        return
    device = _normalize_device(device)
    t = _status.get(device)
    if t is None:
        return
    count, token, value, bound, which = (int(v) for v in t.tolist()[:STATUS_NUMEL])
    if count == 0:
        return
    t.zero_()
    name, what = _STATUS_WHAT.get(which, ("index", "the bound is {bound}"))
    more = f" ({count - 1} more out-of-range entries were skipped)" if count > 1 else ""
    raise IndexError(
        f"kvlayout: {name}[{token}] = {value} is out of range: "
        f"{what.format(bound=bound)}; the rows of that token were not touched{more}"
    )


def _launch_device(tensors: Sequence[Optional[torch.Tensor]]) -> torch.device:
    for t in tensors:
        if t is not None and t.device.type not in ("cpu", "meta"):
            return t.device
    return torch.device("cpu")


def copy_rows(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    src_slots: Optional[torch.Tensor],
    dst_slots: Optional[torch.Tensor],
    num_tokens: int,
    skip_prefix: int,
    src_segments: Sequence[int],
    dst_segments: Sequence[int],
    src_geometry: Sequence[int],
    dst_geometry: Sequence[int],
    num_pieces: int,
    piece_bytes: int,
    max_ctas: int = 0,
    status: Optional[torch.Tensor] = None,
    validate: bool = False,
) -> None:
    """Move rows between two strided byte layouts (torch.ops.kvlayout.copy_rows).

    For each token t in [skip_prefix, num_tokens) with s = src_slots[t] (or t)
    and d = dst_slots[t] (or t), both >= 0, and for each segment g and piece
    h < num_pieces: copy piece_bytes bytes from
    src[src_segments[2g]] + src_segments[2g+1] + piece_offset(src_geometry, s, h)
    to the same address on the dst side. Geometry: [num_slots, page_size,
    stride_page, stride_in_page, stride_piece] in bytes. Slot tensors: 1-D
    int32/int64, any stride. `max_ctas`: CUDA/SYCL grid cap, 0 = default.
    When all tensors are host tensors the CPU kernel runs; otherwise the
    device of the first device tensor (dst, src, slots) runs it, and host
    tensors must be pinned. `status` defaults to that device's status tensor.
    `validate`: a device backend copies the slots to the host (a sync) and
    raises on an out-of-range or repeated destination slot before launching
    (the CPU always does).
    """
    if status is None:
        status = status_tensor(_launch_device([*dst, *src, src_slots, dst_slots]))
    torch.ops.kvlayout.copy_rows(
        list(src), list(dst), src_slots, dst_slots, int(num_tokens), int(skip_prefix),
        list(src_segments), list(dst_segments), list(src_geometry), list(dst_geometry),
        int(num_pieces), int(piece_bytes), int(max_ctas), status, bool(validate),
    )


def copy_runs(src, dst, src_slots, dst_slots, num_tokens, skip_prefix, src_segments, dst_segments,
              src_geometry, dst_geometry, num_pieces, piece_bytes) -> None:
    """:func:`copy_rows` done by the copy engine (torch.ops.kvlayout.copy_runs).

    Same arguments and rule, no CTA budget and no status: the slots must be
    CPU tensors (the host reads them, raises on an out-of-range slot before
    anything is copied, and issues one memory copy per contiguous block).  On
    CUDA it uses no SMs and cannot be captured in a CUDA graph.
    """
    torch.ops.kvlayout.copy_runs(
        list(src), list(dst), src_slots, dst_slots, int(num_tokens), int(skip_prefix),
        list(src_segments), list(dst_segments), list(src_geometry), list(dst_geometry),
        int(num_pieces), int(piece_bytes),
    )


def rope_reposition(
    key: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    max_ctas: int = 0,
    status: Optional[torch.Tensor] = None,
) -> None:
    """Rotate cached keys [T, H, D] in place from old to new RoPE positions.

    cos_sin_cache is [max_pos, rot_dim] (cos then sin halves); pairs are NeoX
    (i, i + rot_dim/2) or GPT-J (2i, 2i+1); math in fp32. Tokens with a
    negative position are untouched.
    """
    if status is None:
        status = status_tensor(key.device)
    torch.ops.kvlayout.rope_reposition(
        key, old_positions, new_positions, cos_sin_cache, bool(is_neox), int(max_ctas), status
    )
