"""Execution: run a plan's I/O and steps to produce per-rank tensors on their devices.

Remap-only parameters are read run by run straight from the file into each rank's tensor
(see :mod:`shardload.transfer`), so a rank reads only its own bytes and every byte is read once;
parameters with a compute step are read whole, run through their step functions, and split.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint import open_checkpoint, read_header
from .dtypes import to_torch
from .errors import CheckpointError, PlanError, ShardloadError
from .plan import ModelPlan, ParamPlan, build_plan, resolve_shard_info
from .reader import Reader
from .transfer import Transfer

if TYPE_CHECKING:
    import torch

    from .checkpoint import Checkpoint


def run_steps(plan: ParamPlan, x: torch.Tensor) -> torch.Tensor:
    """Apply every step of ``plan`` to the whole tensor ``x``, checking each result against the plan."""
    import torch

    for step in plan.steps:
        try:
            x = step.func.fn(x, *step.args)
        except ShardloadError:
            raise
        except Exception as err:
            raise PlanError(
                f"step function failed: {type(err).__name__}: {err}", param=plan.name, step=step.index, func=step.name
            ) from None
        if not isinstance(x, torch.Tensor):
            raise PlanError(
                f"returned {type(x).__name__}, not a tensor", param=plan.name, step=step.index, func=step.name
            )
        if tuple(x.shape) != step.out_shape or x.dtype != to_torch(step.out_dtype):
            raise PlanError(
                f"returned {list(x.shape)} {x.dtype} but the plan says {list(step.out_shape)} {step.out_dtype}",
                param=plan.name, step=step.index, func=step.name,
            )  # fmt: skip
    return x


def materialize(plan: ParamPlan, files: Reader, ranks: Sequence[int]) -> list[torch.Tensor]:
    """Build this parameter's shards for ``ranks`` on the CPU (fresh, contiguous tensors), reading synchronously."""
    with Transfer(files, threads=0) as transfer:
        shards = transfer.param(plan, ranks)
        transfer.wait()
    return shards


def iter_shards(plan: ModelPlan, ranks: Sequence[int]) -> Iterator[tuple[ParamPlan, list[torch.Tensor]]]:
    """Stream ``(param plan, shards for ranks)`` one parameter at a time, in checkpoint order, on the CPU."""
    with Reader() as reader, Transfer(reader) as transfer:
        for param in plan.params.values():
            shards = transfer.param(param, ranks)
            transfer.wait()
            yield param, shards


def default_devices(num_shards: int) -> list[str]:
    """``cuda:0..N-1`` when that many GPUs are visible, otherwise the CPU for every rank."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= num_shards:
        return [f"cuda:{r}" for r in range(num_shards)]
    return ["cpu"] * num_shards


def load(
    model: str | os.PathLike[str],
    num_shards: int,
    devices: Sequence[Any] | None = None,
    shard_info: Any = None,
) -> list[dict[str, torch.Tensor]]:
    """Load every rank's shard of ``model``: a list of N state dicts, shard r on ``devices[r]``.

    ``model`` is a directory (``model.safetensors`` or an HF index), a ``.safetensors`` file,
    or a directory written by :func:`convert`. Each stored byte is read once.

    Example::

        shards = shardload.load("llama-dir", 8)          # cuda:0..7 when present, else CPU
        shards[3]["model.layers.0.self_attn.qkv_proj.weight"].shape
    """
    devices = list(devices) if devices is not None else default_devices(num_shards)
    if len(devices) != num_shards:
        raise ShardloadError(f"got {len(devices)} devices for num_shards={num_shards}", file=str(model))
    checkpoint = open_checkpoint(model)
    if checkpoint.kind == "converted":
        if shard_info is not None:
            raise ShardloadError("a converted directory carries its own shard_info; do not pass one", file=str(model))
        return [load_rank(model, r, num_shards, devices[r]) for r in range(num_shards)]
    plan = build_plan(resolve_shard_info(checkpoint, shard_info), checkpoint, num_shards)
    return run_plan(plan, range(num_shards), devices)


def run_plan(
    plan: ModelPlan, ranks: Sequence[int], devices: Sequence[Any], *, staged: bool = False
) -> list[dict[str, torch.Tensor]]:
    """Every parameter of ``plan`` for ``ranks`` (rank ``ranks[k]`` on ``devices[k]``): all allocated, then read
    by the thread pool.

    ``staged`` sends CPU destinations through the staging buffers too (to test that path on the CPU).
    """
    result: list[dict[str, torch.Tensor]] = [{} for _ in ranks]
    with Reader() as reader, Transfer(reader, staged=staged, defer=True) as transfer:
        for param in plan.params.values():
            for k, t in enumerate(transfer.param(param, ranks, devices)):
                result[k][param.name] = t
        transfer.wait()
    return result


def _dist_defaults(rank: int | None, num_shards: int | None) -> tuple[int, int]:
    if rank is not None and num_shards is not None:
        return rank, num_shards
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ShardloadError("rank and num_shards are required when no torch.distributed process group is initialised")
    return (dist.get_rank() if rank is None else rank), (dist.get_world_size() if num_shards is None else num_shards)


def load_rank(
    model: str | os.PathLike[str],
    rank: int | None = None,
    num_shards: int | None = None,
    device: Any = "cpu",
    shard_info: Any = None,
    *,
    verify: bool = False,
) -> dict[str, torch.Tensor]:
    """Load only rank ``rank``'s shard of ``model`` onto ``device``, reading only the bytes it needs.

    Under an initialised torch.distributed process group, ``rank`` and ``num_shards`` default
    to the group's rank and world size. ``verify`` checks a converted file's sha256.

    Example::

        state = shardload.load_rank("llama-dir", rank=1, num_shards=4, device="cuda:1")
    """
    rank, num_shards = _dist_defaults(rank, num_shards)
    checkpoint = open_checkpoint(model)
    if checkpoint.kind == "converted":
        if shard_info is not None:
            raise ShardloadError("a converted directory carries its own shard_info; do not pass one", file=str(model))
        return _load_converted_rank(checkpoint, rank, num_shards, device, verify)
    plan = build_plan(resolve_shard_info(checkpoint, shard_info), checkpoint, num_shards)
    if not 0 <= rank < num_shards:
        raise ShardloadError(f"rank {rank} is out of range for num_shards={num_shards}", file=str(model))
    return run_plan(plan, [rank], [device])[0]


def rank_file_name(rank: int, num_shards: int) -> str:
    """The file name of rank ``rank`` in a converted directory: ``rank-00003-of-00008.safetensors``."""
    return f"rank-{rank:05d}-of-{num_shards:05d}.safetensors"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 8 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def _load_converted_rank(
    checkpoint: Checkpoint, rank: int, num_shards: int, device: Any, verify: bool
) -> dict[str, torch.Tensor]:
    manifest = checkpoint.manifest or {}
    where = str(checkpoint.root / "shard_manifest.json")
    if manifest["num_shards"] != num_shards:
        raise CheckpointError(
            f"directory was converted for num_shards={manifest['num_shards']}, not {num_shards}; "
            "convert the source checkpoint again or load it directly",
            file=where,
        )
    if not 0 <= rank < num_shards:
        raise CheckpointError(f"rank {rank} is out of range for num_shards={num_shards}", file=where)
    name = rank_file_name(rank, num_shards)
    entry = next((f for f in manifest["files"] if f["path"] == name), None)
    if entry is None:
        raise CheckpointError(f"manifest lists no file {name}", file=where)
    path = checkpoint.root / name
    try:
        size = path.stat().st_size
    except OSError:
        raise CheckpointError(f"rank file {name} is missing", file=where) from None
    if size != entry["size"]:
        raise CheckpointError(f"{name} is {size} bytes, the manifest says {entry['size']}", file=where)
    if verify and sha256_file(path) != entry.get("sha256"):
        raise CheckpointError(f"{name} does not match its sha256 in the manifest", file=where)
    infos = list(read_header(path).values())
    with Reader() as reader, Transfer(reader) as transfer:
        tensors = transfer.tensors(infos, device)
        transfer.wait()
    return {info.name: t for info, t in zip(infos, tensors, strict=True)}
