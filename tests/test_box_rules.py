"""Box rules agree with their functions on arbitrary output boxes, not just whole-rank ones.

For a random sub-box of a step's output, the pieces its box rule returns, copied from the input,
must reproduce the function's output on that box element for element. Hypothesis draws shapes,
arguments and boxes.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import reference as ref
from helpers.boxes import apply_pieces, sub_box
from shardload.planning.registry import lookup


@st.composite
def _reorder_case(draw: st.DrawFn) -> tuple:
    n = draw(st.sampled_from([1, 2, 3, 4]))
    unit = draw(st.integers(1, 3))
    segments = draw(st.lists(st.integers(1, 3).map(lambda k: k * n), min_size=1, max_size=4))
    other = draw(st.integers(1, 3))
    dim = draw(st.integers(0, 1))
    shape = [other, other]
    shape[dim] = sum(segments) * unit
    return tuple(shape), dim, segments, n, unit


@settings(max_examples=150, deadline=None)
@given(case=_reorder_case(), data=st.data())
def test_reorder_segments_boxes(case: tuple, data: st.DataObject) -> None:
    shape, dim, segments, n, unit = case
    x = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) + 1
    out_box = data.draw(sub_box(shape))
    want = ref.reorder_segments(x, dim, segments, n, unit)[tuple(slice(a, b) for a, b in out_box)]
    got = apply_pieces("shard_funcs.reorder_segments", x, out_box, (dim, segments, n, unit))
    np.testing.assert_array_equal(got, want)
    fn = lookup("shard_funcs.reorder_segments").fn(torch.from_numpy(x), dim, segments, n, unit)
    np.testing.assert_array_equal(fn.numpy(), ref.reorder_segments(x, dim, segments, n, unit))


@settings(max_examples=150, deadline=None)
@given(
    n=st.sampled_from([1, 2, 3, 4, 8]),
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    dim_pick=st.integers(0, 2),
    data=st.data(),
)
def test_shard_dim_and_replicate_boxes(n: int, shape: list[int], dim_pick: int, data: st.DataObject) -> None:
    dim = dim_pick % len(shape)
    shape = list(shape)
    shape[dim] *= n
    x = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) + 1
    out_shape, _ = lookup("shard_funcs.shard_dim").shape(tuple(shape), "int64", dim, n)
    out_box = data.draw(sub_box(out_shape))
    want = ref.shard_dim(x, dim, n)[tuple(slice(a, b) for a, b in out_box)]
    np.testing.assert_array_equal(apply_pieces("shard_funcs.shard_dim", x, out_box, (dim, n)), want)
    rep_box = data.draw(sub_box((n, *shape)))
    want = ref.replicate(x, n)[tuple(slice(a, b) for a, b in rep_box)]
    np.testing.assert_array_equal(apply_pieces("shard_funcs.replicate", x, rep_box, (n,)), want)


@st.composite
def _segments_case(draw: st.DrawFn) -> tuple:
    n = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    pack = draw(st.sampled_from([1, 1, 2, 4]))
    unit = pack * draw(st.integers(1, 2))
    kv_counts = [d for d in range(1, 9) if d % n == 0 or n % d == 0]
    segments, kv = [], []
    for _ in range(draw(st.integers(1, 3))):
        is_kv = draw(st.booleans())
        segments.append(draw(st.sampled_from(kv_counts)) if is_kv else n * draw(st.integers(1, 2)))
        kv.append(int(is_kv))
    dim = draw(st.integers(0, 1))
    shape = [draw(st.integers(1, 3)), draw(st.integers(1, 3))]
    shape[dim] = sum(segments) * unit // pack
    return tuple(shape), dim, segments, kv, n, unit, pack


@settings(max_examples=200, deadline=None)
@given(case=_segments_case(), data=st.data())
def test_shard_segments_boxes(case: tuple, data: st.DataObject) -> None:
    shape, dim, segments, kv, n, unit, pack = case
    x = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) + 1
    func = lookup("shard_funcs.shard_segments")
    args = (dim, segments, kv, n, unit, pack)
    out_shape, _ = func.shape(shape, "int64", *args)
    full = ref.shard_segments(x, *args)
    assert tuple(full.shape) == tuple(out_shape)
    out_box = data.draw(sub_box(out_shape))
    want = full[tuple(slice(a, b) for a, b in out_box)]
    np.testing.assert_array_equal(apply_pieces("shard_funcs.shard_segments", x, out_box, args), want)
    np.testing.assert_array_equal(func.fn(torch.from_numpy(x), *args).numpy(), full)


@st.composite
def _pad_case(draw: st.DrawFn) -> tuple:
    n = draw(st.sampled_from([1, 2, 3, 4, 8]))
    shape = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    dim = draw(st.integers(0, len(shape) - 1))
    multiple = draw(st.sampled_from([n, n, 2 * n, 4 * n]))  # num_shards divides the padded size
    return tuple(shape), dim, multiple, n


@settings(max_examples=200, deadline=None)
@given(case=_pad_case(), data=st.data())
def test_pad_dim_boxes(case: tuple, data: st.DataObject) -> None:
    """pad_dim's box rule, on any sub-box of its output (stored part, padding or both), and its function agree
    with the reference: stored elements where they were, zeros after."""
    shape, dim, multiple, n = case
    x = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) + 1
    func = lookup("shard_funcs.pad_dim")
    assert func.pads and func.remap
    out_shape, _ = func.shape(shape, "int64", dim, multiple, n)
    full = ref.pad_dim(x, dim, multiple, n)
    assert tuple(full.shape) == tuple(out_shape)
    out_box = data.draw(sub_box(out_shape))
    want = full[tuple(slice(a, b) for a, b in out_box)]
    np.testing.assert_array_equal(apply_pieces("shard_funcs.pad_dim", x, out_box, (dim, multiple, n)), want)
    np.testing.assert_array_equal(func.fn(torch.from_numpy(x), dim, multiple, n).numpy(), full)


@st.composite
def _padded_chain(draw: st.DrawFn) -> tuple:
    n = draw(st.sampled_from([1, 2, 3, 4, 5, 8]))
    shape = draw(st.lists(st.integers(1, 11), min_size=1, max_size=3))
    dim = draw(st.integers(0, len(shape) - 1))
    multiple = draw(st.sampled_from([n, 2 * n, 8 * n]))
    return tuple(shape), dim, multiple, n


@settings(max_examples=150, deadline=None)
@given(case=_padded_chain())
def test_pad_then_shard_plan_covers_every_rank(case: tuple) -> None:
    """Traced through a plan, pad_dim + shard_dim give each rank copies of its stored elements and zero boxes for
    the rest: together they rebuild the reference's rank slice, every element written once (no data file)."""
    from pathlib import Path

    from shardload.format.shard_info import ShardInfo
    from shardload.planning.plan import build_plan
    from shardload.planning.runs import param_runs
    from shardload.sources.checkpoint import Checkpoint
    from shardload.sources.tensor_info import TensorInfo

    shape, dim, multiple, n = case
    x = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) + 1
    steps = [["shard_funcs.pad_dim", [None, None], dim, multiple, "num_shards"],
             ["shard_funcs.shard_dim", [None, None], dim, "num_shards"]]  # fmt: skip
    info = TensorInfo("w", "int64", shape, Path("<none>"), 0, x.nbytes)
    checkpoint = Checkpoint(Path("<m>"), Path("."), "safetensors", {"w": info})
    param = build_plan(ShardInfo.from_dict({"version": 1, "params": {"w": steps}}), checkpoint, n).params["w"]
    want = ref.rank_slices(x, [("pad_dim", dim, multiple, n), ("shard_dim", dim, n)], n)
    for r in range(n):
        got = np.full(param.shape, -1, dtype=np.int64)
        written = np.zeros(param.shape, dtype=np.int64)
        for piece in param.pieces(r) or []:
            dst = tuple(slice(a, b) for a, b in piece.dst)
            got[dst] = x[tuple(slice(a, b) for a, b in piece.src)].reshape(got[dst].shape)
            written[dst] += 1
        for box in param.zeros(r):
            got[tuple(slice(a, b) for a, b in box)] = 0
            written[tuple(slice(a, b) for a, b in box)] += 1
        assert (written == 1).all()
        np.testing.assert_array_equal(got, want[r])
        assert param.read_nbytes(r) == int((want[r] != 0).sum()) * 8  # reads only stored elements (all nonzero)
    assert param_runs(param, range(n)) is not None  # the coverage check accepts runs + padding


@settings(max_examples=100, deadline=None)
@given(
    n=st.sampled_from([1, 2, 3, 4, 8]),
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    dim_pick=st.integers(0, 2),
    group_size=st.integers(1, 4),
    data=st.data(),
)
def test_shard_packed_and_groups_boxes(
    n: int, shape: list[int], dim_pick: int, group_size: int, data: st.DataObject
) -> None:
    """The quantized splits (packed words, per-group values) move what their functions move, on any box."""
    dim = dim_pick % len(shape)
    shape = list(shape)
    shape[dim] *= n
    x = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) + 1
    for name, args in (("shard_funcs.shard_packed", (dim, 8, n)), ("shard_funcs.shard_groups", (dim, group_size, n))):
        func = lookup(name)
        out_shape, _ = func.shape(tuple(shape), "int32", *args)
        whole = func.fn(torch.from_numpy(x), *args).numpy()
        np.testing.assert_array_equal(whole, ref.shard_dim(x, dim, n))
        out_box = data.draw(sub_box(out_shape))
        want = whole[tuple(slice(a, b) for a, b in out_box)]
        np.testing.assert_array_equal(apply_pieces(name, x, out_box, args), want)


def test_every_built_in_box_rule_has_a_property_test() -> None:
    """A built-in step with a box rule (the planner reads through it) is exercised on arbitrary boxes above."""
    from pathlib import Path

    from shardload.planning import registry

    text = Path(__file__).read_text()
    ruled = sorted(name for name, step in registry._REGISTRY.items() if name.startswith("shard_funcs.") and step.boxes)
    assert ruled, "no built-in step with a box rule is registered"
    untested = [name for name in ruled if f'"{name}"' not in text.split("def test_every_built_in_box_rule")[0]]
    assert untested == [], f"box rules without a property test here: {untested}"
