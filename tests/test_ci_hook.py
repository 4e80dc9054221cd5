"""Validation in users' CI (docs/ci.md): the shardload-validate hook of .pre-commit-hooks.yaml, run through pre-commit
itself when it is installed, and the keys docs/ci.md lists for ``validate --json``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from shardload.cli.main import main
from shardload.format import strictjson
from shardload.models.generated import SCHEMA_URL

ROOT = Path(__file__).resolve().parent.parent


def _hook() -> dict:
    import yaml

    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    return next(h for h in hooks if h["id"] == "shardload-validate")


def test_the_hook_runs_validate_on_shard_info_files() -> None:
    hook = _hook()
    assert hook["entry"] == "shardload validate" and hook["language"] == "python"
    pattern = re.compile(hook["files"])
    assert all(pattern.search(p) for p in ("shard_info.json", "models/x/shard_info.tp8.json"))
    assert not any(pattern.search(p) for p in ("shard_manifest.json", "config.json", "shard_info.json.bak",
                                               "shard_info.schema.json", "vendor/shard_info.schema.json"))  # fmt: skip
    for path in (ROOT / "shard_info.schema.json", ROOT / "shardload" / "format" / "shard_info.schema.json"):
        schema = strictjson.loads(path.read_text())  # the published schema passes the strict reading it asks of files
        assert schema["$id"] == SCHEMA_URL and "version 1" in schema["$comment"]


def _pre_commit(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # this checkout's shardload
    env = {**os.environ, "PRE_COMMIT_HOME": str(repo.parent / "pre-commit-home"), "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "pre_commit", *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_the_hook_through_pre_commit(example_dir: Path, tmp_path: Path) -> None:
    """pre-commit checks the manifest, then runs the hook (as a local, system hook: the python one would pip-install
    shardload and torch into a virtualenv, which needs PyPI) on the matching files only, several per run."""
    pytest.importorskip("pre_commit")
    manifest = _pre_commit(tmp_path, "validate-manifest", str(ROOT / ".pre-commit-hooks.yaml"))
    assert manifest.returncode == 0, manifest.stdout + manifest.stderr
    repo = tmp_path / "repo"
    (repo / "good").mkdir(parents=True)
    (repo / "bad").mkdir()
    (repo / "good" / "shard_info.json").write_bytes((example_dir / "shard_info.json").read_bytes())
    (repo / "good" / "shard_info.tp2.json").write_bytes((example_dir / "shard_info.json").read_bytes())
    (repo / "bad" / "shard_info.json").write_text('{"version": 2, "params": {}}')
    (repo / "notes.json").write_text("not json, and no shard_info")
    hook = {k: v for k, v in _hook().items() if k not in ("entry", "language", "description")}
    hook |= {"entry": f"{sys.executable} -m shardload validate", "language": "system"}
    config = {"repos": [{"repo": "local", "hooks": [hook]}]}
    (repo / ".pre-commit-config.yaml").write_text(json.dumps(config))  # JSON is YAML
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    failed = _pre_commit(repo, "run", "--all-files")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "bad/shard_info.json: unsupported version 2 (this shardload reads version 1)" in failed.stdout
    assert "good/shard_info.tp2.json: valid for num_shards 1, 2, 4, 8" in failed.stdout
    assert "notes.json" not in failed.stdout
    (repo / "bad" / "shard_info.json").unlink()
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    passed = _pre_commit(repo, "run", "--all-files", "--verbose")
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "good/shard_info.json: valid for num_shards 1, 2, 4, 8" in passed.stdout


def test_docs_list_the_keys_validate_json_prints(example_dir: Path, tmp_path: Path) -> None:
    text = (ROOT / "docs" / "ci.md").read_text()
    section = text.split("## What `validate --json` prints", 1)[1]
    documented = set(re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE))
    result = CliRunner().invoke(main, ["validate", str(example_dir / "shard_info.json"), "--json"])
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)) == documented
    bad = tmp_path / "shard_info.json"
    bad.write_text('{"version": 1, "params": {"w": [["shard_funcs.shard_dim", [[4, 4], "float16"], 0, 3]]}}')
    report = json.loads(CliRunner().invoke(main, ["validate", str(bad), "--json", "-n", "2"]).stdout)
    listed = section.split("Each problem (and warning) has", 1)[1].split("\n\n")[0]
    keys = set(re.findall(r"`(\w+)`", listed.split("`message`")[0])) - {"FormatError", "PlanError", "CheckpointError"}
    assert "`num_shards`, the N it was" in listed
    assert set(report["problems"][0]) == {*keys, "message", "num_shards"}
    sample = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])  # the example document
    assert set(sample) == set(report) and set(sample["problems"][0]) == set(report["problems"][0])
