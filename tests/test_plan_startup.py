"""Start-up of a model planned from transformers' TP table: the shipped table (hf_tp_plans.json) and config.json are
enough, so a known model type never imports transformers; a type the table lacks imports it and says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.tp_table_models import write_tiny_gemma
from shardload.models import hf_tp_tables

# run the command line in a fresh interpreter, then name the heavy modules it imported
_INSPECT = """
import sys
from shardload.cli.main import main
sys.argv = ["shardload", "inspect", sys.argv[1], "-n", "8"]
try:
    main()
except SystemExit as exit:
    assert not exit.code, exit.code
heavy = ("transformers", "torch", "numpy", "safetensors")
print("imported:", " ".join(m for m in heavy if m in sys.modules), file=sys.stderr)
"""


def test_inspect_of_a_table_type_does_not_import_transformers(tmp_path: Path) -> None:
    """``shardload inspect -n 8`` of a Gemma (no preset: planned from transformers' table) reads the shipped table and
    imports neither transformers nor torch."""
    model = write_tiny_gemma(tmp_path / "gemma")
    done = subprocess.run([sys.executable, "-c", _INSPECT, str(model)], capture_output=True, text=True, check=True)
    assert done.stderr.splitlines()[-1].rstrip() == "imported:", done.stderr
    notes = [line for line in done.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1, done.stderr
    assert "(GemmaConfig.base_model_tp_plan + GemmaForCausalLM._tp_plan; shardload's table)" in notes[0]
    assert "model.layers.0.self_attn.q_proj.weight" in done.stdout


def test_a_type_the_table_lacks_imports_transformers_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without gemma in the table, the plan comes from the installed transformers; the note says it was imported."""
    pytest.importorskip("transformers")
    from click.testing import CliRunner

    from shardload.cli.main import main

    table = hf_tp_tables.shipped_table()
    lacking = {**table, "models": {k: v for k, v in table["models"].items() if k != "gemma"}}
    monkeypatch.setattr(hf_tp_tables, "shipped_table", lambda: lacking)
    model = write_tiny_gemma(tmp_path / "gemma")
    result = CliRunner().invoke(main, ["inspect", str(model), "-n", "8"])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1, result.stderr
    assert "imported: model_type 'gemma' is not in shardload's table of transformers" in notes[0]
    assert "(GemmaConfig.base_model_tp_plan + GemmaForCausalLM._tp_plan;" in notes[0]
    planned = CliRunner().invoke(main, ["plan", str(model), "-o", "-"])
    assert planned.exit_code == 0, planned.output
    assert "note: model_type 'gemma' is not in shardload's table of transformers" in planned.stderr
    assert "imported: model_type 'gemma'" in json.loads(planned.stdout)["description"]
    monkeypatch.undo()  # the control: the table knows gemma
    with_table = CliRunner().invoke(main, ["plan", str(model), "-o", "-"])
    assert with_table.exit_code == 0 and "imported" not in with_table.stderr + with_table.stdout


_LOAD = """
import sys
import shardload
shardload.load_rank(sys.argv[1], 1, 2)
print(" ".join(sorted(m for m in sys.modules if m.startswith("shardload.integrations."))))
"""


def test_a_first_load_of_a_plain_checkpoint_imports_no_server_layout(tmp_path: Path) -> None:
    """A fresh process's first load asks every split format whether the model is one of theirs: vLLM's
    ``sharded_state`` answers no for a plain checkpoint without importing its reader (its layout planner, vLLM's
    families and names: tens of milliseconds a server's first load paid)."""
    from helpers.checkpoints import parallel_model

    model = parallel_model(tmp_path / "m")
    done = subprocess.run([sys.executable, "-c", _LOAD, str(model)], capture_output=True, text=True, check=True)
    imported = set(done.stdout.split())
    heavy = {f"shardload.integrations.vllm.{m}" for m in ("sharded_state", "layout", "families", "names", "saved")}
    assert not imported & heavy, sorted(imported)
