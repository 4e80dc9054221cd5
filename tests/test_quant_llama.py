"""A tiny Llama quantized by compressed-tensors (W4A16 asymmetric, saved by transformers) loaded through
``shardload.load``: every stored tensor of every rank checked against the unsharded checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import quant_reference as qref
import shardload
from shardload.checkpoint import open_checkpoint
from shardload.quant_plan import WeightSplit, companion_steps, read_quantization_config

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER = 4, 2, 16, 64, 128


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
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).half()
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


def llama_params(model: Path) -> dict[str, Any]:
    """What a plan generator writes: the dense Megatron split of each weight, turned into companion steps."""
    tensors = {n: (t.shape, t.dtype) for n, t in open_checkpoint(model).tensors.items()}
    qconfig = read_quantization_config(model)
    params: dict[str, Any] = {
        "model.embed_tokens.weight": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]],
        "lm_head.weight": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]],
    }
    for layer in range(2):
        p = f"model.layers.{layer}."
        splits = {
            "self_attn.q_proj": WeightSplit("column", segments=(HEADS,), unit=HEAD_DIM),
            "self_attn.k_proj": WeightSplit("column", segments=(KV_HEADS,), unit=HEAD_DIM, gqa=True),
            "self_attn.v_proj": WeightSplit("column", segments=(KV_HEADS,), unit=HEAD_DIM, gqa=True),
            "self_attn.o_proj": WeightSplit("row"),
            "mlp.gate_proj": WeightSplit("column"),
            "mlp.up_proj": WeightSplit("column"),
            "mlp.down_proj": WeightSplit("row"),
        }
        for module, split in splits.items():
            params.update(companion_steps(p + module, split, tensors, qconfig))
    return params


@pytest.mark.parametrize("n", [2, 4])  # 4 > 2 KV heads: k_proj/v_proj heads are replicated, two ranks each
def test_tiny_quantized_llama_loads_sharded(tiny_llama: Path, n: int) -> None:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    qc = json.loads((tiny_llama / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    group = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    scheme = QuantizationScheme(targets=group.targets, weights=group.weights)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    stored = load_file(str(tiny_llama / "model.safetensors"))
    params = llama_params(tiny_llama)
    assert "model.layers.0.self_attn.k_proj.weight_zero_point" in params

    shards = shardload.load(tiny_llama, n, devices=["cpu"] * n, shard_info={"version": 1, "params": params})
    splits = {"q_proj": (0, HEADS), "k_proj": (0, KV_HEADS), "v_proj": (0, KV_HEADS), "o_proj": (1, 0),
              "gate_proj": (0, 0), "up_proj": (0, 0), "down_proj": (1, 0)}  # fmt: skip
    modules = {name.rsplit(".", 1)[0] for name in stored if name.endswith(".weight_packed")}
    assert len(modules) == 14
    for r in range(n):
        assert shards[r].keys() == stored.keys()
        checked = set()
        for module in modules:
            full = compressor.decompress({k.rsplit(".", 1)[1]: v for k, v in stored.items()
                                          if k.startswith(module + ".")}, scheme)["weight"]  # fmt: skip
            local = {k.rsplit(".", 1)[1]: v for k, v in shards[r].items() if k.startswith(module + ".")}
            got = compressor.decompress(local, scheme)["weight"]
            assert local["weight_shape"].tolist() == list(got.shape)
            dim, heads = splits[module.rsplit(".", 1)[1]]
            segments = (heads,) if heads else ()
            want = qref.dense_rank_slice(full.numpy(), dim, n, r, segments, HEAD_DIM if heads else 1, gqa=True)
            np.testing.assert_array_equal(got.numpy(), want, err_msg=f"{module} rank {r}")
            checked |= {f"{module}.{s}" for s in local}
        for name, t in stored.items():
            if name in checked:
                continue
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                want = t.chunk(n, dim=0)[r]
            else:
                assert t.dim() == 1, name  # norms: replicated
                want = t
            assert torch.equal(shards[r][name], want), name
            checked.add(name)
        assert checked == set(stored)
