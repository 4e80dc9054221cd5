"""examples/torchrun_load.py under real processes: torchrun, 2 ranks on CPU (gloo), load_rank from the group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import tiny_models
from shardload.cli.main import main

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchrun_load.py"


@pytest.mark.slow
def test_torchrun_two_ranks_match_the_unsharded_model(tmp_path: Path) -> None:
    """Qwen2 with one KV head (replicated on both ranks), qkv biases and tied embeddings."""
    model_dir = tmp_path / "qwen2"
    tiny_models.build("qwen2", model_dir, num_key_value_heads=1)
    planned = CliRunner().invoke(main, ["plan", str(model_dir), "-n", "2"])
    assert planned.exit_code == 0, planned.output
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(EXAMPLE), str(model_dir)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("world size 2:"))
    assert float(line.rsplit(" ", 1)[1]) <= 1e-5
