"""Hugging Face Hub ids as models, resolved from a real Hub cache laid out by huggingface_hub's own functions
(blobs, snapshots/<commit> links, refs), offline: every load is compared element for element with the same
load from the directory the cache was filled from."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import shardload
from helpers.hub import put_revision
from shardload.cli.example import write_example
from shardload.cli.main import main
from shardload.errors import CheckpointError, ShardloadError
from shardload.sources.checkpoint import open_checkpoint

if os.environ.get("CI") == "true":  # CI installs huggingface_hub through the test extra: never skip there
    import huggingface_hub
else:
    huggingface_hub = pytest.importorskip("huggingface_hub")

from huggingface_hub import file_download

REPO = "shardload-test/tiny-llama"
COMMIT_MAIN = "a" * 40
COMMIT_V1 = "b" * 40


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, example_dir: Path) -> Path:
    """An offline Hub cache holding REPO at main (the example model) and at tag v1 (another seed)."""
    cache = tmp_path / "hub"
    other = write_example(tmp_path / "seed1", seed=1)
    put_revision(cache, REPO, example_dir, COMMIT_MAIN, "main")
    put_revision(cache, REPO, other, COMMIT_V1, "v1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # an id names no local path here
    return cache


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_cache_is_laid_out_as_huggingface_hub_reads_it(hub: Path, example_dir: Path) -> None:
    info = huggingface_hub.scan_cache_dir(hub)
    (repo,) = info.repos
    assert repo.repo_id == REPO
    assert {r.commit_hash: set(r.refs) for r in repo.revisions} == {COMMIT_MAIN: {"main"}, COMMIT_V1: {"v1"}}
    found = huggingface_hub.try_to_load_from_cache(REPO, "model.safetensors", cache_dir=hub)
    assert Path(found).read_bytes() == (example_dir / "model.safetensors").read_bytes()


def test_load_hub_id_and_revisions_offline(hub: Path, example_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "seed1"
    for rank in range(2):
        want = shardload.load_rank(example_dir, rank, 2)
        _equal(shardload.load_rank(REPO, rank, 2), want)
        _equal(shardload.load_rank(f"{REPO}@main", rank, 2), want)
        _equal(shardload.load_rank(f"{REPO}@{COMMIT_MAIN}", rank, 2), want)
        _equal(shardload.load_rank(f"{REPO}@v1", rank, 2), shardload.load_rank(other, rank, 2))
    assert not torch.equal(
        shardload.load_rank(f"{REPO}@v1", 0, 2)["lm_head.weight"], shardload.load_rank(REPO, 0, 2)["lm_head.weight"]
    )  # the two revisions really differ
    cpus = ["cpu"] * 2
    for got, want in zip(shardload.load(REPO, 2, devices=cpus), shardload.load(example_dir, 2, cpus), strict=True):
        _equal(got, want)


def test_missing_hub_id_offline_is_one_line(hub: Path) -> None:
    with pytest.raises(CheckpointError) as err:
        shardload.load_rank("shardload-test/not-cached", 0, 2)
    message = err.value.message
    assert message.startswith(
        "shardload-test/not-cached: no such file or directory, and the Hugging Face Hub model "
        "shardload-test/not-cached is not in the local cache"
    )
    assert "HF_HUB_OFFLINE is set" in message and "hf download shardload-test/not-cached" in message
    assert "\n" not in message
    with pytest.raises(CheckpointError, match="is not in the local cache"):
        shardload.load_rank(f"{REPO}@no-such-tag", 0, 2)
    result = CliRunner().invoke(main, ["inspect", "shardload-test/not-cached", "-n", "2"])
    assert result.exit_code == 1 and result.output.count("\n") == 1 and "HF_HUB_OFFLINE" in result.output


def test_a_local_path_wins_over_a_hub_id(hub: Path, tmp_path: Path, example_multi_dir: Path) -> None:
    local = tmp_path / "shardload-test" / "tiny-llama"
    shutil.copytree(example_multi_dir, local)
    ckpt = open_checkpoint(REPO)
    assert ckpt.root == Path(REPO) and ckpt.path.name == "model.safetensors.index.json"


def test_cli_with_hub_ids(hub: Path, example_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    got = runner.invoke(main, ["inspect", REPO, "-n", "2", "--json"])
    want = runner.invoke(main, ["inspect", str(example_dir), "-n", "2", "--json"])
    assert got.exit_code == 0 and json.loads(got.output) == json.loads(want.output)
    got = runner.invoke(main, ["validate", str(example_dir / "shard_info.json"), "--model", f"{REPO}@v1", "-n", "2"])
    assert got.exit_code == 0, got.output
    before = sorted(str(p) for p in hub.rglob("*"))
    got = runner.invoke(main, ["plan", REPO, "--overwrite"])
    assert got.exit_code == 0, got.output
    assert json.loads(got.stdout)["params"]  # no -o: the plan goes to stdout, never into the cache
    snapshot = Path(huggingface_hub.snapshot_download(REPO, local_files_only=True))
    got = runner.invoke(main, ["plan", REPO, "-o", str(snapshot / "shard_info.json"), "--overwrite"])
    assert got.exit_code == 1 and "lies inside the Hugging Face cache" in got.output
    assert sorted(str(p) for p in hub.rglob("*")) == before  # nothing was written into the cache
    out = tmp_path / "tp2"
    got = runner.invoke(main, ["convert", REPO, "-n", "2", "-o", str(out), "-q"])
    assert got.exit_code == 0, got.output
    for rank in range(2):
        _equal(shardload.load_rank(out, rank, 2), shardload.load_rank(example_dir, rank, 2))
    got = runner.invoke(main, ["verify", str(out), "--source", REPO])
    assert got.exit_code == 0 and "every rank equals" in got.output, got.output


@pytest.mark.parametrize("inside", ["blobs", "snapshots", "refs"])
def test_convert_never_writes_into_the_cache(hub: Path, inside: str) -> None:
    storage = hub / file_download.repo_folder_name(repo_id=REPO, repo_type="model")
    with pytest.raises(ShardloadError, match="write the output elsewhere"):
        shardload.convert(REPO, 2, storage / inside / "out")


def test_download_patterns_fetch_weights_config_and_tokenizer_only() -> None:
    """HUB_PATTERNS through huggingface_hub's own matcher (the one snapshot_download applies to allow_patterns)."""
    from huggingface_hub.utils import filter_repo_objects

    from shardload.sources.location import HUB_PATTERNS

    repo_files = [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "config.json", "generation_config.json", "shard_info.json", "tokenizer.json", "tokenizer_config.json",
        "tokenizer.model", "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
        "pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "flax_model.msgpack", "tf_model.h5",
        "original/consolidated.00.pth", "model.gguf", "README.md", ".gitattributes", "modeling_custom.py",
    ]  # fmt: skip
    fetched = set(filter_repo_objects(repo_files, allow_patterns=HUB_PATTERNS))
    assert fetched == set(repo_files[:13])


@pytest.mark.parametrize("model", ["some-org/some-model", "models/llama-typo", "some-org/some-model@v1.0"])
def test_hub_id_in_a_fresh_process_is_one_line(tmp_path: Path, model: str) -> None:
    """A fresh interpreter, where nothing has imported huggingface_hub's submodules first (test imports above
    would hide a missing import): a Hub id, or a mistyped local path that reads as one, is one line."""
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-cache"), "NO_COLOR": "1"}
    got = subprocess.run(
        [sys.executable, str(Path(__file__).parents[1] / "cli.py"), "inspect", model, "-n", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    repo = model.split("@")[0]
    assert got.returncode == 1, got.stderr
    assert got.stderr.startswith(f"error: {model}: no such file or directory, and the Hugging Face Hub model {repo}")
    assert "HF_HUB_OFFLINE is set" in got.stderr and got.stderr.count("\n") == 1, got.stderr


@pytest.mark.parametrize(
    "revision", ["../../../etc", "main/../../x", "/etc/passwd", "refs/../main", "a//b", "main/", "a\\..\\b", "."]
)
def test_hub_revision_that_is_a_path_is_refused(hub: Path, revision: str) -> None:
    with pytest.raises(CheckpointError) as err:
        shardload.load_rank(f"{REPO}@{revision}", 0, 2)
    assert err.value.message == (
        f"{REPO}@{revision}: the revision {revision!r} is not a branch, tag or commit name (no empty, '.' or '..' "
        "parts, no leading or trailing '/', no backslash)"
    )


def test_a_snapshot_linked_to_another_repositorys_is_refused(hub: Path, tmp_path: Path) -> None:
    """A revision's snapshot folder that is itself a symlink to another repository's snapshot (its files then
    resolve into that repository's blobs) is refused, as a file linked there is: a snapshot holds its own
    repository's blobs only."""
    other_repo = "shardload-test/other"
    put_revision(hub, other_repo, write_example(tmp_path / "seed2", seed=2), COMMIT_V1, "main")
    storage = hub / file_download.repo_folder_name(repo_id=REPO, repo_type="model")
    theirs = hub / file_download.repo_folder_name(repo_id=other_repo, repo_type="model") / "snapshots" / COMMIT_V1
    snapshot = storage / "snapshots" / COMMIT_MAIN
    shutil.rmtree(snapshot)
    snapshot.symlink_to(theirs, target_is_directory=True)
    with pytest.raises(CheckpointError, match="resolves outside the model directory"):
        shardload.load_rank(REPO, 0, 2)


def test_weights_corrupted_on_their_way_from_the_hub_are_refused_and_dropped_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, example_dir: Path
) -> None:
    """A proxy or CDN that flips a byte of a weight file in transit: huggingface_hub checks only its size, so the
    cache kept the bytes under the sha256 the Hub names them by, and every load (and later offline load) took them.
    Each blob downloaded now is hashed against its name: one line, the blob dropped, and the next online load
    fetches the file again and loads it exactly."""
    from helpers.fake_hub import FakeHub, use_fake_hub

    hub = FakeHub()
    try:
        hub.add(REPO, example_dir, COMMIT_MAIN)
        use_fake_hub(monkeypatch, hub.url, tmp_path / "hf")
        monkeypatch.chdir(tmp_path)
        weights = hub.repos[REPO].files["model.safetensors"]
        flipped = bytearray(weights)
        flipped[-3] ^= 0x40
        hub.repos[REPO].garbled["model.safetensors"] = bytes(flipped)
        with pytest.raises(CheckpointError, match=r"model\.safetensors") as err:
            shardload.load_rank(REPO, 1, 2)
        assert "\n" not in str(err.value) and "sha256" in str(err.value)
        blobs = list((tmp_path / "hf" / "hub").rglob("blobs/*"))
        assert all(b.read_bytes() != bytes(flipped) for b in blobs), "the corrupted blob stayed in the cache"
        hub.repos[REPO].garbled.clear()
        _equal(shardload.load_rank(REPO, 1, 2), shardload.load_rank(example_dir, 1, 2))
    finally:
        hub.close()


@pytest.mark.parametrize("how", ["two files", "a download that fails"])
def test_every_corrupted_download_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, example_dir: Path, how: str
) -> None:
    """Two files corrupted in transit (the weights and config.json), or the weights corrupted while another file's
    download fails: only the first blob was dropped, or none, and the next load (network fixed) took the rest from
    the cache as they were. Every corrupted blob is dropped; the next load is exact."""
    import huggingface_hub._snapshot_download as snapshot

    from helpers.fake_hub import FakeHub, use_fake_hub

    hub = FakeHub()
    try:
        hub.add(REPO, example_dir, COMMIT_MAIN)
        use_fake_hub(monkeypatch, hub.url, tmp_path / "hf")
        monkeypatch.chdir(tmp_path)
        files = hub.repos[REPO].files
        for name in ("model.safetensors", "config.json") if how == "two files" else ("model.safetensors",):
            flipped = bytearray(files[name])
            flipped[-3] ^= 0x01
            hub.repos[REPO].garbled[name] = bytes(flipped)
        failing = [how == "a download that fails"]
        download = snapshot.hf_hub_download

        def flaky(*args: object, **kwargs: object) -> object:
            path = download(*args, **kwargs)
            if failing[0] and kwargs.get("filename") == "shard_info.json":
                raise OSError("connection reset by peer")
            return path

        monkeypatch.setattr(snapshot, "hf_hub_download", flaky)
        with pytest.raises(CheckpointError) as err:
            shardload.load_rank(REPO, 1, 2)
        assert "\n" not in str(err.value)
        hub.repos[REPO].garbled.clear()
        failing[0] = False
        _equal(shardload.load_rank(REPO, 1, 2), shardload.load_rank(example_dir, 1, 2))
    finally:
        hub.close()


def test_a_blob_is_hashed_as_the_hub_names_it(tmp_path: Path) -> None:
    """A Hub cache names a blob by the sha256 of a file kept in LFS, or by the git blob id of one kept in git: the
    digest computed from the bytes is compared with the name of either form; any other name is not checked."""
    import hashlib

    from helpers.fake_hub import git_blob_id
    from shardload.sources.location import blob_digest

    data = b'{"model_type": "llama"}\n'
    for name in (hashlib.sha256(data).hexdigest(), git_blob_id(data), "1" * 64, "x.incomplete"):
        (tmp_path / name).write_bytes(data)
    assert blob_digest(tmp_path / hashlib.sha256(data).hexdigest()) == hashlib.sha256(data).hexdigest()
    assert blob_digest(tmp_path / git_blob_id(data)) == git_blob_id(data)
    assert blob_digest(tmp_path / ("1" * 64)) == hashlib.sha256(data).hexdigest()
    assert blob_digest(tmp_path / "x.incomplete") is None
