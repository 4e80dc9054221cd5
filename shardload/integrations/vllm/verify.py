"""``shardload verify OUT --source MODEL`` of a ``sharded_state`` output: the manifest's plan against the one the
source gives, then every rank file's tensors (names, dtypes, shapes, bytes) against the ones ``convert --layout
vllm`` makes from the source now. Never imports vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...engine.verify_dir import plan_differences
from ...errors import CheckpointError, ShardloadError
from ...sources.checkpoint import open_checkpoint
from ...sources.manifest import MANIFEST_NAME
from ...sources.safetensors_header import read_header
from ...sources.tensor_info import TensorInfo
from .layout import VllmLayout, plan_layout
from .sharded_state import FILE_PATTERN
from .writer import rank_tensors


def against_source(out: Path, source: Any, manifest: dict, shard_info: Any) -> list[CheckpointError]:
    """A ``sharded_state`` output against ``source``: the manifest's plan against the source's, then every rank
    file's tensors (names, dtypes, shapes, bytes) against the ones ``convert --layout vllm`` makes from it now."""
    n = manifest["num_shards"]
    try:
        layout = plan_layout(
            open_checkpoint(source), n, shard_info, expert_parallel=manifest.get("expert_parallel") is True
        )
    except ShardloadError as err:
        return [CheckpointError(f"cannot plan the source for num_shards={n}: {err.message}", file=str(source))]
    differences = plan_differences(manifest.get("shard_info"), layout.plan.resolved_shard_info(),
                                    str(out / MANIFEST_NAME))  # fmt: skip
    if differences:
        return differences
    try:
        headers = [read_header(out / FILE_PATTERN.format(rank=r)) for r in range(n)]
    except CheckpointError as err:
        return [err]
    try:
        return _rank_differences(out, layout, headers)
    except ShardloadError as err:
        return [CheckpointError(f"cannot read the source: {err.message}", file=str(source))]


def _rank_differences(out: Path, layout: VllmLayout, headers: list[dict[str, TensorInfo]]) -> list[CheckpointError]:
    """Every rank file's tensors (``headers``, rank order) against the ones ``layout`` makes from the source."""
    n = len(headers)
    problems: list[CheckpointError] = []
    wanted = {t.name for t in layout.tensors}
    for r, header in enumerate(headers):
        for name in sorted(header.keys() - wanted):
            problems.append(CheckpointError(f"{name!r} is in the output but not in the source's layout",
                                            file=str(out / f"rank {r}")))  # fmt: skip
    for t, shards in rank_tensors(layout, n):
        for r, (header, shard) in enumerate(zip(headers, shards, strict=True)):
            where = str(out / f"rank {r}")
            info = header.get(t.name)
            if info is None:
                problems.append(CheckpointError(f"{t.name!r} is in the source's layout but not in the output",
                                                file=where))  # fmt: skip
                continue
            want = shard.contiguous().reshape(-1).view(_u8()).numpy().tobytes()
            if (info.dtype, info.shape) != (t.dtype, tuple(shard.shape)):
                what = f"source {t.dtype} {tuple(shard.shape)}, output {info.dtype} {info.shape}"
                problems.append(CheckpointError(f"{t.name!r} differs: {what}", file=where))
            elif _read_bytes(info.file, info.offset, info.nbytes) != want:
                problems.append(CheckpointError(f"{t.name!r} differs from the source's bytes", file=where))
    return problems


def _read_bytes(path: Path, offset: int, nbytes: int) -> bytes:
    """``nbytes`` bytes of ``path`` from ``offset`` (one tensor of a rank file)."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(nbytes)


def _u8() -> Any:
    import torch

    return torch.uint8
