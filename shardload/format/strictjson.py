"""Strict JSON: decoding files that come from strangers (a key twice in one object, or the non-standard
constants NaN/Infinity, are errors instead of being silently accepted), and writing a document atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class DuplicateKeyError(ValueError):
    """An object names the same key twice (``json`` would silently keep the last)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # built in C; a key given twice makes it shorter than the pairs, then found in Python
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads(text: str) -> Any:
    """Decode ``text`` like ``json.loads``, raising DuplicateKeyError or ValueError for what JSON forbids."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constants)
    except ValueError as err:
        if "integer string conversion" in str(err):  # CPython's cap, and its advice to raise it: not the user's
            raise ValueError("an integer of more digits than any shape or offset has") from None
        raise


def write_atomic(path: str | os.PathLike[str], document: Any) -> None:
    """Write ``document`` as indented JSON to ``path`` atomically: a temporary file beside it, then a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
