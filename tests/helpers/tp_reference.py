"""Tensor-parallel forward passes over N rank state dicts, written from the architectures' definitions.

Each rank computes with its own tensors only. Where a deployment communicates, rank results are
combined as the collective would: column-parallel outputs are concatenated (all-gather) and
row-parallel partial sums are added (all-reduce). Nothing here uses shardload or transformers, so
a wrong shard changes the result.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

State = dict[str, torch.Tensor]


def all_reduce(parts: list[torch.Tensor]) -> torch.Tensor:
    """Sum of the ranks' partial results (an all-reduce)."""
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def all_gather(parts: list[torch.Tensor], dim: int = -1) -> torch.Tensor:
    """The ranks' column-parallel outputs side by side (an all-gather)."""
    return torch.cat(parts, dim=dim)


def vocab_embedding(shards: list[State], name: str, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Embedding lookup: each rank looks up the ids in its own vocab rows, zeros elsewhere, then all-reduce."""
    tables = [s[name] for s in shards]
    if tables[0].shape[0] == vocab:  # replicated table
        return F.embedding(ids, tables[0])
    parts = []
    for r, table in enumerate(tables):
        start = r * table.shape[0]
        local = ids - start
        inside = (local >= 0) & (local < table.shape[0])
        parts.append(F.embedding(local.clamp(0, table.shape[0] - 1), table) * inside[..., None])
    return all_reduce(parts)


def vocab_logits(shards: list[State], name: str, xs: list[torch.Tensor], vocab: int) -> torch.Tensor:
    """Output projection of each rank's input ``xs[r]``: its vocab rows give its logits, concatenated
    (a replicated table gives every rank all logits)."""
    tables = [s[name] for s in shards]
    if tables[0].shape[0] == vocab:
        return xs[0] @ tables[0].T
    return all_gather([x @ t.T for x, t in zip(xs, tables, strict=True)])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding on [batch, heads, seq, head_dim] (rotate-half form)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Softmax attention on [batch, heads, seq, head_dim]; query heads share KV heads in groups."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        seq = q.shape[-2]
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, -1, head_dim).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d)


def _linear(x: torch.Tensor, state: State, name: str) -> torch.Tensor:
    bias = state.get(name + ".bias")
    return F.linear(x, state[name + ".weight"], bias)


# --- decoder-only (Llama, Mistral, Qwen2, Phi-3, Mixtral) ------------------------------------------


def decoder_logits(config: dict[str, Any], shards: list[State], ids: torch.Tensor, experts: str = "tp") -> torch.Tensor:
    """Logits of a Llama-family decoder (dense or Mixtral MoE) run tensor-parallel over ``shards``."""
    h = decoder_embed(config, shards, ids)
    h = decoder_layers(config, shards, h, range(config["num_hidden_layers"]), experts)
    return decoder_head(config, shards, h)


def decoder_embed(config: dict[str, Any], shards: list[State], ids: torch.Tensor) -> torch.Tensor:
    """The first pipeline stage's input: token embeddings (vocab-parallel over ``shards``)."""
    return vocab_embedding(shards, "model.embed_tokens.weight", ids, config["vocab_size"])


def decoder_layers(
    config: dict[str, Any], shards: list[State], h: torch.Tensor, layers: range, experts: str = "tp"
) -> torch.Tensor:
    """Run decoder ``layers`` tensor-parallel over ``shards`` on the hidden state ``h`` (one pipeline stage's body)."""
    n = len(shards)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    local_q, local_kv = heads // n, (kv_heads // n if kv_heads % n == 0 else 1)
    eps = config["rms_norm_eps"]
    theta = (config.get("rope_parameters") or {}).get("rope_theta") or config["rope_theta"]
    for layer in layers:
        p = f"model.layers.{layer}."
        parts = []
        for s in shards:
            x = rms_norm(h, s[p + "input_layernorm.weight"], eps)
            if p + "self_attn.qkv_proj.weight" in s:
                qkv = _linear(x, s, p + "self_attn.qkv_proj")
                q, k, v = qkv.split([local_q * head_dim, local_kv * head_dim, local_kv * head_dim], -1)
            else:
                q, k, v = (_linear(x, s, p + f"self_attn.{w}_proj") for w in "qkv")
            assert q.shape[-1] == local_q * head_dim and k.shape[-1] == local_kv * head_dim
            q, k, v = _heads(q, head_dim), _heads(k, head_dim), _heads(v, head_dim)
            out = attention(rope(q, theta), rope(k, theta), v, causal=True)
            parts.append(F.linear(_merge(out), s[p + "self_attn.o_proj.weight"]))
        h = h + all_reduce(parts)
        parts = []
        for rank, s in enumerate(shards):
            x = rms_norm(h, s[p + "post_attention_layernorm.weight"], eps)
            parts.append(_moe(config, s, p, x, experts, n, rank) if _is_moe(s, p) else _mlp(s, p + "mlp.", x))
        h = h + all_reduce(parts)
    return h


def decoder_head(config: dict[str, Any], shards: list[State], h: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's output: final norm and (vocab-parallel) logits."""
    xs = [rms_norm(h, s["model.norm.weight"], config["rms_norm_eps"]) for s in shards]
    head = "lm_head.weight" if "lm_head.weight" in shards[0] else "model.embed_tokens.weight"
    return vocab_logits(shards, head, xs, config["vocab_size"])


def _mlp(s: State, p: str, x: torch.Tensor) -> torch.Tensor:
    """SiLU-gated MLP on this rank's slice of the intermediate dim: a partial sum of the output."""
    if p + "gate_up_proj.weight" in s:
        gate, up = F.linear(x, s[p + "gate_up_proj.weight"]).chunk(2, -1)
    else:
        gate, up = F.linear(x, s[p + "gate_proj.weight"]), F.linear(x, s[p + "up_proj.weight"])
    return F.linear(F.silu(gate) * up, s[p + "down_proj.weight"])


def _is_moe(s: State, p: str) -> bool:
    return any(k.startswith((p + "block_sparse_moe.", p + "mlp.experts.")) for k in s)


def _moe(config: dict[str, Any], s: State, p: str, x: torch.Tensor, experts: str, n: int, rank: int) -> torch.Tensor:
    """Mixtral sparse MoE on one rank: top-k routing (replicated router), then this rank's expert work.

    With ``experts="tp"`` the rank runs every expert on its slice of the intermediate dim; with
    ``"parallel"`` it runs its own contiguous group of whole experts. Either way: a partial sum.
    """
    num_experts, top_k = config["num_local_experts"], config["num_experts_per_tok"]
    stacked = p + "mlp.experts.gate_up_proj" in s
    router = s[p + ("mlp.gate.weight" if stacked else "block_sparse_moe.gate.weight")]
    probs = F.linear(x, router).softmax(-1)
    weights, chosen = probs.topk(top_k, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    routing = torch.zeros_like(probs).scatter(-1, chosen, weights)  # [b, s, experts], zero where not chosen
    group = num_experts // n if experts == "parallel" else num_experts
    first = rank * group if experts == "parallel" else 0  # global id of this rank's first expert
    out = torch.zeros_like(x)
    for local in range(group):
        if stacked:
            gate, up = F.linear(x, s[p + "mlp.experts.gate_up_proj"][local]).chunk(2, -1)
            down = s[p + "mlp.experts.down_proj"][local]
        else:
            w = p + f"block_sparse_moe.experts.{local}."
            gate, up, down = F.linear(x, s[w + "w1.weight"]), F.linear(x, s[w + "w3.weight"]), s[w + "w2.weight"]
        e = first + local
        out = out + routing[..., e : e + 1] * F.linear(F.silu(gate) * up, down)
    return out


# --- BERT encoder --------------------------------------------------------------------------------


def bert_hidden(config: dict[str, Any], shards: list[State], ids: torch.Tensor) -> torch.Tensor:
    """Last hidden state of a BERT encoder run tensor-parallel over ``shards`` (no padding mask)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = hidden // heads
    eps = config["layer_norm_eps"]
    s0 = shards[0]
    positions = torch.arange(ids.shape[1])
    h = vocab_embedding(shards, "embeddings.word_embeddings.weight", ids, config["vocab_size"])
    h = h + s0["embeddings.position_embeddings.weight"][positions] + s0["embeddings.token_type_embeddings.weight"][0]
    h = F.layer_norm(h, (hidden,), s0["embeddings.LayerNorm.weight"], s0["embeddings.LayerNorm.bias"], eps)
    for layer in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{layer}."
        parts = []
        for s in shards:
            q, k, v = (_heads(_linear(h, s, p + f"attention.self.{w}"), head_dim) for w in ("query", "key", "value"))
            parts.append(F.linear(_merge(attention(q, k, v, causal=False)), s[p + "attention.output.dense.weight"]))
        attn = all_reduce(parts) + s0[p + "attention.output.dense.bias"]  # a row-parallel bias is added once
        ln = p + "attention.output.LayerNorm."
        h = F.layer_norm(attn + h, (hidden,), s0[ln + "weight"], s0[ln + "bias"], eps)
        parts = [
            F.linear(F.gelu(_linear(h, s, p + "intermediate.dense")), s[p + "output.dense.weight"]) for s in shards
        ]
        out = all_reduce(parts) + s0[p + "output.dense.bias"]
        h = F.layer_norm(out + h, (hidden,), s0[p + "output.LayerNorm.weight"], s0[p + "output.LayerNorm.bias"], eps)
    return h
