"""vLLM's ``load_format="shardload"`` with ``model_loader_extra_config={"verify": ...}``: a verified load gives the
same tokens as a plain one, and one flipped byte in the checkpoint fails the load with the integrity message."""

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

from shardload.engine.hashing import hash_model
from shardload.sources.safetensors_header import read_header

HERE = Path(__file__).parent


def test_verified_vllm_load(tmp_path: Path) -> None:
    model = tmp_path / "llama"
    make_models.llama(model)
    root = hash_model(model).root
    flipped = shutil.copytree(model, tmp_path / "flipped")
    info = read_header(flipped / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    data = bytearray((flipped / "model.safetensors").read_bytes())
    data[info.offset + info.nbytes // 2] ^= 0x20
    (flipped / "model.safetensors").write_bytes(bytes(data))

    def job(path: Path, name: str, extra: dict[str, Any]) -> dict[str, Any]:
        return {"model": str(path), "load_format": "shardload", "tp": 1, "out": str(tmp_path / name), "extra": extra}

    jobs = [job(model, "plain.json", {}), job(model, "root.json", {"verify": root}),
            job(model, "true.json", {"verify": True}), job(flipped, "flipped.json", {"verify": root})]  # fmt: skip
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps(jobs))
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, str(HERE / "run_vllm.py"), str(spec)], stdout=out,
                              stderr=subprocess.STDOUT, timeout=900, check=False)  # fmt: skip
    assert proc.returncode == 0, log.read_text()[-4000:]
    results = {j["out"]: json.loads(Path(j["out"]).read_text()) for j in jobs}
    plain = results[str(tmp_path / "plain.json")]
    assert "error" not in plain, plain
    for name in ("root.json", "true.json"):
        assert results[str(tmp_path / name)] == plain
    error = results[str(tmp_path / "flipped.json")].get("error", "")
    assert "hash mismatch" in error and "down_proj" in error, error
