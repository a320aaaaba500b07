"""What every operation family shares: the family record, error inputs as data, device helpers.

A *sample* is a small frozen dataclass (layouts, geometry, dtype, slots as
tuples, seeds) whose ``repr`` rebuilds it: ``kvlayout conformance --replay
'<repr>'`` runs exactly that case again.  Every sample class has

* ``family`` - the name of the family it belongs to;
* ``group()`` - the row of the report it counts in (a layout family such as
  ``vllm->hicache``, or an error kind);
* ``describe()`` - one line for people;
* ``run(device)`` - builds the tensors on ``device`` from numpy (random bytes
  for sources, sentinel or random bytes for destinations), runs the op,
  runs the reference on the same initial content, and compares every output
  tensor in full as unsigned integers (so rows that must stay untouched are
  checked too); raises ``AssertionError`` (or the op's unexpected exception)
  on a mismatch.

An :class:`OpFamily` names its sample strategy, its reference operation and
its error kinds; :class:`ErrorKind` is one class of invalid argument as data
(the exception type and a regex the message must match).
"""

from __future__ import annotations

import collections
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the reference runs on the host CPU

import dataclasses
import re
from typing import Callable, Sequence

import numpy as np
import torch

from kvlayout import ops
from kvlayout.reference.layouts import Geometry, get

from .. import strategies as S

# ---------------------------------------------------------------------------------------
# numpy <-> torch, bit for bit
# ---------------------------------------------------------------------------------------

# Same-size signed integers: torch.from_numpy knows every one of them (it knows no ml_dtypes type).
_INT_OF_SIZE = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor(array, device: str = "cpu", *, pin: bool = False) -> torch.Tensor:
    """A torch copy of a numpy array (ml_dtypes included), bit for bit; pinned host memory with ``pin``."""
    a = np.ascontiguousarray(array)
    t = torch.from_numpy(a.view(_INT_OF_SIZE[a.dtype.itemsize]).copy())
    t = t.view(getattr(torch, a.dtype.name))
    return t.pin_memory() if pin else t.to(device)


def to_torch(layout, physical, device: str = "cpu", *, pin: bool = False):
    """A numpy physical cache (the reference's convention) as torch tensors of the same structure."""
    layout = get(layout)
    parts = (physical,) if layout.single_part else tuple(physical)
    out = [[tensor(x, device, pin=pin) for x in value] if part.per_layer else tensor(value, device, pin=pin)
           for part, value in zip(layout.parts, parts)]
    return out[0] if layout.single_part else tuple(out)


def bind(layout, physical, geom: Geometry, device: str = "cpu", *, pin: bool = False):
    """``ops.bind`` of a torch copy of a numpy physical cache (``page_size`` where shapes cannot tell it)."""
    page_size = None if get(layout).paged else geom.BS
    return ops.bind(layout, to_torch(layout, physical, device, pin=pin), page_size=page_size)


STRIDE_FILLER = 2**30 - 3
"""What sits between the slots of a strided slot tensor: out of range for every cache a sample draws, so a
kernel that read it instead of the slot would fail the comparison or raise."""


def slots(values, dtype="int64", device: str = "cpu", *, pin: bool = False,
          strided: bool = False) -> torch.Tensor | None:
    """A slot (or position) tensor of ``dtype`` (a torch dtype or its name); ``None`` stays ``None``.

    ``strided``: every other element of a tensor twice as long (a view with
    stride 2), :data:`STRIDE_FILLER` between the slots.
    """
    if values is None:
        return None
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    flat = np.asarray(values, np.int64).reshape(-1)
    if strided:
        flat = np.stack([flat, np.full_like(flat, STRIDE_FILLER)], axis=1).reshape(-1)
    t = torch.as_tensor(flat, dtype=dtype)
    t = t.pin_memory() if pin else t.to(device)
    return t[::2] if strided else t


def bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's elements as unsigned integers of its element size, on the host."""
    t = t.detach().cpu().contiguous()
    return t.view(_TORCH_INT_OF_SIZE[t.element_size()]).numpy().view(f"u{t.element_size()}")


def random_array(shape, dtype: str, rng) -> np.ndarray:
    """An array of random bytes (NaN and Inf patterns included); ``rng`` is a Generator or a seed."""
    dt = S.numpy_dtype(dtype)
    raw = np.random.default_rng(rng).integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def rows_geometry(P: int, L: int, T: int, H: int, E: int) -> Geometry:
    """Geometry of a ``rows`` buffer ``[P, L, T, H, E]``."""
    return Geometry(P=P, L=L, NB=T, BS=1, H=H, E=E)


def flat(layout, physical) -> list:
    """Every array (or tensor) of a physical value, part by part and layer by layer, as given."""
    layout = get(layout)
    parts = (physical,) if layout.single_part else tuple(physical)
    return [x for part, value in zip(layout.parts, parts) for x in (value if part.per_layer else [value])]


def sync(device: str) -> None:
    """Wait for the device and raise what its kernels recorded (nothing to do on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        ops.check_errors(device)


def clear_errors(device: str) -> None:
    """Drop an error a previous case left recorded on ``device`` (so it is not blamed on the next one)."""
    if torch.device(device).type != "cpu":
        try:
            ops.check_errors(device)
        except IndexError:
            pass


# ---------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------

def assert_same(got, want, what: str = "tensor") -> None:
    """Every tensor of ``got`` holds exactly the bytes of the matching array of ``want``.

    ``got``: a tensor or a sequence of tensors; ``want``: numpy/jax arrays
    (same nesting).  Compared as unsigned integers: NaN payloads count.
    """
    got = list(got) if isinstance(got, (list, tuple)) else [got]
    want = [np.asarray(w) for w in (want if isinstance(want, (list, tuple)) else [want])]
    assert len(got) == len(want), f"{what}: {len(got)} tensors, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert tuple(g.shape) == w.shape, f"{what} {i}: shape {tuple(g.shape)}, expected {w.shape}"
        gb, wb = bits(g), S.bits(w)
        wrong = np.argwhere(gb != wb)
        if wrong.size:
            first = tuple(int(v) for v in wrong[0])
            raise AssertionError(
                f"{what} {i} (shape {w.shape}): {len(wrong)} of {w.size} elements differ; first at {list(first)}: "
                f"got 0x{int(gb[first]):x}, expected 0x{int(wb[first]):x}")


def snapshot(tensors) -> list[np.ndarray]:
    """Host copies of the bits of every tensor."""
    return [bits(t).copy() for t in tensors]


def assert_unchanged(tensors, before: list[np.ndarray], what: str = "destination") -> None:
    """Every tensor still holds the bits :func:`snapshot` recorded."""
    for i, (t, b) in enumerate(zip(tensors, before)):
        changed = int((bits(t) != b).sum())
        assert changed == 0, f"{what} {i}: {changed} elements changed although the call was rejected"


REFUSALS: collections.Counter = collections.Counter()
"""Refusals :func:`expect_raises` saw in this process: ``named`` (the message named the argument: matched its
pattern), ``unnamed`` (the expected type, but a message that does not name it), ``missing`` (nothing or
something else was raised).  The runner reports them per run (``--fuzz-report``)."""


def expect_raises(fn: Callable, exc, regex: str) -> BaseException:
    """Call ``fn``; it must raise ``exc`` (a type or a tuple) whose message matches ``regex``."""
    names = exc.__name__ if isinstance(exc, type) else "/".join(e.__name__ for e in exc)
    try:
        fn()
    except exc as e:  # noqa: PERF203
        named = re.search(regex, str(e)) is not None
        REFUSALS["named" if named else "unnamed"] += 1
        assert named, f"{type(e).__name__} does not match {regex!r}: {e}"
        return e
    except Exception as e:
        REFUSALS["missing"] += 1
        raise AssertionError(f"expected {names}, got {type(e).__name__}: {e}") from None
    REFUSALS["missing"] += 1
    raise AssertionError(f"expected {names} matching {regex!r}; nothing was raised")


# ---------------------------------------------------------------------------------------
# The reference under jax.jit
# ---------------------------------------------------------------------------------------

class JittedReference:
    """``kvlayout.reference`` operations, each call compiled as one XLA program.

    Run op by op, the reference compiles every jnp primitive for every new
    shape (tens of milliseconds each, some fifteen per transfer); generated
    cases rarely repeat a shape, so most of a case's time went there.  Here
    each call is ``jax.jit`` of the same reference function: arrays (numpy or
    jax, at any depth of the arguments) are traced, every other argument
    (layout names, geometries, layer and plane lists, ``skip_prefix``,
    ``is_neox``) is static.  The values are the reference's (byte moves copy
    bits either way; RoPE may differ by the FMA contractions its tolerance
    allows).  What jit leaves out is the reference's check of slot values
    (not known while tracing), so only valid slots may be given: the
    reference's own errors are tested eagerly in ``tests/test_reference.py``.
    The page helpers compute element masks from concrete values, so they are
    called eagerly (:data:`EAGER`).
    """

    EAGER = frozenset({"get_page", "set_page", "zero_page", "page_spans", "skip_prefix"})
    _ARRAY = object()
    _KEEP = 512          # compiled calls kept; cases rarely repeat a shape, so older ones are dropped

    def __init__(self):
        self._compiled: dict = {}

    def __getattr__(self, name):
        import jax

        from kvlayout import reference as R

        fn = getattr(R, name)
        if name in self.EAGER:
            return fn

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


reference = JittedReference()
"""``reference.transfer(...)`` etc.: the spec's operation under ``jax.jit`` (see :class:`JittedReference`)."""


# ---------------------------------------------------------------------------------------
# Families and error inputs
# ---------------------------------------------------------------------------------------

def slot_out_of_range_message(arg: str) -> str:
    """The message of an out-of-range slot: the argument, and the token, value and bound of :attr:`Invalid.values`."""
    return arg + r"\[{token}\] = {value} is out of range: the \w+ holds {bound} slots"


def index_out_of_range_message(arg: str) -> str:
    """The message of an out-of-range layer or plane: the argument, its value and the count."""
    return arg + r" contains {value}, out of range: there are {count}"


DTYPES_DIFFER = r"dtypes differ: source {src}, destination {dst}"
ROW_WIDTHS_DIFFER = r"row widths differ: source H\*E = {src}, destination H\*E = {dst}"
REPEATED_DESTINATION = r"dst_slots repeats slot \d+ \(dst_slots\[\d+\] and dst_slots\[\d+\]\)"


@dataclasses.dataclass(frozen=True)
class ErrorKind:
    """One class of invalid argument, as data.

    ``rule``: the decided rule it breaks (a name of
    ``kvlayout.reference.semantics.RULES``), which gives the one exception
    type every path raises (:attr:`error_type`).  ``build(sample, device,
    validate)`` makes the invalid call from a
    :class:`~kvlayout.conformance.families.errors.BadInputSample` and returns
    an :class:`Invalid`; the call must raise ``error_type`` with a message
    matching ``error_regex`` (which names the argument) and leave every
    tensor of ``Invalid.keep`` as it was; fields of ``error_regex``
    (``{value}``) are filled with what the built :class:`Invalid` says the
    message must state (:meth:`regex`).  ``deferrable``: on CUDA the
    default path does not check the value on the host; the kernel skips the
    bad token and ``ops.check_errors()`` raises (``Invalid.deferred`` then
    says what the destination must hold).  ``devices``: where the kind
    applies (``None`` = every device).
    """

    name: str
    rule: str
    error_regex: str
    build: Callable
    deferrable: bool = False
    devices: tuple[str, ...] | None = None

    @property
    def error_type(self) -> type[Exception]:
        from kvlayout.reference import semantics

        return semantics.get(self.rule).error

    @property
    def family(self) -> str:
        return self.name.split(":")[0]

    def regex(self, invalid: "Invalid") -> str:
        """``error_regex`` with the fields of ``invalid.values`` filled in (as literal text)."""
        return self.error_regex.format(**{k: re.escape(str(v)) for k, v in invalid.values.items()})

    def applies_to(self, device: str) -> bool:
        return self.devices is None or torch.device(device).type in self.devices


@dataclasses.dataclass
class Invalid:
    """An invalid call built on a device: what to call, what must not change, what a deferred error leaves.

    ``keep``: ``(tensors, expected arrays, what)`` triples checked after the
    call is rejected.  ``deferred``: for a deferrable kind on the CUDA
    default path, a function returning ``(tensors, expected arrays)`` after
    the kernel skipped the bad token (the reference with that token's slot
    -1); it may compare by itself and return ``([], [])`` (RoPE's tolerance).
    ``values``: what the message must say (token, value, bound, ...), filled
    into the kind's ``error_regex``.
    """

    call: Callable
    keep: list[tuple[Sequence, Sequence, str]]
    deferred: Callable | None = None
    values: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ErrorInput:
    """An error input in the manner of an OpInfo: the sample, the exception type, the regex its message matches."""

    sample: object
    error_type: type
    error_regex: str


@dataclasses.dataclass(frozen=True)
class OpFamily:
    """An operation family: its samples, its reference, its error kinds.

    ``samples(device, group)``: a hypothesis strategy of samples (all of the
    family, or one group); ``groups(device)``: the groups that each get their
    own share of the examples (``None``: drawn together); ``reference``: the
    spec's operation the samples compare with (documentation: each sample's
    ``run`` calls it); ``errors``: the :class:`ErrorKind` s of the family's
    operations (run by the ``bad_input`` family).
    """

    name: str
    doc: str
    samples: Callable
    reference: str
    groups_of: Callable | None = None
    errors: tuple[ErrorKind, ...] = ()

    def groups(self, device: str):
        return self.groups_of(device) if self.groups_of else None

    # the runner's name for the sample strategy
    def strategy(self, device: str, group: str | None = None):
        return self.samples(device, group)


def pin_if(device: str, wanted: bool) -> bool:
    """Pinned host memory only where it means something: facing a CUDA device."""
    return wanted and torch.device(device).type == "cuda"


def family_of(layout: str) -> str:
    """The catalog family of a layout (``vllm``, ``sglang``, ``lmcache``, ``hicache``, ``rows``)."""
    return get(layout).family


class OnOneCache:
    """Base of the samples of one cache (a ``layout`` field): a sample's report row is the layout's catalog family."""

    def group(self) -> str:
        return family_of(self.layout)


def as_list(values):
    return None if values is None else list(values)


@dataclasses.dataclass
class BadSetup:
    """A valid transfer case bound on a device, for an error kind to spoil.

    ``src_slots``/``dst_slots`` are lists (a kind edits them before making
    tensors); ``layer_kwargs`` are the case's layer lists as ``ops.transfer``
    takes them; ``validate`` is the ``validate`` argument the call must pass.
    """

    case: object
    device: str
    src_np: object
    dst_np: object
    src: object
    dst: object
    src_slots: list
    dst_slots: list
    validate: bool | None

    @classmethod
    def of(cls, case, device: str, validate: bool | None, src_device: str | None = None) -> "BadSetup":
        src_np, dst_np = case.caches()
        return cls(case, device, src_np, dst_np, bind(case.src_layout, src_np, case.src_geom, src_device or device),
                   bind(case.dst_layout, dst_np, case.dst_geom, device), list(case.src_slots),
                   list(case.dst_slots), validate)

    @property
    def layer_kwargs(self) -> dict:
        c = self.case
        return {} if c.src_layers is None else {"src_layers": list(c.src_layers), "dst_layers": list(c.dst_layers)}

    def slot_tensors(self):
        return slots(self.src_slots, "int64", self.device), slots(self.dst_slots, "int64", self.device)

    def rebind_dst(self, dst_np, geom=None) -> None:
        """A new destination (another dtype or geometry) in place of the case's."""
        c = self.case
        self.dst_np, self.dst = dst_np, bind(c.dst_layout, dst_np, geom or c.dst_geom, self.device)

    def dst_unchanged(self) -> list:
        return [(self.dst.tensors, flat(self.case.dst_layout, self.dst_np), "destination (must not change)")]
