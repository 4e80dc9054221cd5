"""What a pinned root pins: every input a load's result depends on (weight files, the header bytes actually parsed,
shard_info or its absence, config.json, the index), from local files and from an S3 store that lies once."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import shardload
from helpers.checkpoints import write_model
from helpers.verified import shard
from shardload.engine.hashing import hash_model
from shardload.errors import ShardloadError


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "a.weight": rng.standard_normal((256, 512)).astype(np.float16),
        "b.weight": rng.standard_normal((256, 512)).astype(np.float16),
        "norm.weight": rng.standard_normal(512).astype(np.float16),
    }


SPLIT = {"version": 1, "num_shards": None, "params": {"a.weight": [shard([256, 512], 0)]}}


def _one_line(err: pytest.ExceptionInfo[ShardloadError], *words: str) -> None:
    text = str(err.value)
    assert "\n" not in text, text
    for w in words:
        assert w in text, text


def test_a_shard_info_added_after_hashing_is_refused(tmp_path: Path) -> None:
    """The record was made when the plan came from no shard_info: one added later is an input the root does not
    pin, refused by name (verify=True and a pinned root alike)."""
    model = write_model(tmp_path / "m", _tensors())
    root = hash_model(model).root
    (model / "shard_info.json").write_text(json.dumps(SPLIT))
    for verify in (root, True):
        with pytest.raises(ShardloadError) as err:
            shardload.load_rank(model, 1, 2, verify=verify)
        _one_line(err, "shard_info.json", "not in the integrity record")


def test_a_hashed_plan_input_removed_is_refused(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", _tensors(), SPLIT)
    root = hash_model(model).root
    (model / "shard_info.json").unlink()
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(model, 1, 2, verify=root)
    _one_line(err, "shard_info.json", "missing")


def _two_files(model: Path) -> Path:
    """The tensors split over one.safetensors and two.safetensors (no index), with SPLIT as shard_info.json."""
    from safetensors.numpy import save_file

    model.mkdir()
    t = _tensors()
    save_file({"a.weight": t["a.weight"]}, str(model / "one.safetensors"))
    save_file({"b.weight": t["b.weight"], "norm.weight": t["norm.weight"]}, str(model / "two.safetensors"))
    (model / "shard_info.json").write_text(json.dumps(SPLIT))
    return model


def test_a_hashed_weight_file_deleted_is_refused(tmp_path: Path) -> None:
    """A directory of several safetensors files (no index): one of them deleted after hashing is not a smaller
    model, it is an error naming the file."""
    model = _two_files(tmp_path / "m")
    root = hash_model(model).root
    assert set(shardload.load_rank(model, 0, 2, verify=root)) == {"a.weight", "b.weight", "norm.weight"}
    (model / "two.safetensors").unlink()
    for verify in (root, True):
        with pytest.raises(ShardloadError) as err:
            shardload.load_rank(model, 0, 2, verify=verify)
        _one_line(err, "two.safetensors", "missing")


def test_verified_checks_pass_on_an_untouched_model(tmp_path: Path) -> None:
    """The control: the same models, untouched, load under a pinned root and equal the plain load."""
    model = write_model(tmp_path / "m", _tensors(), SPLIT)
    root = hash_model(model).root
    for rank in range(2):
        plain = shardload.load_rank(model, rank, 2)
        pinned = shardload.load_rank(model, rank, 2, verify=root)
        assert plain.keys() == pinned.keys() and all(torch.equal(plain[k], pinned[k]) for k in plain)


# --- bytes checked are the bytes parsed: a store that lies on the first GET only -------------------------------


def _swap_offsets(raw: bytes) -> bytes:
    """A safetensors file's first bytes with the data_offsets of a.weight and b.weight swapped (same length)."""
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["a.weight"]["data_offsets"], header["b.weight"]["data_offsets"] = (
        header["b.weight"]["data_offsets"],
        header["a.weight"]["data_offsets"],
    )
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    return raw[:8] + text + b" " * (n - len(text)) + raw[8 + n :]


class _Once:
    """A forge for the proxy: the first GET of the key whose range starts at ``at`` is replaced by ``change``."""

    def __init__(self, change, at: int | None = 0) -> None:
        self.change, self.at, self.done = change, at, False

    def __call__(self, body: bytes, rng: tuple[int, int] | None) -> bytes | None:
        start = rng[0] if rng is not None else 0
        if self.done or (self.at is not None and start != self.at) or len(body) < 8:
            return None
        self.done = True
        return self.change(body)


@pytest.mark.slow
def test_a_header_forged_on_its_first_get_is_caught(s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("boto3")
    from helpers.s3 import use_endpoint

    use_endpoint(monkeypatch, s3.url, tmp_path)
    model = write_model(tmp_path / "m", _tensors(), SPLIT)
    root = hash_model(model).root
    uri = s3.upload_dir(model, "forged-header")
    key = "forged-header/model.safetensors"
    honest = shardload.load_rank(uri, 0, 2, verify=root)
    assert torch.equal(honest["b.weight"], shardload.load_rank(model, 0, 2)["b.weight"])

    def forge(body: bytes) -> bytes:
        if len(body) == 8:  # the length prefix alone: left as is, the header comes next
            return body
        whole = (model / "model.safetensors").read_bytes()
        (n,) = struct.unpack("<Q", whole[:8])
        return _swap_offsets(whole[: 8 + n])[8:][: len(body)]

    s3.proxy.faults.forge[key] = _Once(forge, at=8)
    try:
        with pytest.raises(ShardloadError) as err:
            shardload.load_rank(uri, 0, 2, verify=root)
    finally:
        s3.proxy.faults.forge.clear()
    _one_line(err, "model.safetensors")


@pytest.mark.slow
def test_a_shard_info_forged_on_its_first_get_is_caught(s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("boto3")
    from helpers.s3 import use_endpoint

    use_endpoint(monkeypatch, s3.url, tmp_path)
    model = write_model(tmp_path / "m", _tensors(), SPLIT)
    root = hash_model(model).root
    uri = s3.upload_dir(model, "forged-plan")
    honest = (model / "shard_info.json").read_bytes()
    other = json.dumps({**SPLIT, "params": {"a.weight": [shard([256, 512], 1)]}}).encode()
    assert len(other) <= len(honest)
    forged = other + b" " * (len(honest) - len(other))
    s3.proxy.faults.forge["forged-plan/shard_info.json"] = _Once(lambda body: forged, at=None)
    try:
        with pytest.raises(ShardloadError) as err:
            shardload.load_rank(uri, 0, 2, verify=root)
    finally:
        s3.proxy.faults.forge.clear()
    _one_line(err, "shard_info.json")


@pytest.mark.slow
def test_a_converted_directory_in_s3_verifies_against_its_pinned_root(
    s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("boto3")
    from helpers.s3 import use_endpoint

    use_endpoint(monkeypatch, s3.url, tmp_path)
    model = write_model(tmp_path / "m", _tensors(), SPLIT)
    out = tmp_path / "tp2"
    shardload.convert(model, 2, out)
    root = json.loads((out / "shard_manifest.json").read_text())["integrity"]["root"]
    uri = s3.upload_dir(out, "converted-pinned")
    for rank in range(2):
        local = shardload.load_rank(out, rank, 2)
        remote = shardload.load_rank(uri, rank, 2, verify=root)
        assert local.keys() == remote.keys() and all(torch.equal(local[k], remote[k]) for k in local)
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(uri, 0, 2, verify="0" * 64)
    _one_line(err, "root")


# --- rank files copied, swapped or taken from another conversion ------------------------------------------------


@pytest.fixture(scope="module")
def vllm_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    pytest.importorskip("transformers")
    from helpers.tiny_models import build
    from shardload.integrations.vllm.writer import convert_vllm

    base = tmp_path_factory.mktemp("vllm-copies")
    llama = base / "llama"
    build("llama", llama, seed=0)
    other = base / "llama-other"
    build("llama", other, seed=1)
    convert_vllm(llama, 4, base / "v4")
    convert_vllm(other, 4, base / "o4")
    return base / "v4", base / "o4"


def _rank(d: Path, r: int) -> Path:
    return d / f"model-rank-{r}-part-0.safetensors"


@pytest.mark.parametrize("how", ["copy", "swap", "foreign"])
@pytest.mark.parametrize("manifest", [True, False])
def test_vllm_rank_files_out_of_place_are_refused(
    vllm_dirs: tuple[Path, Path], tmp_path: Path, how: str, manifest: bool
) -> None:
    good, foreign = vllm_dirs
    d = shutil.copytree(good, tmp_path / "v")
    if how == "copy":
        shutil.copyfile(_rank(d, 0), _rank(d, 1))
    elif how == "swap":
        os.replace(_rank(d, 1), tmp_path / "x")
        os.replace(_rank(d, 2), _rank(d, 1))
        os.replace(tmp_path / "x", _rank(d, 2))
    else:
        shutil.copyfile(_rank(foreign, 1), _rank(d, 1))
    if not manifest:
        (d / "shard_manifest.json").unlink()
    for rank, n in ((0, 2), (1, 4)):
        with pytest.raises(ShardloadError) as err:
            shardload.load_rank(d, rank, n)
        _one_line(err, "model-rank-")


@pytest.mark.parametrize("how", ["copy", "swap", "foreign"])
def test_plain_rank_files_out_of_place_are_refused(tmp_path: Path, how: str) -> None:
    model = write_model(tmp_path / "m", _tensors(), SPLIT)
    other = write_model(tmp_path / "o", {k: -v for k, v in _tensors().items()}, SPLIT)
    d, o = tmp_path / "tp4", tmp_path / "o4"
    shardload.convert(model, 4, d)
    shardload.convert(other, 4, o)
    name = "rank-{:05d}-of-00004.safetensors".format
    if how == "copy":
        shutil.copyfile(d / name(0), d / name(1))
    elif how == "swap":
        os.replace(d / name(1), tmp_path / "x")
        os.replace(d / name(2), d / name(1))
        os.replace(tmp_path / "x", d / name(2))
    else:
        shutil.copyfile(o / name(1), d / name(1))
    for rank, n in ((1, 4), (0, 2)):
        with pytest.raises(ShardloadError) as err:
            shardload.load_rank(d, rank, n)
        _one_line(err, "rank-00001-of-00004.safetensors")


def test_an_index_of_another_name_is_pinned_too(tmp_path: Path) -> None:
    """A model opened by an index with its own name (given by path) has that index in its record: rewritten, it
    is refused like model.safetensors.index.json would be."""
    model = _two_files(tmp_path / "m")
    index = model / "model.fp16.index.json"
    weight_map = {"a.weight": "one.safetensors", "b.weight": "two.safetensors", "norm.weight": "two.safetensors"}
    index.write_text(json.dumps({"weight_map": weight_map}))
    root = hash_model(index).root
    assert set(shardload.load_rank(index, 1, 2, verify=root)) == set(weight_map)
    index.write_text(json.dumps({"weight_map": weight_map}, indent=1))  # same map, other bytes
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(index, 1, 2, verify=root)
    _one_line(err, "model.fp16.index.json", "differs from the integrity record")


@pytest.mark.slow
def test_pinned_roots_across_sources_equal_an_independent_reference(
    s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pinned root over every kind of source (a local model, the same in S3, a converted directory local and in
    S3): each rank equals numpy's own split of the arrays. Resharding a converted directory for another N under a
    pinned root is refused in one line (its record covers the old rank files, not the new ranks' plan)."""
    pytest.importorskip("boto3")
    from helpers.s3 import use_endpoint

    use_endpoint(monkeypatch, s3.url, tmp_path)
    arrays = _tensors()
    model = write_model(tmp_path / "m", arrays, SPLIT)
    root = hash_model(model).root
    out = tmp_path / "tp2"
    shardload.convert(model, 2, out)
    out_root = json.loads((out / "shard_manifest.json").read_text())["integrity"]["root"]
    sources = {
        "local": (model, root),
        "s3": (s3.upload_dir(model, "matrix-src"), root),
        "converted": (out, out_root),
        "converted-s3": (s3.upload_dir(out, "matrix-tp2"), out_root),
    }
    for what, (where, pin) in sources.items():
        for rank in range(2):
            got = shardload.load_rank(where, rank, 2, verify=pin)
            want = {
                "a.weight": np.split(arrays["a.weight"], 2, axis=0)[rank],
                "b.weight": arrays["b.weight"],
                "norm.weight": arrays["norm.weight"],
            }
            assert got.keys() == want.keys(), what
            for k, v in want.items():
                assert np.array_equal(got[k].numpy(), v), (what, rank, k)
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(out, 0, 1, verify=out_root)
    _one_line(err, "verify=<root hash>, --verify ROOT) is not supported")


def test_a_companion_changed_after_its_check_is_not_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """convert --verify checks config.json against the record, then copies it beside the rank files: a config.json
    rewritten in between is read twice with different bytes, an error, and nothing is published."""
    import shardload.engine.output as output

    model = write_model(tmp_path / "m", _tensors(), SPLIT)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 256}))
    root = hash_model(model).root
    real = output.copy_companions

    def swapped_first(*args, **kwargs):
        (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 999}))
        return real(*args, **kwargs)

    monkeypatch.setattr(output, "copy_companions", swapped_first)
    with pytest.raises(ShardloadError) as err:
        shardload.convert(model, 2, tmp_path / "out", verify=root)
    _one_line(err, "config.json", "changed while it was being read")
    assert not (tmp_path / "out").exists()
