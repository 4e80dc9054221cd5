"""The ``convert --layout`` targets: a server's own per-rank layout, written by its integration.

``shardload`` (rank files + manifest, :func:`shardload.convert`) is built in; every other layout is a
:class:`LayoutTarget` an integration registers with :func:`register_layout`, from its entry point in the
``shardload.layouts`` group (loaded once, installed packages only, as steps and split formats are). The command line
takes its ``--layout`` choices and dispatch from :func:`layouts`; ``shardload verify`` checks an output whose
manifest names a target's :attr:`~LayoutTarget.manifest_format` with that target's checks. Nothing here names a
server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ShardloadError
from ..sources.plugins import PluginError, load_once

BUILT_IN = "shardload"
"""The layout :func:`shardload.convert` writes (no target to register)."""
LAYOUT_GROUP = "shardload.layouts"
"""The entry point group a package registers a layout in: each entry point names a callable that calls
:func:`register_layout`."""


@dataclass(frozen=True)
class LayoutTarget:
    """A ``convert --layout NAME`` output: how to write it, how the command line speaks of it, how to check it."""

    name: str
    """``--layout NAME``."""
    convert: Callable[..., list[Any]]
    """``(model, num_shards, out_dir, shard_info, *, overwrite, fsync, verify, expert_parallel[, sha256]) -> written
    files``
    (each with ``path``, ``size``, ``sha256`` and ``entry()``), one per rank in rank order."""
    served: Callable[[Path, int, bool], str]
    """``(out_dir, num_shards, expert_parallel) ->`` the line the command line ends with (how to serve it)."""
    mesh_refusal: str
    """The command line's refusal of ``--mesh`` or a missing ``--num-shards``."""
    expert_parallel: bool = False
    """Whether the target takes ``--expert-parallel``."""
    sha256: bool = False
    """Whether its ``convert`` takes ``sha256=True`` (``--sha256``: every file's sha256 in the manifest too)."""
    manifest_format: str | None = None
    """The ``format`` its outputs' manifest names, so ``shardload verify`` knows them (None: not checked there)."""
    check_manifest: Callable[[Any, Path], None] | None = None
    """``(manifest, manifest path)``: raise a CheckpointError for an inconsistent manifest."""
    against_source: Callable[[Path, Any, dict[str, Any], Any], list[Any]] | None = None
    """``(out_dir, source, manifest, shard_info) ->`` the problems found comparing the output with its source."""
    rank_of: Callable[[str], int | None] | None = None
    """``(a path its manifest lists) ->`` the rank whose file it is, None for any other file: ``shardload verify``
    checks a rank file's header (its rank, conversion and seal) as a load does."""


_LAYOUTS: dict[str, LayoutTarget] = {}


def register_layout(target: LayoutTarget) -> None:
    """Add (or replace) a ``convert --layout`` target; ``shardload`` itself is built in and cannot be replaced."""
    if target.name == BUILT_IN:
        raise ShardloadError(f"--layout {BUILT_IN} is built in; register a layout under another name")
    _LAYOUTS[target.name] = target


def layouts() -> dict[str, LayoutTarget]:
    """Every registered layout target by name, the installed packages' entry points loaded once."""
    try:
        load_once(LAYOUT_GROUP)
    except PluginError as err:  # raised again by every call
        raise ShardloadError(str(err)) from None
    return dict(_LAYOUTS)


def layout_names() -> tuple[str, ...]:
    """``convert --layout``'s choices: the built-in layout, then every registered one."""
    return (BUILT_IN, *sorted(layouts()))


def layout_for_manifest(manifest: Any) -> LayoutTarget | None:
    """The target whose outputs carry a manifest of ``manifest``'s format (None: no registered target's)."""
    if not isinstance(manifest, dict):
        return None
    return next((t for t in layouts().values() if t.manifest_format and t.manifest_format == manifest.get("format")),
                None)  # fmt: skip
