"""TVM tensor caches written by TVM's own writer: any parameters, and a cache pre-sharded as TVM's Disco loader
names it."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest


def import_tvm() -> ModuleType:
    """TVM, imported; a test is skipped where it is missing, except in CI (the test extra installs it there)."""
    if os.environ.get("CI") == "true":
        import tvm

        return tvm
    return pytest.importorskip("tvm")


def dump(
    params: dict[str, np.ndarray], path: Path, *, encode: Any = "raw", cap_mb: int = 32, legacy: bool = False
) -> Path:
    """Write ``params`` with TVM's own writer; ``legacy`` renames the table to its pre-0.22 name."""
    import_tvm()
    from tvm.contrib import tvmjs

    tvmjs.dump_tensor_cache(params, str(path), encode_format=encode, shard_cap_mb=cap_mb, show_progress=False)
    if legacy:
        (path / "tensor-cache.json").rename(path / "ndarray-cache.json")
    return path


def presharded(tmp_path: Path, n: int) -> tuple[Path, dict[str, np.ndarray]]:
    """A cache pre-sharded as TVM's Disco loader names it (``NAME_shard-K-of-N``; TVM's test helper: records sorted
    by shard, then parameter)."""
    rng = np.random.default_rng(5)
    params = {"param_0": rng.uniform(size=[64, 128]).astype("float16"), "param_1": rng.uniform(size=[32, 128])}
    axes = {"param_0": 0, "param_1": 1}
    split = {k: np.split(v.astype("float32") if k == "param_1" else v, n, axis=axes[k]) for k, v in params.items()}
    records = {f"{k}_shard-{i + 1}-of-{n}": split[k][i] for i in range(n) for k in params}
    records["norm"] = np.ones(16, dtype="float16")  # stored whole: every worker gets it
    return dump(records, tmp_path / "pre"), {**{k: v for k, v in split.items()}}
