"""vLLM's ``sharded_state`` layout registered as a split format (the ``shardload.split_formats`` entry point), light
to import: every first load of a process asks each split format whether its model is one, and the reader
(:mod:`.sharded_state`, with vLLM's layout planner, families and names) is imported only for a directory holding a
manifest or a file named as vLLM names rank files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...sources.manifest import MANIFEST_NAME
from ...sources.source_types import SplitFormat, register_split_format

RANK_FILE_PREFIXES = ("model-rank-", "model-pp-")
"""How the names of the rank files vLLM's ``save_model`` writes begin (tensor parallelism only, and with pipeline
parallelism): a directory with none of them and no manifest is not a ``sharded_state`` one."""


def open_if_sharded_state(model: Any, checksums: bool = False) -> Any:
    """``model`` opened as a ``sharded_state`` directory (:func:`.sharded_state.open_vllm_shards`), or None at once
    where it cannot be one (not a local directory, or neither a manifest nor a rank file in it)."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    try:
        names = os.listdir(model)
    except OSError:
        return None
    if MANIFEST_NAME not in names and not any(n.startswith(RANK_FILE_PREFIXES) for n in names):
        return None
    from .sharded_state import open_vllm_shards

    return open_vllm_shards(Path(model), checksums)


SHARDED_STATE = SplitFormat(
    name="vllm-sharded-state",
    what="a sharded_state directory",
    files="vLLM's",
    open=open_if_sharded_state,
)
"""vLLM's ``sharded_state`` layout as a split format (:func:`~shardload.sources.source_types.open_source`)."""


def register() -> None:
    """Register vLLM's ``sharded_state`` layout (the ``shardload.split_formats`` entry point; idempotent). The
    integration's own entry points (the loader, the convert target) call it too, so they read the layout whether or
    not the package's entry points are installed."""
    register_split_format(SHARDED_STATE)
