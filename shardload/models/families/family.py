"""One model family's entry: its model types, the roles of its tensor names, and how vLLM fuses its layers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ...errors import PlanError
from ..vllm_names import DEFAULT_PACKED

ROLES = (
    "vocab", "lm_head", "q", "k", "v", "qkv", "o", "column", "row", "gate_up",
    "expert_column", "expert_row", "stacked_gate_up", "stacked_column", "stacked_row", "stacked_transposed_column",
)  # fmt: skip
"""How a module with that role is split (:func:`shardload.models.presets.role_placement` gives each one meaning)."""


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
class Family:
    """A family of architectures that share tensor names: the model types (config.json's ``model_type``) it
    covers, its module-path suffixes -> roles (``*`` matches a layer or expert index), llama.cpp's GGUF names ->
    roles (None: not read from GGUF), GGUF ``general.architecture`` names -> model type where they differ, and how
    vLLM's model of it names its state (:class:`VllmNames`)."""

    name: str
    model_types: tuple[str, ...]
    roles: Mapping[str, str]
    gguf_roles: Mapping[str, str] | None = None
    gguf_architectures: Mapping[str, str] = field(default_factory=dict)
    vllm_packed: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: DEFAULT_PACKED)
    vllm: VllmNames = field(default_factory=lambda: VllmNames())

    def __post_init__(self) -> None:
        if not self.model_types:
            raise PlanError(f"model family {self.name!r} names no model type")
        stray = sorted(set(self.gguf_architectures.values()) - set(self.model_types))
        if stray:
            raise PlanError(f"model family {self.name!r}: GGUF architectures name model types it lacks: {stray}")
        for table in (self.roles, self.gguf_roles or {}):
            unknown = sorted({role for role in table.values() if role not in ROLES})
            if unknown:
                raise PlanError(f"model family {self.name!r}: unknown role(s) {unknown} (known: {', '.join(ROLES)})")
