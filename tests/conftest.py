"""Shared fixtures: the built-in example model (single- and multi-file) and small checkpoint writers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from shardload.cli.example import write_example


@pytest.fixture
def fsync_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The file descriptors ``os.fsync`` is called with from now on in this test (the calls still happen)."""
    calls: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


@pytest.fixture(scope="session")
def example_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in example model, single file."""
    return write_example(tmp_path_factory.mktemp("example") / "model")


@pytest.fixture(scope="session")
def example_multi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in example model split over two files with model.safetensors.index.json."""
    return write_example(tmp_path_factory.mktemp("example_multi") / "model", multi_file=True)


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
