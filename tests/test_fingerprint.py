"""Content fingerprints for share_reads (shardload.engine.fingerprint), in one process: where the blocks lie, what
two copies of a checkpoint compare as (identical copies elsewhere, a fine-tune under the same headers, a change
between the samples, Hub cache blobs). tests/test_shared_reads.py runs the group's comparison under torch.distributed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import shardload.engine.fingerprint as fp
from helpers.checkpoints import write_model
from shardload.sources.checkpoint import open_checkpoint
from shardload.sources.reader import Reader, count_reads


def prints(model: Path) -> tuple[fp.SamplePlan, list[fp.FileFingerprint]]:
    """The sample plan of every tensor of ``model`` and this copy's fingerprints."""
    plan = fp.plan_samples(open_checkpoint(model).tensors.values())
    with Reader() as reader:
        return plan, fp.fingerprint(plan, reader)


def flip(model: Path, name: str, at: int | None = None) -> None:
    """Change tensor ``name`` of ``model`` in place: every byte, or only the byte at ``at`` inside it."""
    info = open_checkpoint(model).tensors[name]
    with open(info.file, "r+b") as f:
        f.seek(info.offset)
        data = bytearray(f.read(info.nbytes))
        for k in range(len(data)) if at is None else [at]:
            data[k] ^= 0xFF
        f.seek(info.offset)
        f.write(data)


def test_identical_copies_agree_wherever_they_lie(example_multi_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere" / "model"
    shutil.copytree(example_multi_dir, copy)
    for f in copy.iterdir():
        os.utime(f, (1_000_000_000, 1_000_000_000))
    plan, mine = prints(example_multi_dir)
    other_plan, theirs = prints(copy)
    assert [f.nbytes for f in plan.files] == [f.nbytes for f in other_plan.files]
    assert fp.encode(mine) == fp.encode(theirs) and fp.first_difference(theirs, mine) is None
    assert fp.decode(fp.encode(mine)) == mine and len(fp.encode(mine)) == 2 * fp.row_bytes() == 2 * 553


def test_every_tensor_of_a_small_file_is_sampled_and_counted(example_multi_dir: Path) -> None:
    checkpoint = open_checkpoint(example_multi_dir)
    plan = fp.plan_samples(checkpoint.tensors.values())
    assert [f.file for f in plan.files] == list(dict.fromkeys(t.file for t in checkpoint.tensors.values()))
    for samples in plan.files:
        named = {t.name for t in checkpoint.tensors.values() if t.file == samples.file}
        assert len(samples.tensor) == fp.SAMPLES_PER_FILE and set(samples.tensor) == named
        assert bool(np.all(np.diff(samples.src) > 0)) and bool(np.all(samples.length <= fp.SAMPLE_BYTES))
        for slot, name in enumerate(samples.tensor):  # each slot's block lies inside its tensor
            t = checkpoint.tensors[name]
            k = samples.block[slot]
            assert t.offset <= samples.src[k] and samples.src[k] + samples.length[k] <= t.offset + t.nbytes
    with count_reads() as seen, Reader() as reader:
        fp.fingerprint(plan, reader)
    assert seen.bytes == plan.nbytes <= 2 * fp.SAMPLES_PER_FILE * fp.SAMPLE_BYTES


def test_a_fine_tune_under_the_same_headers_differs_in_its_tensor(example_multi_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "finetune"
    shutil.copytree(example_multi_dir, copy)
    name = "model.layers.0.post_attention_layernorm.weight"  # 512 bytes: the smallest kind of tensor
    flip(copy, name)
    plan, mine = prints(copy)
    diff = fp.first_difference(mine, prints(example_multi_dir)[1])
    assert diff is not None and diff.kind == fp.SAMPLE and plan.files[diff.file].tensor[diff.slot] == name
    err = fp.describe(plan, diff, 3, 0)
    assert str(err).startswith(f"{copy / 'model-00001-of-00002.safetensors'}: {name}: shared reads refused: rank 3's")
    assert err.param == name and "\n" not in str(err)


def test_a_change_between_the_samples_goes_unseen(tmp_path: Path) -> None:
    """The documented gap: a block is a sample, so a byte outside every sampled block is not compared."""
    model = write_model(tmp_path / "a", {"big.weight": np.zeros((1024, 1024), dtype=np.float32)})
    copy = tmp_path / "b"
    shutil.copytree(model, copy)
    plan, mine = prints(model)
    samples = plan.files[0]
    info = open_checkpoint(model).tensors["big.weight"]
    covered = np.zeros(info.nbytes, dtype=bool)
    for a, n in zip(samples.src.tolist(), samples.length.tolist(), strict=True):
        covered[a - info.offset : a - info.offset + n] = True
    assert 0 < covered.sum() < info.nbytes
    flip(copy, "big.weight", at=int(np.flatnonzero(~covered)[0]))
    assert fp.first_difference(prints(copy)[1], mine) is None, "outside the samples: not seen"
    flip(copy, "big.weight", at=int(np.flatnonzero(covered)[0]))
    assert fp.first_difference(prints(copy)[1], mine) is not None, "inside a sampled block: seen"


def test_many_tensors_share_the_samples(tmp_path: Path) -> None:
    tensors = {f"t{k:03d}": np.full(1000, k, dtype=np.float32) for k in range(200)}
    plan = fp.plan_samples(open_checkpoint(write_model(tmp_path / "m", tensors)).tensors.values())
    (samples,) = plan.files
    assert len(samples.tensor) == fp.SAMPLES_PER_FILE and len(set(samples.tensor)) == fp.SAMPLES_PER_FILE
    assert samples.nbytes == fp.SAMPLES_PER_FILE * 4000  # one whole 4000-byte tensor per block


def blob_name(salt: str, file: str) -> str:
    """A Hub cache blob name (64 hex digits) for ``file`` of the cache made with ``salt``."""
    return hashlib.sha256((salt + file).encode()).hexdigest()


def hub_copy(model: Path, cache: Path, salt: str) -> Path:
    """``model`` laid out as a Hugging Face Hub cache snapshot: its safetensors files are symlinks to blobs named
    by :func:`blob_name` (as the Hub names a large file's blob by its sha256)."""
    snapshot = cache / "models--org--name" / "snapshots" / "abc"
    blobs = cache / "models--org--name" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in model.iterdir():
        if f.suffix == ".safetensors":
            blob = blobs / blob_name(salt, f.name)
            shutil.copy(f, blob)
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
        elif f.is_file():
            shutil.copy(f, snapshot / f.name)
    return snapshot


def test_a_hub_cache_sha256_is_compared_where_both_copies_have_one(example_multi_dir: Path, tmp_path: Path) -> None:
    one = hub_copy(example_multi_dir, tmp_path / "hub1", "one")
    two = hub_copy(example_multi_dir, tmp_path / "hub2", "two")
    name = "model-00001-of-00002.safetensors"
    assert fp.hub_sha256(one / name) == bytes.fromhex(blob_name("one", name))
    assert fp.hub_sha256(example_multi_dir / name) is None
    plan, first = prints(one)
    diff = fp.first_difference(prints(two)[1], first)
    assert diff is not None and diff.kind == fp.SHA256, "the same bytes at every sample, another revision's hash"
    assert "has another sha256" in str(fp.describe(plan, diff, 1, 0))
    plain = prints(example_multi_dir)[1]  # a copy outside any Hub cache: nothing to compare the hash with
    assert fp.first_difference(plain, first) is None and fp.first_difference(first, plain) is None


@pytest.mark.parametrize("size", [0, 3])
def test_a_file_without_tensor_bytes_has_a_fingerprint(tmp_path: Path, size: int) -> None:
    model = write_model(tmp_path / "m", {"empty": np.zeros((0, 4), dtype=np.float32), "x": np.ones(size, np.uint8)})
    plan, mine = prints(model)
    assert plan.nbytes == size and len(mine) == 1 and len(mine[0].digests) == fp.SAMPLES_PER_FILE * fp.DIGEST_BYTES


def test_a_verdict_another_rank_sends_is_checked_before_it_is_used(example_multi_dir: Path) -> None:
    plan = fp.plan_samples(open_checkpoint(example_multi_dir).tensors.values())
    good = [fp.Difference(0, fp.SIZE), fp.Difference(1, fp.SAMPLE, 63), fp.Difference(1, fp.SHA256)]
    bad = [fp.Difference(2, fp.SIZE), fp.Difference(-1, fp.SAMPLE, 0), fp.Difference(0, fp.SAMPLE, 64),
           fp.Difference(0, 9), fp.Difference(0, fp.UNREADABLE)]  # fmt: skip
    assert all(fp.well_formed(plan, d) for d in good) and not any(fp.well_formed(plan, d) for d in bad)
    assert "has another size than rank 0's, though" in str(fp.describe(plan, good[0], 2, 0))


def test_fewer_blocks_when_tuned(example_multi_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp, "SAMPLES_PER_FILE", 4)
    plan, mine = prints(example_multi_dir)
    assert all(len(f.tensor) == 4 for f in plan.files) and plan.nbytes <= 2 * 4 * fp.SAMPLE_BYTES
    assert fp.decode(fp.encode(mine)) == mine and fp.row_bytes() == 8 + 1 + 32 + 4 * 8
