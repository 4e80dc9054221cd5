"""The model-family registry: one entry per family, each model type in one family, a new family planned from
its entry alone."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import shardload
from shardload.errors import PlanError
from shardload.integrations.vllm.families import VLLM_FAMILIES, VllmFamily, register_vllm_family, vllm_packing
from shardload.models import families
from shardload.models.families import Family, family_for, register_family
from shardload.models.generated import generate

TOY_ROLES = {
    "wte": "vocab",
    "blocks.*.attn.wq": "q",
    "blocks.*.attn.wk": "k",
    "blocks.*.attn.wv": "v",
    "blocks.*.attn.wo": "o",
    "blocks.*.ffn.up": "column",
    "blocks.*.ffn.down": "row",
    "head": "lm_head",
}
TOY_CONFIG = {"model_type": "toy_lm", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 32, "vocab_size": 64}  # fmt: skip
TOY_TENSORS = {
    "wte.weight": (64, 16),
    "blocks.0.attn.wq.weight": (16, 16),
    "blocks.0.attn.wk.weight": (8, 16),
    "blocks.0.attn.wv.weight": (8, 16),
    "blocks.0.attn.wo.weight": (16, 16),
    "blocks.0.ffn.up.weight": (32, 16),
    "blocks.0.ffn.down.weight": (16, 32),
    "blocks.0.norm.weight": (16,),
    "head.weight": (64, 16),
}


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> list[Family]:
    """The family table, restored after the test."""
    table = list(families.FAMILIES)
    monkeypatch.setattr(families, "FAMILIES", table)
    return table


def _toy_model(directory: Path) -> Path:
    directory.mkdir()
    rng = np.random.default_rng(0)
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in TOY_TENSORS.items()}
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(TOY_CONFIG))
    return directory


def test_every_model_type_belongs_to_one_family() -> None:
    counts = Counter(t for family in families.FAMILIES for t in family.model_types)
    assert [t for t, n in counts.items() if n > 1] == []
    assert len({f.name for f in families.FAMILIES}) == len(families.FAMILIES)
    assert family_for("qwen3_moe") is not None and family_for("qwen3_moe").name == "qwen3_moe"


def test_a_family_registered_in_a_test_plans_a_tiny_model(tmp_path: Path, registry: list[Family]) -> None:
    """One entry makes an unknown architecture plannable; rank r then holds rank r's rows and columns."""
    model = _toy_model(tmp_path / "toy")
    with pytest.raises(PlanError, match="no plan source knows this architecture"):
        generate(model)
    register_family(Family("toy", ("toy_lm",), TOY_ROLES))
    result = generate(model, num_shards=[2])
    assert result.style == "megatron" and result.source == "the toy_lm preset"
    assert result.supported == [1, 2, 4]  # four query heads bound N (two KV heads are replicated at N=4)
    assert "blocks.0.norm.weight" not in result.document["params"]
    placements = result.placements
    assert (placements["blocks.0.ffn.down.weight"].style, placements["blocks.0.ffn.down.weight"].dim) == ("row", 1)
    assert placements["blocks.0.attn.wq.weight"].rule == "preset toy_lm: blocks.*.attn.wq"
    shards = shardload.load(model, 2, devices=["cpu", "cpu"], shard_info=result.document)
    from safetensors.numpy import load_file

    full = load_file(str(model / "model.safetensors"))
    for r in range(2):
        np.testing.assert_array_equal(
            shards[r]["blocks.0.ffn.up.weight"].numpy(), full["blocks.0.ffn.up.weight"][r * 16 : (r + 1) * 16]
        )
        np.testing.assert_array_equal(
            shards[r]["blocks.0.ffn.down.weight"].numpy(), full["blocks.0.ffn.down.weight"][:, r * 16 : (r + 1) * 16]
        )
        np.testing.assert_array_equal(
            shards[r]["blocks.0.attn.wk.weight"].numpy(), full["blocks.0.attn.wk.weight"][r * 4 : (r + 1) * 4]
        )
        np.testing.assert_array_equal(shards[r]["blocks.0.norm.weight"].numpy(), full["blocks.0.norm.weight"])


def test_a_model_type_stays_in_one_family(registry: list[Family]) -> None:
    with pytest.raises(PlanError, match=r"model type\(s\) \['mistral'\] already belong to a family"):
        register_family(Family("mine", ("my_lm", "mistral"), TOY_ROLES))
    assert family_for("my_lm") is None
    with pytest.raises(PlanError, match=r"unknown role\(s\) \['rows'\]"):
        Family("bad", ("bad_lm",), {"ffn.down": "rows"})


def test_vllm_packing_comes_from_the_family(registry: list[Family], monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's fusion of a model type is its family's entry in the vLLM integration's table, else Llama's."""
    monkeypatch.setattr("shardload.integrations.vllm.families.VLLM_FAMILIES", dict(VLLM_FAMILIES))
    assert vllm_packing("llama")["qkv_proj"] == ("q_proj", "k_proj", "v_proj")
    register_family(Family("fused", ("fused_lm",), TOY_ROLES))
    assert vllm_packing("fused_lm") == vllm_packing("llama")
    register_vllm_family("fused", VllmFamily(packed={"wqkv": ("wq", "wk", "wv")}))
    assert vllm_packing("fused_lm") == {"wqkv": ("wq", "wk", "wv")}
    assert vllm_packing("unknown_lm") == vllm_packing("llama")


def test_every_vllm_family_entry_names_a_family() -> None:
    """Each entry of the vLLM integration's table is keyed by a known family's name (a typo would go unused)."""
    from shardload.models.families import FAMILIES

    assert set(VLLM_FAMILIES) <= {f.name for f in FAMILIES}


def test_gguf_architectures_map_to_their_family_model_type() -> None:
    from shardload.models.families import gguf_model_type

    assert gguf_model_type("qwen3moe") == "qwen3_moe" and family_for(gguf_model_type("qwen3moe")).name == "qwen3_moe"
    assert gguf_model_type("llama") == "llama" and gguf_model_type("no_such_arch") == "no_such_arch"
    with pytest.raises(PlanError, match="GGUF architectures name model types it lacks"):
        Family("odd", ("odd_lm",), TOY_ROLES, gguf_architectures={"oddlm": "other_lm"})


def test_gpt_oss_splits_its_stacked_experts_by_output(tmp_path: Path) -> None:
    """GPT-OSS: experts stored ``[experts, in, out]`` (gate and up interleaved along ``out``) split along the last
    dim, the down projection by its rows, the sinks by heads; the down bias and the router stay whole."""
    rng = np.random.default_rng(0)
    e, hidden, inter, heads, kv, head_dim = 4, 32, 16, 4, 2, 8
    shapes = {
        "model.layers.0.mlp.experts.gate_up_proj": (e, hidden, 2 * inter),
        "model.layers.0.mlp.experts.gate_up_proj_bias": (e, 2 * inter),
        "model.layers.0.mlp.experts.down_proj": (e, inter, hidden),
        "model.layers.0.mlp.experts.down_proj_bias": (e, hidden),
        "model.layers.0.mlp.router.weight": (e, hidden),
        "model.layers.0.self_attn.q_proj.weight": (heads * head_dim, hidden),
        "model.layers.0.self_attn.k_proj.weight": (kv * head_dim, hidden),
        "model.layers.0.self_attn.sinks": (heads,),
    }
    full = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    (tmp_path / "m").mkdir()
    save_file(full, str(tmp_path / "m" / "model.safetensors"))
    config = {"model_type": "gpt_oss", "hidden_size": hidden, "intermediate_size": inter, "num_local_experts": e,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "num_hidden_layers": 1,
              "vocab_size": 64}  # fmt: skip
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    p = "model.layers.0."
    for r in range(2):
        got = {k: v.numpy() for k, v in shardload.load_rank(tmp_path / "m", r, 2).items()}
        cols, rows = slice(r * inter, (r + 1) * inter), slice(r * inter // 2, (r + 1) * inter // 2)
        gate_up = full[p + "mlp.experts.gate_up_proj"]
        np.testing.assert_array_equal(got[p + "mlp.experts.gate_up_proj"], gate_up[..., cols])
        np.testing.assert_array_equal(got[p + "mlp.experts.gate_up_proj_bias"],
                                      full[p + "mlp.experts.gate_up_proj_bias"][:, cols])  # fmt: skip
        np.testing.assert_array_equal(got[p + "mlp.experts.down_proj"], full[p + "mlp.experts.down_proj"][:, rows])
        for whole in ("mlp.experts.down_proj_bias", "mlp.router.weight"):
            np.testing.assert_array_equal(got[p + whole], full[p + whole])
        np.testing.assert_array_equal(got[p + "self_attn.sinks"], full[p + "self_attn.sinks"][2 * r : 2 * r + 2])


def _longest_pattern(path: str, patterns: list[str]) -> str | None:
    """Reference for preset matching, written out plainly: every pattern tried, digits starred on both sides,
    the longest that the path equals or ends with at a dot boundary (the first of equally long ones)."""

    def star(text: str) -> str:
        return ".".join("*" if part.isdigit() else part for part in text.split("."))

    best = None
    for pattern in patterns:
        p = star(pattern)
        if (star(path) == p or star(path).endswith("." + p)) and (best is None or len(p) > len(star(best))):
            best = pattern
    return best


def test_preset_matching_agrees_with_trying_every_pattern() -> None:
    from shardload.models import presets

    rng = np.random.default_rng(0)
    checked = 0
    for model_type in families.model_types():
        family = family_for(model_type)
        for roles in (family.roles, family.gguf_roles or {}):
            patterns = list(roles)
            starred = presets._starred(patterns)
            words = sorted({w for p in patterns for w in p.split(".")} | {"model", "3", "12", "weight", "bias"})
            paths = [f"{prefix}{p.replace('*', '7')}{suffix}" for p in patterns
                     for prefix in ("", "model.", "model.layers.5.") for suffix in ("", ".weight")]  # fmt: skip
            paths += [".".join(rng.choice(words, size=rng.integers(1, 7)).tolist()) for _ in range(300)]
            for path in paths:
                assert presets._match(path, starred) == _longest_pattern(path, patterns), (model_type, path)
                checked += 1
    assert checked > 1000
    alike = ["a.*.b", "a.3.b", "b"]  # the first two star alike: the first one wins, as with every pattern tried
    starred = presets._starred(alike)
    for path in ("x.a.3.b", "a.7.b", "c.b", "b", "a.b"):
        assert presets._match(path, starred) == _longest_pattern(path, alike), path
    assert presets._match("x.a.3.b", starred) == "a.*.b"
