"""Zero padding (``shard_funcs.pad_dim``, a remap with a zero-filled region) on every read path.

Every destination is allocated poisoned (``torch.empty`` filled with ones), so a padded element that no path
writes shows up; each rank's tensor must equal the numpy reference element for element (padding included), and
a rank must read exactly its own stored bytes, nothing for its padding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardload
import shardload.engine.read_schedule as read_schedule
import shardload.engine.transfer as transfer
import shardload.engine.writer as writer
from helpers import reference as ref
from helpers.checkpoints import random_array, write_model
from shardload.engine.run import run_plan
from shardload.engine.steps import run_steps
from shardload.engine.transfer import Transfer
from shardload.errors import PlanError
from shardload.format.shard_info import ShardInfo
from shardload.planning.plan import build_plan
from shardload.planning.registry import register, unregister
from shardload.sources.checkpoint import open_checkpoint
from shardload.sources.reader import Reader, count_reads

VOCAB, HIDDEN = 250, 16


def _steps(dim: int, multiple: int | str) -> list[list[Any]]:
    return [
        ["shard_funcs.pad_dim", [None, None], dim, multiple, "num_shards"],
        ["shard_funcs.shard_dim", [None, None], dim, "num_shards"],
    ]


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A vocabulary of 250 rows (vLLM's rule), an LM head and its bias (plain rule), a column-padded tensor, and
    a replicated one."""
    rng = np.random.default_rng(5)
    tensors = {
        "embed": random_array(rng, (VOCAB, HIDDEN), "float16"),
        "head": random_array(rng, (VOCAB, HIDDEN), "float32"),
        "head_bias": random_array(rng, (VOCAB,), "float32"),
        "cols": random_array(rng, (8, 30), "int32"),
        "norm": random_array(rng, (HIDDEN,), "float32"),
    }
    info = {
        "version": 1,
        "num_shards": None,
        "params": {
            "embed": _steps(0, 64),
            "head": _steps(0, "num_shards"),
            "head_bias": _steps(0, "num_shards"),
            "cols": _steps(1, "num_shards"),
        },
    }
    return write_model(tmp_path_factory.mktemp("padded") / "m", tensors, info)


REF_STEPS = {
    "embed": lambda n: [("pad_dim", 0, 64, n), ("shard_dim", 0, n)],
    "head": lambda n: [("pad_dim", 0, n, n), ("shard_dim", 0, n)],
    "head_bias": lambda n: [("pad_dim", 0, n, n), ("shard_dim", 0, n)],
    "cols": lambda n: [("pad_dim", 1, n, n), ("shard_dim", 1, n)],
}


def _reference(model: Path, n: int) -> list[dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    stored = load_file(str(model / "model.safetensors"))
    out: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    for name, x in stored.items():
        slices = ref.rank_slices(x, REF_STEPS[name](n), n) if name in REF_STEPS else [x] * n
        for r in range(n):
            out[r][name] = slices[r]
    return out


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor shardload allocates with ``torch.empty`` starts as ones, never as the zeros padding must be."""
    real = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        return real(*args, **kwargs).fill_(1)

    monkeypatch.setattr(torch, "empty", empty)


def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "STAGE_BYTES", 256)
    monkeypatch.setattr(read_schedule, "STAGE_MIN_SLICE", 16)
    monkeypatch.setattr(transfer, "JOB_BYTES", 160)
    monkeypatch.setattr(writer, "STAGE_SET_BYTES", 192)
    monkeypatch.setattr(writer, "STAGE_CHUNK_LIMITS", (48, 400))
    monkeypatch.setattr(writer, "READ_THROUGH_BYTES", 32)


def _load(path: str, model: Path, n: int, tmp: Path) -> list[dict[str, Any]]:
    plan = shardload.plan_model(model, n)
    options = shardload.ReadOptions(strategy="map" if path in ("map", "staged_map") else "read")
    if path in ("read", "map"):
        return [shardload.load_rank(model, r, n, read_options=options) for r in range(n)]
    if path in ("staged_read", "staged_map"):
        return [run_plan(plan, [r], ["cpu"], staged=True, read_options=options)[0] for r in range(n)]
    if path == "all":
        return shardload.load(model, n, devices=["cpu"] * n, read_options=options)
    if path == "staged_all":
        return run_plan(plan, range(n), ["cpu"] * n, staged=True, read_options=options)
    if path == "mmap":
        return [shardload.load_rank(model, r, n, mmap=True, read_options=options) for r in range(n)]
    if path == "out":  # a server's own (dirty) parameter memory
        result: list[dict[str, Any]] = [{} for _ in range(n)]
        with Reader() as reader, Transfer(reader, read_options=options) as t:
            for param in plan.params.values():
                dirty = [torch.full(param.shape, 3, dtype=getattr(torch, param.dtype)) for _ in range(n)]
                for r, got in enumerate(t.param(param, range(n), out=dirty)):
                    result[r][param.name] = got
            t.wait()
        return result
    if path == "compute":
        from safetensors.torch import load_file

        stored = load_file(str(model / "model.safetensors"))
        return [{name: run_steps(param, stored[name])[r] for name, param in plan.params.items()} for r in range(n)]
    assert path in ("convert", "convert_mmap")
    shardload.convert(model, n, tmp)
    return [shardload.load_rank(tmp, r, n, verify=True, mmap=path == "convert_mmap", read_options=options)
            for r in range(n)]  # fmt: skip


PATHS = ("read", "map", "staged_read", "staged_map", "all", "staged_all", "mmap", "out", "compute", "convert",
         "convert_mmap")  # fmt: skip


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [3, 4, 8])
def test_padding_is_zero_on_every_path(
    padded_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str, n: int
) -> None:
    _small_chunks(monkeypatch)
    if n == 3:  # vLLM's rule cannot serve 3 ranks here (256 rows): a one-line error, then the plain rule alone
        with pytest.raises(PlanError, match=r"embed: step 1 \(shard_funcs.pad_dim\): size 250 padded to 256 .*=3"):
            shardload.plan_model(padded_model, 3)
        return
    want = _reference(padded_model, n)
    got = _load(path, padded_model, n, tmp_path / "out")
    for r in range(n):
        assert got[r].keys() == want[r].keys()
        for name, t in got[r].items():
            assert tuple(t.shape) == want[r][name].shape, (path, r, name)
            np.testing.assert_array_equal(t.numpy(), want[r][name], err_msg=f"{path} rank {r} {name}")
    last = got[n - 1]["embed"].numpy()
    stored = VOCAB - (n - 1) * (256 // n)
    assert (last[stored:] == 0).all() and last.shape[0] == 256 // n  # the padding itself: zeros


def _own_bytes(name: str, n: int, r: int) -> int:
    """Bytes of rank r's stored rows (or columns), from the reference's arithmetic alone."""
    if name == "embed":
        per, rows, row = 256 // n, VOCAB, HIDDEN * 2
    elif name == "head":
        per, rows, row = -(-VOCAB // n), VOCAB, HIDDEN * 4
    elif name == "head_bias":
        per, rows, row = -(-VOCAB // n), VOCAB, 4
    else:
        per, rows, row = -(-30 // n), 30, 8 * 4  # columns of 8 int32 rows
    return (min(rows, (r + 1) * per) - min(rows, r * per)) * row


@pytest.mark.parametrize("strategy", ["read", "map"])
@pytest.mark.parametrize("n", [4, 8])
def test_a_rank_reads_its_own_rows_and_nothing_for_padding(padded_model: Path, strategy: str, n: int) -> None:
    options = shardload.ReadOptions(strategy=strategy)
    plan = shardload.plan_model(padded_model, n)
    for r in range(n):
        own = {name: _own_bytes(name, n, r) for name in REF_STEPS}
        assert {name: plan.params[name].read_nbytes(r) for name in REF_STEPS} == own
        with count_reads() as seen:
            state = shardload.load_rank(padded_model, r, n, read_options=options)
        assert seen.bytes == sum(own.values()) + state["norm"].numel() * 4


def test_padding_of_the_last_rank_is_listed(padded_model: Path) -> None:
    plan = shardload.plan_model(padded_model, 4)
    embed = plan.params["embed"]
    assert embed.pads and embed.shape == (64, HIDDEN)
    assert embed.zeros(0) == [] and embed.zeros(3) == [((58, 64), (0, HIDDEN))]
    assert plan.params["cols"].zeros(3) == [((0, 8), (6, 8))]  # 30 columns padded to 32: rank 3 holds 6 + 2
    assert shardload.plan_model(padded_model, 2).params["embed"].zeros(1) == []  # 2 divides 250: no padding


def test_a_box_rule_without_a_source_needs_pads(tmp_path: Path) -> None:
    """Only a step registered with pads=True may leave output without a source; pads needs a box rule."""

    def shape(s: tuple[int, ...], d: str, n: int) -> tuple[tuple[int, ...], str]:
        return (n, *s), d

    def boxes(out_box: Any, in_shape: Any, n: int) -> list[Any]:
        return [(None, out_box)]

    def no_source(x: torch.Tensor, num_shards: int) -> torch.Tensor:
        return torch.zeros(num_shards, *x.shape, dtype=x.dtype)

    register("tests.no_source", shape=shape, boxes=boxes)(no_source)
    try:
        model = write_model(tmp_path, {"w": np.ones((4, 2), np.float32)})
        info = ShardInfo.from_dict({"version": 1, "params": {"w": [["tests.no_source", [None, None], "num_shards"]]}})
        plan = build_plan(info, open_checkpoint(model), 2)
        with pytest.raises(PlanError, match=r"w: step 1 \(tests.no_source\): .*no source.*pads=True"):
            plan.params["w"].pieces(0)
    finally:
        unregister("tests.no_source")
    with pytest.raises(TypeError, match="pads=True"):
        register("tests.pads_without_boxes", shape=shape, pads=True)(no_source)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("strategy", ["read", "map"])
def test_padding_is_zero_on_the_gpu(padded_model: Path, strategy: str) -> None:
    """Pinned staging and side-stream uploads onto a GPU: the padding (zeroed on the default stream) survives the
    uploads of the stored rows, whether read with preadv or copied out of a mapping."""
    options = shardload.ReadOptions(strategy=strategy)
    n = 4
    want = _reference(padded_model, n)
    every = shardload.load(padded_model, n, devices=["cuda:0"] * n, read_options=options)
    for r in range(n):
        for got in (every[r], shardload.load_rank(padded_model, r, n, device="cuda:0", read_options=options)):
            for name, t in got.items():
                assert t.device.type == "cuda"
                np.testing.assert_array_equal(t.cpu().numpy(), want[r][name], err_msg=f"{strategy} rank {r} {name}")
