"""RoPE key repositioning on torch tensors (same rule as ``reference.rope``)."""

from __future__ import annotations

import torch

from kvlayout.reference import semantics as rules

from . import _native
from .views import as_int

ROPE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rope_reposition(keys: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
                    cos_sin_cache: torch.Tensor, *, is_neox: bool, max_ctas: int = 0) -> torch.Tensor:
    """Rotate keys ``[T, H, D]`` in place from ``old_positions`` to ``new_positions`` ``[T]``.

    ``cos_sin_cache [max_pos, rot]`` (cos then sin halves).  NeoX pairs
    ``(i, i + rot/2)``, GPT-J ``(2i, 2i + 1)``; fp32 math; dims ``>= rot`` and
    tokens with a negative position are unchanged.  ``keys`` may be a strided
    view (the K half of a packed K/V row) as long as its last dim is
    contiguous.  Returns ``keys``.
    """
    max_ctas = as_int("max_ctas", max_ctas, lo=0, hi=2 ** 31 - 1)
    if keys.dtype not in ROPE_DTYPES:
        rules.ELEMENT_TYPE.fail(f"keys must be float32, float16 or bfloat16, got {keys.dtype}")
    if keys.dim() != 3:
        rules.ROPE_GEOMETRY.fail(f"keys must be [T, H, D], got shape {tuple(keys.shape)}")
    for name, pos in (("old_positions", old_positions), ("new_positions", new_positions)):
        if pos.dtype not in (torch.int32, torch.int64):
            rules.INDEX_DTYPE.fail(f"{name} must be int32/int64 of shape ({keys.shape[0]},), "
                                   f"got {pos.dtype} {tuple(pos.shape)}")
        if pos.dim() != 1 or pos.shape[0] != keys.shape[0]:
            rules.INDEX_SHAPE.fail(f"{name} must be int32/int64 of shape ({keys.shape[0]},), "
                                   f"got {pos.dtype} {tuple(pos.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] % 2 or cos_sin_cache.shape[1] > keys.shape[2]:
        rules.ROPE_GEOMETRY.fail(f"cos_sin_cache must be [max_pos, rot] with rot even and <= {keys.shape[2]}, "
                                 f"got {tuple(cos_sin_cache.shape)}")
    _native.rope_reposition(keys, old_positions, new_positions, cos_sin_cache, is_neox, max_ctas,
                            _native.status_tensor(keys.device))
    return keys
