"""The quantized-layout steps: box rules on arbitrary sub-boxes, functions against references, and their errors.

``shard_segments`` with its pack factor is checked with the other box rules (test_box_rules.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import reference as ref
from helpers.boxes import apply_pieces, sub_box
from shardload.errors import StepArgumentError
from shardload.planning.registry import lookup


@settings(max_examples=100, deadline=None)
@given(
    n=st.sampled_from([1, 2, 3, 4, 8]),
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    dim_pick=st.integers(0, 2),
    factor=st.sampled_from([1, 8, 32]),
    data=st.data(),
)
def test_packed_and_group_splits_are_even_splits(
    n: int, shape: list[int], dim_pick: int, factor: int, data: st.DataObject
) -> None:
    dim = dim_pick % len(shape)
    shape[dim] *= n
    x = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) + 1
    want = ref.shard_dim(x, dim, n)
    for name, args in (
        ("shard_funcs.shard_packed", (dim, factor, n)),
        ("shard_funcs.shard_groups", (dim, factor, n)),
        ("shard_funcs.shard_groups", (dim, factor, n, shape[dim] * factor)),
    ):
        func = lookup(name)
        out_shape, _ = func.shape(tuple(shape), "int64", *args)
        assert tuple(out_shape) == want.shape
        np.testing.assert_array_equal(func.fn(torch.from_numpy(x), *args).numpy(), want)
        out_box = data.draw(sub_box(out_shape))
        want_box = want[tuple(slice(a, b) for a, b in out_box)]
        np.testing.assert_array_equal(apply_pieces(name, x, out_box, args), want_box)


def _shape_error(name: str, shape: tuple[int, ...], *args: object, dtype: str = "float16") -> str:
    with pytest.raises(StepArgumentError) as err:
        lookup(name).shape(shape, dtype, *args)
    return str(err.value)


def test_errors_say_what_does_not_divide() -> None:
    # MLC-LLM issue 3004: 409 groups of 40 inputs on a row-parallel down_proj
    msg = _shape_error("shard_funcs.shard_groups", (4096, 409), 1, 40, 2)
    assert msg == (
        "409 groups along dim 1 cannot be split across 2 ranks (group size 40): group 204 would straddle ranks 0 and 1"
    )
    assert "5 ranks" in _shape_error("shard_funcs.shard_groups", (8, 409), 1, 40, 5)
    # FP8 128x128 blocks over 1000 rows: ceil(1000/128) = 8 blocks, the last one partial
    assert lookup("shard_funcs.shard_groups").shape((8, 4), "float32", 0, 128, 1, 1000)[0] == (1, 8, 4)
    msg = _shape_error("shard_funcs.shard_groups", (8, 4), 0, 128, 2, 1000, dtype="float32")
    assert "(the last one partial)" in msg and "group 3 would straddle ranks 0 and 1" in msg
    assert "need 9" in _shape_error("shard_funcs.shard_groups", (8, 4), 0, 128, 1, 1100)
    msg = _shape_error("shard_funcs.shard_packed", (64, 96), 1, 8, 5, dtype="int32")
    assert msg.startswith("96 packs along dim 1 cannot be split across 5 ranks (8 values per int32")
    msg = _shape_error("shard_funcs.shard_segments", (48, 8), 0, [4, 2, 2], [0, 1, 1], 3, 6)
    assert msg == (
        "segment 0 holds 4 units of 6 (in a fused QKV: 4 heads of head_dim 6); 4 is not divisible by num_shards=3, "
        "so a head would be cut"
    )
    msg = _shape_error("shard_funcs.shard_segments", (48, 8), 0, [6, 3, 3], [0, 1, 1], 2, 4)
    assert msg == "segment 1: num_shards=2 neither divides its 3 KV heads nor is a multiple of them (query heads: 6)"
    msg = _shape_error("shard_funcs.shard_segments", (48, 8), 0, [4, 2, 2], [0, 0, 0], 4, 6)
    assert (
        "segment 1 holds 2 units of 6 (in a fused QKV: 2 heads of head_dim 6); 2 is not divisible by num_shards=4"
        in msg
    )  # KV heads not flagged
    msg = _shape_error("shard_funcs.shard_segments", (5, 8), 0, [4, 2, 2], [0, 1, 1], 2, 6, 8)
    assert "do not match dim 0 of size 5" in msg
    msg = _shape_error("shard_funcs.shard_segments", (8, 8), 0, [8, 2, 2], [0, 1, 1], 4, 4, 6)
    assert msg == (
        "segment 0: a rank's part (elements 0..8) does not fall on boundaries of 6 "
        "(pack or group size) for num_shards=4"
    )


def test_shard_shape_rewrites_each_ranks_logical_shape() -> None:
    func = lookup("shard_funcs.shard_shape")
    x = torch.tensor([384, 768], dtype=torch.int64)
    assert func.shape((2,), "int64", 1, 4) == ((4, 2), "int64")
    assert func.fn(x, 1, 4).tolist() == [[384, 192]] * 4
    assert func.fn(x, 0, 3).tolist() == [[128, 768]] * 3
    gqa = torch.tensor([(8 + 2 + 2) * 32, 64], dtype=torch.int64)
    assert func.fn(gqa, 0, 8, [8, 2, 2], [0, 1, 1], 32).tolist() == [[(1 + 1 + 1) * 32, 64]] * 8
    with pytest.raises(StepArgumentError, match="segment 1 holds 2 units"):  # no KV flags: nothing is replicated
        func.fn(gqa, 0, 8, [8, 2, 2], [], 32)
    with pytest.raises(StepArgumentError, match="384, which does not divide by num_shards=5"):
        func.fn(x, 0, 5)
    with pytest.raises(StepArgumentError, match="1-d integer shape vector"):
        func.shape((2, 2), "int64", 0, 2)


def test_shard_group_index_makes_indices_local_and_refuses_act_order() -> None:
    func = lookup("shard_funcs.shard_group_index")
    g_idx = torch.arange(64, dtype=torch.int32) // 8  # 8 groups in input order
    out = func.fn(g_idx, 8, 4)
    assert out.dtype == torch.int32 and out.shape == (4, 16)
    assert (out == torch.arange(16, dtype=torch.int32) // 8).all()
    shuffled = g_idx[torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(StepArgumentError, match="act-order"):
        func.fn(shuffled, 8, 4)
    assert "6 groups cannot be split across 4 ranks" in _shape_error(
        "shard_funcs.shard_group_index", (64,), 6, 4, dtype="int32"
    )
