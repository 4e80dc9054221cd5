"""GPT-OSS's tensor names: Llama's attention (with biases and per-head sinks), a router, and experts stored stacked
as ``[experts, in, out]`` with gate and up interleaved along ``out``."""

from __future__ import annotations

from .family import Family

ROLES: dict[str, str] = {
    "embed_tokens": "vocab",
    "lm_head": "lm_head",
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.o_proj": "o",
    "self_attn.sinks": "column",
    "experts.gate_up_proj": "stacked_transposed_column",
    "experts.gate_up_proj_bias": "stacked_column",
    "experts.down_proj": "stacked_column",
}
"""Path suffixes -> role. One sink per head: split like the heads (N divides them). ``gate_up_proj`` [experts,
hidden, 2 x intermediate], gate and up interleaved (g0, u0, g1, u1, ...): a rank's run of the last dim is its
intermediate rows' pairs, as servers split it; its bias the same along dim 1; ``down_proj`` [experts, intermediate,
hidden] by rows; ``down_proj_bias`` and the router whole."""

GPT_OSS = Family("gpt_oss", ("gpt_oss",), ROLES)
"""OpenAI's GPT-OSS."""
