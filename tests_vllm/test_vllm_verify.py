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


def _run(jobs: list[dict[str, Any]], tmp_path: Path) -> None:
    """Run ``jobs`` in one ``run_vllm.py`` process (its output in ``tmp_path/log.txt``); each job writes its "out"."""
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps(jobs))
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, str(HERE / "run_vllm.py"), str(spec)], stdout=out,
                              stderr=subprocess.STDOUT, timeout=900, check=False)  # fmt: skip
    assert proc.returncode == 0, log.read_text()[-4000:]


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
    _run(jobs, tmp_path)
    results = {j["out"]: json.loads(Path(j["out"]).read_text()) for j in jobs}
    plain = results[str(tmp_path / "plain.json")]
    assert "error" not in plain, plain
    for name in ("root.json", "true.json"):
        assert results[str(tmp_path / name)] == plain
    error = results[str(tmp_path / "flipped.json")].get("error", "")
    assert "hash mismatch" in error and "down_proj" in error, error


def test_a_converted_directory_rewritten_before_the_fill_is_refused_or_its_verified_bytes_kept(tmp_path: Path) -> None:
    """A converted directory at its own N is read as views of its rank file, copied into vLLM's parameters after the
    load returned. With ``verify`` those views were paged in after the hash, so a rewrite in between filled vLLM
    with bytes no hash had seen; now a verified load reads what it hashes (the tokens of the file as it was), and a
    plain one refuses a file rewritten before its copies were made."""
    import shardload

    model = tmp_path / "llama"
    make_models.llama(model)
    jobs = []
    for name, extra, flip in (("plain", {}, False), ("verified", {"verify": True}, True), ("views", {}, True)):
        converted = tmp_path / f"tp1-{name}"
        shardload.convert(model, 1, converted)
        job = {"model": str(converted), "load_format": "shardload", "tp": 1, "out": str(tmp_path / f"{name}.json"),
               "extra": extra}  # fmt: skip
        if flip:
            job["flip_before_fill"] = str(converted / "rank-00000-of-00001.safetensors")
        jobs.append(job)
    _run(jobs, tmp_path)
    results = {Path(j["out"]).stem: json.loads(Path(j["out"]).read_text()) for j in jobs}
    assert "error" not in results["plain"], results["plain"]
    assert results["verified"] == results["plain"], results["verified"].get("error")
    error = results["views"].get("error", "")
    assert "changed while" in error and "rank-00000-of-00001" in error, error
