"""Settings read from the environment."""

from __future__ import annotations

import os


def environment_capacity(name: str, default: int, minimum: int = 1) -> int:
    """A cache bound from environment variable ``name`` (an integer >= ``minimum``), ``default`` when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} = {raw!r}: it must be {kind}")
    return int(raw)


def environment_choice(name: str, choices: tuple[str, ...]) -> str:
    """A setting from environment variable ``name``, one of ``choices``; the first of them when unset."""
    raw = os.environ.get(name, "").strip() or choices[0]
    if raw not in choices:
        raise ValueError(f"{name} = {raw!r}: it must be one of {choices}")
    return raw
