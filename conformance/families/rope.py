"""The ``rope`` family: ``ops.rope_reposition``, the one numeric op, against the reference's RoPE.

Keys ``[T, H, D]`` (or the K half of packed K/V rows ``[T, H, 2, D]``, a
strided view whose V half must not change), NeoX and GPT-J pairings, fp32 /
fp16 / bf16 keys, a cos/sin cache in fp32 or the keys' dtype, positions with
negative ("leave this token") values.  :func:`assert_rope` is the one
comparison with a tolerance; every other test of RoPE uses it and
:func:`expected_keys` (the reference, ``kvlayout.reference.rope_reposition``).

Tolerance.  The kernels and the reference evaluate the same expression per
rotary pair in fp32,

    x' = x co + y so,  y' = y co - x so;   x" = x' cn - y' sn,  y" = y' cn + x' sn,

with ``|cos|, |sin| <= 1``.  Each stage rounds at most three times (two
products, one sum) and a compiler may contract a product and a sum into an
FMA, so the two fp32 results differ by at most a few units of
``2^-24 (|x| + |y|)``: well below ``1e-5 (|x| + |y|)`` (relative to the pair's
magnitude, since the output can cancel).  fp16/bf16 keys are loaded exactly
into fp32 and rounded once at the end: two fp32 values closer than one
storage ulp round to the same value or to neighbours, so the results differ
by at most one ulp of the storage type (plus the fp32 bound where the output
is tiny after cancellation).  Tokens with a negative position and dimensions
``>= rot`` must be unchanged bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import strategies as st

from kvlayout import ops

from .. import strategies as S
from .core import ErrorKind, Invalid, OpFamily, assert_same, bits, reference, slots, sync, tensor

ROPE_DTYPES = ("float32", "float16", "bfloat16")
_MANTISSA = {"float32": 23, "float16": 10, "bfloat16": 7}
_MIN_NORMAL = {"float32": 2.0 ** -126, "float16": 2.0 ** -14, "bfloat16": 2.0 ** -126}
FP32_PAIR_TOLERANCE = 1e-5
"""Allowed fp32 difference, relative to ``|x| + |y|`` of the element's rotary pair (see the module text)."""


def cos_sin_table(max_pos: int, rot: int, dtype: str = "float32", base: float = 10000.0) -> np.ndarray:
    """A ``[max_pos, rot]`` cos/sin cache: cos in columns ``[0, rot/2)``, sin in ``[rot/2, rot)``."""
    inv_freq = base ** (-np.arange(0, rot, 2, dtype=np.float64) / rot)
    angles = np.arange(max_pos, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(S.numpy_dtype(dtype))


def expected_keys(keys, old, new, cos_sin, *, is_neox: bool) -> np.ndarray:
    """The reference's rotated keys (each argument a numpy array or a tensor on any device)."""
    return np.asarray(reference.rope_reposition(*(_host(x) for x in (keys, old, new, cos_sin)), is_neox=is_neox))


def _host(x) -> np.ndarray:
    """A tensor as numpy of the same dtype (bf16 through ml_dtypes), bit for bit; arrays as they are."""
    if not isinstance(x, torch.Tensor):
        return np.asarray(x)
    return bits(x).view(S.numpy_dtype(str(x.dtype).removeprefix("torch."))).reshape(tuple(x.shape))


def _ulp(x: np.ndarray, dtype: str) -> np.ndarray:
    x = np.maximum(np.abs(x), _MIN_NORMAL[dtype])
    return np.exp2(np.floor(np.log2(x)) - _MANTISSA[dtype])


def assert_rope(got: torch.Tensor, want, keys_in, old, new, *, rot: int, is_neox: bool) -> None:
    """RoPE output ``got [T, H, D]`` against the reference's ``want``, from the keys ``keys_in``.

    Rotary dims within the tolerance of the module text; dims ``>= rot`` and
    tokens with a negative position bit for bit equal to ``keys_in``.
    """
    keys_in = _host(keys_in)
    dtype = keys_in.dtype.name
    got_f = got.detach().cpu().float().numpy().astype(np.float64)
    want_f = np.asarray(want).astype(np.float64)
    x_in = np.abs(keys_in.astype(np.float64))
    half = rot // 2
    if is_neox:   # magnitude |x| + |y| of each element's rotary pair
        pair = x_in[..., :half] + x_in[..., half:rot]
        mag = np.concatenate([pair, pair], axis=-1)
    else:
        pair = x_in[..., 0:rot:2] + x_in[..., 1:rot:2]
        mag = np.repeat(pair, 2, axis=-1)
    tol = FP32_PAIR_TOLERANCE * mag
    if dtype != "float32":
        tol = tol + _ulp(np.maximum(np.abs(got_f[..., :rot]), np.abs(want_f[..., :rot])), dtype)
    err = np.abs(got_f[..., :rot] - want_f[..., :rot])
    bad = ~(err <= tol)
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise AssertionError(f"keys: {int(bad.sum())} rotated elements outside the tolerance; first at {list(i)}: "
                             f"got {got_f[i]!r}, expected {want_f[i]!r} (tolerance {tol[i]:.3g})")
    got_bits, in_bits = bits(got), S.bits(keys_in)
    changed = np.argwhere(got_bits[..., rot:] != in_bits[..., rot:])
    assert not changed.size, f"keys: dims >= rot changed, first at {changed[0].tolist()}"
    skipped = (np.asarray(old) < 0) | (np.asarray(new) < 0)
    changed = np.argwhere(got_bits[skipped] != in_bits[skipped])
    assert not changed.size, f"keys: a token with a negative position changed, first at {changed[0].tolist()}"


@dataclasses.dataclass(frozen=True)
class RopeSample:
    """``ops.rope_reposition`` on keys ``[T, H, D]`` (``packed``: the K half of ``[T, H, 2, D]``)."""

    T: int
    H: int
    D: int
    rot: int
    max_pos: int
    dtype: str
    cache_dtype: str
    is_neox: bool
    old: tuple[int, ...]
    new: tuple[int, ...]
    packed: bool = False
    seed: int = 0
    position_dtype: str = "int64"
    family = "rope"

    def group(self) -> str:
        return ("neox" if self.is_neox else "gptj") + (" packed" if self.packed else "")

    def describe(self) -> str:
        return (f"rope {'NeoX' if self.is_neox else 'GPT-J'} keys [{self.T}, {self.H}, {self.D}] {self.dtype} "
                f"rot={self.rot} max_pos={self.max_pos} cache {self.cache_dtype}{' packed' if self.packed else ''}")

    def run(self, device: str) -> None:
        shape = (self.T, self.H, 2, self.D) if self.packed else (self.T, self.H, self.D)
        rng = np.random.default_rng(self.seed)
        buf_np = rng.standard_normal(shape).astype(np.float32).astype(S.numpy_dtype(self.dtype))
        keys_np = np.ascontiguousarray(buf_np[:, :, 0] if self.packed else buf_np)
        table = cos_sin_table(self.max_pos, self.rot, self.cache_dtype)
        buf = tensor(buf_np, device)
        keys = buf[:, :, 0] if self.packed else buf
        out = ops.rope_reposition(keys, slots(self.old, self.position_dtype, device),
                                  slots(self.new, self.position_dtype, device), tensor(table, device),
                                  is_neox=self.is_neox)
        sync(device)
        assert out is keys, "rope_reposition must return keys"
        want = expected_keys(keys_np, np.array(self.old, np.int64), np.array(self.new, np.int64), table,
                             is_neox=self.is_neox)
        assert_rope(keys, want, keys_np, self.old, self.new, rot=self.rot, is_neox=self.is_neox)
        if self.packed:
            assert_same(buf[:, :, 1].contiguous(), buf_np[:, :, 1], "V half (must not change)")


@st.composite
def rope_samples(draw, device: str, group: str | None = None):
    is_neox = draw(st.booleans()) if group is None else group.startswith("neox")
    packed = draw(st.booleans()) if group is None else group.endswith("packed")
    T = draw(st.integers(0, 32))
    D = draw(st.sampled_from((2, 4, 8, 16, 32, 64, 80, 128)))
    max_pos = draw(st.integers(1, 4096))
    dtype = draw(st.sampled_from(ROPE_DTYPES))
    position = st.one_of(st.integers(0, max_pos - 1), st.integers(0, max_pos - 1),
                         st.sampled_from((-1, -2, -(2**31), -(2**62))))
    position_dtype = draw(st.sampled_from(("int64", "int32")))
    if position_dtype == "int32":
        position = position.filter(lambda p: p >= -(2**31))
    return RopeSample(T, draw(st.integers(1, 8)), D, draw(st.sampled_from(sorted({D, max(2, D // 2), 2}))), max_pos,
                      dtype, draw(st.sampled_from(("float32", dtype))), is_neox,
                      tuple(draw(st.lists(position, min_size=T, max_size=T))),
                      tuple(draw(st.lists(position, min_size=T, max_size=T))), packed,
                      draw(st.integers(0, 2**32 - 1)), position_dtype)


ROPE = OpFamily("rope", "ops.rope_reposition, NeoX and GPT-J, packed K/V views", rope_samples, "rope_reposition")
SAMPLES = (RopeSample,)


# ---------------------------------------------------------------------------------------
# Error inputs, as data: keys [T, 2, 8] fp32, a cache of 16 positions of rot 8, old = 0..T-1, new reversed
# ---------------------------------------------------------------------------------------

ERROR_MAX_POS, ERROR_ROT = 16, 8


def _rope_call(edit):
    """``edit(args, sample)`` spoils one argument of a valid call and returns what the message must say;
    ``args`` holds keys, old, new (lists, or tensors as given) and cos_sin (numpy)."""
    def build(b, device, validate):
        T = max(1, min(b.case.T, 8))
        keys_np = np.random.default_rng(3).standard_normal((T, 2, 8)).astype(np.float32)
        original = tensor(keys_np, device)
        args = {"keys": original, "old": list(range(T)), "new": [T - 1 - i for i in range(T)],
                "cos_sin": cos_sin_table(ERROR_MAX_POS, ERROR_ROT)}
        values = edit(args, b) or {}
        keys = args["keys"]
        old, new = (x if isinstance(x, torch.Tensor) else slots(x, "int64", device) for x in (args["old"], args["new"]))
        cos_sin = args["cos_sin"] if isinstance(args["cos_sin"], torch.Tensor) else tensor(args["cos_sin"], device)

        def call():
            ops.rope_reposition(keys, old, new, cos_sin, is_neox=b.token % 2 == 0)

        def deferred():
            o, n = np.array(args["old"]), np.array(args["new"])
            bad = (o >= ERROR_MAX_POS) | (n >= ERROR_MAX_POS)
            o[bad] = n[bad] = -1
            want = expected_keys(keys_np, o, n, args["cos_sin"], is_neox=b.token % 2 == 0)
            assert_rope(keys, want, keys_np, o, n, rot=ERROR_ROT, is_neox=b.token % 2 == 0)
            return [], []     # compared within the tolerance above

        unchanged = [([keys], [keys_np], "keys (must not change)")] if keys is original else []
        return Invalid(call, unchanged, deferred, values=values)
    return build


def _position_out_of_range(name: str):
    def edit(args, b):
        token = b.token % len(args[name])
        args[name][token] = ERROR_MAX_POS + b.offset
        return {"token": token, "value": ERROR_MAX_POS + b.offset, "bound": ERROR_MAX_POS}
    return edit


def _positions_as(name: str, dtype: str = "int64", shape=None):
    """Positions ``name`` of element type ``dtype`` (and, with ``shape``, that shape)."""
    def edit(args, b):
        pos = torch.tensor(args[name], device=args["keys"].device).to(getattr(torch, dtype))
        args[name] = pos if shape is None else pos.view(*shape, -1)
        return {"T": len(pos)}
    return edit


def _keys_as(edit_keys):
    def edit(args, b):
        args["keys"] = edit_keys(args["keys"])
        return {"T": args["keys"].shape[0], "shape": tuple(args["keys"].shape)}
    return edit


def _strided_keys(args, b):
    """Keys whose last dimension is strided (a transposed view), with a cache that fits them."""
    args["keys"] = args["keys"].transpose(1, 2)[:, :2]
    args["cos_sin"] = cos_sin_table(ERROR_MAX_POS, 2)


def _cos_sin_as(table):
    def edit(args, b):
        args["cos_sin"] = table(args)
    return edit


COS_SIN_SHAPE_MESSAGE = r"cos_sin_cache must be \[max_pos, rot\] with rot even and <= 8"
POSITIONS_MESSAGE = r"{name} must be int32/int64 of shape \({T},\)"

ROPE = dataclasses.replace(ROPE, errors=(
    *(ErrorKind(f"rope: {name}_positions out of range", "position_out_of_range",
                name + r"_positions\[{token}\] = {value} is out of range: cos_sin_cache holds {bound} positions",
                _rope_call(_position_out_of_range(name)), deferrable=True) for name in ("old", "new")),
    *(ErrorKind(f"rope: {name}_positions of {dtype}", "index_dtype",
                POSITIONS_MESSAGE.replace("{name}", name + "_positions"), _rope_call(_positions_as(name, dtype)))
      for name in ("old", "new") for dtype in ("float32", "int16")),
    *(ErrorKind(f"rope: {name}_positions not 1-D", "index_shape",
                POSITIONS_MESSAGE.replace("{name}", name + "_positions"), _rope_call(_positions_as(name, shape=(1,))))
      for name in ("old", "new")),
    *(ErrorKind(f"rope: {name}_positions of the wrong length", "index_shape",
                POSITIONS_MESSAGE.replace("{name}", name + "_positions").replace("{T}", r"\d+"),
                _rope_call(lambda args, b, name=name: args[name].append(0))) for name in ("old", "new")),
    ErrorKind("rope: keys not floating point", "element_type",
              r"keys must be float32, float16 or bfloat16, got torch\.int32",
              _rope_call(_keys_as(lambda k: torch.zeros(tuple(k.shape), dtype=torch.int32, device=k.device)))),
    ErrorKind("rope: keys not [T, H, D]", "rope_geometry", r"keys must be \[T, H, D\], got shape {shape}",
              _rope_call(_keys_as(lambda k: k.view(k.shape[0], -1)))),
    ErrorKind("rope: keys' last dimension strided", "rope_geometry", r"key's last dimension must be contiguous",
              _rope_call(_strided_keys)),
    ErrorKind("rope: rotary dim larger than the head", "rope_geometry", COS_SIN_SHAPE_MESSAGE + r", got \(16, 10\)",
              _rope_call(_cos_sin_as(lambda args: cos_sin_table(ERROR_MAX_POS, 10)))),
    ErrorKind("rope: odd rotary dim", "rope_geometry", COS_SIN_SHAPE_MESSAGE,
              _rope_call(_cos_sin_as(lambda args: np.zeros((ERROR_MAX_POS, 7), np.float32)))),
    ErrorKind("rope: cos_sin_cache 3-D", "rope_geometry", COS_SIN_SHAPE_MESSAGE,
              _rope_call(_cos_sin_as(lambda args: np.zeros((2, ERROR_MAX_POS, ERROR_ROT), np.float32)))),
    ErrorKind("rope: cos_sin_cache 1-D", "rope_geometry", COS_SIN_SHAPE_MESSAGE,
              _rope_call(_cos_sin_as(lambda args: np.zeros((ERROR_MAX_POS,), np.float32)))),
    ErrorKind("rope: cos_sin_cache of another dtype", "element_type",
              r"cos_sin_cache must be float32 or the key's dtype",
              _rope_call(_cos_sin_as(lambda args: cos_sin_table(ERROR_MAX_POS, ERROR_ROT, "float16")))),
))
