"""What vLLM's model of each model family fuses and how it names its state: one entry per family (vLLM 0.32).

A family's tensor names and roles are :mod:`shardload.models.families`'; this table adds vLLM's side, keyed by the
family's name. A family without an entry is Llama's to vLLM (``qkv_proj`` and ``gate_up_proj`` fused, no aliases).
:func:`register_vllm_family` adds one at run time, beside :func:`~shardload.models.families.register_family`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ...models.families import family_for
from .names import DEFAULT_PACKED


@dataclass(frozen=True)
class VllmNames:
    """What ``convert --layout vllm`` must know of vLLM's model of a family beyond its fusion (vLLM 0.32)."""

    optional_packed: tuple[str, ...] = ()
    """Fused parameters vLLM makes only when the checkpoint has all their parts (DeepSeek's ``fused_qkv_a_proj``
    needs a q LoRA); otherwise each part keeps its own name."""
    state_names: Mapping[str, str] = field(default_factory=dict)
    """Name pieces -> the alias vLLM's ``sharded_state`` keeps for the same tensor (its state dict keeps the
    smallest of a tensor's names): ``.mlp.gate.weight`` -> ``.mlp.experts.gate.weight``."""
    attention: str = "attn"
    """The attention module, under ``self_attn``, whose float32 scales vLLM keeps in its state."""
    tied_head: bool = True
    """Whether vLLM's model keeps an ``lm_head`` when the embeddings are tied (Gemma 2's computes logits from
    ``embed_tokens`` and has none)."""
    transposed: tuple[str, ...] = ()
    """Stored stacked expert tensors (name suffixes) vLLM keeps transposed: ``[experts, in, out]`` stored,
    ``[experts, out, in]`` in vLLM (GPT-OSS)."""
    first_rank_only: tuple[str, ...] = ()
    """Whole stored tensors (name suffixes) vLLM keeps on tensor-parallel rank 0 only, zeros on the others: a
    row-parallel bias added once (GPT-OSS's expert down bias)."""


@dataclass(frozen=True)
class VllmFamily:
    """vLLM's model of one family: its ``packed_modules_mapping`` and its state's names."""

    packed: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: DEFAULT_PACKED)
    names: VllmNames = field(default_factory=VllmNames)


_DEEPSEEK_ATTENTION = ("q_proj", "q_a_layernorm", "q_b_proj", "o_proj")

VLLM_FAMILIES: dict[str, VllmFamily] = {
    "gemma2": VllmFamily(names=VllmNames(tied_head=False)),  # vLLM's Gemma 2 has no lm_head
    "qwen2_moe": VllmFamily(
        names=VllmNames(
            state_names={
                ".mlp.shared_expert.": ".mlp.experts._shared_experts._layer.",
                ".mlp.shared_expert_gate.": ".mlp.experts._shared_experts._layer.expert_gate.",
            }
        )
    ),
    "qwen3_moe": VllmFamily(names=VllmNames(state_names={".mlp.gate.weight": ".mlp.experts.gate.weight"})),
    # vLLM fuses q_a_proj and kv_a_proj_with_mqa when the model has a q LoRA (V3), and keeps its MoE router, its
    # shared experts and some attention projections under aliases (inside mlp.experts and self_attn.mla_attn)
    "deepseek": VllmFamily(
        packed={"gate_up_proj": ("gate_proj", "up_proj"), "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")},
        names=VllmNames(
            optional_packed=("fused_qkv_a_proj",),
            state_names={
                ".mlp.gate.weight": ".mlp.experts.gate.weight",
                ".mlp.gate.e_score_correction_bias": ".mlp.experts.gate.e_score_correction_bias",
                ".mlp.shared_experts.": ".mlp.experts._shared_experts._layer.",
                **{f".self_attn.{m}.": f".self_attn.mla_attn.{m}." for m in _DEEPSEEK_ATTENTION},
            },
            attention="mla_attn.mla_attn",
        ),
    ),
    # unquantized GPT-OSS: vLLM's loader transposes the experts, and keeps the down bias on rank 0 only
    "gpt_oss": VllmFamily(
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
        names=VllmNames(
            state_names={
                ".self_attn.": ".attn.",
                ".embed_tokens.": ".embedding.",
                ".experts.gate_up_proj_bias": ".experts.routed_experts.w13_bias",
                ".experts.down_proj_bias": ".experts.routed_experts.w2_bias",
            },
            transposed=("experts.gate_up_proj", "experts.down_proj"),
            first_rank_only=("experts.down_proj_bias",),
        ),
    ),
}
"""Family name (:attr:`~shardload.models.families.Family.name`) -> vLLM's model of it, where it is not Llama's."""


def register_vllm_family(family: str, entry: VllmFamily) -> VllmFamily:
    """Say how vLLM models ``family`` (a registered family's name); replaces an earlier entry."""
    VLLM_FAMILIES[family] = entry
    return entry


def vllm_family(model_type: object) -> VllmFamily:
    """vLLM's model of ``model_type``: its family's entry, else Llama's."""
    family = family_for(model_type)
    return VLLM_FAMILIES.get(family.name, VllmFamily()) if family is not None else VllmFamily()


def vllm_names(model_type: object) -> VllmNames:
    """How vLLM's model of ``model_type`` names its state: its family's, else Llama's."""
    return vllm_family(model_type).names


def vllm_packing(model_type: object) -> Mapping[str, tuple[str, ...]]:
    """vLLM's ``packed_modules_mapping`` for ``model_type``: its family's, else Llama's."""
    return vllm_family(model_type).packed
