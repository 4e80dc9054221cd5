"""A model without shard_info.json is planned in memory from its config.json by every entry point (load, load_rank,
convert, plan_model, inspect), with one note naming that source; a file or an explicit shard_info still wins.

The tensors must equal those from the file `shardload plan` writes, element for element, and the tensor-parallel
forward over them must give the unsharded model's logits.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import shardload
from helpers import tiny_models
from helpers import tp_reference as tp
from shardload.cli.main import main
from shardload.errors import PlanError
from shardload.models import choices

pytest.importorskip("transformers")

IDS = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.nn.Module]:
    """A tiny GQA Llama without shard_info.json, and a copy holding the file `shardload plan` writes."""
    root = tmp_path_factory.mktemp("fly")
    model = tiny_models.build("llama_gqa", root / "bare")
    planned = root / "planned"
    shutil.copytree(root / "bare", planned)
    result = CliRunner().invoke(main, ["plan", str(planned)])
    assert result.exit_code == 0, result.output
    return root / "bare", planned, model


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_every_api_entry_point_plans_from_config(
    bare: tuple[Path, Path, torch.nn.Module], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir, planned, model = bare
    assert not (model_dir / "shard_info.json").exists()
    n = 4
    with caplog.at_level(logging.INFO, logger="shardload.plan"):
        shards = shardload.load(model_dir, n, devices=["cpu"] * n)
    lines = [r.getMessage() for r in caplog.records if r.name == "shardload.plan"]
    assert lines == [
        f"{model_dir}: no shard_info.json: planned in memory from {model_dir / 'config.json'} (the llama preset)"
    ]
    want = shardload.load(planned, n, devices=["cpu"] * n)
    for r in range(n):
        _same(shards[r], want[r])
        _same(shardload.load_rank(model_dir, r, n), want[r])
    config = json.loads((model_dir / "config.json").read_text())
    with torch.no_grad():
        logits = tp.decoder_logits(config, shards, IDS)
        dense = model(input_ids=IDS).logits
    torch.testing.assert_close(logits, dense, rtol=1e-5, atol=1e-5 * dense.abs().max().item())

    out = tmp_path / "tp4"
    result = shardload.convert(model_dir, n, out)
    manifest = json.loads((out / "shard_manifest.json").read_text())
    assert manifest["shard_info"] == shardload.plan_model(planned, n).resolved_shard_info()
    assert manifest["shard_info"] == result.plan.resolved_shard_info()
    assert "model.layers.0.self_attn.q_proj.weight" in manifest["shard_info"]["params"]
    for r in range(n):
        _same(shardload.load_rank(out, r, n, verify=True), want[r])
    assert not (model_dir / "shard_info.json").exists()  # planned in memory: nothing written beside the weights
    plan = shardload.plan_model(model_dir, 8)
    assert plan.shard_info.source == f"<planned from {model_dir / 'config.json'}>"
    assert plan.params["model.embed_tokens.weight"].shape == (32, 64)


def test_a_file_or_an_explicit_shard_info_wins(
    bare: tuple[Path, Path, torch.nn.Module], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir, _, model = bare
    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    (copy / "shard_info.json").write_text(json.dumps({"version": 1, "params": {}}))  # everything replicated
    stored = model.state_dict()
    with caplog.at_level(logging.INFO, logger="shardload.plan"):
        state = shardload.load_rank(copy, 1, 2)
        explicit = shardload.load_rank(model_dir, 1, 2, shard_info={"version": 1, "params": {}})
    assert not [r for r in caplog.records if r.name == "shardload.plan"]
    for got in (state, explicit):
        assert all(torch.equal(got[k], stored[k]) for k in got)


def test_inspect_and_convert_commands_plan_from_config(
    bare: tuple[Path, Path, torch.nn.Module], tmp_path: Path
) -> None:
    model_dir, _, _ = bare
    runner = CliRunner()
    result = runner.invoke(main, ["inspect", str(model_dir), "--json"])
    assert result.exit_code == 0, result.output
    notes = result.stderr.splitlines()
    assert notes == [
        f"note: {model_dir}: no shard_info.json: planned in memory from {model_dir / 'config.json'} (the llama preset)",
        "note: no -n given: inspecting num_shards=8",
    ]
    rows = json.loads(result.stdout)["rows"]
    assert {r["parameter"]: r for r in rows}["model.embed_tokens.weight"]["rank_shape"] == [32, 64]
    result = runner.invoke(main, ["convert", str(model_dir), "-n", "2", "-o", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith(f"note: {model_dir}: no shard_info.json: planned in memory from ")
    assert (tmp_path / "out" / "shard_manifest.json").exists()


def test_inspect_without_n_takes_the_largest_valid_n_up_to_8(tmp_path: Path) -> None:
    tiny_models.build("llama", tmp_path / "m")  # 4 heads: 8 ranks cannot split them
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    note = result.stderr.splitlines()[-1]
    assert note.startswith("note: no -n given: inspecting num_shards=4, the largest N up to 8 this plan works for")
    assert "(num_shards=8: " in note and "num_shards=8" in note
    assert shardload.plan_model(tmp_path / "m", 4).params["model.embed_tokens.weight"].shape == (64, 64)


def test_no_plan_source_is_one_line_saying_how_to_proceed(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    model_dir = tmp_path / "m"
    model_dir.mkdir()
    save_file({"h.0.attn.c_attn.weight": np.ones((4, 4), np.float32)}, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps({"model_type": "gpt_unknown"}))
    with pytest.raises(PlanError) as caught:
        shardload.load_rank(model_dir, 0, 2)
    message = str(caught.value)
    assert message.startswith(f"{model_dir}: no shard_info.json beside the weights, and planning one from config.json")
    assert "model_type 'gpt_unknown': no plan source knows this architecture" in message
    assert (
        "write a shard_info.json for it beside the weights (docs/format.md); or pass one with --shard-info" in message
    )
    for command in (["inspect", str(model_dir)], ["convert", str(model_dir), "-n", "2", "-o", str(tmp_path / "o")]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 1
        assert result.output.count("\n") == 1 and result.output.startswith(f"error: {model_dir}: no shard_info.json")
        assert "Traceback" not in result.output
    assert not (tmp_path / "o").exists()
    (model_dir / "config.json").unlink()  # nothing to plan from: the hint to write one
    with pytest.raises(PlanError, match=r"no shard_info given and .*shard_info.json does not exist; write one"):
        shardload.load_rank(model_dir, 0, 2)
    assert choices.VOCAB_PADDING["server"] == 64
