"""``convert --layout vllm``: vLLM's ``sharded_state`` layout registered as a convert target (the
``shardload.layouts`` entry point). Light on purpose: the command line lists its choices from here at start, and the
writer (:mod:`.writer`) and its checks (:mod:`.verify`) are imported only when used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...sources.manifest import VLLM_MANIFEST_FORMAT
from ..api import LayoutTarget, register_layout


def _convert(*args: Any, **kwargs: Any) -> list[Any]:
    from .writer import convert_vllm

    return convert_vllm(*args, **kwargs)


def _served(out_dir: Path, num_shards: int, expert_parallel: bool) -> str:
    ep = " --enable-expert-parallel" if expert_parallel else ""
    return (
        f"wrote vLLM's sharded_state layout for tensor_parallel_size={num_shards} to {out_dir}; serve it with "
        f"`vllm serve {out_dir} --load-format sharded_state --tensor-parallel-size {num_shards}{ep}`"
    )


def _check_manifest(manifest: Any, where: Path) -> None:
    from .sharded_state import check_vllm_manifest

    check_vllm_manifest(manifest, where)


def _against_source(out: Path, source: Any, manifest: dict[str, Any], shard_info: Any) -> list[Any]:
    from .verify import against_source

    return against_source(out, source, manifest, shard_info)


def _rank_of(path: str) -> int | None:
    from .sharded_state import rank_of

    return rank_of(path)


SHARDED_STATE_LAYOUT = LayoutTarget(
    name="vllm",
    convert=_convert,
    served=_served,
    mesh_refusal="--layout vllm takes --num-shards (vLLM's tensor-parallel size) and no --mesh",
    expert_parallel=True,
    sha256=True,
    manifest_format=VLLM_MANIFEST_FORMAT,
    check_manifest=_check_manifest,
    against_source=_against_source,
    rank_of=_rank_of,
)
"""vLLM's ``sharded_state`` files, served by stock vLLM with ``load_format="sharded_state"``."""


def register() -> None:
    """Register ``convert --layout vllm`` (the ``shardload.layouts`` entry point; idempotent)."""
    register_layout(SHARDED_STATE_LAYOUT)
