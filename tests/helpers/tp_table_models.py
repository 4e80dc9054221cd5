"""Tiny checkpoints of model types no built-in preset knows, whose plan comes from transformers' TP table, written
with safetensors alone (no transformers needed): ``write_tiny_gemma``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

GEMMA_CONFIG = {
    "model_type": "gemma",
    "architectures": ["GemmaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 8,
    "vocab_size": 256,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


def write_tiny_gemma(directory: Path, model_type: str = "gemma") -> Path:
    """A 2-layer Gemma-shaped checkpoint (config.json + model.safetensors, no shard_info.json) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {**GEMMA_CONFIG, "model_type": model_type}
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads = config["num_attention_heads"] * config["head_dim"]
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads, hidden),
            p + "self_attn.k_proj.weight": (heads, hidden),
            p + "self_attn.v_proj.weight": (heads, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    save_file(
        {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}, directory / "model.safetensors"
    )
    (directory / "config.json").write_text(json.dumps(config))
    return directory
