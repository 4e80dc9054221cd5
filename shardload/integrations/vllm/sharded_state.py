"""vLLM's ``sharded_state`` layout as a source: registered as a split format, so any entry point reads it as boxes."""

from __future__ import annotations

from ...engine.vllm_plan import open_vllm_shards
from ...sources.source_types import SplitFormat, register_split_format

SHARDED_STATE = SplitFormat(
    name="vllm-sharded-state",
    what="a sharded_state directory",
    files="vLLM's",
    open=open_vllm_shards,
    stored=lambda opened: opened.stored,
)


def register() -> None:
    """Register vLLM's ``sharded_state`` layout (the ``shardload.split_formats`` entry point)."""
    register_split_format(SHARDED_STATE)
