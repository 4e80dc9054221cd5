"""A model for verified loading at N ranks (tiles on the rank boundaries), and copies of a model with one byte
flipped."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from helpers.checkpoints import write_model
from shardload.engine.hashing import hash_model
from shardload.sources.safetensors_header import read_header

N = 4


def shard(shape: list[int], dim: int) -> list:
    """A shard_dim step of ``shape`` along ``dim``, its output shape spelled out."""
    out: list = ["num_shards", *shape]
    out[dim + 1] = f"{shape[dim]} // num_shards"
    return ["shard_funcs.shard_dim", [out, "float16"], dim, "num_shards"]


def write_split_model(directory: Path) -> Path:
    """Row- and column-split tensors wide enough that their tiles fall on the rank boundaries for N=4, hashed."""
    rng = np.random.default_rng(1)
    tensors = {
        "row.weight": rng.standard_normal((512, 2048)).astype(np.float16),
        "col.weight": rng.standard_normal((512, 2048)).astype(np.float16),
        "norm.weight": rng.standard_normal(2048).astype(np.float16),
    }
    info = {
        "version": 1,
        "num_shards": None,
        "params": {"row.weight": [shard([512, 2048], 0)], "col.weight": [shard([512, 2048], 1)]},
    }
    model = write_model(directory, tensors, info)
    hash_model(model)
    return model


def tampered(src: Path, dst: Path, offset: int, file: str = "model.safetensors") -> Path:
    """A copy of model ``src`` (record included) with one byte of ``file`` flipped at ``offset``."""
    shutil.copytree(src, dst)
    with open(dst / file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x40]))
    return dst


def offset_of(model: Path, name: str, row: int, col_byte: int, file: str = "model.safetensors") -> int:
    """The file offset of byte ``col_byte`` of row ``row`` of tensor ``name``."""
    info = read_header(model / file)[name]
    return info.offset + row * (info.nbytes // info.shape[0]) + col_byte
