"""The built-in example: a tiny, deterministic Phi-3 float16 checkpoint (config.json says phi3) with its shard_info.

It has what real tensor-parallel checkpoints have: a fused ``qkv_proj`` with grouped-query
attention (Phi-3 naming), a fused ``gate_up_proj``, ``o_proj``/``down_proj`` (row parallel),
vocab-parallel embeddings and ``lm_head``, and replicated norms. Its shard_info is N-agnostic.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ..engine.output import StagingDir, check_output, write_error
from ..engine.writer import save_safetensors
from ..format.shard_info import plans_for_text
from ..models.generated import MAX_CHECKED_NUM_SHARDS as CHECKED_UP_TO
from ..sources.checkpoint import local_output

EXAMPLE_CONFIG: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float16",
}


def example_tensors(config: dict[str, Any] = EXAMPLE_CONFIG, seed: int = 0) -> dict[str, Any]:
    """The example's tensors as float16 numpy arrays, in checkpoint order (same seed, same bytes)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = h // heads

    def w(*shape: int) -> Any:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    def norm() -> Any:
        return (1.0 + 0.1 * rng.standard_normal(h, dtype=np.float32)).astype(np.float16)

    tensors: dict[str, Any] = {"model.embed_tokens.weight": w(vocab, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm()
        tensors[p + "self_attn.qkv_proj.weight"] = w((heads + 2 * kv) * head_dim, h)
        tensors[p + "self_attn.o_proj.weight"] = w(h, heads * head_dim)
        tensors[p + "post_attention_layernorm.weight"] = norm()
        tensors[p + "mlp.gate_up_proj.weight"] = w(2 * inter, h)
        tensors[p + "mlp.down_proj.weight"] = w(h, inter)
    tensors["model.norm.weight"] = norm()
    tensors["lm_head.weight"] = w(vocab, h)
    return tensors


def example_shard_info(config: dict[str, Any] = EXAMPLE_CONFIG) -> dict[str, Any]:
    """An N-agnostic shard_info (document form) for the example's Megatron-style tensor parallelism."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = h // heads
    qkv = (heads + 2 * kv) * head_dim

    def shard(shape: list[int], dim: int) -> list[Any]:
        out: list[Any] = ["num_shards", *shape]
        out[dim + 1] = f"{shape[dim]} // num_shards"
        return ["shard_funcs.shard_dim", [out, "float16"], dim, "num_shards"]

    params: dict[str, Any] = {
        "model.embed_tokens.weight": [shard([vocab, h], 0)],
        "lm_head.weight": [shard([vocab, h], 0)],
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        params[p + "self_attn.qkv_proj.weight"] = [
            ["shard_funcs.reorder_segments", [[qkv, h], "float16"], 0, [heads, kv, kv], "num_shards", head_dim],
            shard([qkv, h], 0),
        ]
        params[p + "self_attn.o_proj.weight"] = [shard([h, heads * head_dim], 1)]
        params[p + "mlp.gate_up_proj.weight"] = [
            ["shard_funcs.reorder_segments", [[2 * inter, h], "float16"], 0, [inter, inter], "num_shards"],
            shard([2 * inter, h], 0),
        ]
        params[p + "mlp.down_proj.weight"] = [shard([h, inter], 1)]
    units = math.gcd(heads, kv, inter, vocab)  # every split: whole heads, both halves of gate_up, the vocabulary
    return {
        "$schema": "https://shardload.dev/shard_info.schema.json",
        "version": 1,
        "num_shards": None,
        "description": "Megatron-style tensor parallelism of the built-in example; N-agnostic; "
        + plans_for_text([n for n in range(1, CHECKED_UP_TO + 1) if units % n == 0], CHECKED_UP_TO),
        "params": params,
    }


def write_example(
    out_dir: str | os.PathLike[str], *, overwrite: bool = False, multi_file: bool = False, seed: int = 0
) -> Path:
    """Create the example model directory (config, tokenizer stub, weights, shard_info.json).

    With ``multi_file`` the weights are split over two files with a ``model.safetensors.index.json``.
    """
    out = local_output(out_dir, "out_dir")
    check_output(out, [], overwrite=overwrite)
    tensors = example_tensors(seed=seed)
    try:
        with StagingDir(out, None, synced=False, overwrite=overwrite) as staging:
            _write_files(staging.dir, tensors, multi_file)
            staging.publish()
    except OSError as err:
        raise write_error(err, out) from None
    return out


def _write_files(out: Path, tensors: dict[str, Any], multi_file: bool) -> None:
    from safetensors.numpy import save_file

    (out / "config.json").write_text(json.dumps(EXAMPLE_CONFIG, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"max_new_tokens": 32}, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}, indent=2) + "\n")
    (out / "shard_info.json").write_text(json.dumps(example_shard_info(), indent=2) + "\n")
    meta = {"format": "pt"}
    if not multi_file:
        path = out / "model.safetensors"
        save_safetensors(lambda: save_file(tensors, str(path), metadata=meta), path)
        return
    names = list(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file_name, part in halves.items():
        path = out / file_name
        save_safetensors(lambda: save_file({k: tensors[k] for k in part}, str(path), metadata=meta), path)  # noqa: B023
        weight_map.update(dict.fromkeys(part, file_name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
