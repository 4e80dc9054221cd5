"""Every rank's tensors of a Llama-family checkpoint, written from the architecture's tensor parallelism, with
plain torch slicing of the full tensors (no shardload code, no shard_info): the reference of the equivalence matrix.

The split is Megatron's, as vLLM applies it:

- the query heads are split N ways; the KV heads too when N divides their count, else (N a multiple of them) each
  KV head is replicated on N / KV-heads consecutive ranks; a fused ``qkv_proj`` holds [q | k | v] rows and rank r
  gets [its q rows | its k rows | its v rows];
- ``o_proj`` and ``down_proj`` (row-parallel) are split by columns; ``gate_proj``/``up_proj`` by rows, a fused
  ``gate_up_proj`` ([gate | up] rows) as [its gate rows | its up rows];
- embeddings and the LM head are split by rows: a vocabulary N divides as it is, another one (and every vocabulary
  in vLLM's own layout) first padded with zero rows to a multiple of 64 (vLLM's rule);
- norms are replicated.

``vllm_rank`` is vLLM's ``sharded_state`` layout: the same tensors, q/k/v and gate/up fused under vLLM's names, the
vocabulary always padded to a multiple of 64, and the four float32 scalar scales (1.0) each attention layer keeps.
"""

from __future__ import annotations

from typing import Any

import torch

State = dict[str, torch.Tensor]
ATTENTION_SCALARS = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")  # vLLM's Attention buffers (1.0 unquantized)


class NotSplittable(ValueError):
    """The model's head counts or vocabulary do not allow this N."""


def _chunk(t: torch.Tensor, n: int, r: int, dim: int = 0) -> torch.Tensor:
    size = t.shape[dim]
    if size % n:
        raise NotSplittable(f"{size} rows along dim {dim} do not split {n} ways")
    step = size // n
    return t.narrow(dim, r * step, step)


def _kv(t: torch.Tensor, kv_heads: int, n: int, r: int) -> torch.Tensor:
    """Rank r's KV heads of a [kv_heads * head_dim, ...] block."""
    if kv_heads % n == 0:
        return _chunk(t, n, r)
    if n % kv_heads == 0:
        return _chunk(t, kv_heads, r // (n // kv_heads))
    raise NotSplittable(f"{n} ranks neither divide nor are a multiple of {kv_heads} KV heads")


def _vocab(t: torch.Tensor, n: int, r: int, always_pad: bool) -> torch.Tensor:
    rows = t.shape[0]
    if rows % n == 0 and not always_pad:
        return _chunk(t, n, r)
    padded = -(-rows // 64) * 64
    whole = torch.zeros((padded, *t.shape[1:]), dtype=t.dtype)
    whole[:rows] = t
    return _chunk(whole, n, r)


def plain_rank(state: State, config: dict[str, Any], n: int, r: int, *, vllm_vocab: bool = False) -> State:
    """Rank r of n: the checkpoint's own names, each tensor as shardload's default plan must split it."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if heads % n:
        raise NotSplittable(f"{heads} query heads do not split {n} ways")
    out: State = {}
    for name, t in state.items():
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            part = _vocab(t, n, r, vllm_vocab)
        elif name.endswith("self_attn.qkv_proj.weight"):
            q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
            part = torch.cat([_chunk(q, n, r), _kv(k, kv_heads, n, r), _kv(v, kv_heads, n, r)])
        elif name.endswith("self_attn.q_proj.weight"):
            part = _chunk(t, n, r)
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            part = _kv(t, kv_heads, n, r)
        elif name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            part = _chunk(t, n, r, 1)
        elif name.endswith("mlp.gate_up_proj.weight"):
            gate, up = t.chunk(2)
            part = torch.cat([_chunk(gate, n, r), _chunk(up, n, r)])
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            part = _chunk(t, n, r)
        elif name.endswith("norm.weight"):
            part = t
        else:  # never replicate a tensor by default: a new kind of tensor must be placed here first
            raise AssertionError(f"the reference does not know how {name} is split")
        out[name] = part.contiguous()
    return out


def vllm_rank(state: State, config: dict[str, Any], n: int, r: int) -> State:
    """Rank r of n in vLLM's ``sharded_state`` layout."""
    plain = plain_rank(state, config, n, r, vllm_vocab=True)
    out: State = {}
    for name, t in plain.items():
        prefix, _, leaf = name.rpartition(".")
        module = prefix.rpartition(".")[2]
        base = prefix.rpartition(".")[0]
        if module in ("q_proj", "gate_proj"):
            parts = ("q_proj", "k_proj", "v_proj") if module == "q_proj" else ("gate_proj", "up_proj")
            fused = "qkv_proj" if module == "q_proj" else "gate_up_proj"
            out[f"{base}.{fused}.{leaf}"] = torch.cat([plain[f"{base}.{p}.{leaf}"] for p in parts])
        elif module not in ("k_proj", "v_proj", "up_proj"):
            out[name] = t
        if name.endswith(("self_attn.qkv_proj.weight", "self_attn.q_proj.weight")):
            for scalar in ATTENTION_SCALARS:
                out[f"{base}.attn.{scalar}"] = torch.tensor(1.0, dtype=torch.float32)
    return out


def mismatches(got: State, want: State) -> list[str]:
    """Every difference between a rank's tensors and the reference's: missing or extra names, dtype, shape, values."""
    problems = [f"missing {k}" for k in sorted(want.keys() - got.keys())]
    problems += [f"unexpected {k}" for k in sorted(got.keys() - want.keys())]
    for name in sorted(want.keys() & got.keys()):
        a, b = got[name], want[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{name}: {a.dtype}{list(a.shape)}, want {b.dtype}{list(b.shape)}")
        elif not torch.equal(a.cpu(), b):
            wrong = int((a.cpu() != b).sum())
            problems.append(f"{name}: {wrong} of {b.numel()} elements differ")
    return problems
