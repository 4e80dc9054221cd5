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
from shardload.models import families
from shardload.models.families import Family, family_for, register_family, vllm_packing
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


def test_vllm_packing_comes_from_the_family(registry: list[Family]) -> None:
    assert vllm_packing("llama")["qkv_proj"] == ("q_proj", "k_proj", "v_proj")
    register_family(Family("fused", ("fused_lm",), TOY_ROLES, vllm_packed={"wqkv": ("wq", "wk", "wv")}))
    assert vllm_packing("fused_lm") == {"wqkv": ("wq", "wk", "wv")}
    assert vllm_packing("unknown_lm") == vllm_packing("llama")


def test_gguf_architectures_map_to_their_family_model_type() -> None:
    from shardload.models.families import gguf_model_type

    assert gguf_model_type("qwen3moe") == "qwen3_moe" and family_for(gguf_model_type("qwen3moe")).name == "qwen3_moe"
    assert gguf_model_type("llama") == "llama" and gguf_model_type("no_such_arch") == "no_such_arch"
    with pytest.raises(PlanError, match="GGUF architectures name model types it lacks"):
        Family("odd", ("odd_lm",), TOY_ROLES, gguf_architectures={"oddlm": "other_lm"})
