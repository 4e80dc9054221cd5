"""Shared fixtures: the built-in example model (single- and multi-file), fsync calls, and the fixtures more than one
test module asks for (the S3 server, the split model for verified loading, a compressed-tensors Llama), made from
tests/helpers/. Test modules never import this file: what they share as code is in tests/helpers/."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from shardload.cli.example import write_example

if TYPE_CHECKING:
    from helpers.s3 import S3


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


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    """A real S3 server (moto) on loopback behind the faulty proxy of helpers/s3.py, one per test module."""
    from helpers.s3 import S3

    server = S3()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def split_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Row- and column-split tensors whose tiles fall on the rank boundaries for N=4, hashed (helpers/verified.py)."""
    from helpers.verified import write_split_model

    return write_split_model(tmp_path_factory.mktemp("split") / "model")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama quantized W4A16_ASYM by compressed-tensors, saved by transformers (helpers/quant_llama.py)."""
    from helpers.quant_llama import write_ct_llama

    return write_ct_llama(tmp_path_factory.mktemp("llama") / "tiny-llama-w4a16")


@pytest.fixture(scope="session", autouse=True)
def declared_entry_points() -> None:
    """Register what this checkout's pyproject.toml declares in the ``shardload.*`` entry point groups (split formats,
    ``convert --layout`` targets), as an install of it would: an editable install's metadata is the pyproject's of
    when it was installed, and may lack a group added since. Each declared value is loaded and called as
    :func:`shardload.sources.plugins.run_entry_points` would (test_entry_points.py checks the declarations)."""
    import importlib

    import tomllib

    groups = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["entry-points"]
    for group, entries in groups.items():
        if group.startswith("shardload.") and group != "shardload.steps":
            for value in entries.values():
                module, _, attr = value.partition(":")
                loaded = importlib.import_module(module)
                if attr:
                    getattr(loaded, attr)()
