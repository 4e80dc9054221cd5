"""What vLLM's model of each model family fuses and how it names its state: one entry per family (vLLM 0.32), and
the model types whose vLLM models were judged against vLLM's own loader (:data:`CHECKED`).

A family's tensor names and roles are :mod:`shardload.models.families`'; this table adds vLLM's side, keyed by the
family's name. A family without an entry is Llama's to vLLM (``qkv_proj`` and ``gate_up_proj`` fused, no aliases).
:func:`register_vllm_family` adds one at run time, beside :func:`~shardload.models.families.register_family`;
:func:`register_vllm_checked` says a model type is checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ...errors import ShardloadError
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


@dataclass(frozen=True)
class Checked:
    """What was judged of one model type against vLLM's default loader, parameter by parameter on every rank."""

    classes: tuple[str, ...]
    """vLLM's model classes for it that ``load_format="shardload"`` fills as vLLM's default loader does."""
    layout: bool = True
    """Whether ``convert --layout vllm`` writes its state as vLLM's ``sharded_state`` loader reads it."""


CHECKED: dict[str, Checked] = {
    "llama": Checked(("LlamaForCausalLM",)),
    "mistral": Checked(("MistralForCausalLM",)),
    "qwen2": Checked(("Qwen2ForCausalLM",)),
    "qwen3": Checked(("Qwen3ForCausalLM",)),
    "mixtral": Checked(("MixtralForCausalLM",)),
    "qwen2_moe": Checked(("Qwen2MoeForCausalLM",)),
    "qwen3_moe": Checked(("Qwen3MoeForCausalLM",)),
    "olmoe": Checked(("OlmoeForCausalLM",)),
    "deepseek_v2": Checked(("DeepseekV2ForCausalLM",)),
    "deepseek_v3": Checked(("DeepseekV3ForCausalLM",)),
    "gemma": Checked(("GemmaForCausalLM",)),
    "gemma2": Checked(("Gemma2ForCausalLM",)),
    "gemma3_text": Checked(("Gemma3ForCausalLM",)),
    "phi3": Checked(("Phi3ForCausalLM",)),
    "gpt_oss": Checked(("GptOssForCausalLM",)),
    "granite": Checked(("GraniteForCausalLM",)),
    "glm4": Checked(("Glm4ForCausalLM",)),
    "cohere": Checked(("CohereForCausalLM",), layout=False),  # vLLM's Cohere has no lm_head; names not written
}
"""config.json model type -> what tests_vllm/test_vllm_params.py judges of it. Any other model is refused in one
line: a vLLM model whose ``load_weights`` reorders the stored bytes (Bloom's and Falcon's fused QKV) or that vLLM
serves through its Transformers backend (which splits a fused ``gate_up_proj`` plainly: GLM) would load wrong
weights without an error, and a state vLLM names otherwise fails inside vLLM."""


def register_vllm_checked(model_type: str, checked: Checked) -> Checked:
    """Say that ``model_type``'s vLLM model was judged (:class:`Checked`) against vLLM's own loader."""
    CHECKED[model_type] = checked
    return checked


def check_served(vllm_class: str, where: str) -> None:
    """Refuse, in one line, a vLLM model class ``load_format="shardload"`` was not checked against."""
    if any(vllm_class in c.classes for c in CHECKED.values()):
        return
    why = (
        "which vLLM serves through its Transformers backend (it splits fused tensors its own way)"
        if vllm_class.startswith("Transformers")
        else "whose load_weights may change the stored bytes on the way in"
    )
    raise ShardloadError(
        f"vLLM's {vllm_class} is not among the models load_format='shardload' was checked against, {why}: serve it "
        f"with vLLM's default loader (checked model types: {', '.join(sorted(CHECKED))})",
        file=where,
    )


def check_layout(config: Mapping[str, object], where: str) -> None:
    """Refuse, in one line, a model whose config.json names no model type whose vLLM state ``convert --layout vllm``
    was checked to write (a model without config.json, which vLLM cannot start from as it is, is laid out as a
    Llama)."""
    if not config:
        return
    model_type = config.get("model_type")
    checked = CHECKED.get(model_type) if isinstance(model_type, str) else None
    if checked is not None and checked.layout:
        return
    known = ", ".join(sorted(k for k, v in CHECKED.items() if v.layout))
    raise ShardloadError(
        f"model_type {model_type!r}: --layout vllm writes only the model types whose vLLM state was checked against "
        f"vLLM's sharded_state loader ({known}); serve this one with load_format='shardload' or vLLM's own loader",
        file=where,
    )


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
