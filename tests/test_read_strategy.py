"""A single CPU rank's two ways of getting its bytes: strided copies out of a mapping (page cache warm, or runs
smaller than a page) and ``preadv`` of the exact runs (cold storage). Both give the unsharded reference's slices,
element for element, and read only the rank's own bytes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from test_load import reference_shards

import shardload
import shardload.engine.transfer as transfer
from conftest import write_model
from shardload.sources.reader import FileMaps, count_reads


@pytest.mark.parametrize("strategy", ["map", "read", "auto"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_strategies_match_reference(example_dir: Path, strategy: str, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "READ_STRATEGY", strategy)
    want = reference_shards(example_dir, n)
    plan = shardload.plan_model(example_dir, n)
    for r in range(n):
        with count_reads() as seen:
            got = shardload.load_rank(example_dir, r, n)
        assert got.keys() == want[r].keys()
        for name, t in got.items():
            np.testing.assert_array_equal(t.numpy(), want[r][name], err_msg=f"{strategy} rank {r} {name}")
        own = sum(t.numel() * t.element_size() for name, t in got.items() if plan.params[name].remap)
        whole = sum(p.source.nbytes for p in plan.params.values() if not p.remap)
        assert own <= seen.bytes <= own + whole
        if strategy == "map":
            assert seen.calls <= len([p for p in plan.params.values() if not p.remap])  # copies make no calls


@pytest.mark.parametrize("n", [2, 8])
def test_staged_copy_out_matches_reference(example_dir: Path, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU route, run on the CPU: strided copies out of the mapping gather a rank's bytes into small staging
    buffers (cycled many times per tensor), each then copied to the rank's tensor."""
    from shardload.engine.load import run_plan

    monkeypatch.setattr(transfer, "READ_STRATEGY", "map")
    monkeypatch.setattr(transfer, "STAGE_BYTES", 4096)
    want = reference_shards(example_dir, n)
    plan = shardload.plan_model(example_dir, n)
    for r in range(n):
        with count_reads() as seen:
            got = run_plan(plan, [r], ["cpu"], staged=True)[0]
        assert got.keys() == want[r].keys()
        for name, t in got.items():
            np.testing.assert_array_equal(t.numpy(), want[r][name], err_msg=f"rank {r} {name}")
        own = sum(t.numel() * t.element_size() for name, t in got.items() if plan.params[name].remap)
        assert own <= seen.bytes
        assert seen.calls <= len([p for p in plan.params.values() if not p.remap])  # copies, not reads


def test_column_slice_of_tall_narrow_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny runs (a few bytes per row) are copied out of the mapping, whatever the cache holds."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4096, 8)).astype(np.float32)
    info = {"w": [["shard_funcs.shard_dim", [[4, 4096, 2], "float32"], 1, 4]]}
    model = write_model(tmp_path / "m", {"w": w}, info)
    for r in range(4):
        with count_reads() as seen:
            got = shardload.load_rank(model, r, 4)
        np.testing.assert_array_equal(got["w"].numpy(), w[:, 2 * r : 2 * r + 2])
        assert seen.bytes == w.nbytes // 4 and seen.calls == 0


def _drop_cache(path: Path) -> float | None:
    """Drop ``path``'s pages from the page cache; return the cached fraction that is left."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    size = path.stat().st_size
    return FileMaps().resident(path, np.array([0]), np.array([size]))


def test_cold_file_is_read_with_preadv(tmp_path: Path) -> None:
    """Row shards of a file that is not in the page cache are read with preadv: exactly the rank's bytes."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((512, 1024)).astype(np.float16)  # rows of 2 KiB: runs of 256 KiB per rank
    info = {"w": [["shard_funcs.shard_dim", [[4, 128, 1024], "float16"], 0, 4]]}
    model = write_model(tmp_path / "m", {"w": w}, info)
    left = _drop_cache(model / "model.safetensors")
    if left is None or left > 0.5:
        pytest.skip(f"the kernel kept the file's pages cached ({left})")
    with count_reads() as seen:
        got = shardload.load_rank(model, 1, 4)
    np.testing.assert_array_equal(got["w"].numpy(), w[128:256])
    assert seen.bytes == w.nbytes // 4 and seen.calls >= 1  # preadv, not a mapping copy
    with count_reads() as warm:
        again = shardload.load_rank(model, 1, 4)  # now cached: copied out of the mapping
    assert torch.equal(got["w"], again["w"]) and warm.calls == 0


def test_file_cut_short_is_an_error_not_sigbus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "READ_STRATEGY", "map")
    w = np.arange(4096, dtype=np.float32).reshape(64, 64)
    model = write_model(tmp_path / "m", {"w": w}, {"w": [["shard_funcs.shard_dim", [[2, 64, 32], "float32"], 1, 2]]})
    plan = shardload.plan_model(model, 2)
    path = model / "model.safetensors"
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 1024)
    with pytest.raises(shardload.CheckpointError, match="shorter than its header says"):
        shardload.engine.load.run_plan(plan, [0], ["cpu"])
