"""RoPE key repositioning (LMCache CacheBlend ``rotary_embedding_k_fused``).

Keys cached at positions ``old`` are moved to positions ``new``: undo the
rotation by the old angle, apply the new one.  The only numeric operation of
kvlayout; math in fp32, compared with a tolerance.
"""

from __future__ import annotations

import einops
import jax.numpy as jnp
import numpy as np

from . import semantics as rules
from .operations import concrete

# The two pairings differ only in where the halves of a rotary pair sit:
# NeoX pairs (i, i + rot/2), GPT-J pairs (2i, 2i + 1).
PAIRING = {True: "t h (two i) -> two t h i", False: "t h (i two) -> two t h i"}


def rope_reposition(keys, old_positions, new_positions, cos_sin_cache, *, is_neox: bool) -> jnp.ndarray:
    """Rotate keys ``[T, H, D]`` from ``old_positions [T]`` to ``new_positions [T]``.

    ``cos_sin_cache [max_pos, rot]``: cos in columns ``[0, rot/2)``, sin in
    ``[rot/2, rot)``.  For each rotary pair ``(x, y)`` with (co, so) at the old
    and (cn, sn) at the new position:

        x' = x*co + y*so,   y' = y*co - x*so      (undo old)
        x" = x'*cn - y'*sn, y" = y'*cn + x'*sn    (apply new)

    Dimensions ``>= rot`` are unchanged.  A token with a negative position is
    unchanged (rule ``negative_slot``); a position ``>= max_pos`` breaks rule
    ``position_out_of_range``.  Result in the keys' dtype (fp32 math, rounded
    once).
    """
    keys = jnp.asarray(keys)
    old_positions, new_positions = jnp.asarray(old_positions), jnp.asarray(new_positions)
    if keys.dtype not in (jnp.float32, jnp.float16, jnp.bfloat16):
        rules.ELEMENT_TYPE.fail(f"keys must be float32, float16 or bfloat16, got {keys.dtype}")
    if keys.ndim != 3:
        rules.ROPE_GEOMETRY.fail(f"keys must be [T, H, D], got shape {keys.shape}")
    if jnp.ndim(cos_sin_cache) != 2:
        rules.ROPE_GEOMETRY.fail(f"cos_sin_cache must be [max_pos, rot], got shape {jnp.shape(cos_sin_cache)}")
    cache = jnp.asarray(cos_sin_cache, jnp.float32)
    max_pos, rot = cache.shape
    if rot % 2 or rot > keys.shape[-1]:
        rules.ROPE_GEOMETRY.fail(f"cos_sin_cache must be [max_pos, rot] with rot even and <= {keys.shape[-1]}: "
                                 f"rotary dim {rot}")
    for name, pos in (("old_positions", old_positions), ("new_positions", new_positions)):
        if not jnp.issubdtype(pos.dtype, jnp.integer):
            rules.INDEX_DTYPE.fail(f"{name} must be int32/int64, got {pos.dtype}")
        if pos.shape != keys.shape[:1]:
            rules.INDEX_SHAPE.fail(f"{name} has shape {pos.shape}, expected ({keys.shape[0]},)")
        values = concrete(pos)  # None under jit: no check there
        if values is not None and values.size and values.max() >= max_pos:
            i = int(np.argmax(values >= max_pos))
            rules.POSITION_OUT_OF_RANGE.fail(f"{name}[{i}] = {int(values[i])} is out of range: cos_sin_cache "
                                             f"holds {max_pos} positions")

    valid = (old_positions >= 0) & (new_positions >= 0)
    cos, sin = jnp.split(cache, 2, axis=1)                          # [max_pos, rot/2] each

    def angle(pos):
        p = jnp.where(valid, pos, 0)
        return cos[p][:, None, :], sin[p][:, None, :]                # [T, 1, rot/2]

    (co, so), (cn, sn) = angle(old_positions), angle(new_positions)
    pattern = PAIRING[is_neox]
    x, y = einops.rearrange(keys[..., :rot].astype(jnp.float32), pattern, two=2)
    x1, y1 = x * co + y * so, y * co - x * so
    x2, y2 = x1 * cn - y1 * sn, y1 * cn + x1 * sn
    inverse = pattern.split(" -> ")[1] + " -> " + pattern.split(" -> ")[0]
    rotated = einops.rearrange(jnp.stack([x2, y2]), inverse, two=2).astype(keys.dtype)
    out = keys.at[..., :rot].set(rotated)
    return jnp.where(valid[:, None, None], out, keys)
