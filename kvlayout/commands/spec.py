"""``kvlayout spec``: the Markdown specification, generated from ``kvlayout.reference``.

Everything in the document comes from the reference: module and function
docstrings, the catalog, the einops patterns, and worked examples computed
with ``element_location``.  ``docs/spec.md`` is this output, kept in sync by a
test.
"""

from __future__ import annotations

import inspect
import sys

DEFAULT_DOC = "docs/spec.md"
"""The committed specification (relative to the repository root)."""

OPERATIONS = (
    ("Transfers", ("transfer", "gather", "scatter", "skip_prefix", "move")),
    ("Page helpers", ("get_page", "set_page", "zero_page", "page_spans")),
    ("RoPE", ("rope_reposition",)),
)

# (KV heads, sender TP, receiver TP) whose routes the resharding section tabulates: heads split both
# ways, replicated on either side, and an MLA latent (one head on every rank).
RESHARDING_EXAMPLES = ((8, 4, 2), (8, 2, 4), (8, 1, 2), (2, 4, 2), (2, 2, 4), (1, 2, 1))

# Logical coordinates (plane, layer, slot, head, e) shown for every layout,
# clipped to the example geometry.
EXAMPLE_COORDS = ((0, 0, 0, 0, 0), (1, 0, 5, 1, 2), (0, 1, 6, 0, 1), (1, 1, 3, 1, 0), (0, 1, 7, 1, 2))

AXES_TABLE = """\
| axis | meaning | size |
|---|---|---|
| `p` | plane: K = 0, V = 1 (MHA); the latent (MLA) | P = 2 or 1 |
| `l` | layer | L |
| `nb` | page (block) | NB |
| `bs` | slot inside a page | BS (page size) |
| `n` | the flat slot axis `(nb bs)`: slot `s = nb * BS + bs` | N = NB * BS |
| `h` | head | H |
| `e` | element of a head's row | E |
"""

SEMANTICS_INTRO = (
    "Each rule below is a named item of `kvlayout.reference.semantics`, the one place it is stated: the "
    "reference's checks raise through it, the conformance families and tests cite it by name, and a rule that "
    "refuses an input names the one exception type every path raises for it (the reference, the torch ops on "
    "every device, the compat layer)."
)


def add_arguments(parser) -> None:
    parser.add_argument("--out", metavar="FILE", help="write the Markdown here (default: standard output)")
    parser.add_argument("--check", nargs="?", const=DEFAULT_DOC, metavar="FILE",
                        help=f"write nothing; exit 1 if FILE (default {DEFAULT_DOC}) differs from what "
                             "`kvlayout spec` renders")


def _example_geometry(layout):
    from kvlayout.reference import make_geometry

    axes = {a for part in layout.parts for a in part.full_axes}
    columns = (2, 1) if any(p.column is not None for p in layout.parts) else ()
    return make_geometry(layout, L=2 if "l" in axes else 1, N=8,
                         H=2 if "h" in axes and layout.planes != 1 else 1, E=3,
                         page_size=1 if layout.chunk else 4, columns=columns)


def _shapes(layout, geom) -> str:
    out = []
    for part in layout.parts:
        shape = "[" + ", ".join(str(n) for n in geom.part_shape(part)) + "]"
        shape = f"list of {geom.L} x {shape}" if part.per_layer else shape
        out.append(f"{part.name}: {shape}" if len(layout.parts) > 1 else shape)
    return "; ".join(out)


def _geometry_text(layout, geom) -> str:
    text = f"P = {geom.P}, L = {geom.L}, N = {geom.N}"
    if layout.chunk:
        text += " (chunk positions)"
    elif layout.paged:
        text += f" (NB = {geom.NB} pages of BS = {geom.BS})"
    else:
        text += f" (flat slot axis; page size {geom.BS} matters only to the page helpers)"
    text += f", H = {geom.H}, E = {geom.E}"
    if geom.columns:
        text += f" (column blocks {', '.join(str(c) for c in geom.columns)})"
    return text


def _kind(layout) -> str:
    if layout.chunk:
        return "contiguous chunk (slot = position, no slot tensor needed)"
    return "paged" if layout.paged else "flat slot axis"


def _layout_section(layout) -> list[str]:
    from kvlayout.reference import describe_pattern, element_location

    geom = _example_geometry(layout)
    lines = [f"### `{layout.name}`", "", f"*{layout.origin}*", "",
             f"* family: {layout.family}",
             f"* planes: {layout.planes if layout.planes is not None else 'follows the tensor (1 or 2)'}",
             f"* physical structure: `{layout.structure()}`",
             f"* kind: {_kind(layout)}"]
    if layout.engine_name:
        lines.append(f"* the engine calls it: `{layout.engine_name}`")
    if layout.notes:
        lines.append(f"* notes: {layout.notes}")
    lines += ["", "Pattern (physical, stacked over layers for a per-layer list, to logical):", "", "```"]
    lines += describe_pattern(layout)
    lines += ["```", "",
              f"Worked example: {_geometry_text(layout, geom)}; physical shapes {_shapes(layout, geom)}.", "",
              "| plane | layer | slot | head | e | part | list index | index in tensor |",
              "|---|---|---|---|---|---|---|---|"]
    seen = []
    for p, l, s, h, e in EXAMPLE_COORDS:
        coord = (min(p, geom.P - 1), min(l, geom.L - 1), min(s, geom.N - 1), min(h, geom.H - 1), min(e, geom.E - 1))
        if coord in seen:
            continue
        seen.append(coord)
        part, outer, index = element_location(layout, geom, *coord)
        outer_text = str(outer[0]) if outer else "-"
        lines.append("| " + " | ".join(str(c) for c in coord)
                     + f" | {part} | {outer_text} | `[{', '.join(str(i) for i in index)}]` |")
    lines.append("")
    return lines


def _resharding_section() -> list[str]:
    """Heads per rank and the routes of a few TP pairs, computed by ``reference.resharding``."""
    from kvlayout.reference import resharding

    lines = ["## Resharding across tensor-parallel sizes", "", inspect.cleandoc(resharding.__doc__), "",
             "Routes of a few pairs of TP groups (computed by `kv_routes`; heads are global, `[start, stop)`):", "",
             "| KV heads | sender TP | receiver TP | heads per sender rank | heads per receiver rank | "
             "routes: sender -> receiver: heads |", "|---|---|---|---|---|---|"]
    for heads, src_tp, dst_tp in RESHARDING_EXAMPLES:
        def held(tp):
            return ", ".join("[{}, {})".format(*resharding.kv_heads(r, tp, heads)) for r in range(tp))

        routes = ", ".join(f"{r.src_rank} -> {r.dst_rank}: [{r.head_start}, {r.head_stop})"
                           for r in resharding.kv_routes(heads, src_tp, dst_tp))
        lines.append(f"| {heads} | {src_tp} | {dst_tp} | {held(src_tp)} | {held(dst_tp)} | {routes} |")
    lines.append("")
    for name in ("kv_heads", "source_rank", "kv_routes", "reshard"):
        fn = getattr(resharding, name)
        lines += [f"### `{name}`", "", "```python", _signature(fn), "```", "", inspect.getdoc(fn) or "", ""]
    return lines


def _signature(fn) -> str:
    return f"{fn.__name__}{inspect.signature(fn)}".replace("'", "")


def render() -> str:
    """The whole document."""
    import kvlayout.reference as R
    from kvlayout.reference import layouts as layouts_module
    from kvlayout.reference import operations, pages, rope, semantics

    lines = ["# kvlayout specification", "",
             "> Generated by `kvlayout spec` from `kvlayout.reference` (the executable spec, JAX + einops).",
             "> Do not edit by hand: change the reference and regenerate.", "",
             "## Contents", "",
             "1. [The logical space](#the-logical-space)",
             "2. [Decided semantics](#decided-semantics)",
             "3. [Catalog](#catalog)",
             "4. [Layouts](#layouts)",
             "5. [Operations](#operations)",
             "6. [Resharding across tensor-parallel sizes](#resharding-across-tensor-parallel-sizes)", "",
             "## The logical space", "",
             inspect.cleandoc(layouts_module.__doc__), "",
             "Axes:", "", AXES_TABLE,
             "## Decided semantics", "", SEMANTICS_INTRO, "", semantics.render_markdown(),
             "## Catalog", "",
             "| name | family | planes | physical structure | origin |", "|---|---|---|---|---|"]
    for layout in R.CATALOG.values():
        planes = layout.planes if layout.planes is not None else "1 or 2"
        lines.append(f"| [`{layout.name}`](#{layout.name}) | {layout.family} | {planes} | "
                     f"`{layout.structure()}` | {layout.origin} |")
    lines += ["", "## Layouts", "",
              "Each layout below: where it comes from, its physical structure, its einops pattern(s) to the "
              "logical `[P, L, N, H, E]` array, and where a few logical elements live in a small example "
              "(computed by `reference.element_location`). Axes a layout lacks have size 1.", ""]
    for layout in R.CATALOG.values():
        lines += _layout_section(layout)
    lines += ["## Operations", "",
              "Every operation is a pure function: it returns the new destination instead of writing in place. "
              "Physical values: a one-part layout is its tensor (or list of per-layer tensors); a layout of "
              "several parts is a tuple with one entry per part, in the layout's part order.", ""]
    module_docs = {"Transfers": operations.__doc__, "Page helpers": pages.__doc__, "RoPE": rope.__doc__}
    for title, names in OPERATIONS:
        lines += [f"### {title}", ""]
        if title in module_docs:
            lines += [inspect.cleandoc(module_docs[title]), ""]
        for name in names:
            fn = getattr(R, name)
            lines += [f"#### `{name}`", "", "```python", _signature(fn), "```", "",
                      inspect.getdoc(fn) or "", ""]
    lines += _resharding_section()
    return "\n".join(lines).rstrip() + "\n"


def check(path: str, text: str) -> int:
    """0 when ``path`` holds exactly ``text``; else 1, with the start of a diff on standard error."""
    import difflib

    try:
        with open(path, encoding="utf-8") as f:
            committed = f.read()
    except FileNotFoundError:
        print(f"kvlayout spec --check: {path} does not exist; run `kvlayout spec --out {path}`", file=sys.stderr)
        return 1
    if committed == text:
        print(f"kvlayout spec --check: {path} is up to date")
        return 0
    diff = list(difflib.unified_diff(committed.splitlines(), text.splitlines(), f"{path} (committed)",
                                     f"{path} (rendered)", lineterm="", n=1))
    print(f"kvlayout spec --check: {path} is stale; run `kvlayout spec --out {path}`", file=sys.stderr)
    print("\n".join(diff[:40]) + ("\n..." if len(diff) > 40 else ""), file=sys.stderr)
    return 1


def run(args) -> int:
    from kvlayout.cli import writable_file

    if args.out:
        writable_file(args.out)   # before rendering, so that a bad path costs nothing
    text = render()
    if getattr(args, "check", None):
        return check(args.check, text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
