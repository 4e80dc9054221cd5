"""Every built-in step and chains of them, for N in 1, 2, 3, 4, 8, against the numpy reference.

Both execution paths are checked element for element: the box path (each rank copies only
its source boxes) and the functional path (the step functions run on the whole tensor).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import reference as ref
from conftest import random_array, write_model
from shardload.engine.load import materialize
from shardload.engine.steps import run_steps
from shardload.errors import PlanError
from shardload.format.shard_info import ShardInfo
from shardload.planning.plan import build_plan
from shardload.sources.checkpoint import open_checkpoint
from shardload.sources.reader import Reader

NS = (1, 2, 3, 4, 8)

Case = tuple[tuple[int, ...], str, Callable[[int], tuple[list[Any], list[tuple]]]]


def step(name: str, *args: Any) -> list[Any]:
    """A document-form step with the output shape left for the shape rule to infer."""
    return [f"shard_funcs.{name}", [None, None], *args]


CASES: dict[str, Case] = {
    "shard_dim0": ((24, 10), "float16", lambda n: ([step("shard_dim", 0, "num_shards")], [("shard_dim", 0, n)])),
    "shard_dim1": ((6, 48), "float32", lambda n: ([step("shard_dim", 1, "num_shards")], [("shard_dim", 1, n)])),
    "shard_dim2_3d": ((4, 6, 24), "int32", lambda n: ([step("shard_dim", 2, "num_shards")], [("shard_dim", 2, n)])),
    "shard_dim_neg": ((5, 24), "int8", lambda n: ([step("shard_dim", -1, "num_shards")], [("shard_dim", 1, n)])),
    "shard_dim_1d": ((48,), "float16", lambda n: ([step("shard_dim", 0, "num_shards")], [("shard_dim", 0, n)])),
    "replicate": ((7, 3), "uint8", lambda n: ([step("replicate", "num_shards")], [("replicate", n)])),
    "qkv_gqa_units": (
        ((8 + 4 + 4) * 3, 5),
        "float16",
        lambda n: (
            [step("reorder_segments", 0, [8, 4, 4], "num_shards", 3), step("shard_dim", 0, "num_shards")],
            [("reorder_segments", 0, [8, 4, 4], n, 3), ("shard_dim", 0, n)],
        ),
    ),
    "gate_up": (
        (48, 7),
        "float32",
        lambda n: (
            [step("reorder_segments", 0, [24, 24], "num_shards"), step("shard_dim", 0, "num_shards")],
            [("reorder_segments", 0, [24, 24], n), ("shard_dim", 0, n)],
        ),
    ),
    "segments_dim1": (
        (5, 48),
        "int32",
        lambda n: (
            [step("reorder_segments", 1, [24, 8, 16], "num_shards"), step("shard_dim", 1, "num_shards")],
            [("reorder_segments", 1, [24, 8, 16], n), ("shard_dim", 1, n)],
        ),
    ),
    "shard_then_reorder": (
        (24, 48),
        "float16",
        lambda n: (
            [step("shard_dim", 0, "num_shards"), step("reorder_segments", 2, [16, 32], 1)],
            [("shard_dim", 0, n), ("reorder_segments", 2, [16, 32], 1)],
        ),
    ),
    "two_reorders": (
        (48, 3),
        "float32",
        lambda n: (
            [
                step("reorder_segments", 0, [24, 24], "num_shards"),
                step("reorder_segments", 0, [24, 24], "num_shards"),
                step("shard_dim", 0, "num_shards"),
            ],
            [("reorder_segments", 0, [24, 24], n), ("reorder_segments", 0, [24, 24], n), ("shard_dim", 0, n)],
        ),
    ),
    "qkv_heads": (
        ((8 + 2 + 2) * 3, 5),
        "float16",
        lambda n: (
            [step("shard_segments", 0, [8, 2, 2], [0, 1, 1], "num_shards", 3)],
            [("shard_segments", 0, [8, 2, 2], [0, 1, 1], n, 3)],
        ),
    ),
    "kv_heads_dim1": (
        (3, 2 * 4),
        "float32",
        lambda n: ([step("shard_segments", 1, [2], [1], "num_shards", 4)], [("shard_segments", 1, [2], [1], n, 4)]),
    ),
    "pad_vocab_vllm": (
        (250, 6),
        "float16",
        lambda n: (
            [step("pad_dim", 0, 64, "num_shards"), step("shard_dim", 0, "num_shards")],
            [("pad_dim", 0, 64, n), ("shard_dim", 0, n)],
        ),
    ),
    "pad_plain_dim1_3d": (
        (2, 3, 23),
        "int32",
        lambda n: (
            [step("pad_dim", -1, "num_shards", "num_shards"), step("shard_dim", 2, "num_shards")],
            [("pad_dim", 2, n, n), ("shard_dim", 2, n)],
        ),
    ),
    "pad_bias_then_replicate": (
        (7,),
        "float32",
        lambda n: (
            [step("pad_dim", 0, 4, "num_shards"), step("replicate", "num_shards")],
            [("pad_dim", 0, 4, n), ("replicate", n)],
        ),
    ),
    "reorder_then_replicate": (
        (24, 2),
        "float16",
        lambda n: (
            [step("reorder_segments", 0, [12, 12], "num_shards"), step("replicate", "num_shards")],
            [("reorder_segments", 0, [12, 12], n), ("replicate", n)],
        ),
    ),
}


def _valid(shape: tuple[int, ...], name: str, n: int) -> bool:
    """Whether the case can be planned for n, decided from the case's own sizes (not the library)."""
    needs = {
        "shard_dim0": [24],
        "shard_dim1": [48],
        "shard_dim2_3d": [24],
        "shard_dim_neg": [24],
        "shard_dim_1d": [48],
        "replicate": [],
        "qkv_gqa_units": [8, 4, 4],
        "gate_up": [24, 24],
        "segments_dim1": [24, 8, 16],
        "shard_then_reorder": [24],
        "two_reorders": [24, 24],
        "reorder_then_replicate": [12, 12],
        "qkv_heads": [8],
        "kv_heads_dim1": [],
        "pad_vocab_vllm": [] if 250 % n == 0 else [256],
        "pad_plain_dim1_3d": [],
        "pad_bias_then_replicate": [] if 7 % n == 0 else [8],
    }[name]
    kv_heads = {"qkv_heads": [2, 2], "kv_heads_dim1": [2]}.get(name, [])
    return all(k % n == 0 for k in needs) and all(k % n == 0 or n % k == 0 for k in kv_heads)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("name", list(CASES))
def test_step_chain_matches_reference(tmp_path: Path, name: str, n: int) -> None:
    shape, dtype, build = CASES[name]
    doc_steps, ref_steps = build(n)
    x = random_array(np.random.default_rng(zlib.crc32(f"{name}-{n}".encode())), shape, dtype)
    model = write_model(tmp_path, {"w": x})
    info = ShardInfo.from_dict({"version": 1, "num_shards": None, "params": {"w": doc_steps}})
    checkpoint = open_checkpoint(model)
    if not _valid(shape, name, n):
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
