"""Experts stored stacked under vLLM's expert parallelism, without vLLM: a rank's run of experts is planned as one
slice of each stacked tensor when vLLM placed them linearly, and any other placement is one located line."""

from __future__ import annotations

import pytest

from shardload.errors import ShardloadError
from shardload.format.shard_info import ShardInfo
from shardload.integrations.vllm.loader import _stacked_experts_by_rank
from shardload.integrations.vllm.names import Target

NAME = "model.layers.0.mlp.experts.gate_up_proj"
PARAM = "model.layers.0.mlp.experts.routed_experts.w13_weight"


def _plan(table: list[int], rank: int, num_shards: int) -> ShardInfo:
    return _stacked_experts_by_rank(ShardInfo(), {NAME}, {NAME: Target(PARAM)}, {PARAM: table}, rank, num_shards, "m")


def test_linear_placement_is_a_split_along_the_experts() -> None:
    steps = _plan([-1, -1, 0, 1], rank=1, num_shards=2).params[NAME]
    assert [(s.func, s.args) for s in steps] == [("shard_funcs.shard_dim", (0, "num_shards"))]


@pytest.mark.parametrize(
    ("table", "rank", "num_shards"),
    [([0, -1, 1, -1], 0, 2), ([-1, -1, 1, 0], 1, 2), ([0, 1, -1], 0, 2)],
    ids=["round-robin", "reordered", "uneven"],
)
def test_other_placements_are_refused_in_one_line(table: list[int], rank: int, num_shards: int) -> None:
    with pytest.raises(ShardloadError, match="even run per rank") as err:
        _plan(table, rank, num_shards)
    assert NAME in str(err.value) and "\n" not in str(err.value)
