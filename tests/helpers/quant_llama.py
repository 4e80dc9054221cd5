"""Tiny quantized Llamas: one quantized by compressed-tensors and saved by transformers, and synthetic ones whose
linear layers are stored by a format's module builder (GPTQ, AWQ, MLC, FP8)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from helpers.quantized import Builder, Dequant, Tensors, awq_module, fp8_module, gptq_module, mlc_module

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


def write_ct_llama(out: Path) -> Path:
    """LlamaForCausalLM with random weights, every Linear but lm_head quantized W4A16_ASYM (group 16), saved to
    ``out`` (skips the test where transformers or compressed-tensors is missing)."""
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
    model.save_pretrained(out)
    compressor.update_config(str(out))
    return out


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
