"""The shardload command line: click's test runner for every command, plus the installed executable."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import shardload
from shardload.cli.main import main


@pytest.fixture()
def runner() -> CliRunner:
    return CliRunner()


def test_validate_valid_file(runner: CliRunner, example_dir: Path) -> None:
    result = runner.invoke(main, ["validate", str(example_dir / "shard_info.json"), "--model", str(example_dir)])
    assert result.exit_code == 0, result.output
    assert "valid for num_shards 1, 2, 4, 8" in result.output


def test_validate_reports_each_problem_on_one_line(runner: CliRunner, example_dir: Path, tmp_path: Path) -> None:
    info = json.loads((example_dir / "shard_info.json").read_text())
    params = info["params"]
    params["model.layers.0.mlp.down_proj.weight"][0][0] = "os.system"
    params["model.layers.1.self_attn.o_proj.weight"][0][1][1] = "float32"
    params["model.layers.9.mlp.down_proj.weight"] = params["model.layers.1.mlp.down_proj.weight"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(info))
    result = runner.invoke(main, ["validate", str(bad), "--model", str(example_dir), "-n", "2", "-n", "16"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert (
        f"{bad}: model.layers.0.mlp.down_proj.weight: step 1 (os.system): unknown function 'os.system' "
        "(not registered; --plugin MODULE registers your own)" in lines
    )
    assert any(
        "model.layers.1.self_attn.o_proj.weight: step 1 (shard_funcs.shard_dim): declared dtype float32" in ln
        for ln in lines
    )
    assert any("model.layers.9.mlp.down_proj.weight: names no parameter" in ln for ln in lines)
    assert any(
        "qkv_proj.weight: step 1 (shard_funcs.reorder_segments)" in ln and ln.endswith("[num_shards=16]")
        for ln in lines
    )
    assert all(ln.startswith(f"{bad}: ") for ln in lines)
    assert "Traceback" not in result.output


def test_validate_json_report(runner: CliRunner, example_dir: Path) -> None:
    result = runner.invoke(main, ["validate", str(example_dir / "shard_info.json"), "--model", str(example_dir),
                                  "-n", "4", "-n", "3", "--json"])  # fmt: skip
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["valid"] is False and report["num_shards_checked"] == [4, 3] and report["valid_for"] == [4]
    assert report["problems"] and all(p["num_shards"] == [3] for p in report["problems"])
    assert {"file", "param", "step", "function", "reason", "message"} <= set(report["problems"][0])


def test_validate_without_model_and_malformed_file(runner: CliRunner, tmp_path: Path) -> None:
    seed = tmp_path / "seed.json"
    seed.write_text(json.dumps({"x_0": [["shard_funcs.shard_dim", [[2, 64, 64], "float16"], 1, 2]]}))
    ok = runner.invoke(main, ["validate", str(seed)])
    assert ok.exit_code == 0 and "valid for num_shards 2" in ok.output
    broken = tmp_path / "broken.json"
    broken.write_text('{"x": [["f", [[1], "float16"]],')
    result = runner.invoke(main, ["validate", str(broken)])
    assert result.exit_code == 1
    assert result.output.strip().startswith(f"{broken}: not valid JSON")
    assert len(result.output.strip().splitlines()) == 1


def test_usage_errors_exit_2(runner: CliRunner, example_dir: Path) -> None:
    assert runner.invoke(main, ["validate"]).exit_code == 2
    assert runner.invoke(main, ["validate", "x.json", "-n", "0"]).exit_code == 2
    assert runner.invoke(main, ["convert", str(example_dir), "-o", "x"]).exit_code == 2
    assert runner.invoke(main, ["frobnicate"]).exit_code == 2


def test_inspect_table_and_json(runner: CliRunner, example_dir: Path) -> None:
    result = runner.invoke(main, ["inspect", str(example_dir), "-n", "4"])
    assert result.exit_code == 0, result.output
    row = next(ln for ln in result.output.splitlines() if ln.startswith("model.layers.0.self_attn.qkv_proj.weight"))
    assert "[512, 256]" in row and "reorder_segments > shard_dim" in row and "[128, 256]" in row
    assert "replicated bytes per rank: 2.5 KiB (2560)" in result.output
    as_json = json.loads(runner.invoke(main, ["inspect", str(example_dir), "-n", "4", "--json"]).output)
    plan = shardload.plan_model(example_dir, 4)
    assert as_json["totals"]["bytes_per_rank"] == [plan.rank_nbytes(0)] * 4
    assert len(as_json["rows"]) == len(plan.params)
    bad = runner.invoke(main, ["inspect", str(example_dir), "-n", "3"])
    assert bad.exit_code == 1 and bad.output.startswith("error: ") and "not divisible" in bad.output


def test_convert_command(runner: CliRunner, example_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(main, ["convert", str(example_dir), "--num-shards", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "rank-00001-of-00002.safetensors" in result.output
    manifest = json.loads((out / "shard_manifest.json").read_text())
    assert [f["path"] for f in manifest["files"][:2]] == [
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    ]
    again = runner.invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(out)])
    assert again.exit_code == 1 and "output directory exists" in again.output
    quiet = runner.invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(out), "--overwrite", "-q"])
    assert quiet.exit_code == 0 and quiet.output == ""
    missing = runner.invoke(main, ["convert", str(tmp_path / "nope"), "-n", "2", "-o", str(tmp_path / "o2")])
    assert missing.exit_code == 1 and "no such file or directory" in missing.output


def test_example_command(runner: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "ex"
    assert runner.invoke(main, ["example", str(out)]).exit_code == 0
    assert (out / "shard_info.json").exists() and (out / "model.safetensors").exists()
    assert runner.invoke(main, ["example", str(out)]).exit_code == 1
    assert runner.invoke(main, ["example", str(out), "--overwrite", "--multi-file"]).exit_code == 0
    assert (out / "model.safetensors.index.json").exists()


def _installed_command() -> str:
    found = shutil.which("shardload", path=str(Path(sys.executable).parent)) or shutil.which("shardload")
    if found is None:
        pytest.fail("the shardload command is not installed (pip install -e .)")
    return found


def test_installed_command_end_to_end(tmp_path: Path) -> None:
    exe = _installed_command()
    model, out = tmp_path / "model", tmp_path / "out"
    subprocess.run([exe, "example", str(model)], check=True, capture_output=True, text=True)
    done = subprocess.run([exe, "convert", str(model), "--num-shards", "8", "-o", str(out)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "rank-00007-of-00008.safetensors" in done.stdout
    assert done.stderr == "", "no progress bar when stderr is not a terminal"
    direct = shardload.load_rank(model, 5, 8)
    converted = shardload.load_rank(out, 5, 8, verify=True)
    assert direct.keys() == converted.keys()
    assert all(torch.equal(direct[k], converted[k]) for k in direct)
    bad = subprocess.run(
        [exe, "convert", str(model), "-n", "3", "-o", str(tmp_path / "o3")], capture_output=True, text=True
    )
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith(f"error: {model / 'shard_info.json'}: ")
    assert not (tmp_path / "o3").exists()
    shim = subprocess.run([sys.executable, str(Path(__file__).parent.parent / "cli.py"), "--version"],
                          capture_output=True, text=True)  # fmt: skip
    assert shim.returncode == 0 and shardload.__version__ in shim.stdout


def test_convert_with_other_shard_info_copies_neither(runner: CliRunner, example_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.json"
    other.write_text((example_dir / "shard_info.json").read_text())
    out = tmp_path / "out"
    result = runner.invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(out), "--shard-info", str(other)])
    assert result.exit_code == 0, result.output
    assert not (out / "shard_info.json").exists() and not (out / "other.json").exists()
    assert (out / "config.json").read_text() == (example_dir / "config.json").read_text()
