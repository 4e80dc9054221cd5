"""``shardload verify MODEL`` on a source checkpoint: every file re-hashed against its integrity record
(``shardload hash``), one line and exit 1 per problem, ``--root`` pins the record, a model without one gets the hint."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from helpers.verified import offset_of, tampered
from shardload.cli.main import main
from shardload.format.hash_record import RECORD_NAME, root_of


def _verify(*args: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr (a refusal is one ``error:`` line on stderr)."""
    result = CliRunner().invoke(main, ["verify", *args])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.stdout, result.stderr


def test_an_intact_model_matches_its_record(split_model: Path) -> None:
    root = root_of((split_model / RECORD_NAME).read_bytes())
    code, out, _ = _verify(str(split_model))
    assert code == 0, out
    assert "2 files" in out and "match" in out and root in out
    code, out, _ = _verify(str(split_model), "--root", root.upper())
    assert code == 0, out


def test_a_flipped_byte_names_the_file_and_its_byte_range(split_model: Path, tmp_path: Path) -> None:
    at = offset_of(split_model, "col.weight", 300, 1000)
    model = tampered(split_model, tmp_path / "m", at)
    code, out, err = _verify(str(model))
    assert code == 1
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    assert "model.safetensors" in lines[0] and "col.weight" in lines[0] and "differ" in lines[0]
    lo, hi = map(int, re.search(r"bytes (\d+)\.\.(\d+)", lines[0]).groups())
    assert lo <= at < hi and hi - lo <= 128 << 10
    assert "1 problem" in err


def test_a_pinned_wrong_root_fails(split_model: Path) -> None:
    code, _, err = _verify(str(split_model), "--root", "0" * 64)
    assert code == 1 and "pinned root" in err and len(err.strip().splitlines()) == 1
    code, _, err = _verify(str(split_model), "--root", "abc")
    assert code == 2 and "64-digit root hash" in err  # a usage error, as convert --verify tells it


def test_no_record_says_how_to_make_one(split_model: Path, tmp_path: Path) -> None:
    model = shutil.copytree(split_model, tmp_path / "m")
    (model / RECORD_NAME).unlink()
    code, _, err = _verify(str(model))
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"shardload hash {model}" in lines[0], err
    assert "not a converted directory" not in err


def test_file_level_problems_one_line_each(split_model: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    model = shutil.copytree(split_model, tmp_path / "m")
    (model / "shard_info.json").unlink()  # listed, now missing
    tensors = load_file(str(model / "model.safetensors"))
    save_file({**tensors, "new.weight": np.zeros(4, np.float16)}, str(model / "model.safetensors"))  # another size
    save_file({"extra.weight": np.zeros(4, np.float32)}, str(model / "extra.safetensors"))  # an extra weight file
    code, out, err = _verify(str(model))
    assert code == 1
    lines = out.strip().splitlines()
    assert len(lines) == 3, out
    assert any("shard_info.json" in line and "missing" in line for line in lines)
    assert any("model.safetensors" in line and "bytes" in line and "record says" in line for line in lines)
    assert any("extra.safetensors" in line and "not in the integrity record" in line for line in lines)
    assert "3 problem(s)" in err


def test_json_report(split_model: Path, tmp_path: Path) -> None:
    code, out, _ = _verify(str(split_model), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["files"] == 2 and doc["problems"] == []
    assert doc["root"] == root_of((split_model / RECORD_NAME).read_bytes())
    model = tampered(split_model, tmp_path / "m", offset_of(split_model, "row.weight", 3, 0))
    code, out, _ = _verify(str(model), "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["ok"] and len(doc["problems"]) == 1
    assert doc["problems"][0]["file"].endswith("model.safetensors") and "row.weight" in doc["problems"][0]["reason"]


def test_root_goes_with_a_source_checkpoint(split_model: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "o"
    assert CliRunner().invoke(main, ["convert", str(split_model), "-n", "2", "-o", str(out_dir)]).exit_code == 0
    code, out, _ = _verify(str(out_dir))
    assert code == 0 and "shard_manifest.json" in out  # a converted directory: checked as before
    code, _, err = _verify(str(out_dir), "--root", "0" * 64)
    assert code == 2 and "--root goes with a source checkpoint" in err
