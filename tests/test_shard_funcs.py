"""Every built-in step and chains of them, for N in 1, 2, 3, 4, 8, against the numpy reference.

Both execution paths are checked element for element: the box path (each rank copies only
its source boxes) and the functional path (the step functions run on the whole tensor).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import reference as ref
from helpers.checkpoints import random_array, write_model
from helpers.step_cases import CASES, step, valid
from shardload.engine.run import materialize
from shardload.engine.steps import run_steps
from shardload.errors import PlanError
from shardload.format.shard_info import ShardInfo
from shardload.planning.plan import build_plan
from shardload.sources.checkpoint import open_checkpoint
from shardload.sources.reader import Reader

NS = (1, 2, 3, 4, 8)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("name", list(CASES))
def test_step_chain_matches_reference(tmp_path: Path, name: str, n: int) -> None:
    shape, dtype, build = CASES[name]
    doc_steps, ref_steps = build(n)
    x = random_array(np.random.default_rng(zlib.crc32(f"{name}-{n}".encode())), shape, dtype)
    model = write_model(tmp_path, {"w": x})
    info = ShardInfo.from_dict({"version": 1, "num_shards": None, "params": {"w": doc_steps}})
    checkpoint = open_checkpoint(model)
    if not valid(shape, name, n):
        with pytest.raises(PlanError, match=r"divisible|cutting|cannot be split|neither divides"):
            build_plan(info, checkpoint, n)
        return
    plan = build_plan(info, checkpoint, n)
    param = plan.params["w"]
    assert param.remap
    want = ref.rank_slices(x, ref_steps, n)
    with Reader() as files:
        boxes = materialize(param, files, range(n))
    functional = run_steps(param, torch.from_numpy(x.copy()))
    for r in range(n):
        assert tuple(param.shape) == want[r].shape
        np.testing.assert_array_equal(boxes[r].numpy(), want[r])
        np.testing.assert_array_equal(functional[r].numpy(), want[r])


@pytest.mark.parametrize("n", (1, 2, 4, 8))
def test_shard_dim_ranks_read_disjoint_boxes(tmp_path: Path, n: int) -> None:
    """Pure sharding: over all ranks the source boxes cover the tensor exactly once."""
    x = random_array(np.random.default_rng(n), (16, 40), "float32")
    model = write_model(tmp_path, {"w": x})
    info = ShardInfo.from_dict(
        {
            "version": 1,
            "params": {"w": [step("reorder_segments", 1, [8, 32], "num_shards"), step("shard_dim", 1, "num_shards")]},
        }
    )
    plan = build_plan(info, open_checkpoint(model), n)
    hits = np.zeros(x.shape, dtype=np.int64)
    for r in range(n):
        pieces = plan.params["w"].pieces(r)
        assert pieces is not None
        for p in pieces:
            hits[tuple(slice(a, b) for a, b in p.src)] += 1
        assert plan.params["w"].read_nbytes(r) == x.nbytes // n
    assert (hits == 1).all()


def test_unit_split_error_names_the_unit(tmp_path: Path) -> None:
    x = random_array(np.random.default_rng(0), (32 * 4, 8), "float16")
    model = write_model(tmp_path, {"qkv": x})
    info = ShardInfo.from_dict(
        {
            "version": 1,
            "params": {
                "qkv": [step("reorder_segments", 0, [16, 8, 8], "num_shards", 4), step("shard_dim", 0, "num_shards")]
            },
        }
    )
    with pytest.raises(PlanError, match=r"segment 1 holds 8 units of 4 .*num_shards=16, so a head would be cut"):
        build_plan(info, open_checkpoint(model), 16)


def test_kv_heads_error_names_the_head_counts(tmp_path: Path) -> None:
    x = random_array(np.random.default_rng(0), ((6 + 2 + 2) * 4, 8), "float16")
    model = write_model(tmp_path, {"qkv": x})
    info = ShardInfo.from_dict(
        {"version": 1, "params": {"qkv": [step("shard_segments", 0, [6, 2, 2], [0, 1, 1], "num_shards", 4)]}}
    )
    with pytest.raises(
        PlanError,
        match=r"qkv: step 1 \(shard_funcs.shard_segments\): segment 1: num_shards=3 neither divides its 2 KV heads "
        r"nor is a multiple of them \(query heads: 6\)",
    ):
        build_plan(info, open_checkpoint(model), 3)
    with pytest.raises(
        PlanError, match=r"segment 0 holds 6 units of 4 .*not divisible by num_shards=4, so a head would be cut"
    ):
        build_plan(info, open_checkpoint(model), 4)
    bad_flags = ShardInfo.from_dict(
        {"version": 1, "params": {"qkv": [step("shard_segments", 0, [6, 2, 2], [0, 1], "num_shards", 4)]}}
    )
    with pytest.raises(PlanError, match=r"kv must hold one 0/1 flag per segment"):
        build_plan(bad_flags, open_checkpoint(model), 2)


@pytest.mark.parametrize("step", ["shard_funcs.reorder_segments", "shard_funcs.shard_segments"])
def test_segment_lists_are_bounded_by_the_pieces_they_make(tmp_path: Path, step: str) -> None:
    """A segment list from a file costs memory for every (segment, rank) piece: 2**19 segments split 16 ways is
    refused in one line before any piece is built (old code built the 8M pieces: about a gigabyte, and 13 GB for a
    list of 2M at N = 64); the same list at N = 2 still plans."""
    size = 16 << 19
    segments = [16] * (1 << 19)
    if step.endswith("reorder_segments"):
        steps = [
            [step, [[size], "uint8"], 0, segments, "num_shards"],
            ["shard_funcs.shard_dim", [["num_shards", f"{size} // num_shards"], "uint8"], 0, "num_shards"],
        ]
    else:
        steps = [[step, [["num_shards", f"{size} // num_shards"], "uint8"], 0, segments, [0] * len(segments),
                  "num_shards"]]  # fmt: skip
    model = write_model(tmp_path / "m", {"w": np.zeros(size, dtype=np.uint8)}, {"version": 1, "params": {"w": steps}})
    info, checkpoint = ShardInfo.load(model / "shard_info.json"), open_checkpoint(model)
    (problem,) = build_plan(info, checkpoint, 16, strict=False).problems
    assert "524288 segments split 16 ways" in problem.message and "over the limit" in problem.message, problem
    assert not build_plan(info, checkpoint, 2, strict=False).problems
