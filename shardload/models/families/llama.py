"""Llama's tensor names (Hugging Face and llama.cpp's GGUF), shared by every decoder family that keeps them."""

from __future__ import annotations

from collections.abc import Mapping

from .family import Family

ROLES: dict[str, str] = {
    "embed_tokens": "vocab",
    "lm_head": "lm_head",
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.qkv_proj": "qkv",
    "self_attn.o_proj": "o",
    "mlp.gate_proj": "column",
    "mlp.up_proj": "column",
    "mlp.gate_up_proj": "gate_up",
    "mlp.down_proj": "row",
    "shared_expert.gate_proj": "column",
    "shared_expert.up_proj": "column",
    "shared_expert.down_proj": "row",
    "experts.*.w1": "expert_column",
    "experts.*.w3": "expert_column",
    "experts.*.gate_proj": "expert_column",
    "experts.*.up_proj": "expert_column",
    "experts.*.w2": "expert_row",
    "experts.*.down_proj": "expert_row",
    "experts.gate_up_proj": "stacked_gate_up",
    "experts.gate_proj": "stacked_column",
    "experts.up_proj": "stacked_column",
    "experts.down_proj": "stacked_row",
}
"""Module (or, for stacked experts, parameter) path suffixes -> role: Llama's names, and Mixtral's and Qwen-MoE's
expert names."""

GGUF_ROLES: dict[str, str] = {
    "token_embd": "vocab",
    "output": "lm_head",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_qkv": "qkv",
    "attn_output": "o",
    "ffn_gate": "column",
    "ffn_up": "column",
    "ffn_down": "row",
    "ffn_gate_shexp": "column",
    "ffn_up_shexp": "column",
    "ffn_down_shexp": "row",
    "ffn_gate_exps": "stacked_column",
    "ffn_up_exps": "stacked_column",
    "ffn_down_exps": "stacked_row",
}
"""llama.cpp's GGUF tensor names -> role, for every decoder that keeps Llama's names."""


def llama_named(
    name: str,
    *model_types: str,
    gguf_overrides: Mapping[str, str] | None = None,
    gguf_architectures: Mapping[str, str] | None = None,
) -> Family:
    """A family that keeps Llama's tensor names (``gguf_overrides``: the GGUF names whose role differs;
    ``gguf_architectures``: GGUF architecture names -> model type where they differ."""
    gguf = {**GGUF_ROLES, **(gguf_overrides or {})}
    return Family(name, model_types, ROLES, gguf, dict(gguf_architectures or {}))
