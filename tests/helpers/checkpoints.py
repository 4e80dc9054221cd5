"""Small safetensors checkpoints written from numpy arrays, with or without a shard_info.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Random, never-all-zero data of the given numpy dtype name."""
    if dtype.startswith("float"):
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape, dtype=dtype)


def write_model(directory: Path, tensors: dict[str, np.ndarray], shard_info: Any = None) -> Path:
    """Write ``tensors`` as model.safetensors (and shard_info.json when given) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    if shard_info is not None:
        (directory / "shard_info.json").write_text(json.dumps(shard_info))
    return directory


def parallel_model(directory: Path) -> Path:
    """Row-parallel, column-parallel, fused-QKV, replicated, empty and 0-d parameters, random data."""
    rng = np.random.default_rng(11)
    tensors = {
        "row": random_array(rng, (64, 96), "float16"),
        "col": random_array(rng, (96, 128), "float16"),
        "qkv": random_array(rng, ((8 + 4 + 4) * 4, 64), "float16"),
        "norm": random_array(rng, (96,), "float16"),
        "empty": np.zeros((0, 8), dtype=np.float16),
        "scale": np.array(rng.standard_normal(), dtype=np.float32),  # 0-d
    }
    info = {
        "version": 1,
        "params": {
            "row": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]],
            "col": [["shard_funcs.shard_dim", [None, None], 1, "num_shards"]],
            "empty": [["shard_funcs.shard_dim", [None, None], 1, "num_shards"]],
            "qkv": [
                ["shard_funcs.reorder_segments", [None, None], 0, [8, 4, 4], "num_shards", 4],
                ["shard_funcs.shard_dim", [None, None], 0, "num_shards"],
            ],
        },
    }
    return write_model(directory, tensors, info)


def rank_bytes(path: Path) -> bytes:
    """A converted rank file's bytes with its conversion id and seal blanked: two converts of the same plan write the
    same bytes but for the id each run stamps (so a file of one cannot pass for the other's) and the seal of each
    run's manifest."""
    import re

    raw = re.sub(rb'"shardload\.conversion":"[0-9a-f]{32}"', b'"shardload.conversion":"-"', Path(path).read_bytes())
    return re.sub(rb'"shardload\.seal":"[0-9a-f]{64}"', b'"shardload.seal":"-"', raw)


def rewrite_header(path: Path, edit: Any) -> None:
    """Apply ``edit`` to the safetensors header of ``path`` (a dict, changed in place) and write it back padded to
    its old length, so the file keeps its size (and the size its manifest lists)."""
    import struct

    raw = Path(path).read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + size])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= size
    Path(path).write_bytes(raw[:8] + text + b" " * (size - len(text)) + raw[8 + size :])


def seal_as_version_1(directory: Path) -> None:
    """Make converted directory ``directory`` as shardload 0.x before seal version 2 wrote it: ``sealed: true`` in its
    manifest, each rank file's seal over its tensor table without its place (rank, N, stage)."""
    from shardload.sources.manifest import FROM_SAFETENSORS, manifest_digest, seal
    from shardload.sources.tensor_info import TensorInfo

    manifest = json.loads((directory / "shard_manifest.json").read_text())
    manifest["sealed"] = True
    (directory / "shard_manifest.json").write_text(json.dumps(manifest))
    digest = manifest_digest(json.loads(json.dumps(manifest)))

    def reseal(header: dict) -> None:
        table = [TensorInfo(name, FROM_SAFETENSORS[e["dtype"]], tuple(e["shape"]), Path(), e["data_offsets"][0],
                            e["data_offsets"][1] - e["data_offsets"][0])
                 for name, e in header.items() if name != "__metadata__"]  # fmt: skip
        header["__metadata__"]["shardload.seal"] = seal(digest, table)

    for entry in manifest["files"]:
        if entry["path"].endswith(".safetensors"):
            rewrite_header(directory / entry["path"], reseal)


def unseal(directory: Path) -> None:
    """Make converted directory ``directory`` (either layout) as an older shardload wrote it: no seal in any rank
    file's header, and no ``sealed`` mark in its manifest."""
    manifest = json.loads((directory / "shard_manifest.json").read_text())
    manifest.pop("sealed")
    (directory / "shard_manifest.json").write_text(json.dumps(manifest))
    for entry in manifest["files"]:
        if entry["path"].endswith(".safetensors"):
            rewrite_header(directory / entry["path"], lambda header: header["__metadata__"].pop("shardload.seal"))
