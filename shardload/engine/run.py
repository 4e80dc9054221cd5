"""Running a plan: every parameter of a plan (or a pipeline stage of it) read for some ranks into tensors.

Remap-only parameters are read run by run straight from the file into each rank's tensor
(see :mod:`shardload.engine.transfer`), so a rank reads only its own bytes and every byte is read once;
parameters with a compute step are read whole, run through their step functions, and split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ShardloadError
from ..planning.mesh import Mesh, stage_plans
from ..planning.plan import ModelPlan, ParamPlan
from ..sources.reader import RunReader
from .integrity import wrapped
from .paths import data_path_for
from .read_strategy import ReadOptions
from .transfer import Transfer, reader_for_plan

if TYPE_CHECKING:
    import torch


def materialize(plan: ParamPlan, files: RunReader, ranks: Sequence[int]) -> list[torch.Tensor]:
    """Build this parameter's shards for ``ranks`` on the CPU (fresh, contiguous tensors), reading synchronously."""
    with Transfer(files, read_options=ReadOptions(threads=0)) as transfer:
        shards = transfer.param(plan, ranks)
        transfer.wait()
    return shards


def iter_shards(
    plan: ModelPlan, ranks: Sequence[int], wrap: Callable[[RunReader], RunReader] | None = None
) -> Iterator[tuple[ParamPlan, list[torch.Tensor]]]:
    """Stream ``(param plan, shards for ranks)`` one parameter at a time, in checkpoint order, on the CPU
    (``wrap``: a verifying reader)."""
    with wrapped(reader_for_plan(plan.params.values()), wrap) as reader, Transfer(reader) as transfer:
        for param in plan.params.values():
            shards = transfer.param(param, ranks)
            transfer.wait()
            yield param, shards


def stages_of(plan: ModelPlan, layout: Mesh) -> list[ModelPlan]:
    """One plan per pipeline stage of ``layout`` (the plan itself when there is one stage); a refusal is located at
    the plan's checkpoint."""
    if layout.pp == 1:
        return [plan]
    try:
        return stage_plans(plan, layout)
    except ShardloadError as err:
        raise err.located(file=plan.checkpoint.name if plan.checkpoint is not None else None) from None


def run_plan(
    plan: ModelPlan,
    ranks: Sequence[int],
    devices: Sequence[Any],
    *,
    staged: bool = False,
    mmap: bool = False,
    progress: Callable[[int, int], None] | None = None,
    wrap: Callable[[RunReader], RunReader] | None = None,
    read_options: ReadOptions | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Every parameter of ``plan`` for ``ranks`` (rank ``ranks[k]`` on ``devices[k]``): all set up, then read by
    the reader threads and this one.

    ``staged`` sends CPU destinations through the staging buffers too (to test that path on the CPU);
    ``mmap`` (one CPU rank) maps what it can instead of reading it (see :func:`load_rank`); ``wrap`` wraps the
    reader (a verifying reader, :func:`~shardload.engine.integrity.verified_reader`); ``read_options`` sets the
    reader threads and a single rank's read strategy; ``out`` (one rank) gives checked destinations by name
    (:meth:`Fill.destinations`), filled in place of fresh tensors.
    """
    result: list[dict[str, torch.Tensor]] = [{} for _ in ranks]
    import torch

    one_rank = len(ranks) == 1 and torch.device(devices[0]).type in ("cpu", "cuda")
    with (
        wrapped(reader_for_plan(plan.params.values(), read_options), wrap) as reader,
        Transfer(
            reader,
            path=data_path_for(devices, mmap=mmap, one_rank=one_rank, staged=staged),
            read_options=read_options,
            defer=True,  # every parameter set up, then read (cold reads at once): see Transfer
            progress=progress,
        ) as transfer,
    ):
        for param in plan.params.values():
            dest = None if out is None else out.get(param.name)
            for k, t in enumerate(transfer.param(param, ranks, devices, out=None if dest is None else [dest])):
                result[k][param.name] = t
        transfer.wait()
    return result
