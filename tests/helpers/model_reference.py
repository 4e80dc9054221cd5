"""A model directory's rank slices by the numpy reference (helpers/reference.py), and the check that loaded ranks
equal them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file

from helpers import reference as ref


def reference_shards(model: Path, n: int) -> list[dict[str, np.ndarray]]:
    """Rank slices computed by the numpy reference from the stored tensors and shard_info's step list."""
    tensors = load_file(str(model / "model.safetensors")) if (model / "model.safetensors").exists() else {}
    if not tensors:
        for f in sorted(model.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
    info = json.loads((model / "shard_info.json").read_text())
    params = info.get("params", info)
    out: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    for name, x in tensors.items():
        steps = [
            (s[0].removeprefix("shard_funcs."), *[n if a == "num_shards" else a for a in s[2:]])
            for s in params.get(name, [])
        ]
        slices = ref.rank_slices(x, steps, n) if steps else [x] * n
        for r in range(n):
            out[r][name] = slices[r]
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, np.ndarray]) -> None:
    """``got`` (a rank's loaded tensors) holds exactly ``want``'s names and values, each tensor contiguous."""
    assert set(got) == set(want)
    for name, t in got.items():
        assert t.is_contiguous(), name
        np.testing.assert_array_equal(t.cpu().numpy(), want[name], err_msg=name)
