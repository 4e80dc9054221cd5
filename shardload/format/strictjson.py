"""Strict JSON decoding for files that come from strangers: a key twice in one object, or the
non-standard constants NaN/Infinity, are errors instead of being silently accepted."""

from __future__ import annotations

import json
from typing import Any


class DuplicateKeyError(ValueError):
    """An object names the same key twice (``json`` would silently keep the last)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads(text: str) -> Any:
    """Decode ``text`` like ``json.loads``, raising DuplicateKeyError or ValueError for what JSON forbids."""
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constants)
