"""Running a parameter's step functions on a whole tensor, each result checked against the plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import PlanError, ShardloadError
from ..sources.dtypes import to_torch

if TYPE_CHECKING:
    import torch

    from ..planning.plan import ParamPlan


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
