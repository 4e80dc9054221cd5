"""One tensor-parallel shard per process: shardload.load_rank under torch.distributed, then a forward pass.

    shardload plan MODEL_DIR                      # writes MODEL_DIR/shard_info.json once
    torchrun --nproc_per_node 2 examples/torchrun_load.py MODEL_DIR

Each process calls ``shardload.load_rank(MODEL_DIR)`` without rank or N: both come from the
initialised process group, and the process reads only its own bytes. The forward pass is a
Llama-family decoder (Llama, Mistral, Qwen2, Phi-3 fused qkv; grouped-query attention included)
written for tensor parallelism: column-parallel layers keep their slice of the output,
row-parallel layers all-reduce partial sums, the vocab-parallel embedding all-reduces a masked
lookup and the lm_head all-gathers its vocab slices. Rank 0 then compares the logits with the
unsharded transformers model, both in float32 (CPU, gloo; CUDA and NCCL when every rank has a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardload


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on [batch, heads, seq, head_dim]."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    angles = torch.arange(seq, dtype=torch.float32, device=x.device)[:, None] * inv_freq
    angles = torch.cat([angles, angles], -1)
    rotated = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * angles.cos() + rotated * angles.sin()


def linear(x: torch.Tensor, state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return F.linear(x, state[name + ".weight"], state.get(name + ".bias"))


def tp_forward(config: dict, state: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Logits of a Llama-family decoder, this rank holding ``state`` (its shard), ranks joined by collectives."""
    world = dist.get_world_size()
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    local_q, local_kv = heads // world, max(kv_heads // world, 1)
    eps, vocab = config["rms_norm_eps"], config["vocab_size"]
    theta = (config.get("rope_parameters") or {}).get("rope_theta") or config.get("rope_theta", 10000.0)

    table = state["model.embed_tokens.weight"]  # this rank's vocab rows
    start = dist.get_rank() * table.shape[0]
    local = ids - start
    inside = (local >= 0) & (local < table.shape[0])
    h = F.embedding(local.clamp(0, table.shape[0] - 1), table) * inside[..., None]
    dist.all_reduce(h)
    batch, seq = ids.shape
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        x = rms_norm(h, state[p + "input_layernorm.weight"], eps)
        if p + "self_attn.qkv_proj.weight" in state:
            q, k, v = linear(x, state, p + "self_attn.qkv_proj").split(
                [local_q * head_dim, local_kv * head_dim, local_kv * head_dim], -1
            )
        else:
            q, k, v = (linear(x, state, p + f"self_attn.{w}_proj") for w in "qkv")
        q, k, v = (t.view(batch, seq, -1, head_dim).transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(local_q // local_kv, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(rope(q, theta), rope(k, theta), v, is_causal=True)
        out = F.linear(out.transpose(1, 2).reshape(batch, seq, -1), state[p + "self_attn.o_proj.weight"])
        dist.all_reduce(out)  # row-parallel o_proj: sum the partial outputs
        h = h + out
        x = rms_norm(h, state[p + "post_attention_layernorm.weight"], eps)
        if p + "mlp.gate_up_proj.weight" in state:
            gate, up = F.linear(x, state[p + "mlp.gate_up_proj.weight"]).chunk(2, -1)
        else:
            gate, up = F.linear(x, state[p + "mlp.gate_proj.weight"]), F.linear(x, state[p + "mlp.up_proj.weight"])
        out = F.linear(F.silu(gate) * up, state[p + "mlp.down_proj.weight"])
        dist.all_reduce(out)  # row-parallel down_proj
        h = h + out
    x = rms_norm(h, state["model.norm.weight"], eps)
    head = state.get("lm_head.weight", table)  # tied embeddings: the vocab-parallel table is the head
    local_logits = x @ head.T
    gathered = [torch.empty_like(local_logits) for _ in range(world)]
    dist.all_gather(gathered, local_logits.contiguous())
    logits = torch.cat(gathered, -1)
    assert logits.shape[-1] == vocab
    return logits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="model directory (safetensors + config.json)")
    parser.add_argument("--shard-info", type=Path, help="shard_info.json (default MODEL/shard_info.json)")
    parser.add_argument("--no-check", action="store_true", help="skip the comparison with transformers on rank 0")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu"
    try:
        state = shardload.load_rank(args.model, device=device, shard_info=args.shard_info)  # rank, N from the group
        state = {name: t.float() for name, t in state.items()}  # compute in float32 to compare closely
        config = json.loads((args.model / "config.json").read_text())
        ids = torch.randint(0, config["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
        with torch.no_grad():
            logits = tp_forward(config, state, ids).cpu()
        if dist.get_rank() != 0 or args.no_check:
            return 0
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            want = reference(input_ids=ids.cpu()).logits
        error = ((logits - want).abs().max() / want.abs().max()).item()
        print(f"world size {dist.get_world_size()}: max error relative to the largest logit {error:.2e}")
        return 0 if error <= 1e-5 else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
