"""A run of KV heads of a bound cache, as a cache of the same layout (a view, no copy).

A tensor-parallel rank's cache row ``(h e)`` holds its heads in order, each
``D`` elements.  Moving some of those heads to another rank means moving a
column range of every row; the op library moves whole rows, so the range is
bound as a cache of its own: the same tensors narrowed along the layout's
head axis (``H`` = the rank's heads, ``E = D``), or along the element axis
when the layout keeps all heads in one row (``H = 1``, ``E`` = heads x ``D``,
the LMCache chunk formats).  Binding reads strides, so the narrowed views need
no copy and every address still comes from the op library's one formula.
"""

from __future__ import annotations

from kvlayout.ops import KVCache, bind


def head_size_of(cache: KVCache, num_heads: int) -> int:
    """Elements per head ``D`` when ``cache``'s row holds ``num_heads`` heads (``H * E / num_heads``)."""
    width = cache.row_width
    if num_heads < 1 or width % num_heads:
        raise ValueError(f"{cache.layout.name}: a row of H*E = {cache.geometry.H}*{cache.geometry.E} elements "
                         f"cannot hold {num_heads} KV heads of equal size")
    return width // num_heads


def head_view(cache: KVCache, start: int, stop: int, head_size: int) -> KVCache:
    """Heads ``[start, stop)`` of every row of ``cache`` (heads counted within the row, ``D = head_size``).

    Returns ``cache`` itself for the whole row, else a :class:`KVCache` of the
    same layout over narrowed views of its tensors: ``H' = stop - start`` heads
    of ``E = D`` when the layout's ``H`` is the head count, or ``H = 1`` and
    ``E' = (stop - start) * D`` when the row keeps every head in ``E``.
    """
    g = cache.geometry
    if head_size < 1 or cache.row_width % head_size:
        raise ValueError(f"{cache.layout.name}: a row of H*E = {g.H}*{g.E} elements is not a whole number of "
                         f"heads of {head_size}")
    heads = cache.row_width // head_size
    if not 0 <= start < stop <= heads:
        raise ValueError(f"heads [{start}, {stop}) are not within the row's {heads} heads")
    if (start, stop) == (0, heads):
        return cache
    if g.H == heads and g.E == head_size:
        axis, lo, hi = "h", start, stop
    elif g.H == 1 and not g.columns:
        axis, lo, hi = "e", start * head_size, stop * head_size
    else:
        raise ValueError(f"{cache.layout.name}: a row of H = {g.H} x E = {g.E} does not split into {heads} heads "
                         f"of {head_size} at head boundaries")
    parts = []
    for view in cache.parts:
        dim = view.part.pattern.split().index(axis)
        narrowed = [t.narrow(dim, lo, hi - lo) for t in view.tensors]
        parts.append(narrowed if view.part.per_layer else narrowed[0])
    physical = parts[0] if cache.layout.single_part else tuple(parts)
    # page_size: a flat slot axis cannot tell it; a paged one is checked against it
    return bind(cache.layout, physical, page_size=g.BS)
