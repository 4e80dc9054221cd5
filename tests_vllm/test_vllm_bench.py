"""``benchmarks/vllm_load.py`` runs on this virtualenv's vLLM: its arguments, and a tiny TP=2 run under torchrun with
vLLM's real groups, the launch that failed on a fresh venv (``KeyError: 'VLLM_DIST_IDENT'``; a shared ident then
collides on /dev/shm). A smoke test of the benchmark: its figures are not checked, only that it measures."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("CI") != "true":
    pytest.importorskip("vllm", reason="vLLM runs in its own virtualenv: .ci/vllm-venv DIR")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vllm_load.py"


def bench(*args: str, timeout: int = 60) -> subprocess.CompletedProcess[str]:
    """The benchmark script run with ``args`` by this virtualenv's Python, this checkout first on its path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)  # fmt: skip


def test_arguments() -> None:
    shown = bench("--help")
    assert shown.returncode == 0, shown.stderr
    assert all(flag in shown.stdout for flag in ("--tp", "--repeats", "--launcher", "--formats"))
    refused = bench("--tp", "0")
    assert refused.returncode == 2
    assert "--repeats and --tp take positive numbers" in refused.stderr


def test_tiny_tp2_under_torchrun(tmp_path: Path) -> None:
    def ours() -> set[str]:
        return set(glob.glob("/dev/shm/*shardload-bench-*"))

    before = ours()
    run = bench("--tp", "2", "--launcher", "torchrun", "--formats", "shardload", "--size-gib", "0.05",
                "--repeats", "1", "--keep", str(tmp_path), timeout=300)  # fmt: skip
    out = run.stdout
    assert run.returncode in (0, 1), out[-3000:] + run.stderr[-3000:]  # 1: a target missed, as a tiny model may
    rows = [line for line in out.splitlines() if line.startswith("| 2 | ")]
    assert rows and rows[0].startswith("| 2 | `shardload` | "), out[-3000:] + run.stderr[-3000:]
    assert rows[-1].endswith("| 1.000x |"), out  # issue 30's table: the reader count, exactly the rank's bytes
    assert "pages still cached after eviction (mincore, worst run): 0 MiB" in out
    assert ours() == before  # the run's shared-memory segments are removed
