"""Settings read from the environment."""

from __future__ import annotations

import os


def environment_capacity(name: str, default: int) -> int:
    """A cache bound from environment variable ``name`` (a positive integer), ``default`` when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name} = {raw!r}: it must be a positive integer")
    return int(raw)
