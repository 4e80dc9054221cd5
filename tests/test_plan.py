"""Planning: every kind of problem is found without reading data, located, and reported per N."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers.checkpoints import random_array, write_model
from shardload.errors import PlanError
from shardload.format.shard_info import ShardInfo
from shardload.planning.plan import build_plan
from shardload.sources.checkpoint import open_checkpoint


@pytest.fixture()
def small_model(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    return write_model(
        tmp_path / "m",
        {"a": random_array(rng, (8, 12), "float16"), "b": random_array(rng, (12,), "float32"),
         "c": random_array(rng, (6, 10), "int32")},
    )  # fmt: skip


def doc(params: dict[str, Any], num_shards: int | None = None) -> ShardInfo:
    return ShardInfo.from_dict({"version": 1, "num_shards": num_shards, "params": params}, source="si.json")


def shard(dim: int, shape: Any = None, dtype: str | None = None, n: Any = "num_shards") -> list[Any]:
    return ["shard_funcs.shard_dim", [shape, dtype], dim, n]


PROBLEMS = [
    ({"a": [["nope.func", [None, None], 0]]}, "a", 1, "unknown function 'nope.func'"),
    ({"a": [["os.system", [None, None], "touch x"]]}, "a", 1, "unknown function 'os.system'"),
    ({"a": [["shard_funcs.shard_dim", [None, None], 0]]}, "a", 1, "takes 2 extra argument(s), got 1"),
    ({"a": [["shard_funcs.shard_dim", [None, None], 0, 2, 3]]}, "a", 1, "takes 2 extra argument(s), got 3"),
    ({"a": [["shard_funcs.shard_dim", [None, None], "x", "num_shards"]]}, "a", 1, "argument 'dim'"),
    ({"a": [["shard_funcs.shard_dim", [None, None], [0], "num_shards"]]}, "a", 1, "argument 'dim'"),
    ({"a": [["shard_funcs.reorder_segments", [None, None], 0, 8, "num_shards"]]}, "a", 1, "list of integers"),
    ({"a": [["shard_funcs.shard_dim", [None, None], "0 // 0", "num_shards"]]}, "a", 1, "divides by zero"),
    ({"a": [["shard_funcs.shard_dim", [None, None], "1 +", "num_shards"]]}, "a", 1, "malformed expression"),
    ({"a": [shard(0, ["num_shards", 8, 12])]}, "a", 1,
     "declared output shape [2, 8, 12] but shard_funcs.shard_dim gives [2, 4, 12]"),
    ({"a": [shard(0, None, "float32")]}, "a", 1, "declared dtype float32 but shard_funcs.shard_dim gives float16"),
    ({"a": [shard(1, None, None)]}, None, None, None),  # valid for 2
    ({"b": [shard(0, ["num_shards", "12 // num_shards"], "float16")]}, "b", 1, "the checkpoint's dtype"),
    ({"c": [shard(1)]}, None, None, None),
    ({"c": [shard(2)]}, "c", 1, "dim 2 is out of range"),
    ({"a": [["shard_funcs.reorder_segments", [None, None], 0, [4, 4], "num_shards"]]}, "a", 1,
     "last step must output [num_shards=2, ...], got [8, 12]"),
    ({"a": [shard(0, n=4)]}, "a", 1, "last step must output [num_shards=2, ...], got [4, 2, 12]"),
    ({"zz": [shard(0)]}, "zz", None, "names no parameter of"),
    ({"cc": [shard(0)]}, "cc", None, "did you mean 'c'"),
]  # fmt: skip


@pytest.mark.parametrize(("params", "param", "step", "reason"), PROBLEMS)
def test_problems_are_located(
    small_model: Path, params: dict, param: str | None, step: int | None, reason: str | None
) -> None:
    plan = build_plan(doc(params), open_checkpoint(small_model), 2, strict=False)
    if reason is None:
        assert plan.problems == []
        return
    assert len(plan.problems) == 1, [str(p) for p in plan.problems]
    problem = plan.problems[0]
    assert problem.file == "si.json" and problem.param == param and problem.step == step
    assert reason in str(problem), str(problem)
    prefix = f"si.json: {param}: " + (f"step {step} (" if step else "")
    assert str(problem).startswith(prefix)


def test_not_divisible_message(small_model: Path) -> None:
    plan = build_plan(doc({"c": [shard(1)]}), open_checkpoint(small_model), 3, strict=False)
    assert [str(p) for p in plan.problems] == [
        "si.json: c: step 1 (shard_funcs.shard_dim): dim 1 of size 10 is not divisible by num_shards=3"
    ]


def test_all_problems_collected_and_strict_raises_first(small_model: Path) -> None:
    info = doc({"a": [shard(5)], "b": [["x", [None, None]]], "q": [shard(0)]})
    plan = build_plan(info, open_checkpoint(small_model), 2, strict=False)
    assert {p.param for p in plan.problems} == {"a", "b", "q"}
    with pytest.raises(PlanError, match=r"and 2 more problems"):
        build_plan(info, open_checkpoint(small_model), 2)


def test_fixed_n_file_refuses_other_n(small_model: Path) -> None:
    info = doc({"a": [shard(0, n=2)]}, num_shards=2)
    assert build_plan(info, open_checkpoint(small_model), 2, strict=False).problems == []
    with pytest.raises(PlanError, match=r"only.*cannot plan for num_shards=4"):
        build_plan(info, open_checkpoint(small_model), 4)


def test_plan_without_checkpoint_checks_declarations() -> None:
    seed = ShardInfo.from_dict({"x": [["shard_funcs.shard_dim", [[2, 4, 8], "float16"], 1, 2],
                                      ["shard_funcs.shard_dim", [[2, 4, 1, 8], "float16"], 1, 2]]})  # fmt: skip
    problems = build_plan(seed, None, 2, strict=False).problems
    assert len(problems) == 1 and "declared output shape [2, 4, 1, 8] but" in str(problems[0])
    agnostic = doc({"x": [["shard_funcs.reorder_segments", [[6, 8], "float16"], 0, [3, 3], 1]]})
    problems = build_plan(agnostic, None, 2, strict=False).problems
    assert len(problems) == 1 and "last step must output [num_shards=2, ...], got [6, 8]" in str(problems[0])
    unknown = ShardInfo.from_dict({"x": [["evil", [[2, 4], "float16"]]]})
    assert "unknown function" in str(build_plan(unknown, None, 2, strict=False).problems[0])


def test_replicated_parameters_and_totals(small_model: Path) -> None:
    plan = build_plan(doc({"a": [shard(0)]}), open_checkpoint(small_model), 2)
    assert plan.params["b"].replicated and plan.params["c"].replicated
    assert plan.params["a"].shape == (4, 12)
    assert plan.replicated_nbytes == 12 * 4 + 60 * 4
    assert plan.rank_nbytes(0) == 4 * 12 * 2 + plan.replicated_nbytes
    resolved = plan.resolved_shard_info()
    assert resolved["num_shards"] == 2
    assert resolved["params"] == {"a": [["shard_funcs.shard_dim", [[2, 4, 12], "float16"], 0, 2]]}
    again = build_plan(ShardInfo.from_dict(resolved), open_checkpoint(small_model), 2)
    assert again.params["a"].shape == (4, 12)


def test_a_structure_that_fails_is_planned_once(tmp_path: Path) -> None:
    """Parameters shaped alike (every layer of a model) share their planned steps, and now their failure too: the
    shape rule runs once for 50 such parameters that cannot split, and each is still named in its own problem (old
    code planned each failing one again: `shardload plan` of a model of 900k tensors took about an hour)."""
    import shardload
    from shardload.errors import StepArgumentError

    calls = []

    def rule(shape: tuple[int, ...], dtype: str, num_shards: int) -> tuple[tuple[int, ...], str]:
        calls.append(num_shards)
        raise StepArgumentError(f"cannot split {shape[0]} rows {num_shards} ways")

    shardload.register("tests.never_splits", shape=rule)(lambda x, num_shards: x)
    try:
        tensors = {f"layer.{i}.w": np.zeros((6, 4), np.float16) for i in range(50)}
        params = {name: [["tests.never_splits", [None, None], "num_shards"]] for name in tensors}
        model = write_model(tmp_path / "m", tensors, {"version": 1, "params": params})
        plan = build_plan(ShardInfo.load(model / "shard_info.json"), open_checkpoint(model), 4, strict=False)
        assert sorted(p.param for p in plan.problems) == sorted(tensors)
        assert all(p.reason.startswith("cannot split 6 rows") and p.step == 1 for p in plan.problems), plan.problems
        assert len(calls) == 1
    finally:
        shardload.planning.registry.unregister("tests.never_splits")
