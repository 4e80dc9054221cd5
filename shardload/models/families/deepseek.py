"""DeepSeek V2 and V3 (multi-head latent attention, shared and routed experts): their tensor names."""

from __future__ import annotations

from .family import Family
from .llama import ROLES as LLAMA_ROLES

ROLES: dict[str, str] = {
    **{k: v for k, v in LLAMA_ROLES.items() if not k.startswith(("self_attn.", "shared_expert."))},
    "self_attn.q_proj": "heads_column",  # no q LoRA (V2-Lite): heads x (nope + rope) rows, whole heads per rank
    "self_attn.q_b_proj": "heads_column",
    "self_attn.kv_b_proj": "heads_column",  # heads x (nope + v) rows
    "self_attn.o_proj": "heads_row",  # heads x v_head_dim inputs
    "shared_experts.gate_proj": "column",
    "shared_experts.up_proj": "column",
    "shared_experts.down_proj": "row",
}
"""Module path suffixes -> role; the latent projections (``q_a_proj``, ``kv_a_proj_with_mqa``), their norms and
the router are replicated, as servers keep them."""

DEEPSEEK = Family("deepseek", ("deepseek_v2", "deepseek_v3"), ROLES)
"""DeepSeek V2 and V3: Llama's decoder names, latent attention and shared experts."""
