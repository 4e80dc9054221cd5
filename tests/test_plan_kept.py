"""A shard_info made from config.json is kept per process, keyed by everything it is made from: loading the same
model again skips making it, and a changed config, a changed tensor or a new model family makes it again. What is
kept cannot be changed through what a caller gets."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardload
import shardload.models.generated as generated
import shardload.models.plan_source as plan_source
from helpers.checkpoints import write_model
from helpers.model_reference import reference_shards
from shardload.format.shard_info import ShardInfo
from shardload.sources.checkpoint import open_checkpoint

GENERATE = generated.generate
"""``generate`` itself, for the reference: the tests spy on the module's name."""


def _llama(directory: Path, kv_heads: int = 2, seed: int = 0, dtype: type = np.float32) -> Path:
    """A one-layer Llama (hidden 16, 4 heads of 4, ``kv_heads`` KV heads) of ``dtype`` without shard_info.json."""
    rng = np.random.default_rng(seed)
    h, inter, vocab, kv = 16, 32, 64, kv_heads * 4
    shapes = {
        "model.embed_tokens.weight": (vocab, h),
        "model.layers.0.self_attn.q_proj.weight": (h, h),
        "model.layers.0.self_attn.k_proj.weight": (kv, h),
        "model.layers.0.self_attn.v_proj.weight": (kv, h),
        "model.layers.0.self_attn.o_proj.weight": (h, h),
        "model.layers.0.mlp.gate_proj.weight": (inter, h),
        "model.layers.0.mlp.up_proj.weight": (inter, h),
        "model.layers.0.mlp.down_proj.weight": (h, inter),
        "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.post_attention_layernorm.weight": (h,),
        "model.norm.weight": (h,),
        "lm_head.weight": (vocab, h),
    }
    write_model(directory, {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()})
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": 4, "num_key_value_heads": kv_heads, "head_dim": 4,
              "num_hidden_layers": 1, "vocab_size": vocab, "tie_word_embeddings": False}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    assert not (directory / "shard_info.json").exists()
    return directory


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every model ``generate`` is asked to plan, with nothing kept from before the test."""
    monkeypatch.setattr(plan_source, "_generated", type(plan_source._generated)())
    made: list[Path] = []

    def spy(model: Any, **kwargs: Any) -> Any:
        made.append(Path(model.path))
        return GENERATE(model, **kwargs)

    monkeypatch.setattr(generated, "generate", spy)
    return made


def _fresh(model: Path) -> dict[str, Any]:
    """The shard_info ``generate`` makes for ``model`` now, as a document."""
    return ShardInfo.from_dict(GENERATE(open_checkpoint(model), check_up_to=0).document).to_dict()


def test_the_same_model_is_planned_from_its_config_once(tmp_path: Path, calls: list[Path]) -> None:
    model = _llama(tmp_path / "m")
    first, source = plan_source.plan_shard_info(open_checkpoint(model), None)
    again, source_again = plan_source.plan_shard_info(open_checkpoint(model), None)
    assert calls == [model]
    assert source == source_again and "planned in memory" in source
    assert first.to_dict() == again.to_dict() == _fresh(model)
    assert first.params
    first.params.clear()  # a caller's copy: what is kept stays whole
    third, _ = plan_source.plan_shard_info(open_checkpoint(model), None)
    assert third.to_dict() == _fresh(model)
    assert calls == [model]


def test_a_changed_config_or_tensor_is_planned_again(tmp_path: Path, calls: list[Path]) -> None:
    model = _llama(tmp_path / "m", kv_heads=2)
    before, _ = plan_source.plan_shard_info(open_checkpoint(model), None)
    config = (model / "config.json").read_text()
    _llama(model, kv_heads=2, seed=1, dtype=np.float16)  # the tensors alone change: their dtype
    assert (model / "config.json").read_text() == config
    halves, _ = plan_source.plan_shard_info(open_checkpoint(model), None)
    assert calls == [model, model]
    assert halves.to_dict() == _fresh(model) != before.to_dict()
    _llama(model, kv_heads=4, seed=1)  # k_proj and v_proj change shape under the same names, and the config
    after, _ = plan_source.plan_shard_info(open_checkpoint(model), None)
    assert calls == [model] * 3
    assert after.to_dict() == _fresh(model) != before.to_dict()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))  # the config alone
    plan_source.plan_shard_info(open_checkpoint(model), None)
    assert calls == [model] * 4
    ref = tmp_path / "ref"  # the numpy reference of the plan made now; a load through the kept one must match it
    shutil.copytree(model, ref)
    (ref / "shard_info.json").write_text(json.dumps(_fresh(model)))
    want = reference_shards(ref, 2)
    for rank in range(2):
        got = shardload.load_rank(model, rank, 2)
        assert got.keys() == want[rank].keys()
        for name, t in got.items():
            np.testing.assert_array_equal(t.numpy(), want[rank][name], err_msg=f"rank {rank} {name}")


def test_a_new_model_family_plans_again(tmp_path: Path, calls: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from shardload.models import families

    model = _llama(tmp_path / "m")
    plan_source.plan_shard_info(open_checkpoint(model), None)
    monkeypatch.setattr(families, "FAMILIES", [*families.FAMILIES, families.FAMILIES[0]])  # one more registered
    plan_source.plan_shard_info(open_checkpoint(model), None)
    swapped = [*families.FAMILIES[:-1], replace(families.FAMILIES[-1])]  # as many, one of them another
    monkeypatch.setattr(families, "FAMILIES", swapped)
    plan_source.plan_shard_info(open_checkpoint(model), None)
    assert calls == [model] * 3


def test_a_bad_config_still_says_what_was_being_planned(tmp_path: Path, calls: list[Path]) -> None:
    model = _llama(tmp_path / "m")
    (model / "config.json").write_text('{"model_type": "llama", "model_type": "llama"}')
    with pytest.raises(shardload.ShardloadError) as err:
        plan_source.plan_shard_info(open_checkpoint(model), None)
    assert str(err.value).startswith(f"{model}: no shard_info.json beside the weights, and planning one from "
                                      "config.json failed: ")  # fmt: skip
    assert "model_type" in str(err.value) and calls == []


def test_only_the_last_few_plans_are_kept(tmp_path: Path, calls: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_source, "KEPT_PLANS", 2)
    models = [_llama(tmp_path / f"m{k}", seed=k) for k in range(3)]
    for model in models:
        plan_source.plan_shard_info(open_checkpoint(model), None)
    assert len(plan_source._generated) == 2
    plan_source.plan_shard_info(open_checkpoint(models[0]), None)  # the oldest was dropped: made again
    assert calls == [*models, models[0]]
