"""Quantized Llamas planned by ``shardload plan`` and run tensor-parallel: the quantized plan end to end.

A tiny Llama quantized by compressed-tensors (W4A16 asymmetric, saved by transformers), and synthetic
Llama checkpoints in GPTQ (with and without act-order), AWQ, MLC and FP8 layouts. ``plan`` writes steps
for every stored tensor from config.json (its quantization_config included); for every N it claims,
each rank's dequantized weights equal that rank's part of the dequantized weights, element for
element, and a tensor-parallel forward over the N dequantized rank state dicts (tests/tp_reference.py)
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
from safetensors.torch import load_file, save_file

import shardload
import tiny_models
import tp_reference as tp
from shardload.models.generated import generate
from shardload.planning.validate import validate_file
from test_quant_formats import (
    Builder,
    Dequant,
    Tensors,
    awq_module,
    fp8_module,
    gptq_module,
    local_tensors,
    mlc_module,
    rank_reference,
)

pytest.importorskip("transformers")

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB = 4, 2, 16, 64, 128, 128
LINEARS = {  # module -> (out, in) and the split the architecture calls for (style, dim, segments, unit, kv)
    "self_attn.q_proj": ((HEADS * HEAD_DIM, HIDDEN), ("column", 0, (HEADS,), HEAD_DIM, (False,))),
    "self_attn.k_proj": ((KV_HEADS * HEAD_DIM, HIDDEN), ("column", 0, (KV_HEADS,), HEAD_DIM, (True,))),
    "self_attn.v_proj": ((KV_HEADS * HEAD_DIM, HIDDEN), ("column", 0, (KV_HEADS,), HEAD_DIM, (True,))),
    "self_attn.o_proj": ((HIDDEN, HEADS * HEAD_DIM), ("row", 1, (HEADS,), HEAD_DIM, (False,))),
    "mlp.gate_proj": ((INTER, HIDDEN), ("column", 0, (), 1, ())),
    "mlp.up_proj": ((INTER, HIDDEN), ("column", 0, (), 1, ())),
    "mlp.down_proj": ((HIDDEN, INTER), ("row", 1, (), 1, ())),
}
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


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LlamaForCausalLM with random weights, every Linear but lm_head quantized W4A16_ASYM (group 16), saved."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).half()
    with torch.no_grad():  # HF's init leaves norms at one, which would hide a misplaced norm
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16)
    qconfig = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]
    )
    apply_quantization_config(model, qconfig)
    for module in model.modules():
        if hasattr(module, "weight_scale"):  # calibrate from the weights (min/max per group)
            w = module.weight.data
            groups = w.reshape(w.shape[0], -1, 16)
            scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype)
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    out = tmp_path_factory.mktemp("llama") / "tiny-llama-w4a16"
    model.save_pretrained(out)
    compressor.update_config(str(out))
    return out


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

SYNTHETIC: dict[str, tuple[Builder, dict[str, Any]]] = {
    "gptq": (
        lambda rng, p, out, inp: gptq_module(rng, p, out, inp, group=16),
        {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": False},
    ),
    "gptq-act-order": (
        lambda rng, p, out, inp: gptq_module(rng, p, out, inp, group=16, desc_act=True),
        {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True, "sym": False},
    ),
    "awq": (
        lambda rng, p, out, inp: awq_module(rng, p, out, inp, group=16),
        {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemm", "zero_point": True},
    ),
    "mlc": (lambda rng, p, out, inp: mlc_module(rng, p, out, inp, group=16), {"quant_method": "mlc", "bits": 4}),
    "fp8": (lambda rng, p, out, inp: fp8_module(rng, p, out, inp), {"quant_method": "fp8"}),
}


def write_llama(directory: Path, build: Builder, qconfig: dict[str, Any], seed: int = 0) -> dict[str, Dequant]:
    """A 2-layer Llama whose linear layers (not lm_head) are stored by ``build``; returns the dequantizers."""
    rng = np.random.default_rng(seed)

    def dense(*shape: int, base: float = 0.0) -> torch.Tensor:
        return torch.from_numpy((base + 0.1 * rng.standard_normal(shape)).astype(np.float16))

    tensors: Tensors = {"model.embed_tokens.weight": dense(VOCAB, HIDDEN), "lm_head.weight": dense(VOCAB, HIDDEN)}
    tensors["model.norm.weight"] = dense(HIDDEN, base=1.0)
    dequants: dict[str, Dequant] = {}
    for layer in range(2):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = dense(HIDDEN, base=1.0)
        tensors[p + "post_attention_layernorm.weight"] = dense(HIDDEN, base=1.0)
        for module, ((out, inp), _) in LINEARS.items():
            stored, dequants[p + module] = build(rng, p + module, out, inp)
            tensors.update(stored)
    if qconfig["quant_method"] == "fp8":  # keep activations moderate: FP8 values reach 448
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            tensors[name] = tensors[name] * 1e-3
    directory.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": 2, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 64, "tie_word_embeddings": False, "quantization_config": qconfig,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return dequants


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
