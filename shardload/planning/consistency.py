"""Placements that plan and load but cannot compute the model: a module whose weight is split one way while its
bias is placed another (a Llama plan used on a Qwen2 with biases loads without a word otherwise). Pure: only the
plan's stored and per-rank shapes are read. ``shardload validate --model`` reports these as warnings, and fails
on them with ``--strict``."""

from __future__ import annotations

from ..errors import PlanError
from .plan import ModelPlan


def _split_dims(plan: ModelPlan, name: str) -> list[int]:
    """The dims along which a parameter's rank tensor is smaller than the stored tensor."""
    p = plan.params[name]
    if len(p.shape) != len(p.source.shape):
        return [-1]  # reshaped by its steps (a quantized layout): not compared
    return [d for d, (a, b) in enumerate(zip(p.shape, p.source.shape, strict=True)) if a != b]


def placement_warnings(plan: ModelPlan) -> list[PlanError]:
    """Every ``X.weight`` / ``X.bias`` pair whose placements disagree, as located errors."""
    if plan.num_shards < 2:
        return []
    found = []
    for name in plan.params:
        if not name.endswith(".bias"):
            continue
        weight = name.removesuffix(".bias") + ".weight"
        if weight not in plan.params or len(plan.params[weight].source.shape) != 2:
            continue
        w_dims, b_dims = _split_dims(plan, weight), _split_dims(plan, name)
        if -1 in w_dims or -1 in b_dims:
            continue
        w_rows, b_len = plan.params[weight].shape[0], plan.params[name].shape[0]
        if w_dims == [0] and not b_dims:
            reason = f"{weight} is split along its output dim but its bias is replicated: split the bias the same way"
        elif w_dims == [0] and b_len != w_rows:
            reason = f"{weight} gives each rank {w_rows} output rows but its bias {b_len} entries"
        elif w_dims == [1] and b_dims:
            reason = (
                f"{weight} is split along its input dim, so its bias must be replicated (added once after the "
                "all-reduce), but the bias is split"
            )
        elif not w_dims and b_dims:
            reason = f"{weight} is replicated but its bias is split"
        else:
            continue
        found.append(PlanError(reason, file=plan.shard_info.source, param=name))
    return found
