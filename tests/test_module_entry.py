"""``python -m shardload`` is the same command line as the ``shardload`` script."""

from __future__ import annotations

import subprocess
import sys


def test_python_dash_m_runs_the_cli(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "shardload", "example", str(tmp_path / "m")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "m" / "shard_info.json").is_file()
    usage = subprocess.run([sys.executable, "-m", "shardload", "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and usage.stdout.startswith("Usage: shardload ")


def test_import_shardload_stays_light():
    """``import shardload`` pulls in no array, tensor, hashing or format package: the loaders import them when
    called (a CLI start, or a server that only registers the load format, pays for none of them)."""
    probe = (
        "import sys, shardload\n"
        "heavy = ('torch', 'numpy', 'blake3', 'safetensors', 'transformers', 'boto3', 'huggingface_hub', 'gguf')\n"
        "print(','.join(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"import shardload imported: {out.stdout.strip()}"
