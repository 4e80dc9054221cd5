"""`shardload plan` on real architectures: the sharded model computes the same function.

Tiny transformers models (random fp32 weights, saved with save_pretrained) are planned, loaded for
N ranks with shardload.load, and run tensor-parallel over the N rank state dicts by
tests/helpers/tp_reference.py; logits must match the unsharded HF model within 1e-5 relative.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import shardload
from helpers import tiny_models
from helpers import tp_reference as tp
from shardload.cli.main import main
from shardload.models.generated import generate, model_placements, shard_info_document
from shardload.planning.validate import validate_file

pytest.importorskip("transformers")

IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Every tiny model kind, built once: directory and the unsharded HF model."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: (root / kind, tiny_models.build(kind, root / kind)) for kind in tiny_models.KINDS}


def _plan(model_dir: Path, *args: str) -> Path:
    out = model_dir / f"shard_info{'_'.join(args).replace('-', '')}.json"
    result = CliRunner().invoke(main, ["plan", str(model_dir), "-o", str(out), "--overwrite", *args])
    assert result.exit_code == 0, result.output
    return out


def _config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


def _reference_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


CAUSAL = [
    ("llama", [1, 2, 4]),
    ("qwen2", [1, 2, 4]),
    ("llama_gqa", [1, 2, 4, 8]),
    ("phi3", [1, 2, 4]),
    ("mixtral", [1, 2, 4]),
    ("mixtral_stacked", [1, 2, 4]),
]


@pytest.mark.parametrize(("kind", "ns"), CAUSAL, ids=[k for k, _ in CAUSAL])
def test_tensor_parallel_logits_match(models: dict, kind: str, ns: list[int]) -> None:
    model_dir, model = models[kind]
    info = _plan(model_dir)
    report = validate_file(info, model_dir, ns)
    assert report["valid"], report["problems"]
    assert report["warnings"] == [], "a plan that computes the model has no placement warnings"
    want = _reference_logits(model)
    for n in ns:
        shards = shardload.load(model_dir, n, devices=["cpu"] * n, shard_info=info)
        with torch.no_grad():
            got = tp.decoder_logits(_config(model_dir), shards, IDS)
        _assert_close(got, want)


@pytest.mark.parametrize("ns", [[1, 2, 4]])
def test_expert_parallel_logits_match(models: dict, ns: list[int]) -> None:
    model_dir, model = models["mixtral_stacked"]
    info = _plan(model_dir, "--experts", "parallel")
    want = _reference_logits(model)
    for n in ns:
        shards = shardload.load(model_dir, n, devices=["cpu"] * n, shard_info=info)
        gate_up = shards[0]["model.layers.0.mlp.experts.gate_up_proj"]
        assert gate_up.shape == (4 // n, 256, 64)  # whole experts: the fused intermediate dim is intact
        with torch.no_grad():
            _assert_close(tp.decoder_logits(_config(model_dir), shards, IDS, experts="parallel"), want)


def test_bert_hidden_states_match(models: dict) -> None:
    model_dir, model = models["bert"]
    info = _plan(model_dir)
    with torch.no_grad():
        want = model(input_ids=IDS).last_hidden_state
    for n in (1, 2, 4):
        shards = shardload.load(model_dir, n, devices=["cpu"] * n, shard_info=info)
        assert shards[0]["embeddings.word_embeddings.weight"].shape == (256 // n, 64)
        with torch.no_grad():
            _assert_close(tp.bert_hidden(_config(model_dir), shards, IDS), want)


@pytest.mark.parametrize("n", [4, 8])
def test_gqa_kv_heads_follow_vllm_rule(models: dict, n: int) -> None:
    """N > KV heads: rank r holds KV head r // (N / num_kv_heads), weights and biases alike."""
    model_dir, _ = models["qwen2"] if n == 4 else models["llama_gqa"]
    kv_heads, head_dim = 2, 16 if n == 4 else 8
    stored = shardload.load(model_dir, 1, devices=["cpu"], shard_info={"version": 1, "params": {}})[0]
    shards = shardload.load(model_dir, n, devices=["cpu"] * n, shard_info=_plan(model_dir))
    names = [k for k in stored if ".k_proj." in k or ".v_proj." in k]
    assert any(k.endswith("bias") for k in names) == (n == 4)
    for name in names:
        for r, shard in enumerate(shards):
            head = r // (n // kv_heads)
            assert torch.equal(shard[name], stored[name][head * head_dim : (head + 1) * head_dim])


def test_swapped_shards_change_the_result(models: dict) -> None:
    """The tensor-parallel forward notices a rank holding another rank's KV head (the check can fail)."""
    model_dir, model = models["qwen2"]
    shards = shardload.load(model_dir, 4, devices=["cpu"] * 4, shard_info=_plan(model_dir))
    name = "model.layers.0.self_attn.k_proj.weight"
    shards[0][name], shards[2][name] = shards[2][name], shards[0][name]
    with torch.no_grad():
        got = tp.decoder_logits(_config(model_dir), shards, IDS)
    assert not torch.allclose(got, _reference_logits(model), rtol=1e-3, atol=1e-3)


# --- HF tp_plan ---------------------------------------------------------------------------------


def _with_tp_plan(src: Path, dst: Path, config_cls: str) -> Path:
    """A copy of ``src`` whose config.json carries transformers' own base_model_tp_plan / ep_plan."""
    import transformers

    dst.mkdir()
    for f in src.iterdir():
        if (
            f.suffix in (".safetensors", ".json")
            and f.name != "shard_info.json"
            and not f.name.startswith("shard_info")
        ):
            (dst / f.name).write_bytes(f.read_bytes())
    cls = getattr(transformers, config_cls)
    config = _config(src)
    config["base_model_tp_plan"] = dict(cls.base_model_tp_plan)
    if getattr(cls, "base_model_ep_plan", None):
        config["base_model_ep_plan"] = dict(cls.base_model_ep_plan)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_hf_tp_plan_llama(models: dict, tmp_path: Path) -> None:
    src, model = models["llama_gqa"]
    model_dir = _with_tp_plan(src, tmp_path / "llama", "LlamaConfig")
    info = json.loads(_plan(model_dir).read_text())
    assert "base_model_tp_plan" in info["description"]
    # transformers adds embed_tokens: embedding_rowwise to a base model's plan that does not name it
    assert "model.embed_tokens.weight" in info["params"]
    want = _reference_logits(model)
    for n in (1, 2, 4, 8):
        shards = shardload.load(model_dir, n, devices=["cpu"] * n, shard_info=info)
        assert shards[0]["model.embed_tokens.weight"].shape == (256 // n, 64)
        assert shards[0]["lm_head.weight"].shape == (256 // n, 64)
        with torch.no_grad():
            _assert_close(tp.decoder_logits(_config(model_dir), shards, IDS), want)


@pytest.mark.parametrize("experts", ["tp", "parallel"])
def test_hf_tp_plan_mixtral_stacked(models: dict, tmp_path: Path, experts: str) -> None:
    src, model = models["mixtral_stacked"]
    model_dir = _with_tp_plan(src, tmp_path / "mixtral", "MixtralConfig")
    info = _plan(model_dir, "--experts", experts)
    want = _reference_logits(model)
    for n in (1, 2, 4):
        shards = shardload.load(model_dir, n, devices=["cpu"] * n, shard_info=info)
        with torch.no_grad():
            _assert_close(tp.decoder_logits(_config(model_dir), shards, IDS, experts=experts), want)


def test_hf_styles_translate_literally() -> None:
    """Each HF style becomes the split HF applies; attention colwise splits by whole heads."""
    config = {"model_type": "x", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "base_model_tp_plan": {
                  "layers.*.self_attn.qkv_proj": "colwise_gather_output", "layers.*.self_attn.k_proj": "colwise",
                  "layers.*.self_attn.o_proj": "rowwise", "layers.*.mlp.gate_up_proj": "packed_colwise",
                  "layers.*.mlp.down_proj": "rowwise_split_input", "embed_tokens": "embedding_rowwise",
                  "layers.*.mlp.experts.gate_up_proj": "grouped_gemm", "norm": "replicated_with_grad_allreduce",
                  "layers.*.unused": "colwise"}}  # fmt: skip

    class T:
        def __init__(self, *shape: int) -> None:
            self.shape, self.dtype = shape, "float32"

    tensors = {
        "model.layers.0.self_attn.qkv_proj.weight": T(128, 64),
        "model.layers.0.self_attn.k_proj.weight": T(32, 64),
        "model.layers.0.self_attn.k_proj.bias": T(32),
        "model.layers.0.self_attn.o_proj.weight": T(64, 64),
        "model.layers.0.self_attn.o_proj.bias": T(64),
        "model.layers.0.mlp.gate_up_proj.weight": T(256, 64),
        "model.layers.0.mlp.down_proj.weight": T(64, 128),
        "model.layers.0.mlp.experts.gate_up_proj": T(4, 256, 64),
        "model.embed_tokens.weight": T(256, 64),
        "model.norm.weight": T(64),
        "lm_head.weight": T(256, 64),
    }
    placements, notes = model_placements(config, tensors)
    short = {n: n.removeprefix("model.layers.0.").removeprefix("model.") for n in tensors}
    got = {short[n]: (p.style, p.dim, p.segments, p.unit, p.kv) for n, p in placements.items()}
    assert got == {
        # transformers gathers this output and splits it plainly; stored fused, every rank gets its own q, k and v
        # heads, as vLLM's fused layers and any runtime keeping the output local need (docs/model-plans.md)
        "self_attn.qkv_proj.weight": ("column", 0, (4, 2, 2), 16, (False, True, True)),
        "self_attn.k_proj.weight": ("column", 0, (2,), 16, (True,)),
        "self_attn.k_proj.bias": ("column", 0, (2,), 16, (True,)),
        "self_attn.o_proj.weight": ("row", 1, (4,), 16, (False,)),
        "self_attn.o_proj.bias": ("replicated", None, (), 1, ()),
        "mlp.gate_up_proj.weight": ("column", 0, (128, 128), 1, ()),
        "mlp.down_proj.weight": ("row", 1, (), 1, ()),
        "mlp.experts.gate_up_proj": ("expert", 0, (), 1, ()),
        "embed_tokens.weight": ("vocab", 0, (), 1, ()),
        "norm.weight": ("replicated", None, (), 1, ()),
        "lm_head.weight": ("column", 0, (), 1, ()),
    }
    assert notes == ["tp_plan entry 'layers.*.unused' (colwise) matched no tensor"]
    doc = shard_info_document(placements, tensors)
    assert doc["params"]["model.layers.0.self_attn.qkv_proj.weight"] == [
        ["shard_funcs.shard_segments", [None, "float32"], 0, [4, 2, 2], [0, 1, 1], "num_shards", 16]
    ]
    assert doc["params"]["model.layers.0.self_attn.k_proj.weight"] == [
        ["shard_funcs.shard_segments", [None, "float32"], 0, [2], [1], "num_shards", 16]
    ]


# --- the plan command ------------------------------------------------------------------------------


def test_plan_matches_the_example_shard_info(example_dir: Path, tmp_path: Path) -> None:
    """The example model's hand-written shard_info and the generated one give the same shards."""
    out = tmp_path / "generated.json"
    result = CliRunner().invoke(main, ["plan", str(example_dir), "-o", str(out), "-n", "8"])
    assert result.exit_code == 0, result.output
    assert "num_shards 1, 2, 4, 8, 16\n" in result.output
    for n in (1, 2, 4, 8):
        written = shardload.load(example_dir, n)
        generated = shardload.load(example_dir, n, shard_info=out)
        for r in range(n):
            assert written[r].keys() == generated[r].keys()
            for name, t in written[r].items():
                assert torch.equal(t, generated[r][name]), (n, r, name)


def test_plan_writes_a_file_valid_for_every_n_it_claims(models: dict) -> None:
    model_dir, _ = models["llama_gqa"]
    generated = generate(model_dir)
    assert generated.supported == [1, 2, 4, 8]
    assert "plans for num_shards 1, 2, 4, 8 (checked 1..64)" in generated.document["description"]
    path = _plan(model_dir)
    assert json.loads(path.read_text()) == generated.document
    report = validate_file(path, model_dir, generated.supported)
    assert report["valid"] and report["valid_for"] == [1, 2, 4, 8]
    assert validate_file(path, model_dir, [3, 16])["valid_for"] == []


def _fake_model(directory: Path, config: dict[str, Any], tensors: dict[str, tuple[int, ...]]) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True)
    save_file({k: np.ones(s, dtype=np.float16) for k, s in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_plan_rejects_n_that_divides_neither_way(tmp_path: Path) -> None:
    config = {"model_type": "llama", "hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 4}
    model_dir = _fake_model(tmp_path / "m", config, {
        "model.layers.0.self_attn.q_proj.weight": (96, 96), "model.layers.0.self_attn.k_proj.weight": (32, 96),
        "model.layers.0.self_attn.v_proj.weight": (32, 96), "model.layers.0.self_attn.o_proj.weight": (96, 96),
    })  # fmt: skip
    runner = CliRunner()
    result = runner.invoke(main, ["plan", str(model_dir), "-n", "6"])
    assert result.exit_code == 1
    assert result.output.strip() == (
        f"error: {model_dir}: num_shards=6 neither divides num_key_value_heads=4 "
        "nor is a multiple of it (num_attention_heads=12)"
    )
    assert not (model_dir / "shard_info.json").exists()
    result = runner.invoke(main, ["plan", str(model_dir), "-n", "12"])
    assert result.exit_code == 0, result.output
    assert "num_shards 1, 2, 4, 12" in result.output
    report = validate_file(model_dir / "shard_info.json", model_dir, [6])
    assert any(
        "k_proj.weight: step 1 (shard_funcs.shard_segments): segment 0: num_shards=6 neither divides its 4 KV heads"
        in p["message"]
        for p in report["problems"]
    )


def test_plan_errors(models: dict, tmp_path: Path) -> None:
    runner = CliRunner()
    separate, _ = models["mixtral"]
    result = runner.invoke(main, ["plan", str(separate), "-o", str(tmp_path / "x.json"), "--experts", "parallel"])
    assert result.exit_code == 1
    assert "block_sparse_moe.experts.0.w1.weight: --experts parallel needs expert weights stacked" in result.output
    llama, _ = models["llama"]
    result = runner.invoke(main, ["plan", str(llama), "-o", str(tmp_path / "y.json"), "--style", "hf"])
    assert result.exit_code == 0, result.output  # transformers' LlamaConfig carries the plan
    _plan(llama)  # writes llama/shard_info.json
    result = runner.invoke(main, ["plan", str(llama)])
    assert result.exit_code == 1 and "shard_info.json: exists (pass --overwrite" in result.output
    unknown = _fake_model(tmp_path / "u", {"model_type": "gpt2"}, {"h.0.attn.c_attn.weight": (4, 4)})
    result = runner.invoke(main, ["plan", str(unknown)])
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert result.output.startswith(f"error: {unknown / 'config.json'}: model_type 'gpt2': no plan source knows")
    assert result.output.endswith("write a shard_info.json for it beside the weights (docs/format.md)\n")
    result = runner.invoke(main, ["plan", str(unknown), "--style", "hf"])
    assert result.exit_code == 1
    assert "--style hf needs a base_model_tp_plan in config.json or a transformers" in result.output
    no_config = tmp_path / "nc"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes((unknown / "model.safetensors").read_bytes())
    result = runner.invoke(main, ["plan", str(no_config)])
    assert result.exit_code == 1 and "no config.json here" in result.output
    result = runner.invoke(main, ["plan", str(llama), "--experts", "all"])
    assert result.exit_code == 2
    for r in (result,):
        assert "Traceback" not in r.output


def test_plan_to_stdout(models: dict) -> None:
    model_dir, _ = models["phi3"]
    result = CliRunner().invoke(main, ["plan", str(model_dir), "-o", "-"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["num_shards"] is None and doc["params"]["model.layers.0.self_attn.qkv_proj.weight"][0][0] == (
        "shard_funcs.shard_segments"
    )


def test_placements_see_quantized_modules_as_their_logical_weight() -> None:
    """A module stored quantized (packed values, scales) is placed as its logical weight, with the logical shape;
    its stored companions get their steps from that placement."""
    from shardload.models.placement import Header
    from shardload.models.stored_layouts import logical_tensors

    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 96}  # fmt: skip
    stored = {
        "model.layers.0.self_attn.k_proj.weight_packed": Header((32, 8), "int32"),
        "model.layers.0.self_attn.k_proj.weight_scale": Header((32, 2), "float16"),
        "model.layers.0.mlp.gate_up_proj.weight_packed": Header((192, 8), "int32"),
        "model.layers.0.self_attn.rotary_emb.inv_freq": Header((8,), "float32"),
    }
    logical = logical_tensors(stored)
    assert logical == {
        "model.layers.0.self_attn.k_proj.weight": Header((32, 64), "int32"),
        "model.layers.0.mlp.gate_up_proj.weight": Header((192, 64), "int32"),
        "model.layers.0.self_attn.rotary_emb.inv_freq": stored["model.layers.0.self_attn.rotary_emb.inv_freq"],
    }
    placements, _ = model_placements(config, logical)
    k = placements["model.layers.0.self_attn.k_proj.weight"]
    assert (k.style, k.dim, k.segments, k.unit, k.kv) == ("column", 0, (2,), 16, (True,))
    assert placements["model.layers.0.mlp.gate_up_proj.weight"].segments == (96, 96)
    assert placements["model.layers.0.self_attn.rotary_emb.inv_freq"].style == "replicated"
    params = shard_info_document(placements, stored)["params"]
    assert params == {
        "model.layers.0.self_attn.k_proj.weight_packed": [
            ["shard_funcs.shard_segments", [None, "int32"], 0, [2], [1], "num_shards", 16]
        ],
        "model.layers.0.self_attn.k_proj.weight_scale": [
            ["shard_funcs.shard_segments", [None, "float16"], 0, [2], [1], "num_shards", 16]
        ],
        "model.layers.0.mlp.gate_up_proj.weight_packed": [
            ["shard_funcs.shard_segments", [["num_shards", "192 // num_shards", 8], "int32"], 0, [96, 96], [0, 0],
             "num_shards"]
        ],
    }  # fmt: skip


def test_a_replicated_bias_under_a_split_weight_is_a_warning(models: dict, tmp_path: Path) -> None:
    """A Llama plan (no bias entries) used on a Qwen2, whose q/k/v projections have biases: it loads, but every rank
    would add the whole bias to its slice of the output. validate --model says so; --strict fails."""
    model_dir, _ = models["qwen2"]
    info = json.loads(_plan(model_dir).read_text())
    info["params"] = {k: v for k, v in info["params"].items() if not k.endswith(".bias")}
    path = tmp_path / "llama_style.json"
    path.write_text(json.dumps(info))
    report = validate_file(path, model_dir, [2])
    assert report["valid"] and report["warnings"]
    assert all("is split along its output dim but its bias is replicated" in w["reason"] for w in report["warnings"])
    assert {w["param"].rsplit(".", 2)[-2] for w in report["warnings"]} == {"q_proj", "k_proj", "v_proj"}
    runner = CliRunner()
    plain = runner.invoke(main, ["validate", str(path), "--model", str(model_dir), "-n", "2"])
    assert plain.exit_code == 0 and "warning:" in plain.stderr
    strict = runner.invoke(main, ["validate", str(path), "--model", str(model_dir), "-n", "2", "--strict"])
    assert strict.exit_code == 1 and "which fail --strict" in strict.stderr
    as_json = runner.invoke(main, ["validate", str(path), "--model", str(model_dir), "-n", "2", "--strict", "--json"])
    assert as_json.exit_code == 1 and json.loads(as_json.output)["verdict"] == "fail"


def test_a_fused_tensor_whose_output_transformers_gathers_gives_each_rank_its_part_of_every_piece(
    tmp_path: Path,
) -> None:
    """GLM-4 stores gate and up fused (``mlp.gate_up_proj``), and transformers' plan gathers its output
    (``colwise_gather_output``), so it splits the tensor plainly: rank 0 all of gate, rank 1 all of up. vLLM's fused
    layer (and any runtime keeping the output local) needs rank r's part of gate, then of up: the plan gave the
    plain split, which loaded into vLLM's parameters without a word (reviewer's finding, vLLM's default loader as
    the judge)."""
    import transformers
    from safetensors.torch import load_file

    sizes = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "head_dim": 16}
    config = transformers.Glm4Config(**sizes, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.Glm4ForCausalLM(config).save_pretrained(tmp_path / "glm4")
    stored = load_file(str(tmp_path / "glm4" / "model.safetensors"))
    name = "model.layers.0.mlp.gate_up_proj.weight"
    gate, up = stored[name].chunk(2, 0)
    for n in (2, 4):
        for r in range(n):
            got = shardload.load_rank(tmp_path / "glm4", r, n)[name]
            torch.testing.assert_close(got, torch.cat([gate.chunk(n, 0)[r], up.chunk(n, 0)[r]]), rtol=0, atol=0)


def test_head_counts_under_other_config_names_bound_n(tmp_path: Path) -> None:
    """GPT-J's config.json says ``n_head`` and ``n_embd`` (transformers' attribute_map): read as the head count, they
    refuse an N that would cut a head (N=8 gave rank 0 half of one of 4 heads, and vLLM refuses that N)."""
    import transformers

    from shardload.models.generated import generate

    config = transformers.GPTJConfig(vocab_size=128, n_embd=64, n_layer=1, n_head=4, rotary_dim=8, n_positions=64)
    transformers.GPTJForCausalLM(config).save_pretrained(tmp_path / "gptj")
    assert generate(tmp_path / "gptj").supported == [1, 2, 4]
    with pytest.raises(shardload.ShardloadError):
        shardload.load_rank(tmp_path / "gptj", 0, 8)


def test_latent_attention_projections_are_split_by_whole_heads(tmp_path: Path) -> None:
    """DeepSeek's q_proj, q_b_proj, kv_b_proj (heads x rows each) and o_proj (heads x v_head_dim inputs) were plain
    column and row splits: with 4 heads, N=8 loaded with rank 0 holding half a head of each. They are split by whole
    heads now, so N must divide the head count; N=2 and 4 give a plain split's bytes."""
    from safetensors.torch import save_file

    from shardload.models.generated import generate

    hidden, heads, nope, rope, v, lora = 64, 4, 16, 8, 16, 32
    config = {"model_type": "deepseek_v2", "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": heads, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v,
              "kv_lora_rank": lora, "q_lora_rank": None, "num_hidden_layers": 1, "intermediate_size": 128,
              "vocab_size": 256}  # fmt: skip
    model = tmp_path / "deepseek"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    prefix = "model.layers.0.self_attn."
    tensors = {
        prefix + "q_proj.weight": torch.randn(heads * (nope + rope), hidden, generator=g),
        prefix + "kv_a_proj_with_mqa.weight": torch.randn(lora + rope, hidden, generator=g),
        prefix + "kv_b_proj.weight": torch.randn(heads * (nope + v), lora, generator=g),
        prefix + "o_proj.weight": torch.randn(hidden, heads * v, generator=g),
    }
    save_file(tensors, str(model / "model.safetensors"))
    assert generate(model).supported == [1, 2, 4]
    for n in (2, 4):
        for rank in range(n):
            got = shardload.load_rank(model, rank, n)
            for name in ("q_proj", "kv_b_proj"):
                assert torch.equal(got[prefix + name + ".weight"], tensors[prefix + name + ".weight"].chunk(n)[rank])
            assert torch.equal(got[prefix + "o_proj.weight"], tensors[prefix + "o_proj.weight"].chunk(n, 1)[rank])
    with pytest.raises(shardload.ShardloadError, match="4 is not divisible by num_shards=8, so a head would be cut"):
        shardload.load_rank(model, 0, 8)


@pytest.mark.parametrize("style", ["preset", "hf"])
@pytest.mark.parametrize("layout", ["gptq-marlin", "sparse-24-bitmask"])
def test_a_split_module_stored_in_a_layout_no_rule_knows_is_refused(tmp_path: Path, layout: str, style: str) -> None:
    """A module the plan splits, stored under names no layout knows (GPTQ's marlin repacking ``P.B``/``P.s``;
    compressed-tensors' 2:4 sparse ``P.weight.compressed``/``.bitmask``): its tensors matched no rule and were
    copied whole to every rank, beside split embeddings, a state dict that is no tensor-parallel split, and the
    plan claimed N up to 64. Under a config's own ``base_model_tp_plan`` (transformers' rules) ``P.B`` was cut
    as if it were the module's weight, the marlin tiles split mid-tile."""
    from safetensors.torch import save_file

    hidden, heads, kv, head_dim, inter, vocab = 128, 4, 2, 32, 256, 256
    config = {"model_type": "llama", "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv,
              "head_dim": head_dim, "intermediate_size": inter, "num_hidden_layers": 1, "vocab_size": vocab,
              "tie_word_embeddings": False}  # fmt: skip
    if style == "hf":
        config["base_model_tp_plan"] = {
            "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
            "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
        }  # fmt: skip
    modules = {
        "self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv * head_dim, hidden),
        "self_attn.v_proj": (kv * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter),
    }  # fmt: skip

    def stored(rows: int, cols: int) -> dict[str, torch.Tensor]:
        if layout == "gptq-marlin":
            return {"B": torch.zeros(cols // 16, rows * 2, dtype=torch.int32),
                    "s": torch.zeros(cols // 128, rows, dtype=torch.float16)}  # fmt: skip
        return {
            "weight.compressed": torch.zeros(rows, cols // 2, dtype=torch.bfloat16),
            "weight.bitmask": torch.zeros(rows, cols // 8, dtype=torch.uint8),
            "weight.shape": torch.tensor([rows, cols]),
            "weight.row_offsets": torch.zeros(rows, dtype=torch.int32),
        }

    quant = ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}
             if layout == "gptq-marlin" else
             {"quant_method": "compressed-tensors", "format": "sparse-24-bitmask", "config_groups": {}})  # fmt: skip
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    tensors = {f"model.layers.0.{m}.{k}": v for m, shape in modules.items() for k, v in stored(*shape).items()}
    tensors |= {"model.embed_tokens.weight": torch.zeros(vocab, hidden), "lm_head.weight": torch.zeros(vocab, hidden)}
    save_file(tensors, str(model / "model.safetensors"))
    with pytest.raises(shardload.ShardloadError, match="in a layout no rule knows") as err:
        shardload.load_rank(model, 0, 2)
    assert "\n" not in str(err.value) and "model.layers.0.mlp.down_proj" in str(err.value)


@pytest.mark.parametrize("n", [2, 4])
def test_per_head_attention_scales_follow_their_heads(tmp_path: Path, n: int) -> None:
    """KV-cache scales stored per head (compressed-tensors' ``attn_head`` strategy: ``self_attn.k_scale`` and
    ``v_scale`` ``[kv_heads, 1, 1]``, ``q_scale`` ``[heads, 1, 1]``) went whole to every rank, though each rank holds
    only its heads (vLLM gives rank r its heads' scales); ``q_scale`` was taken for MLC's quantized part and no N
    planned. Now each rank holds the scales of the heads it holds, KV heads replicated past their count as k_proj's
    are; a per-tensor scale stays whole."""
    from safetensors.torch import load_file, save_file

    from helpers import tiny_models

    model = tmp_path / "m"
    tiny_models.build("llama_gqa", model)  # 8 heads, 2 KV heads, head_dim 8
    state = load_file(model / "model.safetensors")
    a = "model.layers.0.self_attn."
    state[a + "k_scale"] = torch.tensor([1.0, 2.0]).reshape(2, 1, 1)
    state[a + "v_scale"] = torch.tensor([3.0, 4.0]).reshape(2, 1, 1)
    state[a + "q_scale"] = torch.arange(1.0, 9.0).reshape(8, 1, 1)
    state["model.layers.1.self_attn.k_scale"] = torch.tensor(5.0)  # per tensor
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    kv_cache = {"num_bits": 8, "type": "float", "strategy": "attn_head"}
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
                                     "kv_cache_scheme": kv_cache}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    k_rows = state[a + "k_proj.weight"].reshape(2, 8, -1)  # [kv head, head_dim, hidden]
    for r in range(n):
        got = shardload.load_rank(model, r, n)
        kv = [h for h in range(2) if torch.equal(got[a + "k_proj.weight"].reshape(-1, 8, 64)[0], k_rows[h])]
        assert len(kv) == 1, "the rank's k_proj rows are one KV head's"
        want_kv = torch.tensor([[1.0, 2.0][kv[0]]]).reshape(1, 1, 1) if n >= 2 else None
        assert torch.equal(got[a + "k_scale"], want_kv), (r, got[a + "k_scale"])
        assert torch.equal(got[a + "v_scale"], want_kv + 2), (r, got[a + "v_scale"])
        heads = 8 // n
        assert torch.equal(got[a + "q_scale"].flatten(), torch.arange(1.0 + r * heads, 1.0 + (r + 1) * heads)), r
        assert got["model.layers.1.self_attn.k_scale"].item() == 5.0


def test_generate_plans_only_the_n_config_json_allows(example_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``shardload plan`` built a whole plan for each of the 64 N it checks, those config.json's head counts already
    refuse included, and kept every message of every one: 2 ms and 17 KB per tensor (reviewer M: 74 CPU s for a
    37,000-tensor MoE). Only the N config.json allows are planned; what it records is unchanged."""
    from shardload.models.generated import config_problems
    from shardload.planning import plan

    real, planned = plan.build_plan, []

    def counting(info: Any, checkpoint: Any, n: int, **kwargs: Any) -> Any:
        planned.append(n)
        return real(info, checkpoint, n, **kwargs)

    made = generate(example_dir)
    monkeypatch.setattr(plan, "build_plan", counting)
    again = generate(example_dir)
    allowed = [n for n in range(1, 65) if not config_problems(json.loads((example_dir / "config.json").read_text()),
                                                                 again.placements, n)]  # fmt: skip
    assert sorted(planned) == allowed and len(allowed) < 64, (planned, allowed)
    assert again.document == made.document and again.supported == made.supported
