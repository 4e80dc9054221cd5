"""Plans from transformers' own TP plans, judged by transformers' own tensor parallelism.

scripts/hf_tp_compare.py loads tiny random models with ``from_pretrained(tp_plan="auto")`` under
torchrun (2 ranks, gloo, CPU) and compares every rank's local tensors with shardload's ``load_rank``
of the same rank, planned from the model directory. Here a representative subset runs through the
same code; the whole table is the script's (docs/model-plans.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import torch

import shardload
from helpers import tiny_models
from helpers import tp_reference as tp
from shardload.models import hf_tp_tables
from shardload.models.generated import generate

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "hf_tp_compare.py"


def _script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class T:
    def __init__(self, *shape: int) -> None:
        self.shape, self.dtype = shape, "float32"


# --- where plans come from ------------------------------------------------------------------------


def test_shipped_table_is_what_the_installed_transformers_declares() -> None:
    """scripts/gen_hf_tp_plans.py run now writes exactly the shipped table."""
    shipped = hf_tp_tables.shipped_table()
    installed = version("transformers")
    if shipped["transformers"] != installed:
        pytest.skip(f"table from transformers {shipped['transformers']}, installed {installed}: regenerate it")
    gen = _script("gen_hf_tp_plans")
    assert gen.render(gen.build_table()) == (ROOT / "shardload" / "models" / hf_tp_tables.TABLE_FILE).read_text()
    assert len(shipped["models"]) >= 100 and "gemma" in shipped["models"]


def test_every_style_transformers_knows_is_translated() -> None:
    import transformers.distributed.expert_parallel  # noqa: F401  (registers the expert-parallel styles)
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    assert set(ALL_PARALLEL_STYLES.keys()) <= set(hf_tp_tables.STYLES)
    used = {
        style
        for entry in hf_tp_tables.shipped_table()["models"].values()
        for key in ("tp_plan", "ep_plan", "head_plan")
        for style in entry.get(key, {}).values()
    }
    assert used <= set(hf_tp_tables.STYLES)


def test_sources_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """config.json's own plan wins, then the shipped table, then (a type the table lacks) the installed transformers."""
    config = {"model_type": "gemma", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    table = hf_tp_tables.tp_table_for(config)
    shipped = hf_tp_tables.shipped_table()["transformers"]
    assert table.source == (
        f"transformers {shipped} (GemmaConfig.base_model_tp_plan + GemmaForCausalLM._tp_plan; shardload's table)"
    )
    assert table.head_plan == {"lm_head": "colwise_gather_output"} and table.prefix == "model"
    own = hf_tp_tables.tp_table_for({**config, "base_model_tp_plan": {"layers.*.mlp.up_proj": "colwise"}})
    assert own.source == "base_model_tp_plan of config.json" and own.tp_plan == {"layers.*.mlp.up_proj": "colwise"}
    assert (own.head_plan, own.prefix, own.tied) == (table.head_plan, table.prefix, table.tied)
    lacking = {"transformers": shipped, "models": {}}
    monkeypatch.setattr(hf_tp_tables, "shipped_table", lambda: lacking)
    installed = hf_tp_tables.tp_table_for(config)
    assert installed.source == (
        f"transformers {version('transformers')} (GemmaConfig.base_model_tp_plan + GemmaForCausalLM._tp_plan; "
        f"imported: model_type 'gemma' is not in shardload's table of transformers {shipped})"
    )
    assert (table.tp_plan, table.head_plan, table.prefix, table.tied) == (
        installed.tp_plan, installed.head_plan, installed.prefix, installed.tied,
    )  # fmt: skip
    assert hf_tp_tables.tp_table_for({"model_type": "no-such-type"}) is None


# every model type this module and tests/test_plan_startup.py plan with --style hf or the auto style's table
EXERCISED = ["gemma", "gemma3_text", "qwen3_moe", "deepseek_v3", "starcoder2", "phi", "gpt_neox", "olmo2", "phi3"]
EXERCISED += ["llama4_text", "olmoe", "llama"]


@pytest.mark.parametrize("model_type", EXERCISED)
def test_table_plan_equals_the_imported_plan(model_type: str) -> None:
    """The shipped table's plan (what planning reads) is the installed transformers' for each type the tests use."""
    table = hf_tp_tables.known_table(model_type)
    imported = hf_tp_tables.transformers_entry(model_type)
    assert table is not None and imported is not None
    imported_table = hf_tp_tables.HfTpTable.from_entry(model_type, imported, table.source)
    if "model_class" not in imported:  # a sub-config: no auto mapping names its model class, the table does
        imported_table = replace(imported_table, **{k: getattr(table, k) for k in ("head_plan", "prefix", "tied")})
        imported_table = replace(imported_table, model_class=table.model_class)
    if version("transformers") != hf_tp_tables.shipped_table()["transformers"]:
        pytest.skip("the table is from another transformers: scripts/gen_hf_tp_plans.py --check says what moved")
    assert table == imported_table


def test_import_shardload_does_not_import_transformers() -> None:
    code = (
        "import sys, shardload; from shardload.models.generated import model_placements; "
        "model_placements({'model_type': 'llama', 'hidden_size': 8, 'num_attention_heads': 2}, {}); "
        "assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_auto_style_uses_transformers_plan_where_no_preset(tmp_path: Path) -> None:
    """A Gemma (no built-in preset) plans from transformers' GemmaConfig plan; the description names it."""
    import transformers

    config = transformers.GemmaConfig(
        **tiny_models.COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    transformers.GemmaForCausalLM(config).save_pretrained(tmp_path)
    result = generate(tmp_path, num_shards=[2])
    assert result.style == "hf" and "GemmaConfig.base_model_tp_plan" in result.document["description"]
    params = result.document["params"]
    assert "model.embed_tokens.weight" in params and "model.layers.0.self_attn.q_proj.weight" in params
    assert "model.layers.0.input_layernorm.weight" not in params


# --- how styles translate ------------------------------------------------------------------------


def test_names_match_as_transformers_matches_them() -> None:
    """Exact generic names, else the parameter's module; prefix of the base model; lm_head from the model class."""
    plan = hf_tp_tables.HfTpTable(
        "x",
        {"layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts": "moe_tp_experts",
         "layers.*.mlp.experts.down_proj": "rowwise", "layers.*.mlp.fc1": "colwise"},
        "test",
    )  # fmt: skip
    tensors = {
        "model.embed_tokens.weight": T(256, 64),
        "model.layers.0.mlp.experts.gate_up_proj": T(4, 256, 64),
        "model.layers.0.mlp.experts.gate_up_proj_bias": T(4, 256),  # the experts module's: replicated
        "model.layers.0.mlp.experts.down_proj": T(4, 64, 128),
        "model.layers.0.mlp.fc1.weight": T(128, 64),
        "model.layers.0.mlp.fc1.bias": T(128),
        "model.layers.0.other.mlp.fc1.weight": T(128, 64),  # a suffix is not a match
        "lm_head.weight": T(256, 64),
    }
    placements, notes = hf_tp_tables.hf_placements({"model_type": "x"}, tensors, plan=plan)
    got = {n: (p.style, p.dim, p.segments) for n, p in placements.items()}
    assert got == {
        "model.embed_tokens.weight": ("vocab", 0, ()),
        "model.layers.0.mlp.experts.gate_up_proj": ("column", 1, (128, 128)),
        "model.layers.0.mlp.experts.gate_up_proj_bias": ("replicated", None, ()),
        "model.layers.0.mlp.experts.down_proj": ("row", 2, ()),
        "model.layers.0.mlp.fc1.weight": ("column", 0, ()),
        "model.layers.0.mlp.fc1.bias": ("column", 0, ()),
        "model.layers.0.other.mlp.fc1.weight": ("replicated", None, ()),
        "lm_head.weight": ("column", 0, ()),
    }
    assert notes == []
    # a base-model checkpoint (no prefix) gets no lm_head entry and still the base plan
    base = {k.removeprefix("model."): v for k, v in tensors.items() if k != "lm_head.weight"}
    placements, _ = hf_tp_tables.hf_placements({"model_type": "x"}, base, plan=plan)
    assert placements["layers.0.mlp.fc1.weight"].style == "column" and placements["embed_tokens.weight"].dim == 0


def test_runtime_only_styles_leave_weights_whole() -> None:
    runtime = [s for s, (rule, _) in hf_tp_tables.STYLES.items() if rule == "replicated"]
    assert {"moe_tp_experts", "mla_kv_a_proj", "replicated_with_grad_allreduce", "sequence_parallel"} <= set(runtime)
    plan = hf_tp_tables.HfTpTable("x", {f"m{i}": s for i, s in enumerate(runtime)}, "test")
    tensors = {f"model.m{i}.weight": T(8, 8) for i in range(len(runtime))}
    placements, _ = hf_tp_tables.hf_placements({"model_type": "x"}, tensors, plan=plan)
    assert {p.style for p in placements.values()} == {"replicated"}


# --- transformers' own tensor parallelism is the judge --------------------------------------------

# MoE (qwen3_moe; deepseek_v3 with MLA and run-time-only styles), biases (starcoder2, phi, gpt_neox), tied
# embeddings (gemma, starcoder2), no built-in preset (gemma, phi, olmo2, deepseek_v3), gathered plain splits
# (phi3), packed_rowwise experts behind an attribute that is not base_model_prefix (llama4_text), a fused
# query_key_value under another prefix (gpt_neox).
SUBSET = ["gemma", "qwen3_moe", "deepseek_v3", "starcoder2", "phi", "gpt_neox", "olmo2", "phi3", "llama4_text"]
SUBSET += ["olmoe#orig"]  # stored one tensor per expert, as on the Hub: transformers stacks them when loading
ODD_VOCAB = "llama@vocab_size=257"
CONTROL = "llama#swap"  # each rank against the other rank's shard: must differ


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One torchrun launch over the subset, the odd vocab and the control (the script's own code)."""
    out = tmp_path_factory.mktemp("hf_tp") / "rows.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--types", ",".join([*SUBSET, ODD_VOCAB, CONTROL]), "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return {row["type"]: row for row in json.loads(out.read_text())}


def moved_since_table(model_type: str) -> str | None:
    """Why the installed transformers is not the judge of ``model_type`` against the shipped table (its plan moved
    in a release after the table's), or None."""
    shipped = hf_tp_tables.shipped_table()
    installed = version("transformers")
    if installed == shipped["transformers"]:
        return None
    if hf_tp_tables.transformers_entry(model_type) == shipped["models"].get(model_type):
        return None
    table = shipped["transformers"]
    return f"{model_type}'s TP plan moved between transformers {table} and {installed}: regenerate the table"


@pytest.mark.parametrize("model_type", SUBSET)
@pytest.mark.slow
def test_every_local_tensor_equals_transformers(compared: dict[str, dict[str, Any]], model_type: str) -> None:
    row = compared[model_type]
    moved = moved_since_table(model_type.split("#")[0])
    if moved is not None and row["outcome"] != "equal":
        pytest.skip(moved)  # a newer transformers release, not a shardload change: the table test says so too
    assert row["outcome"] == "equal", row
    assert row["compared"] > 2 * 10  # both ranks, every weight of a 2-layer model
    if model_type == "phi3":  # fused qkv_proj / gate_up_proj, gathered by transformers: each piece split instead
        assert row["departed"] and all(n.endswith(("qkv_proj.weight", "gate_up_proj.weight")) for n in row["departed"])


def test_the_comparison_can_fail(compared: dict[str, dict[str, Any]]) -> None:
    row = compared[CONTROL]
    assert row["outcome"] == "differs" and "model.layers.0.self_attn.q_proj.weight" in row["differs"]


def test_odd_vocab(compared: dict[str, dict[str, Any]]) -> None:
    """transformers gives rank 0 129 rows of a 257-row vocab and rank 1 128 (torch.chunk); shardload's plain
    padding (to a multiple of N) gives the same rows, rank 1's followed by one zero row."""
    row = compared[ODD_VOCAB]
    assert row["outcome"] == "equal", row
    assert row["padded"] == ["lm_head.weight", "model.embed_tokens.weight"], row


@pytest.mark.slow
def test_gqa_above_kv_heads_transformers_splits_a_head_shardload_replicates(tmp_path: Path) -> None:
    """4 query heads, 1 KV head, 2 ranks: transformers gives each rank half of the KV head, and its forward cannot
    compute attention; shardload gives both ranks the whole head, and its tensor-parallel forward (each rank its
    own two query heads against the one KV head) equals the unsharded logits."""
    out = tmp_path / "gqa.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--gqa", "--json", str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    proof = json.loads(out.read_text())
    theirs, ours = proof["transformers"], proof["shardload"]
    assert [r["k_proj"] for r in theirs] == [[8, 64], [8, 64]]  # half of a 16-wide head on each rank
    assert all("error" in r or r["max_abs_diff"] > 1e-3 for r in theirs), theirs
    assert ours["k_proj"] == [[16, 64], [16, 64]]
    assert ours["max_abs_diff"] < 1e-4, ours


def test_fused_checkpoint_follows_the_plan_for_its_parts(tmp_path: Path) -> None:
    """A Llama stored with q/k/v fused into qkv_proj and gate/up into gate_up_proj (as Phi-3 and vLLM store them):
    transformers' plan names only the parts; --style hf splits the fused tensors by whole heads (KV heads
    replicated past their count) and by both halves, and the tensor-parallel forward equals the unsharded one."""
    from safetensors.torch import load_file, save_file

    model = tiny_models.build("llama_gqa", tmp_path / "src")  # 8 query heads, 2 KV heads
    state = load_file(tmp_path / "src" / "model.safetensors")
    fused = {}
    for name, tensor in state.items():
        if ".q_proj." in name:
            p = name.replace(".q_proj.", ".{}.")
            fused[p.format("qkv_proj")] = torch.cat([state[p.format(w)] for w in ("q_proj", "k_proj", "v_proj")])
        elif ".gate_proj." in name:
            p = name.replace(".gate_proj.", ".{}.")
            fused[p.format("gate_up_proj")] = torch.cat([state[p.format(w)] for w in ("gate_proj", "up_proj")])
        elif not any(f".{w}." in name for w in ("k_proj", "v_proj", "up_proj")):
            fused[name] = tensor
    model_dir = tmp_path / "fused"
    model_dir.mkdir()
    save_file(fused, model_dir / "model.safetensors")
    (model_dir / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    plan = generate(model_dir, style="hf", num_shards=[2, 4, 8])
    qkv = plan.placements["model.layers.0.self_attn.qkv_proj.weight"]
    assert (qkv.segments, qkv.kv) == ((8, 2, 2), (False, True, True))
    assert plan.placements["model.layers.0.mlp.gate_up_proj.weight"].segments == (128, 128)
    config = json.loads((model_dir / "config.json").read_text())
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for n in (1, 2, 4, 8):
            shards = shardload.load(model_dir, n, devices=["cpu"] * n, shard_info=plan.document)
            got = tp.decoder_logits(config, shards, ids)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


# --- head counts bound N, whatever the plan's source ---------------------------------------------


@pytest.fixture(scope="module")
def neox_10_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPT-NeoX with 10 heads of 8 (query_key_value interleaved per head) and a 960-row vocabulary, which every
    N up to 16 that divides the heads also divides (transformers 5.24 splits ``embed_in`` by rows), so only the
    heads limit N."""
    import transformers

    config = transformers.GPTNeoXConfig(
        vocab_size=960, hidden_size=80, num_attention_heads=10, num_hidden_layers=1, intermediate_size=160,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("neox10")
    transformers.GPTNeoXForCausalLM(config).save_pretrained(out)
    return out


def test_hf_plan_never_cuts_a_head(neox_10_heads: Path) -> None:
    """transformers' plan splits query_key_value colwise; the plan lists only N that divide the 10 heads."""
    generated = generate(neox_10_heads, check_up_to=16)
    assert generated.style == "hf"
    assert generated.supported == [1, 2, 5, 10]
    qkv = generated.placements["gpt_neox.layers.0.attention.query_key_value.weight"]
    assert (qkv.segments, qkv.unit) == ((10,), 24)  # whole heads of q, k and v (3 x 8) each
    dense = generated.placements["gpt_neox.layers.0.attention.dense.weight"]
    assert (dense.dim, dense.segments, dense.unit) == (1, (10,), 8)


@pytest.mark.parametrize("n", [3, 4])
def test_a_head_cutting_n_fails_naming_the_heads(neox_10_heads: Path, tmp_path: Path, n: int) -> None:
    """plan -n N fails on the head count; validate --strict of the written plan fails N=3 and N=4 too."""
    from click.testing import CliRunner

    from shardload.cli.main import main

    runner = CliRunner()
    out = tmp_path / "plan.json"
    refused = runner.invoke(main, ["plan", str(neox_10_heads), "-o", str(out), "-n", str(n)])
    assert refused.exit_code == 1 and not out.exists()
    assert refused.output == f"error: {neox_10_heads}: num_attention_heads=10 is not divisible by num_shards={n}\n"
    assert runner.invoke(main, ["plan", str(neox_10_heads), "-o", str(out)]).exit_code == 0
    checked = runner.invoke(main, ["validate", str(out), "--model", str(neox_10_heads), "-n", str(n), "--strict"])
    assert checked.exit_code == 1 and "head" in checked.output, checked.output
    # planned in memory (no file to validate): the error cuts a head, and points to the command that lists the N
    converted = runner.invoke(main, ["convert", str(neox_10_heads), "-n", str(n), "-o", str(tmp_path / "out")])
    assert converted.exit_code == 1 and "so a head would be cut" in converted.stderr, converted.stderr
    assert f"see `shardload plan {neox_10_heads} -o -`" in converted.stderr and not (tmp_path / "out").exists()
