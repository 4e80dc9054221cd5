"""Bad arguments to the Python API and the validate command are one located line, never a traceback; and the
paths taken when a parameter has too many runs to list give the reference's slices."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from test_load import reference_shards

import shardload
import shardload.planning.runs as runs_module
from shardload.cli.main import main
from shardload.errors import ShardloadError


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda m: shardload.load(m, 2, devices=["gpu", "gpu"]), "device 'gpu' is not a device torch knows"),
        (lambda m: shardload.load(m, 2, devices="cpu"), "devices must be a list of 2 devices"),
        (lambda m: shardload.load(m, 2, devices=[None, "cpu"]), "device must be a string, an int or a torch.device"),
        (lambda m: shardload.load_rank(m, "0", 2), "rank must be an int, got '0'"),
        (lambda m: shardload.load_rank(m, 0, 2, device=1.5), "device must be a string"),
        (lambda m: shardload.load(m, 2, shard_info=5), "shard_info .* must be a path"),
        (lambda m: shardload.load(None, 2), "model must be a path"),
        (lambda m: shardload.convert(m, 2, None), "out_dir must be a path"),
        (lambda m: shardload.load(m, 10**9), "over the limit of 65536"),
        (lambda m: shardload.load_rank(m, 0, mesh="pp=2,tp=100000"), "over the limit of 65536"),
    ],
)
def test_bad_api_arguments_are_one_line_errors(example_dir: Path, call: Any, says: str) -> None:
    with pytest.raises(ShardloadError, match=says) as err:
        call(example_dir)
    assert "\n" not in err.value.message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_named(example_dir: Path) -> None:
    with pytest.raises(ShardloadError, match=r"device 'cuda:0' needs a CUDA GPU, and this torch .* sees none"):
        shardload.load_rank(example_dir, 0, 2, device="cuda:0")


def test_validate_usage_errors_exit_2_and_json_verdict(example_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    for target, says in ((tmp_path / "nope.json", "no such file"), (example_dir, "is a directory")):
        result = runner.invoke(main, ["validate", str(target)])
        assert result.exit_code == 2 and result.stderr.startswith(f"error: {target}: {says}")
    info = json.loads((example_dir / "shard_info.json").read_text())
    for i in range(10):
        info["params"][f"extra.{i}"] = [["shard_funcs.shard_dim", [["num_shards", 1], "float16"], 0, "num_shards"]]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(info))
    result = runner.invoke(main, ["validate", str(bad), "--model", str(example_dir), "-n", "2"])
    lines = result.output.splitlines()
    assert result.exit_code == 1 and sum("extra." in ln for ln in lines) == 3, result.output
    assert "... and 7 more parameters with the same problem" in lines[-1]
    for args, code in ((["-n", "2"], 1), (["--list-valid-n"], 1)):
        result = runner.invoke(main, ["validate", str(bad), "--model", str(example_dir), "--json", *args])
        assert result.exit_code == code and json.loads(result.output)["verdict"] == ("pass" if code == 0 else "fail")
    result = runner.invoke(main, ["validate", str(example_dir / "shard_info.json"), "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["verdict"] == "pass"


@pytest.mark.parametrize("n", [2, 4])
def test_too_many_runs_to_list_still_match_the_reference(
    example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """With the run limit set to 0 every parameter takes the paths a tall, narrow tensor takes: one rank copies out
    of the mapping, several read whole and split, convert reads whole; all give the reference's slices."""
    monkeypatch.setattr(runs_module, "MANY_RUNS", 0)
    want = reference_shards(example_dir, n)
    shards = shardload.load(example_dir, n, devices=["cpu"] * n)
    shardload.convert(example_dir, n, tmp_path / "out")
    for r in range(n):
        for got in (shards[r], shardload.load_rank(example_dir, r, n), shardload.load_rank(tmp_path / "out", r, n)):
            assert got.keys() == want[r].keys()
            for name, t in got.items():
                np.testing.assert_array_equal(t.numpy(), want[r][name], err_msg=f"rank {r} {name}")
