"""The table of checkpoint formats besides safetensors: how a path is recognised and opened, and what it can do.

A format module (GGUF, TVM caches) adds one :class:`SourceFormat` with :func:`register_source` when it is
imported; :func:`shardload.sources.checkpoint.open_checkpoint` asks the table, so it never imports a
format module by name, and code elsewhere asks a checkpoint's capabilities (``Checkpoint.config_file``,
``Checkpoint.model_config``, ``Checkpoint.plain_safetensors``, ...), never its format's name.
``shardload.sources`` imports every built-in format module once.
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
    config_file: Callable[[Any], Path] | None = None
    """The file an opened checkpoint's model config is read from; None: ``config.json`` beside the weights."""
    read_config: Callable[[Any], dict[str, Any]] | None = None
    """An opened checkpoint's model config in config.json's terms; None: ``config.json`` beside the weights is read."""
    gguf_model_type: bool = False
    """True when the config's ``model_type`` is a GGUF ``general.architecture`` name, which a model family may map
    to transformers' (``Family.gguf_architectures``)."""
    plain_safetensors: bool = False
    """True when the tensors are plain safetensors files, whole, as ``quantize`` and ``convert --layout vllm`` read."""


_FORMATS: dict[str, SourceFormat] = {}


def register_source(fmt: SourceFormat) -> None:
    """Add (or replace) a checkpoint format in the table."""
    _FORMATS[fmt.name] = fmt


def source_format(name: str) -> SourceFormat | None:
    """The registered format called ``name`` (a ``Checkpoint.kind``), or None (safetensors, converted)."""
    return _FORMATS.get(name)


def format_for_file(path: Path) -> SourceFormat | None:
    """The format that claims the file ``path``, or None (then it is read as safetensors)."""
    return next((f for f in _FORMATS.values() if f.claims_file(path)), None)


def format_for_dir(path: Path) -> SourceFormat | None:
    """The format that claims a directory without safetensors files, or None."""
    return next((f for f in _FORMATS.values() if f.claims_dir(path)), None)
