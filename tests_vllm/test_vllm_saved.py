"""vLLM's own ``save_model`` output as a source: vLLM saves a tiny GQA Llama and a tiny Qwen2 (biases, tied
embeddings, a vocabulary of 250 that vLLM pads) at TP=2 (``ShardedStateLoader.save_model``, through vLLM's
``save_sharded_state``), and ``shardload convert`` reads them back without the original (docs/reshard.md):

- ``-n 4 --layout vllm``: every tensor equal to ``convert ORIGINAL -n 4 --layout vllm``'s;
- ``-n 1`` (plain layout): every tensor equal to ``convert ORIGINAL -n 1``'s;
- vLLM serving the save resharded to TP=1 (``sharded_state``), and the TP=2 save itself at TP=1 with
  ``load_format="shardload"``, gives the same greedy tokens and logprobs as its default loader on the original.

vLLM on the CPU drops each linear layer's weight from its state after packing it for oneDNN, so its save_model would
write none (``test_reshard_vllm_saved.py`` checks that such a save is refused): ``run_vllm.py`` keeps them, as vLLM
on a GPU does, in every worker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("CI") != "true":
    pytest.importorskip("vllm", reason="vLLM runs in its own virtualenv: .ci/vllm-venv DIR")
import make_models
import torch
from safetensors.torch import load_file

import shardload
from shardload.integrations.vllm.writer import convert_vllm

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
MODELS = ["llama", "qwen2"]


def _run(jobs: list[dict[str, Any]], log: Path) -> None:
    spec = log.with_suffix(".jobs.json")
    spec.write_text(json.dumps(jobs))
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, str(HERE / "run_vllm.py"), str(spec)], stdout=out,
                              stderr=subprocess.STDOUT, timeout=900, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(f"run_vllm.py exited {proc.returncode}:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The originals, vLLM's TP=2 saves of them (config.json copied beside) and the conversions of both."""
    root = tmp_path_factory.mktemp("saved")
    jobs = []
    for name in MODELS:
        getattr(make_models, name)(root / name)
        jobs.append({"model": str(root / name), "load_format": "auto", "tp": 2, "out": str(root / f"{name}-save.json"),
                     "save": str(root / f"{name}-saved2")})  # fmt: skip
    _run(jobs, root / "save.log")
    for name in MODELS:
        result = json.loads((root / f"{name}-save.json").read_text())
        assert "error" not in result, result
        shutil.copy(root / name / "config.json", root / f"{name}-saved2" / "config.json")
        for source, tag in ((root / f"{name}-saved2", "saved"), (root / name, "original")):
            convert_vllm(source, 4, root / f"{name}-{tag}-vllm4")
            convert_vllm(source, 1, root / f"{name}-{tag}-vllm1")
            shardload.convert(source, 1, root / f"{name}-{tag}-plain1")
    return root


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out |= {f"{path.name}:{k}": v for k, v in load_file(path).items()}
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize("name", MODELS)
def test_vllm_save_to_tp4_vllm_layout(work: Path, name: str) -> None:
    saved = _tensors(work / f"{name}-saved2")
    assert any(k.endswith("qkv_proj.weight") for k in saved) and any(k.endswith("gate_up_proj.weight") for k in saved)
    _assert_equal(_tensors(work / f"{name}-saved-vllm4"), _tensors(work / f"{name}-original-vllm4"))


@pytest.mark.parametrize("name", MODELS)
def test_vllm_save_to_tp1_plain(work: Path, name: str) -> None:
    _assert_equal(_tensors(work / f"{name}-saved-plain1"), _tensors(work / f"{name}-original-plain1"))


@pytest.fixture(scope="module")
def served(work: Path) -> dict[str, Any]:
    """vLLM at TP=1: its default loader on each original, sharded_state on each save resharded to TP=1."""
    jobs = []
    for name in MODELS:
        jobs.append({"model": str(work / name), "load_format": "auto", "tp": 1, "out": str(work / f"{name}-auto.json")})
        jobs.append({"model": str(work / f"{name}-saved-vllm1"), "load_format": "sharded_state", "tp": 1,
                     "out": str(work / f"{name}-resharded.json")})  # fmt: skip
        jobs.append({"model": str(work / f"{name}-saved2"), "load_format": "shardload", "tp": 1,
                     "out": str(work / f"{name}-shardload.json")})  # fmt: skip
    _run(jobs, work / "serve.log")
    return {Path(j["out"]).stem: json.loads(Path(j["out"]).read_text()) for j in jobs}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("how", ["resharded", "shardload"])
def test_vllm_serves_the_save_at_another_tp(served: dict[str, Any], name: str, how: str) -> None:
    """``resharded``: sharded_state on the save converted to TP=1; ``shardload``: load_format="shardload" pointed at
    the TP=2 save itself, served at TP=1."""
    want, got = served[f"{name}-auto"], served[f"{name}-{how}"]
    assert "error" not in want and "error" not in got, (want, got)
    assert len(want["outputs"]) == 3 and all(len(o["tokens"]) == 8 for o in want["outputs"])
    assert got["outputs"] == want["outputs"]
