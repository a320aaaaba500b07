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


class NativeChoice:
    """A process-wide setting that is one of ``choices`` (the first the default), kept by the extension, where
    the code that reads it runs, as the choice's index (``native_set(index)``, ``native_get() -> index``; a
    flag's index is 0 or 1); set at import from environment variable ``variable`` (:func:`environment_choice`).
    ``what`` names it in the refusal of anything else."""

    def __init__(self, what: str, choices: tuple[str, ...], native_set, native_get, variable: str):
        self.what, self.choices = what, choices
        self._native_set, self._native_get = native_set, native_get
        self.set(environment_choice(variable, choices))

    def set(self, value: str) -> None:
        if not isinstance(value, str) or value not in self.choices:
            raise ValueError(f"{self.what} must be one of {self.choices}, got {value!r}")
        self._native_set(self.choices.index(value))

    def get(self) -> str:
        return self.choices[int(self._native_get())]
