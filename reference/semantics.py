"""The decided semantics: every rule the engines leave open, stated once, as data.

Each rule is a named ``Rule``: a statement (what the specification
says) and, for a rule that refuses an input, the one exception type every
path raises for it - the reference, the torch ops on every device and the
compat layer alike.  Nothing else states these rules:

* the reference's own checks raise through the rule
  (``SLOT_OUT_OF_RANGE.fail(message)``), so the type the spec names is the
  type the oracle raises;
* ``kvlayout spec`` renders ``RULES`` as the "Decided semantics" section
  of ``docs/spec.md``;
* the conformance families and the tests cite rules by name
  (``tests/test_semantics.py`` checks, rule by rule, that the reference and
  the CPU op raise the stated type for a sample bad input and agree on the
  behaviour rules).

Where the ops' native code already raises a typed error (``IndexError`` for
an index out of range, ``ValueError`` for a refused value), that type is the
rule's.  Like an enum of indexing modes, a rule is referred to by name and
never restated in prose elsewhere.

This module imports nothing heavy: the op library reads it without jax.
"""

from __future__ import annotations

import dataclasses
from typing import NoReturn


@dataclasses.dataclass(frozen=True)
class Rule:
    """One decided rule.

    ``name``: how code, tests and documents cite it.  ``statement``: the rule
    as the specification states it (Markdown).  ``error``: the exception type
    raised on every path when an input breaks the rule; ``None`` for a rule
    that defines behaviour rather than refusing input.  ``ops_only``: the rule
    concerns torch tensors (memory, devices, autograd), which the reference's
    array values do not have.
    """

    name: str
    statement: str
    error: type[Exception] | None = None
    ops_only: bool = False

    def fail(self, message: str) -> NoReturn:
        """Raise this rule's exception with ``message`` (the message names the argument, value and bound)."""
        if self.error is None:
            raise TypeError(f"rule {self.name!r} defines behaviour; it has no exception to raise")
        raise self.error(message)


RULES: dict[str, Rule] = {}
"""Every rule by name, in the order the specification lists them."""


def _rule(name: str, statement: str, error: type[Exception] | None = None, *, ops_only: bool = False) -> Rule:
    if name in RULES:
        raise ValueError(f"rule {name!r} is stated twice")
    rule = RULES[name] = Rule(name, " ".join(statement.split()), error, ops_only)
    return rule


def get(name: str) -> Rule:
    """A rule by name."""
    try:
        return RULES[name]
    except KeyError:
        raise KeyError(f"unknown rule {name!r}; known: {', '.join(RULES)}") from None


# ---- behaviour ---------------------------------------------------------------------------

ROWS = _rule("rows", """
    Every operation moves whole rows: the `H * E` elements of one (plane, layer, slot). Source and
    destination need the same row width and element size, not the same head split.""")

NEGATIVE_SLOT = _rule("negative_slot", """
    A negative slot (or RoPE position) means "no token here": nothing is read or written for that token,
    whatever its magnitude. (Array libraries wrap `-1` to the last row; the reference drops negatives
    explicitly.)""")

EMPTY = _rule("empty", """
    A transfer with no tokens, no layers or no planes is a no-op.""")

BYTE_EXACT = _rule("byte_exact", """
    Copies are bit for bit and dtype-agnostic (bf16, fp16, fp32, fp8 stored as fp8 or uint8, int8), NaN
    payloads included: the reference rearranges the unsigned integers of the element size. The only numeric
    operation, RoPE repositioning, is compared with a tolerance.""")

SKIP_PREFIX = _rule("skip_prefix", """
    `skip_prefix = n`: the first `n` tokens are neither read nor written and chunk positions stay absolute
    (token `t` still pairs with chunk position `t`). `n` outside `[0, T]` is refused.""", ValueError)

MOVE_OVERLAP = _rule("move_overlap", """
    `move` reads the cache as it was before the move, so overlapping sources and destinations (shifts,
    swaps, chains) are well defined at any size.""")

# ---- refused input -------------------------------------------------------------------------

SLOT_OUT_OF_RANGE = _rule("slot_out_of_range", """
    A slot `>=` the cache's slot count is an error, never an out-of-bounds access: the message names the
    argument, the token, the value and the bound (e.g. `dst_slots[3] = 99 is out of range: the destination
    holds 64 slots`). With `None` slots, `num_tokens` beyond the cache's slots is the same error. On CPU
    (and on devices with `validate=True`) it is raised before anything is written; a device kernel skips
    the token's rows and `ops.check_errors()` raises it.""", IndexError)

DUPLICATE_DESTINATION_SLOT = _rule("duplicate_destination_slot", """
    A destination slot that appears twice among the non-negative ones is refused (a row written by two
    tokens); repeated source slots are fine. Checked always on CPU, and on devices with
    `validate=True`.""", ValueError)

INDEX_DTYPE = _rule("index_dtype", """
    Slots and RoPE positions are integers: int32/int64 tensors or sequences of ints. Floats and bools are
    refused, not truncated.""", TypeError)

INDEX_SHAPE = _rule("index_shape", """
    Slots and positions are 1-D; source and destination slots have the same length, which `num_tokens`
    (when given) must equal; RoPE positions have one entry per key token.""", ValueError)

ELEMENT_TYPE = _rule("element_type", """
    Source and destination (a cache and its rows, a cache and a flat page) have the same element type, or
    one side is raw integer storage of the same element size (fp8 kept as uint8). RoPE keys are float32,
    float16 or bfloat16.""", TypeError)

ROW_WIDTH = _rule("row_width", """
    Source and destination rows have the same width `H * E` (rows of another head split are fine).""",
                  ValueError)

LAYOUT_SHAPE = _rule("layout_shape", """
    Tensors bound to a layout have the rank, plane count, list length and per-layer shapes the layout
    says; a flat slot axis is a whole number of pages.""", ValueError)

LAYER_PLANE_OUT_OF_RANGE = _rule("layer_plane_out_of_range", """
    A chosen layer or plane outside `[0, count)` is refused.""", IndexError)

LAYER_PLANE_PAIRING = _rule("layer_plane_pairing", """
    Source and destination choose equally many layers (and planes), paired in order; a destination layer
    or plane is chosen at most once.""", ValueError)

INTEGER_ARGUMENT = _rule("integer_argument", """
    Integer arguments (layers, planes, `skip_prefix`, `num_tokens`, pages, `max_ctas`, `page_size`) are
    ints or integer scalars: bools and floats are refused, not truncated.""", TypeError)

ARGUMENT_RANGE = _rule("argument_range", """
    Counts and budgets are in range: `num_tokens` and `max_ctas` `>= 0`, `page_size >= 1`, every integer
    within int64.""", ValueError)

PAGE_OUT_OF_RANGE = _rule("page_out_of_range", """
    A page outside `[0, NB)` (any page but 0 of a layout without pages) is refused.""", IndexError)

FLAT_PAGE_SIZE = _rule("flat_page_size", """
    A flat page given to `set_page` is 1-D and holds exactly one page's elements.""", ValueError)

POSITION_OUT_OF_RANGE = _rule("position_out_of_range", """
    A RoPE position `>=` the rows of `cos_sin_cache` is an error naming the argument, the token, the value
    and the bound; on a device the kernel skips the token and `ops.check_errors()` raises it.""",
                              IndexError)

ROPE_GEOMETRY = _rule("rope_geometry", """
    RoPE keys are `[T, H, D]` with a contiguous last dimension; `cos_sin_cache` is `[max_pos, rot]` with
    `rot` even and `<= D`.""", ValueError)

MEMORY_OVERLAP = _rule("memory_overlap", """
    A source or a slot tensor that overlaps a destination in memory (address ranges: two storages over one
    buffer count), or a destination whose elements alias each other (an expanded tensor), is refused before
    anything is written; within one cache, `move` is the way.""", ValueError, ops_only=True)

DEVICES = _rule("devices", """
    A transfer runs on one device: every tensor of a cache on one device, at most one accelerator per
    transfer, host memory facing a device tensor pinned (read and written in place), no meta tensor mixed
    with tensors that hold data.""", ValueError, ops_only=True)

IN_PLACE = _rule("in_place", """
    The ops write in place as torch's own in-place ops do: every written tensor's version counter is bumped,
    and a leaf that requires grad (with grad mode on) or an inference tensor outside inference mode is
    refused, with torch's own exception type.""", RuntimeError, ops_only=True)


def behaviours() -> list[Rule]:
    """The rules that define behaviour (no exception)."""
    return [r for r in RULES.values() if r.error is None]


def refusals() -> list[Rule]:
    """The rules that refuse input, each with its one exception type."""
    return [r for r in RULES.values() if r.error is not None]


def render_markdown() -> str:
    """The rules as the specification's Markdown list (what ``kvlayout spec`` prints)."""
    lines = []
    for rule in RULES.values():
        raises = f" Raises `{rule.error.__name__}`." if rule.error is not None else ""
        scope = " *(ops only: the reference's arrays are values.)*" if rule.ops_only else ""
        lines.append(f"* **`{rule.name}`**: {rule.statement}{raises}{scope}")
    return "\n".join(lines) + "\n"
