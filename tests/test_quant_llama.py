"""Quantized Llamas planned by ``shardload plan`` and run tensor-parallel: the quantized plan end to end.

A tiny Llama quantized by compressed-tensors (W4A16 asymmetric, saved by transformers), and synthetic
Llama checkpoints in GPTQ (with and without act-order), AWQ, MLC and FP8 layouts. ``plan`` writes steps
for every stored tensor from config.json (its quantization_config included); for every N it claims,
each rank's dequantized weights equal that rank's part of the dequantized weights, element for
element, and a tensor-parallel forward over the N dequantized rank state dicts (tests/helpers/tp_reference.py)
gives the logits of the unsharded dequantized transformers model within 1e-5 relative.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import shardload
from helpers import tiny_models
from helpers import tp_reference as tp
from helpers.quant_llama import LINEARS, SYNTHETIC, VOCAB, write_llama
from helpers.quantized import Dequant, Tensors, gptq_module, local_tensors, rank_reference
from shardload.models.generated import generate
from shardload.planning.validate import validate_file

pytest.importorskip("transformers")

NS = [1, 2, 4]  # 4 query heads; N = 4 > 2 KV heads replicates each KV head on two ranks
IDS = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))


def dequantized(state: Tensors, dequants: dict[str, Dequant]) -> Tensors:
    """A dense float32 state dict: each quantized module as its dequantized ``weight``, the rest as stored."""
    dense = {}
    for name, t in state.items():
        module = name.rsplit(".", 1)[0]
        if module in dequants:
            dense[f"{module}.weight"] = torch.from_numpy(dequants[module](local_tensors(state, module))).float()
        else:
            dense[name] = t.float()
    return dense


def check_quantized_plan(model: Path, dequants: dict[str, Dequant], ns: list[int] = NS) -> None:
    """``plan`` MODEL, then check each claimed N: every stored tensor of every rank, and the tensor-parallel logits."""
    generated = generate(model)
    assert generated.supported == ns, generated.supported
    assert f"plans for num_shards {', '.join(map(str, ns))} (checked" in generated.document["description"]
    generated.save(model / "planned.json")
    assert validate_file(model / "planned.json", model, ns)["valid"]
    assert validate_file(model / "planned.json", model, [max(ns) * 2])["valid_for"] == []
    for module in dequants:  # the split the architecture calls for, decided on the logical weight
        p = generated.placements[f"{module}.weight"]
        assert (p.style, p.dim, p.segments, p.unit, p.kv) == LINEARS[module.split(".", 3)[3]][1], module
    config = json.loads((model / "config.json").read_text())
    stored = load_file(str(model / "model.safetensors"))
    full = {m: dequant(local_tensors(stored, m)) for m, dequant in dequants.items()}
    want_logits = tiny_models.dense_logits(config, dequantized(stored, dequants), IDS)
    for n in ns:
        shards = shardload.load(model, n, devices=["cpu"] * n, shard_info=generated.document)
        for r, shard in enumerate(shards):
            assert shard.keys() == stored.keys()
            for module, dequant in dequants.items():
                want = rank_reference(full[module], generated.placements[f"{module}.weight"], n, r)
                np.testing.assert_array_equal(dequant(local_tensors(shard, module)), want, err_msg=f"{module} {r}/{n}")
            for name, t in stored.items():
                if name.rsplit(".", 1)[0] in dequants:
                    continue
                vocab_split = name in ("model.embed_tokens.weight", "lm_head.weight")
                assert torch.equal(shard[name], t.chunk(n, dim=0)[r] if vocab_split else t), name
        with torch.no_grad():
            got = tp.decoder_logits(config, [dequantized(s, dequants) for s in shards], IDS)
        torch.testing.assert_close(got, want_logits, rtol=1e-5, atol=1e-5 * want_logits.abs().max().item())


# --- a tiny Llama quantized by compressed-tensors, saved by transformers ----------------------------


def test_tiny_compressed_tensors_llama_plan_loads_and_computes(tiny_llama: Path) -> None:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    qc = json.loads((tiny_llama / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    group = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    scheme = QuantizationScheme(targets=group.targets, weights=group.weights)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")

    def decompress(local: Tensors) -> np.ndarray:
        weight = compressor.decompress(local, scheme)["weight"]
        # decompression tolerates a too-large weight_shape, so check it holds this rank's logical shape
        assert local["weight_shape"].tolist() == list(weight.shape)
        return weight.float().numpy()

    stored = load_file(str(tiny_llama / "model.safetensors"))
    modules = sorted({name.rsplit(".", 1)[0] for name in stored if name.endswith(".weight_packed")})
    assert len(modules) == 14 and "model.layers.0.self_attn.k_proj.weight_zero_point" in stored
    check_quantized_plan(tiny_llama, dict.fromkeys(modules, decompress))


# --- synthetic Llamas in the other layouts ---------------------------------------------------------


@pytest.mark.parametrize("layout", list(SYNTHETIC))
def test_synthetic_quantized_llama_plan_loads_and_computes(tmp_path: Path, layout: str) -> None:
    build, qconfig = SYNTHETIC[layout]
    check_quantized_plan(tmp_path / layout, write_llama(tmp_path / layout, build, qconfig))


def test_plan_refuses_n_that_cuts_a_group(tmp_path: Path) -> None:
    """Group size 32 on o_proj's 64 inputs: two groups, so N = 4 (4 heads) cannot work and plan says why."""
    build: Callable[..., Any] = lambda rng, p, out, inp: gptq_module(rng, p, out, inp, group=32)  # noqa: E731
    model = tmp_path / "g32"
    write_llama(model, build, {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False})
    assert generate(model).supported == [1, 2]
    with pytest.raises(shardload.PlanError) as err:
        generate(model, num_shards=[4])
    assert str(err.value).endswith(
        "g32: num_shards=4: model.layers.0.self_attn.o_proj.g_idx: step 1 (shard_funcs.shard_group_index): "
        "2 groups cannot be split across 4 ranks (and 5 more)"
    )


def test_fp8_under_other_method_names_plans_by_its_tensors(tmp_path: Path) -> None:
    """Meta's ``fbgemm_fp8`` and ModelOpt's FP8 store a weight and its scales as the ``fp8`` method does: the plan
    goes by the stored tensors' names, whatever the method is called."""
    build, _ = SYNTHETIC["fp8"]
    for method in ("fbgemm_fp8", "modelopt"):
        check_quantized_plan(tmp_path / method, write_llama(tmp_path / method, build, {"quant_method": method}))


def test_gpt_oss_as_released_in_mxfp4_is_refused(tmp_path: Path) -> None:
    """GPT-OSS ships its experts as MXFP4 ``*_blocks`` and ``*_scales`` beside bf16 ``*_bias``: the plan split the
    biases and left the blocks whole, so rank 0 held every expert's gate_up rows and half their biases."""
    from safetensors.torch import save_file

    e, h, i, heads, kv, hd, v = 4, 64, 64, 4, 2, 16, 128
    g = torch.Generator().manual_seed(0)

    def bf16(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    def u8(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    p = "model.layers.0."
    tensors = {"model.embed_tokens.weight": bf16(v, h), "lm_head.weight": bf16(v, h), "model.norm.weight": bf16(h),
               p + "input_layernorm.weight": bf16(h), p + "post_attention_layernorm.weight": bf16(h),
               p + "self_attn.q_proj.weight": bf16(heads * hd, h), p + "self_attn.k_proj.weight": bf16(kv * hd, h),
               p + "self_attn.v_proj.weight": bf16(kv * hd, h), p + "self_attn.o_proj.weight": bf16(h, heads * hd),
               p + "self_attn.sinks": bf16(heads), p + "mlp.router.weight": bf16(e, h), p + "mlp.router.bias": bf16(e),
               p + "mlp.experts.gate_up_proj_blocks": u8(e, 2 * i, h // 32, 16),
               p + "mlp.experts.gate_up_proj_scales": u8(e, 2 * i, h // 32),
               p + "mlp.experts.gate_up_proj_bias": bf16(e, 2 * i),
               p + "mlp.experts.down_proj_blocks": u8(e, h, i // 32, 16),
               p + "mlp.experts.down_proj_scales": u8(e, h, i // 32),
               p + "mlp.experts.down_proj_bias": bf16(e, h)}  # fmt: skip
    model = tmp_path / "gpt-oss"
    model.mkdir()
    save_file(tensors, str(model / "model.safetensors"))
    config = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": h,
              "intermediate_size": i, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
              "num_hidden_layers": 1, "num_local_experts": e, "num_experts_per_tok": 2, "vocab_size": v,
              "tie_word_embeddings": False, "layer_types": ["full_attention"],
              "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(shardload.PlanError, match="quant_method 'mxfp4' is not one a plan is made for"):
        generate(model)
    with pytest.raises(shardload.PlanError, match="quant_method 'mxfp4'"):
        shardload.load_rank(model, 1, 2)
    del config["quantization_config"]  # the same tensors, the config's record lost
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(shardload.PlanError, match=r"_proj_blocks: is an MXFP4 weight"):
        shardload.load_rank(model, 1, 2)


def test_a_quantization_method_no_plan_knows_is_refused(tmp_path: Path) -> None:
    """bitsandbytes LLM.int8 stores ``weight`` int8 beside per-row scales (``SCB``) and a ``weight_format``: planned
    as a dense weight, a column-split module's scales stayed whole on every rank. A quant_method the plans do not
    know is refused in one line, by ``plan`` and by a load planning in memory."""

    def bnb8(rng: np.random.Generator, p: str, out: int, inp: int) -> tuple[dict[str, torch.Tensor], None]:
        return {f"{p}.weight": torch.from_numpy(rng.integers(-127, 128, (out, inp), dtype=np.int8)),
                f"{p}.SCB": torch.from_numpy((rng.random(out) + 0.5).astype(np.float32)),
                f"{p}.weight_format": torch.tensor([0], dtype=torch.uint8)}, None  # fmt: skip

    model = tmp_path / "bnb8"
    write_llama(model, bnb8, {"quant_method": "bitsandbytes", "load_in_8bit": True})
    with pytest.raises(shardload.PlanError) as err:
        generate(model)
    assert "quant_method 'bitsandbytes'" in str(err.value) and "\n" not in str(err.value), err.value
    with pytest.raises(shardload.PlanError, match="quant_method 'bitsandbytes'"):
        shardload.load_rank(model, 1, 2)
    config = json.loads((model / "config.json").read_text())  # the same tensors, the config's record lost
    del config["quantization_config"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(shardload.PlanError, match=r"\.SCB: is a bitsandbytes companion"):
        shardload.load_rank(model, 1, 2)
