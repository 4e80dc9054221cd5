"""Ranks that load one model side by side agree on what they read (``same_checkpoint``, which vLLM's loader runs
in its tensor-parallel group): a checkpoint replaced or rewritten between two ranks' loads gives each rank a whole
state dict of another version, which no single load can see; the group compares the files its ranks read and
refuses on every rank in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.rendezvous import STORE_ENV, new_store
from shardload.engine.agreement import file_rows, first_disagreement
from shardload.format.input_log import InputLog

WORKER = Path(__file__).resolve().parent / "agreement_worker.py"


def _run(model: Path, case: str) -> list[str]:
    """Each rank's one line of output (``OK ...`` or ``ERROR ...``), by rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", STORE_ENV: new_store(), "WORLD_SIZE": "2",
           "PYTHONPATH": os.pathsep.join(sys.path)}  # fmt: skip
    command = [sys.executable, str(WORKER), str(model), case]
    procs = [
        subprocess.Popen(
            command, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
    return [next(line for line in out.splitlines() if line.startswith(("OK", "ERROR"))) for out in outs]


CASES = ["none", "replace", "reheader", "rewrite-keep-mtime", "touch", "touch-hosts", "own-copy", "slow", "fail",
         "shared"]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_ranks_that_read_different_versions_refuse_together(example_dir: Path, tmp_path: Path, case: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(example_dir, model)
    if case == "own-copy":  # rank 1 loads its own copy, at another path on this host (other inodes)
        shutil.copytree(model, tmp_path / "model-copy")
    lines = _run(model, case)
    if case in ("none", "touch-hosts", "own-copy", "slow"):  # another copy's times are not compared; loads may end
        # minutes apart: the comparison waits as the group's own timeout allows
        assert all(line.startswith("OK") for line in lines), lines
        return
    if case == "shared":
        for line in lines:
            assert line.startswith("ERROR") and "a load with group= inside same_checkpoint" in line, lines
        return
    if case == "fail":
        want = f"ERROR {model}: rank 1 failed to load this model (its own error says why); nothing was returned"
        assert lines[0] == want, lines
        assert lines[1].startswith("ERROR") and "no.such.weight" in lines[1], lines
        return
    detail = "its header or size differs" if case == "reheader" else "on one host, another inode"
    for line in lines:
        assert line.startswith(f"ERROR {model}: ranks 0 and 1 read different versions of model.safetensors ("), line
        assert detail in line and "the checkpoint changed between their loads" in line and "\n" not in line, line


def test_rows_compare_the_files_two_ranks_both_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file only one rank read (its own rank file of a converted directory) is not compared; one both read is,
    its identity only between ranks on one host that read one path on a file system whose inode numbers are stable
    (not a FUSE mount, which may number a file anew at each lookup)."""
    from shardload.format import input_log

    kinds = {1: "ext4", 2: "fuse.rclone"}
    monkeypatch.setattr(input_log, "file_system", kinds.get)
    a, b = InputLog(), InputLog()
    for log in (a, b):
        log.data["/m/shard_manifest.json"] = b"{}"
        log.stamps["/m/shard_manifest.json"] = (1, 2, 2, 10, 10)
    a.data["/m/rank-0.safetensors"] = b"zero"
    b.data["/m/rank-1.safetensors"] = b"one"
    rows = [[(r.key, r.content, r.path, r.version, r.identity) for r in file_rows(log, "/m")] for log in (a, b)]
    assert first_disagreement(rows, [7, 7], {}) is None
    b.stamps["/m/shard_manifest.json"] = (1, 3, 2, 10, 10)  # another inode: replaced
    rows[1] = [(r.key, r.content, r.path, r.version, r.identity) for r in file_rows(b, "/m")]
    names = {r.key: r.name for r in file_rows(a, "/m")}
    assert first_disagreement(rows, [7, 8], names) is None  # two hosts: their own copies
    found = first_disagreement(rows, [7, 7], names)
    assert found is not None and found[:2] == ((0, 1), "shard_manifest.json"), found
    c = InputLog(data=dict(b.data), stamps={"/n/shard_manifest.json": (1, 4, 2, 11, 11)})  # a copy at another path
    c.data["/n/shard_manifest.json"] = c.data.pop("/m/shard_manifest.json")
    copy = [(r.key, r.content, r.path, r.version, r.identity) for r in file_rows(c, "/n")]
    assert first_disagreement([rows[0], copy], [7, 7], names) is None  # one host, its own copy: other times
    fuse = [InputLog(data=dict(log.data), stamps={k: (2, *v[1:]) for k, v in log.stamps.items()}) for log in (a, b)]
    on_fuse = [[(r.key, r.content, r.path, r.version, r.identity) for r in file_rows(log, "/m")] for log in fuse]
    assert first_disagreement(on_fuse, [7, 7], names) is None  # one FUSE mount: its inode numbers tell nothing
    b.data["/m/shard_manifest.json"] = b"{ }"
    rows[1] = [(r.key, r.content, r.path, r.version, r.identity) for r in file_rows(b, "/m")]
    found = first_disagreement(rows, [7, 8], names)
    assert found is not None and found[2] == "its header or size differs", found

    def rows_of(log: InputLog, root: str) -> list[tuple[bytes, ...]]:
        return [(r.key, r.content, r.path, r.version, r.identity) for r in file_rows(log, root)]

    key, mirrored = "s3://b/m/model.safetensors", "s3://c/m/model.safetensors"
    old, new = (InputLog(data={key: b"h"}, versions={key: etag}) for etag in ('"1"', '"2"'))
    mirror = InputLog(data={mirrored: b"h"}, versions={mirrored: '"3"'})  # a copy made with other part sizes
    replaced = first_disagreement([rows_of(old, "s3://b/m"), rows_of(new, "s3://b/m")], [7, 8], {})
    assert replaced is not None and replaced[2] == "another version of the object answered", replaced
    assert first_disagreement([rows_of(old, "s3://b/m"), rows_of(mirror, "s3://c/m")], [7, 8], {}) is None
