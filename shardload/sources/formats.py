"""The table of checkpoint formats besides safetensors: how a path is recognised and opened.

A format module (GGUF today) adds one :class:`SourceFormat` with :func:`register_source` when it is
imported; :func:`shardload.sources.checkpoint.open_checkpoint` asks the table, so it never imports a
format module by name. ``shardload.sources`` imports every built-in format module once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SourceFormat:
    """One checkpoint format: a name, two cheap recognisers (no data read) and an opener (headers only)."""

    name: str
    claims_file: Callable[[Path], bool]
    """True when this file (given directly) is of this format."""
    claims_dir: Callable[[Path], bool]
    """True when this directory, which holds no safetensors file, is a checkpoint of this format."""
    open: Callable[[Path], Any]
    """Open the path, headers only, as a ``shardload.sources.checkpoint.Checkpoint`` (typed loosely: that
    module imports this table, so this one may not import it back)."""


_FORMATS: dict[str, SourceFormat] = {}


def register_source(fmt: SourceFormat) -> None:
    """Add (or replace) a checkpoint format in the table."""
    _FORMATS[fmt.name] = fmt


def format_for_file(path: Path) -> SourceFormat | None:
    """The format that claims the file ``path``, or None (then it is read as safetensors)."""
    return next((f for f in _FORMATS.values() if f.claims_file(path)), None)


def format_for_dir(path: Path) -> SourceFormat | None:
    """The format that claims a directory without safetensors files, or None."""
    return next((f for f in _FORMATS.values() if f.claims_dir(path)), None)
