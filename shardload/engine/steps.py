"""Running a parameter's step functions on a whole tensor, each result checked against the plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import PlanError, ShardloadError
from ..sources.dtypes import to_torch

if TYPE_CHECKING:
    import torch

    from ..planning.plan import ParamPlan, PlannedStep


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold one dtype, shape and the same bytes: ``torch.equal`` compares values, so a NaN differs
    from itself and -0.0 equals 0.0."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def run_steps(plan: ParamPlan, x: torch.Tensor) -> torch.Tensor:
    """Apply every step of ``plan`` to the whole tensor ``x``, checking each result against the plan."""
    import torch

    if plan.source.decode is not None:  # stored encoded (TVM f32-to-bf16): the steps see the decoded values
        x = x.to(to_torch(plan.source.decode))
    if not plan.steps:  # replicated: every rank's slice is the whole tensor (a view, not N copies)
        return x.unsqueeze(0).expand(plan.num_shards, *x.shape)
    for step in plan.steps:
        try:
            x = _call(step, x, plan) if step.func.out else step.func.fn(x, *step.args)
        except ShardloadError:
            raise
        except Exception as err:
            raise PlanError(
                f"step function failed: {type(err).__name__}: {err}", file=plan.where, param=plan.name,
                step=step.index, func=step.name,
            ) from None  # fmt: skip
        if not isinstance(x, torch.Tensor):
            raise PlanError(
                f"returned {type(x).__name__}, not a tensor", file=plan.where, param=plan.name, step=step.index,
                func=step.name,
            )  # fmt: skip
        if tuple(x.shape) != step.out_shape or x.dtype != to_torch(step.out_dtype):
            raise PlanError(
                f"returned {list(x.shape)} {x.dtype} but the plan says {list(step.out_shape)} {step.out_dtype}",
                file=plan.where, param=plan.name, step=step.index, func=step.name,
            )  # fmt: skip
    return x


def _call(step: PlannedStep, x: torch.Tensor, plan: ParamPlan) -> torch.Tensor:
    """Run a destination-passing step: ``out`` is allocated from the declaration, and must come back as it went."""
    import torch

    out = torch.empty(step.out_shape, dtype=to_torch(step.out_dtype))
    where = out.data_ptr()
    returned = step.func.fn(x, *step.args, out)
    if returned is not None and returned is not out:
        raise PlanError(
            "a destination-passing step writes into out and returns nothing; it returned a value",
            file=plan.where, param=plan.name, func=step.name, step=step.index,
        )  # fmt: skip
    if out.data_ptr() != where or tuple(out.shape) != step.out_shape or out.dtype != to_torch(step.out_dtype):
        raise PlanError(
            f"replaced or resized its out tensor ({list(out.shape)} {out.dtype}); it must write into it as allocated",
            file=plan.where, param=plan.name, func=step.name, step=step.index,
        )  # fmt: skip
    return out
