"""numpy <-> torch for the op-library tests.

The cases come from ``kvlayout.conformance.strategies`` as numpy physical
values (the reference's convention); these helpers turn them into torch
tensors on a device (optionally pinned host memory) and read tensors back as
unsigned bits, so every comparison is byte-exact whatever the dtype (NaN
payloads included).  ``jitted_reference`` runs the reference operations
under ``jax.jit``, one compile per call (see :class:`_Jitted`).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import torch

from kvlayout import reference as R
from kvlayout.conformance import strategies as S

# Same-size signed integer: torch.from_numpy knows every one of them.
_INT_OF_SIZE = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def examples(default: int) -> int:
    """Hypothesis examples for one test: ``default``, scaled by ``KVLAYOUT_HYPOTHESIS_EXAMPLES``.

    The variable is a multiplier (``KVLAYOUT_HYPOTHESIS_EXAMPLES=10`` runs ten
    times the default examples of every generated test).
    """
    scale = float(os.environ.get("KVLAYOUT_HYPOTHESIS_EXAMPLES", "1") or 1)
    return max(1, int(round(default * scale)))


class _Jitted:
    """``kvlayout.reference`` operations, each call compiled as one XLA program.

    Run op by op, the reference compiles every jnp primitive for every new
    shape (tens of milliseconds each, some fifteen per transfer): the op
    tests, whose generated cases rarely repeat a shape, spent most of their
    time there.  Here each call is ``jax.jit`` of the same reference function:
    arrays (numpy or jax, at any depth of the arguments) are traced, every
    other argument (layout names, geometries, layer and plane lists,
    ``skip_prefix``, ``is_neox``) is static.  The values are the reference's:
    the byte-moving operations copy bits either way, RoPE may differ by the
    FMA contractions its tolerance allows (see test_ops.py), and
    ``test_reference.py`` checks the reference eagerly against independent
    oracles, with ``test_operations_under_jit`` checking that jit and eager
    agree.  What jit leaves out is the reference's check of slot values (they
    are not known while tracing), so only valid slots may be given: the
    reference's errors are tested eagerly in ``test_reference.py``.
    """

    _ARRAY = object()
    _KEEP = 512          # compiled calls kept; cases rarely repeat a shape, so older ones are dropped

    def __init__(self):
        self._compiled: dict = {}

    def __getattr__(self, name):
        fn = getattr(R, name)

        def call(*args, **kwargs):
            leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
            is_array = [isinstance(x, (np.ndarray, jax.Array)) for x in leaves]
            static = tuple(self._ARRAY if a else x for a, x in zip(is_array, leaves))
            key = (name, tree, static, tuple(type(x) for x in static))     # 1 and True must not share
            jitted = self._compiled.get(key)
            if jitted is None:
                def run(*arrays):
                    it = iter(arrays)
                    a, k = jax.tree_util.tree_unflatten(tree, [next(it) if x is self._ARRAY else x for x in static])
                    return fn(*a, **k)
                if len(self._compiled) >= self._KEEP:
                    self._compiled.clear()
                jitted = self._compiled[key] = jax.jit(run)
            return jitted(*[x for a, x in zip(is_array, leaves) if a])

        call.__name__ = name
        return call


jitted_reference = _Jitted()
"""``jitted_reference.transfer(...)`` etc.: the reference operation under ``jax.jit`` (see :class:`_Jitted`)."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a strategies dtype name."""
    return getattr(torch, name)


def tensor(array, device="cpu", *, pin: bool = False) -> torch.Tensor:
    """A torch copy of a numpy array (any dtype, ml_dtypes included), bit for bit."""
    a = np.ascontiguousarray(array)
    t = torch.from_numpy(a.view(_INT_OF_SIZE[a.dtype.itemsize]).copy())
    t = t.view(torch_dtype(a.dtype.name))
    if pin:
        return t.pin_memory()
    return t.to(device)


def bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's elements as unsigned integers of its element size (on the host)."""
    t = t.detach().cpu().contiguous()
    return t.view(_TORCH_INT_OF_SIZE[t.element_size()]).numpy().view(f"u{t.element_size()}")


def to_torch(layout, physical, device="cpu", *, pin: bool = False):
    """A numpy physical value (reference convention) as torch tensors with the same structure."""
    layout = R.get(layout)
    parts = (physical,) if layout.single_part else tuple(physical)
    out = [[tensor(x, device, pin=pin) for x in value] if part.per_layer else tensor(value, device, pin=pin)
           for part, value in zip(layout.parts, parts)]
    return out[0] if layout.single_part else tuple(out)


def flat(layout, physical) -> list:
    """Every array/tensor of a physical value, part by part and layer by layer."""
    layout = R.get(layout)
    parts = (physical,) if layout.single_part else tuple(physical)
    return [x for part, value in zip(layout.parts, parts) for x in (value if part.per_layer else [value])]


def assert_same_bytes(got, want, what: str = "tensor") -> None:
    """``got`` (torch tensors) holds exactly the bytes of ``want`` (numpy/jax arrays), array by array."""
    got = list(got) if isinstance(got, (list, tuple)) else [got]
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    assert len(got) == len(want), f"{what}: {len(got)} tensors, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        w = np.asarray(w)
        assert tuple(g.shape) == w.shape, f"{what} {i}: shape {tuple(g.shape)}, expected {w.shape}"
        gb, wb = bits(g), S.bits(w)
        if not np.array_equal(gb, wb):
            bad = np.argwhere(gb != wb)
            raise AssertionError(f"{what} {i}: {len(bad)} of {gb.size} elements differ, first at "
                                 f"{tuple(int(v) for v in bad[0])}: got {gb[tuple(bad[0])]:#x}, "
                                 f"expected {wb[tuple(bad[0])]:#x}")


def random_array(shape, dtype: str, rng: np.random.Generator) -> np.ndarray:
    """A numpy array of random bytes (any bit pattern, NaN included) of a strategies dtype."""
    dt = S.numpy_dtype(dtype)
    return rng.integers(0, 256, int(np.prod(shape)) * dt.itemsize, dtype=np.uint8).view(dt).reshape(shape)


def slots(values, dtype=torch.int64, device="cpu", *, pin: bool = False) -> torch.Tensor | None:
    """A slot tensor (``None`` stays ``None``)."""
    if values is None:
        return None
    t = torch.as_tensor(np.asarray(values, np.int64).reshape(-1), dtype=dtype)
    return t.pin_memory() if pin else t.to(device)


def sync(device) -> None:
    """Wait for the device and raise what its kernels recorded (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        from kvlayout import ops
        ops.check_errors(device)


def snapshot(tensors) -> list[np.ndarray]:
    """Host copies of the bits of every tensor."""
    return [bits(t).copy() for t in tensors]


def assert_unchanged(tensors, before: list[np.ndarray], what: str = "destination") -> None:
    """Every tensor still holds the bits recorded by :func:`snapshot`."""
    for i, (t, b) in enumerate(zip(tensors, before)):
        assert np.array_equal(bits(t), b), f"{what} tensor {i} was written"
