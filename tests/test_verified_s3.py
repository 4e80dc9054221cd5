"""Verified loading from object storage: the record beside the objects, read like any of them; a byte altered in
the store fails the rank that reads it (a real S3 server, moto, on loopback)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import shardload
from shardload.cli.main import main
from shardload.engine.hashing import hash_model
from shardload.errors import ShardloadError
from shardload.format.hash_record import RECORD_NAME

if os.environ.get("CI") != "true":
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")

from helpers.s3 import BUCKET, S3, use_endpoint
from helpers.verified import N, offset_of, tampered


@pytest.mark.slow
def test_verified_load_from_s3(s3: S3, split_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_endpoint(monkeypatch, s3.url, tmp_path)
    root = hash_model(split_model).root
    uri = s3.upload_dir(split_model, "verified")
    # hashing the objects gives the same record as hashing the files, written to -o FILE or beside the objects
    assert hash_model(uri, tmp_path / "from-s3.hashes").root == root
    for rank in range(N):
        local = shardload.load_rank(split_model, rank, N)
        for verify in (True, root):
            remote = shardload.load_rank(uri, rank, N, verify=verify)
            assert all(torch.equal(local[k], remote[k]) for k in local)
    bad = s3.upload_dir(tampered(split_model, tmp_path / "bad", offset_of(split_model, "col.weight", 9, 2500)), "bad")
    with pytest.raises(ShardloadError) as excinfo:
        shardload.load_rank(bad, 2, N, verify=root)
    assert "col.weight" in str(excinfo.value) and "\n" not in str(excinfo.value)
    shardload.load_rank(bad, 0, N, verify=root)  # rank 0 never reads that band
    bare = shutil.copytree(split_model, tmp_path / "bare")
    (bare / RECORD_NAME).unlink()
    with pytest.raises(ShardloadError, match="shardload hash"):
        shardload.load_rank(s3.upload_dir(bare, "bare"), 0, N, verify=True)


@pytest.mark.slow
def test_hash_writes_the_record_beside_the_objects(
    s3: S3, split_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``shardload hash s3://...`` puts the record beside the objects (once: again leaves it untouched) and a
    verified load finds it there; a store that refuses the write is one line pointing to -o, nothing written."""
    use_endpoint(monkeypatch, s3.url, tmp_path)
    bare = shutil.copytree(split_model, tmp_path / "bare")
    (bare / RECORD_NAME).unlink(missing_ok=True)
    root = hash_model(split_model).root
    uri = s3.upload_dir(bare, "hash-here")
    done = CliRunner().invoke(main, ["hash", uri, "-q"])
    assert done.exit_code == 0 and done.output.strip() == root, done.output
    record = s3.client().get_object(Bucket=BUCKET, Key=f"hash-here/{RECORD_NAME}")["Body"].read()
    assert record == (split_model / RECORD_NAME).read_bytes()
    s3.proxy.reset()
    assert hash_model(uri).root == root  # identical record: no second PUT
    assert not [r for r in s3.proxy.served if r.method == "PUT"], s3.proxy.served
    for rank in range(N):
        local = shardload.load_rank(split_model, rank, N)
        remote = shardload.load_rank(uri, rank, N, verify=root)
        assert all(torch.equal(local[k], remote[k]) for k in local)
    denied = s3.upload_dir(bare, "denied")
    s3.proxy.faults.forbidden.add(f"denied/{RECORD_NAME}")
    try:
        done = CliRunner().invoke(main, ["hash", denied, "-q"])
    finally:
        s3.proxy.faults.forbidden.clear()
    assert done.exit_code == 1 and done.output.count("\n") == 1, done.output
    assert "access denied" in done.output and "give -o FILE" in done.output, done.output
    assert "testing" not in done.output  # no credential in the message
    assert "Contents" not in s3.client().list_objects_v2(Bucket=BUCKET, Prefix=f"denied/{RECORD_NAME}")
    out = tmp_path / "denied.hashes"
    assert CliRunner().invoke(main, ["hash", denied, "-o", str(out), "-q"]).output.strip() == root
