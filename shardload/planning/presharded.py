"""A cache pre-sharded for N_old (``NAME_shard-K-of-N`` or MLC-LLM's ``NAME_shard-I`` records) as planning sees
it: at N_old each rank's records are its tensors, a plan beside them checked against them (:func:`records_info`);
at any other N the whole tensors they were cut from, whose shapes the plan's steps for N_old pin down
(:func:`whole_view`). A load, a resharding read, ``validate``, ``inspect`` and ``plan_model`` all take these two."""

from __future__ import annotations

from math import prod

from ..errors import PlanError
from ..format.expr import evaluate
from ..format.shard_info import ShardInfo
from ..sources.checkpoint import Checkpoint
from ..sources.dtypes import itemsize
from ..sources.tensor_info import TensorInfo
from .plan import ModelPlan, build_plan

STORED = "<stored tensors>"
"""The file name of a whole tensor no file holds as such (what rank files or records were cut from)."""


def plan_as_loaded(
    shard_info: ShardInfo, checkpoint: Checkpoint | None, num_shards: int, *, strict: bool = True
) -> ModelPlan:
    """The plan a load of ``checkpoint`` (None: the file's own declarations) at ``num_shards`` follows: a cache
    pre-sharded for N_old from its records at N_old, from the whole tensors they were cut from at another N; any
    other checkpoint as it is. With ``strict`` the first problem is raised, else collected."""
    if checkpoint is None or checkpoint.split_for is None:
        return build_plan(shard_info, checkpoint, num_shards, strict=strict)
    try:
        if num_shards == checkpoint.split_for:
            return build_plan(records_info(checkpoint, shard_info), checkpoint, num_shards, strict=strict)
        return build_plan(shard_info, whole_view(checkpoint, shard_info), num_shards, strict=strict)
    except PlanError as err:
        if strict:
            raise
        plan = ModelPlan(num_shards, shard_info, checkpoint)
        plan.problems.append(err)
        return plan


def records_info(checkpoint: Checkpoint, info: ShardInfo) -> ShardInfo:
    """The shard_info of a cache pre-sharded for the N it is loaded at: ``info`` saying how its whole parameters
    split (the plan beside it, which reading it at another N takes) is checked against the records, then has nothing
    to run, each rank's records being its tensors as written; steps for a tensor the cache stores whole are refused
    (its split would be a guess)."""
    listed = sorted(name for name, steps in info.params.items() if steps)
    if not listed:
        return info
    whole = [name for name in listed if name not in checkpoint.shards]
    if whole:
        raise PlanError(
            f"lists steps for a tensor this cache stores whole, pre-sharded for num_shards={checkpoint.split_for}: "
            "load it without that shard_info at this N",
            file=info.source,
            param=whole[0],
        )
    for name in listed:
        _check_records(name, info, checkpoint)
    return ShardInfo({k: v for k, v in info.params.items() if not v}, source=info.source)


def _check_records(name: str, info: ShardInfo, checkpoint: Checkpoint) -> None:
    """Raise unless ``info``'s steps for pre-sharded parameter ``name`` give each rank exactly its records' shape and
    dtype, as the last step declares them. Steps that declare no shape (a plan made for any N) are not checked here:
    the whole shape they would start from is not in the cache (KV heads replicated over ranks make it no multiple of
    the records), and the records are what each rank gets either way."""
    parts = checkpoint.shards[name]
    n, record = len(parts), parts[0]
    last = info.params[name][-1]
    if last.shape is None:
        return
    shape = [evaluate(d, n) for d in last.shape]
    dtype = last.dtype or record.logical_dtype
    if shape != [n, *record.shape] or dtype != record.logical_dtype:
        raise PlanError(
            f"its steps give each of {n} ranks {shape[1:]} {dtype}, but its records are {list(record.shape)} "
            f"{record.logical_dtype}: this shard_info does not describe this cache",
            file=info.source,
            param=name,
        )


def whole_view(checkpoint: Checkpoint, shard_info: ShardInfo) -> Checkpoint:
    """Pre-sharded ``checkpoint`` as the whole tensors it was cut from (each pre-sharded parameter's shape from
    :func:`stored_shape`, in no file), beside the tensors it stores whole."""
    n_old = checkpoint.split_for
    assert n_old is not None
    stored: dict[str, TensorInfo] = {}
    for name, info in checkpoint.tensors.items():
        if name not in checkpoint.shards:
            stored[name] = info
    for name, parts in checkpoint.shards.items():
        part = parts[0]
        if part.decode is not None:
            raise PlanError(
                f"its num_shards={n_old} records are stored {part.dtype} for {part.decode} ranks: resharding copies "
                "boxes of the records as stored, so it needs records stored as the ranks hold them",
                file=checkpoint.name, param=name,
            )  # fmt: skip
        stored[name] = stored_shape(name, shard_info, part, n_old, checkpoint)
    return Checkpoint(checkpoint.root, checkpoint.root, "safetensors", stored)


def stored_shape(name: str, shard_info: ShardInfo, part: TensorInfo, n_old: int, checkpoint: Checkpoint) -> TensorInfo:
    """The whole stored tensor a pre-sharded parameter was cut from: the one shape (a dim of its records times
    N_old, or less by what padding may add) whose steps give each of N_old ranks exactly the records' shape and
    dtype; two such shapes (a padded vocabulary: 382 to 384 rows all give 3 records of 128) are refused."""
    specs = shard_info.params.get(name)
    if not specs:
        raise PlanError(
            f"is pre-sharded for num_shards={n_old}; loading it for another N needs a shard_info that says how the "
            "whole parameter splits (shard_info=, or shard_info.json beside the cache)",
            file=checkpoint.name, param=name,
        )  # fmt: skip
    one = ShardInfo({name: specs}, source=shard_info.source)
    found: list[TensorInfo] = []
    candidates = [
        (d, size) for d, n in enumerate(part.shape) for size in range(n * n_old, max(-1, (n - 1) * n_old), -1)
    ]
    for d, size in candidates:
        shape = tuple(size if i == d else n for i, n in enumerate(part.shape))
        info = TensorInfo(name, part.dtype, shape, checkpoint.root / STORED, 0, prod(shape) * itemsize(part.dtype))
        plan = build_plan(one, Checkpoint(checkpoint.root, checkpoint.root, "safetensors", {name: info}), n_old,
                          strict=False)  # fmt: skip
        got = plan.params.get(name)
        if not plan.problems and got is not None and (tuple(got.shape), got.dtype) == (part.shape, part.dtype):
            if all(f.shape != shape for f in found):
                found.append(info)
    if len(found) != 1:
        shapes = " or ".join(str(list(f.shape)) for f in found) or "none"
        raise PlanError(
            f"cannot tell the whole shape its num_shards={n_old} records of {list(part.shape)} were cut from "
            f"(shapes whose steps give them: {shapes})",
            file=shard_info.source, param=name,
        )  # fmt: skip
    return found[0]
