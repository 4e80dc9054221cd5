"""What a converted directory's checks must keep catching, whatever convert hashes as it writes: a byte changed
anywhere in any rank file fails ``load_rank(verify=True)``, ``verify=<root>``, ``verify_dir`` and ``shardload verify``;
and a directory in the format an older shardload wrote (a version-1 manifest with every file's sha256, a record with
both tilings) still loads and verifies."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch

import shardload
from helpers.verified import N
from shardload.errors import ShardloadError
from shardload.format.hash_record import RECORD_NAME, root_of
from shardload.sources.manifest import MANIFEST_NAME
from shardload.sources.safetensors_header import read_header


def _flip(path: Path, offset: int, mask: int = 0x40) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def _one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def _cli(*args: str) -> tuple[int, str]:
    from click.testing import CliRunner

    from shardload.cli.main import main

    result = CliRunner().invoke(main, list(args))
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def old_format(out: Path) -> Path:
    """Make converted directory ``out`` exactly what an older shardload wrote: the record of its rank files with both
    tilings (hashed by reading them back), and a version-1 manifest listing every file with its size and sha256."""
    from shardload.engine.hashing import hash_files

    manifest = json.loads((out / MANIFEST_NAME).read_text())
    ranks = [e["path"] for e in manifest["files"] if e["path"].endswith(".safetensors")]
    files = [out / name for name in ranks]
    record = hash_files(out, files, {f: list(read_header(f).values()) for f in files}).to_bytes()
    (out / RECORD_NAME).write_bytes(record)
    manifest["version"] = 1
    manifest["integrity"] = {"record": RECORD_NAME, "root": root_of(record)}
    manifest["files"] = [
        {"path": e["path"], "size": (out / e["path"]).stat().st_size,
         "sha256": hashlib.sha256((out / e["path"]).read_bytes()).hexdigest()}
        for e in manifest["files"]
    ]  # fmt: skip
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
    return out


def _offsets(path: Path) -> dict[str, int]:
    """Bytes of a rank file worth flipping: in its header's JSON, the first, a middle and the last tensor byte."""
    data = path.read_bytes()
    head = 8 + struct.unpack("<Q", data[:8])[0]
    ends = [t.offset + t.nbytes for t in read_header(path).values()]
    return {"header": 8 + head // 3, "first tensor byte": head, "middle": (head + len(data)) // 2,
            "last byte": max(ends) - 1}  # fmt: skip


@pytest.mark.parametrize("format_", ["current", "old"])
def test_every_rank_file_byte_change_is_caught(split_model: Path, tmp_path: Path, format_: str) -> None:
    out = shardload.convert(split_model, N, tmp_path / "out").out_dir
    if format_ == "old":
        old_format(out)
    root = shardload.Verify(root=json.loads((out / MANIFEST_NAME).read_text())["integrity"]["root"])
    plain = [shardload.load_rank(split_model, r, N) for r in range(N)]
    for rank in range(N):
        for verify in (True, root):
            got = shardload.load_rank(out, rank, N, verify=verify)
            assert all(torch.equal(got[k], plain[rank][k]) for k in plain[rank])
    assert shardload.verify_dir(out).ok
    assert _cli("verify", str(out))[0] == 0
    original = {p.name: p.read_bytes() for p in out.iterdir() if p.name.endswith(".safetensors")}
    for rank in range(N):
        name = f"rank-{rank:05d}-of-{N:05d}.safetensors"
        path = out / name
        for where, offset in _offsets(path).items():
            _flip(path, offset)
            for verify in (True, root):
                with pytest.raises(ShardloadError) as excinfo:
                    shardload.load_rank(out, rank, N, verify=verify)
                assert name in _one_line(excinfo), (where, verify)
            other = (rank + 1) % N
            assert shardload.load_rank(out, other, N, verify=True).keys() == plain[other].keys()
            report = shardload.verify_dir(out)
            assert [p.file for p in report.problems] == [str(path)], (where, report.problems)
            code, output = _cli("verify", str(out))
            assert code == 1 and name in output, (where, output)
            path.write_bytes(original[name])
    assert shardload.verify_dir(out).ok


def test_a_header_whitespace_change_is_caught(split_model: Path, tmp_path: Path) -> None:
    """A rank file's header padding turned from a space into a tab still parses, to the same tensors: only a hash of
    every byte tells."""
    out = shardload.convert(split_model, N, tmp_path / "out").out_dir
    padded = []
    for rank in range(N):
        path = out / f"rank-{rank:05d}-of-{N:05d}.safetensors"
        data = path.read_bytes()
        head = 8 + struct.unpack("<Q", data[:8])[0]
        if data[head - 1 : head] == b" ":
            padded.append((rank, path, head - 1))
    assert padded, "no rank header is padded: change the model"
    rank, path, offset = padded[0]
    _flip(path, offset, ord(" ") ^ ord("\t"))
    assert read_header(path).keys()  # still a valid file
    for verify in (True, shardload.Verify(root=json.loads((out / MANIFEST_NAME).read_text())["integrity"]["root"])):
        with pytest.raises(ShardloadError) as excinfo:
            shardload.load_rank(out, rank, N, verify=verify)
        assert path.name in _one_line(excinfo)
    assert not shardload.verify_dir(out).ok


def test_a_changed_record_is_caught(split_model: Path, tmp_path: Path) -> None:
    """The output's record is listed in the manifest too: a byte of it changed is reported, and a pinned root
    refuses it."""
    out = shardload.convert(split_model, N, tmp_path / "out").out_dir
    root = shardload.Verify(root=json.loads((out / MANIFEST_NAME).read_text())["integrity"]["root"])
    record = out / RECORD_NAME
    _flip(record, record.stat().st_size - 3)
    report = shardload.verify_dir(out)
    assert report.problems[-1].file == str(record)
    assert all(p.file == str(record) or RECORD_NAME in p.message for p in report.problems)  # files it cannot check
    with pytest.raises(ShardloadError):
        shardload.load_rank(out, 0, N, verify=root)


def test_an_old_format_directory_reshards_with_verify(split_model: Path, tmp_path: Path) -> None:
    """A directory in the older format is read for another N with verify=True (its rank files checked whole)."""
    out = old_format(shardload.convert(split_model, N, tmp_path / "out").out_dir)
    want = shardload.load_rank(split_model, 1, 2)
    got = shardload.load_rank(out, 1, 2, verify=True)
    assert all(torch.equal(got[k], want[k]) for k in want)
    _flip(out / "rank-00003-of-00004.safetensors", 5000)
    with pytest.raises(ShardloadError) as excinfo:
        shardload.load_rank(out, 1, 2, verify=True)
    assert "rank-00003-of-00004.safetensors" in _one_line(excinfo)


def test_manifest_names_rank_files_by_their_leaves_unless_sha256_is_asked(split_model: Path, tmp_path: Path) -> None:
    """convert writes a version-2 manifest: each rank file by the sha256 of its leaves in the output's record (one
    tiling: a rank file's tensors are read whole), the record and the copied files by their sha256. ``sha256=True``
    writes the version-1 manifest an older shardload reads, every file by its sha256."""
    import hashlib

    from shardload.format.hash_record import parse_record

    out = shardload.convert(split_model, N, tmp_path / "out").out_dir
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    record = parse_record((out / RECORD_NAME).read_bytes(), "record")
    assert manifest["version"] == 2
    for entry in manifest["files"]:
        if entry["path"].endswith(".safetensors"):
            assert set(entry) == {"path", "size", "leaves_sha256"}
            assert entry["leaves_sha256"] == hashlib.sha256(record.file(entry["path"]).leaves).hexdigest()
        else:
            assert entry["sha256"] == hashlib.sha256((out / entry["path"]).read_bytes()).hexdigest()
    assert all(len(r.tilings) == 1 for f in record.files for r in f.regions)
    old = shardload.convert(split_model, N, tmp_path / "old", sha256=True).out_dir
    manifest = json.loads((old / MANIFEST_NAME).read_text())
    assert manifest["version"] == 1
    assert all(e["sha256"] == hashlib.sha256((old / e["path"]).read_bytes()).hexdigest() for e in manifest["files"])
    assert all("leaves_sha256" not in e for e in manifest["files"])
    assert shardload.verify_dir(old).ok
    _flip(old / "rank-00001-of-00004.safetensors", 4000)
    with pytest.raises(ShardloadError, match="sha256"):
        shardload.load_rank(old, 1, N, verify=True)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(version=1),  # leaves in a version-1 manifest
        lambda m: m.update(version=3),
        lambda m: m["files"][0].update(sha256="0" * 64),  # both digests
        lambda m: m.pop("integrity"),
        lambda m: m.update(files=[e for e in m["files"] if e["path"] != RECORD_NAME]),
    ],
)
def test_inconsistent_version_2_manifests_are_refused(split_model: Path, tmp_path: Path, edit) -> None:
    out = shardload.convert(split_model, N, tmp_path / "out").out_dir
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["files"][0]["path"].endswith(".safetensors")
    edit(manifest)
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ShardloadError) as excinfo:
        shardload.load_rank(out, 0, N)
    assert "manifest" in _one_line(excinfo)
