"""build_plan plans each parameter structure once and shares it: the plan must be exactly the one a plain build gives.

The checkpoint mixes parameters that share a structure (layers) with near misses that must not share it: the same
shape and steps in another dtype, the same steps on another shape, padding to another multiple, a dim given as an
expression instead of an int, quantized companions (packed weights, group scales, a group index computed whole),
and tensors at different file offsets. A cache key that left out any of these would hand one of them another's
steps or boxes, and the comparison below would fail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers.checkpoints import random_array, write_model
from shardload.format.shard_info import ShardInfo
from shardload.planning import plan as plan_module
from shardload.planning.plan import ModelPlan, build_plan
from shardload.planning.runs import param_runs, zero_spans
from shardload.sources.checkpoint import open_checkpoint

LAYERS = 3


def _step(func: str, *args: Any) -> list[Any]:
    return [f"shard_funcs.{func}", [None, None], *args]


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(7)
    tensors: dict[str, np.ndarray] = {}
    params: dict[str, list[Any]] = {}
    for i in range(LAYERS):
        p = f"layers.{i}."
        tensors[p + "q"] = random_array(rng, (24, 16), "float16")
        params[p + "q"] = [_step("shard_dim", 0, "num_shards")]
        tensors[p + "o"] = random_array(rng, (24, 16), "float16")
        params[p + "o"] = [_step("shard_dim", 1, "num_shards")]
        tensors[p + "o32"] = random_array(rng, (24, 16), "float32")  # same shape and steps, another dtype
        params[p + "o32"] = [_step("shard_dim", 1, "num_shards")]
        tensors[p + "o_tall"] = random_array(rng, (48, 16), "float16")  # same steps, another shape
        params[p + "o_tall"] = [_step("shard_dim", 1, "num_shards")]
        tensors[p + "o_expr"] = random_array(rng, (24, 16), "float16")  # dim as an expression: 0 here, not 1
        params[p + "o_expr"] = [_step("shard_dim", "num_shards // num_shards - 1", "num_shards")]
        tensors[p + "pad3"] = random_array(rng, (10, 8), "float16")
        params[p + "pad3"] = [_step("pad_dim", 0, "3 * num_shards", "num_shards"), _step("shard_dim", 0, "num_shards")]
        tensors[p + "pad5"] = random_array(rng, (10, 8), "float16")  # same, padded to another multiple
        params[p + "pad5"] = [_step("pad_dim", 0, "5 * num_shards", "num_shards"), _step("shard_dim", 0, "num_shards")]
        tensors[p + "qweight"] = random_array(rng, (16, 24), "int32")  # GPTQ-like: packed rows, groups of 8
        params[p + "qweight"] = [_step("shard_packed", 0, 8, "num_shards")]
        tensors[p + "scales"] = random_array(rng, (16, 24), "float16")
        params[p + "scales"] = [_step("shard_groups", 0, 8, "num_shards")]
        tensors[p + "g_idx"] = (np.arange(128, dtype=np.int32) // 8).astype(np.int32)
        params[p + "g_idx"] = [_step("shard_group_index", 16, "num_shards")]
        tensors[p + "norm"] = random_array(rng, (16,), "float16")  # replicated: no steps
        tensors[p + "norm32"] = random_array(rng, (16,), "float32")
    return write_model(tmp_path_factory.mktemp("plan_cache") / "m", tensors, {"version": 1, "params": params})


def _build(model: Path, n: int, cached: bool, monkeypatch: pytest.MonkeyPatch) -> ModelPlan:
    monkeypatch.setattr(plan_module, "STRUCTURE_CACHE", cached)
    checkpoint = open_checkpoint(model)
    info = ShardInfo.load(model / "shard_info.json")
    return build_plan(info, checkpoint, n)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_cached_structure_gives_the_plain_plan(mixed_model: Path, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _build(mixed_model, n, False, monkeypatch)
    cached = _build(mixed_model, n, True, monkeypatch)
    assert list(cached.params) == list(plain.params) and not cached.problems and not plain.problems
    for name, want in plain.params.items():
        got = cached.params[name]
        assert got == want, name  # name, source (offset included), steps with every shape, dtype and argument
        for rank in range(n):
            assert got.pieces(rank) == want.pieces(rank), (name, rank)
            assert got.zeros(rank) == want.zeros(rank), (name, rank)
            assert got.read_nbytes(rank) == want.read_nbytes(rank), (name, rank)
            a, b = zero_spans(got, rank), zero_spans(want, rank)
            assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)), (name, rank)
        runs_got, runs_want = param_runs(got, range(n)), param_runs(want, range(n))
        assert (runs_got is None) == (runs_want is None), name
        if runs_got is not None and runs_want is not None:
            for field in ("src", "length", "buf", "dst"):
                assert np.array_equal(getattr(runs_got, field), getattr(runs_want, field)), (name, field)
    # the cache is in use: every layer shares layer 0's steps, and nothing else does
    for suffix in ("q", "o", "o32", "o_tall", "o_expr", "pad3", "pad5", "qweight", "scales", "g_idx"):
        first = cached.params[f"layers.0.{suffix}"]
        for i in range(1, LAYERS):
            assert cached.params[f"layers.{i}.{suffix}"].steps is first.steps, suffix
            assert plain.params[f"layers.{i}.{suffix}"].steps is not plain.params[f"layers.0.{suffix}"].steps
    distinct = {id(p.steps) for name, p in cached.params.items() if name.startswith("layers.0.") and p.steps}
    assert len(distinct) == 10


def test_plans_for_other_n_are_their_own(mixed_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two builds never share a structure: the cache lives for one build_plan call (one N)."""
    one, two = _build(mixed_model, 1, True, monkeypatch), _build(mixed_model, 2, True, monkeypatch)
    for name, p in two.params.items():
        if p.steps:
            assert p.steps[-1].out_shape[0] == 2 and one.params[name].steps[-1].out_shape[0] == 1, name


def test_arguments_that_are_not_plain_values_are_not_shared() -> None:
    """A step argument that is not a JSON value (a ShardInfo built in Python can hold anything) gets no key."""
    from shardload.format.shard_info import StepSpec
    from shardload.sources.tensor_info import TensorInfo

    class Dim(int):
        def __repr__(self) -> str:
            return "1"

    info = TensorInfo("w", "float16", (4, 4), Path("m.safetensors"), 0, 32)
    plain = plan_module.structure_key([StepSpec("shard_funcs.shard_dim", None, None, (1, "num_shards"))], info, 2)
    odd = plan_module.structure_key([StepSpec("shard_funcs.shard_dim", None, None, (Dim(0), "num_shards"))], info, 2)
    assert plain is not None and odd is None
    flag = plan_module.structure_key([StepSpec("shard_funcs.shard_dim", None, None, (True, "num_shards"))], info, 2)
    assert flag is not None and flag != plain  # True and 1 are different arguments
