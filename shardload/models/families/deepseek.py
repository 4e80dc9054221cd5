"""DeepSeek V2 and V3 (multi-head latent attention, shared and routed experts): their tensor names and vLLM's."""

from __future__ import annotations

from .family import Family, VllmNames
from .llama import ROLES as LLAMA_ROLES

ROLES: dict[str, str] = {
    **{k: v for k, v in LLAMA_ROLES.items() if not k.startswith(("self_attn.", "shared_expert."))},
    "self_attn.q_proj": "column",  # no q LoRA (V2-Lite): heads x (nope + rope) rows, whole heads per rank
    "self_attn.q_b_proj": "column",
    "self_attn.kv_b_proj": "column",  # heads x (nope + v) rows
    "self_attn.o_proj": "row",
    "shared_experts.gate_proj": "column",
    "shared_experts.up_proj": "column",
    "shared_experts.down_proj": "row",
}
"""Module path suffixes -> role; the latent projections (``q_a_proj``, ``kv_a_proj_with_mqa``), their norms and
the router are replicated, as vLLM keeps them."""

DEEPSEEK = Family(
    "deepseek",
    ("deepseek_v2", "deepseek_v3"),
    ROLES,
    vllm_packed={"gate_up_proj": ("gate_proj", "up_proj"), "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")},
    vllm=VllmNames(
        optional_packed=("fused_qkv_a_proj",),
        state_names={
            ".mlp.gate.weight": ".mlp.experts.gate.weight",
            ".mlp.gate.e_score_correction_bias": ".mlp.experts.gate.e_score_correction_bias",
            ".mlp.shared_experts.": ".mlp.experts._shared_experts._layer.",
            **{
                f".self_attn.{m}.": f".self_attn.mla_attn.{m}."
                for m in ("q_proj", "q_a_layernorm", "q_b_proj", "o_proj")
            },
        },
        attention="mla_attn.mla_attn",
    ),
)
"""vLLM fuses ``q_a_proj`` and ``kv_a_proj_with_mqa`` when the model has a q LoRA (V3), and keeps its MoE router,
its shared experts and some attention projections under aliases (inside ``mlp.experts`` and ``self_attn.mla_attn``)."""
