"""A converted directory's rank files and its manifest are checked to belong together, verification on or off: a
manifest whose plan was edited (the rank files untouched) gave every rank wrong bytes at another N, even with
``verify=True``, and ``verify_dir`` passed it; a rank file whose header was edited with its size kept (a dtype of
the same width, a shape reversed, two offsets swapped) loaded at the directory's own N. Each is now one line naming
the file, compared element for element with the source where a load succeeds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import shardload
from helpers.checkpoints import rewrite_header, seal_as_version_1, unseal
from helpers.verified import N
from shardload.errors import ShardloadError
from shardload.sources.manifest import MANIFEST_NAME

SEGMENTS = ["shard_funcs.shard_segments", [["num_shards", "512 // num_shards", 2048], "float16"], 0, [256, 256],
            [0, 0], "num_shards"]  # fmt: skip
"""A step giving ``row.weight``'s ranks the shape shard_dim gives them, other rows."""


def _manifest(out: Path) -> dict:
    return json.loads((out / MANIFEST_NAME).read_text())


def _write(out: Path, manifest: dict) -> None:
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))


def _edit_plan(out: Path) -> None:
    """Give ``row.weight`` other steps of the same shapes in both the manifest's source record and its shard_info
    (what a load at another N checks against each other)."""
    from shardload.engine.reshard import read_record
    from shardload.planning.plan import build_plan
    from shardload.sources.checkpoint import open_checkpoint

    manifest = _manifest(out)
    manifest["source_plan"]["shard_info"]["params"]["row.weight"] = [SEGMENTS]
    info, stored, _ = read_record(manifest["source_plan"], open_checkpoint(out), "x")
    manifest["shard_info"] = json.loads(json.dumps(build_plan(info, stored, N).resolved_shard_info()))
    _write(out, manifest)


def _expected(model: Path, rank: int, n: int) -> dict[str, np.ndarray]:
    """Rank ``rank`` of ``n`` from the source file by numpy alone (row.weight by rows, col.weight by columns)."""
    full = load_file(str(model / "model.safetensors"))
    return {"row.weight": np.split(full["row.weight"], n, 0)[rank],
            "col.weight": np.split(full["col.weight"], n, 1)[rank], "norm.weight": full["norm.weight"]}  # fmt: skip


def _same(got: dict, want: dict[str, np.ndarray]) -> bool:
    return set(got) == set(want) and all(np.array_equal(got[k].numpy(), v) for k, v in want.items())


@pytest.fixture
def converted(split_model: Path, tmp_path: Path) -> Path:
    out = shardload.convert(split_model, N, tmp_path / "out").out_dir
    for n in (N, 2):
        assert _same(shardload.load_rank(out, 1, n), _expected(split_model, 1, n))
    return out


@pytest.mark.parametrize("verify", [False, True])
def test_a_manifest_whose_plan_was_edited_is_refused_at_another_n(converted: Path, verify: bool) -> None:
    _edit_plan(converted)
    with pytest.raises(ShardloadError, match="manifest") as excinfo:
        shardload.load_rank(converted, 1, 2, verify=verify)
    assert "\n" not in str(excinfo.value) and "rank-0000" in str(excinfo.value)
    assert not shardload.verify_dir(converted).ok


def test_a_manifest_edit_outside_the_plan_still_loads(split_model: Path, converted: Path) -> None:
    """What the seal leaves out (which shardload wrote it, the source files' sizes) is not a reason to refuse."""
    manifest = _manifest(converted)
    manifest["shardload_version"] = "0.0.1"
    manifest["source"]["files"][0]["size"] += 1
    _write(converted, manifest)
    for n in (N, 2):
        assert _same(shardload.load_rank(converted, 1, n), _expected(split_model, 1, n))


@pytest.mark.parametrize("edit", ["dtype", "shape", "offsets"])
@pytest.mark.parametrize("n", [N, 2])
def test_a_rank_header_edited_with_its_size_kept_is_refused(converted: Path, edit: str, n: int) -> None:
    def change(header: dict) -> None:
        if edit == "dtype":
            header["row.weight"]["dtype"] = "I16"  # the same width
        elif edit == "shape":
            header["row.weight"]["shape"] = header["row.weight"]["shape"][::-1]  # [128, 2048] to [2048, 128]
        else:  # row.weight and col.weight are the same size: each other's bytes
            row, col = header["row.weight"], header["col.weight"]
            row["data_offsets"], col["data_offsets"] = col["data_offsets"], row["data_offsets"]

    rewrite_header(converted / f"rank-00001-of-{N:05d}.safetensors", change)
    with pytest.raises(ShardloadError, match="rank-00001") as excinfo:
        shardload.load_rank(converted, 1 if n == N else 0, n)
    assert "\n" not in str(excinfo.value)


@pytest.mark.parametrize("n", [N, 2])
def test_rank_files_swapped_with_their_rank_fields_edited_are_refused(converted: Path, n: int) -> None:
    """Two rank files of the same shapes swapped, each header's ``shardload.rank`` set to its new name's rank (its
    size kept): the seal covers the rank a file says it is, so no load takes the other rank's bytes."""

    def name(rank: int) -> Path:
        return converted / f"rank-{rank:05d}-of-{N:05d}.safetensors"

    name(1).rename(converted / "swap")
    name(2).rename(name(1))
    (converted / "swap").rename(name(2))
    for rank in (1, 2):
        rewrite_header(name(rank), lambda header, r=rank: header["__metadata__"].update({"shardload.rank": str(r)}))
    with pytest.raises(ShardloadError, match=r"rank-0000[12]") as excinfo:
        shardload.load(converted, n, ["cpu"] * n)
    assert "\n" not in str(excinfo.value)


def test_a_directory_sealed_by_version_1_still_loads(split_model: Path, converted: Path) -> None:
    """Rank files an earlier shardload sealed without their place load as before; an unknown seal version is one
    line."""
    seal_as_version_1(converted)
    for n in (N, 2):
        assert _same(shardload.load_rank(converted, 1, n), _expected(split_model, 1, n))
    manifest = _manifest(converted)
    manifest["sealed"] = 3
    _write(converted, manifest)
    with pytest.raises(ShardloadError, match="seals of version 3") as excinfo:
        shardload.load_rank(converted, 1, N)
    assert "\n" not in str(excinfo.value)


def test_a_directory_without_seals_still_loads(split_model: Path, converted: Path) -> None:
    """An older shardload's rank files carry no seal: they load as before (the checks they always had)."""
    unseal(converted)
    for n in (N, 2):
        assert _same(shardload.load_rank(converted, 1, n), _expected(split_model, 1, n))


def test_a_rank_file_named_with_six_digits_is_refused_in_one_line(converted: Path) -> None:
    """A manifest listing ``rank-000001-of-00004.safetensors`` passed its check and the load ended in a bare
    StopIteration (own N) or KeyError (another N)."""
    manifest = _manifest(converted)
    old = f"rank-00001-of-{N:05d}.safetensors"
    (converted / old).rename(converted / f"rank-000001-of-{N:05d}.safetensors")
    for entry in manifest["files"]:
        if entry["path"] == old:
            entry["path"] = f"rank-000001-of-{N:05d}.safetensors"
    _write(converted, manifest)
    for n in (N, 2):
        with pytest.raises(ShardloadError, match="inconsistent manifest") as excinfo:
            shardload.load_rank(converted, 0, n)
        assert "\n" not in str(excinfo.value)


def test_a_source_record_entry_of_the_wrong_form_is_refused_in_one_line(converted: Path) -> None:
    """A stored tensor entry of ``[shape, dtype]`` raised a bare TypeError (unhashable list)."""
    manifest = _manifest(converted)
    entry = manifest["source_plan"]["tensors"]["row.weight"]
    manifest["source_plan"]["tensors"]["row.weight"] = entry[::-1]
    _write(converted, manifest)
    with pytest.raises(ShardloadError, match=r"row\.weight") as excinfo:
        shardload.load_rank(converted, 0, 2)
    assert "\n" not in str(excinfo.value)
    assert not shardload.verify_dir(converted).ok


def test_a_rank_file_stripped_of_its_seal_is_refused(converted: Path) -> None:
    """A seal taken out of a rank header (the header padded back to its size) turned the check off; the manifest
    says every rank file of the directory is sealed."""
    rewrite_header(converted / f"rank-00001-of-{N:05d}.safetensors", lambda h: h["__metadata__"].pop("shardload.seal"))
    for n in (N, 2):
        with pytest.raises(ShardloadError, match=r"rank-00001-of-00004\.safetensors: carries no seal") as err:
            shardload.load_rank(converted, 1 if n == N else 0, n)
        assert "\n" not in str(err.value)


def test_manifest_digests_taken_from_many_threads_at_once() -> None:
    """The digests of the last manifests read are kept for the rank files of one load; threads loading other
    directories at once raced on evicting one (a bare KeyError out of a load)."""
    import sys
    import threading

    from shardload.sources.manifest import manifest_digest

    failures: list[BaseException] = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes: the race shows at once

    def digest_many(seed: int) -> None:
        try:
            for i in range(3000):
                manifest_digest({"num_shards": seed * 10_000 + i, "files": []})
        except BaseException as err:  # any failure is the finding
            failures.append(err)

    threads = [threading.Thread(target=digest_many, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert not failures, failures[:3]
