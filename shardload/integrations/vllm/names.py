"""Checkpoint names -> vLLM parameter names: which fused vLLM parameter a stored tensor fills, and in which part.

vLLM fuses a layer's projections into one parameter (``q_proj``, ``k_proj``, ``v_proj`` -> ``qkv_proj``;
``gate_proj``, ``up_proj`` -> ``gate_up_proj``), concatenating each rank's parts along the output dim in the
mapping's order, and stacks a mixture-of-experts layer's experts into two parameters (``experts.w13_weight``:
[experts, gate rows + up rows, hidden]; ``experts.w2_weight``: [experts, hidden, down columns]). Pure: names
only, no vLLM import, so ``convert --layout vllm`` works without vLLM installed. A :class:`Target` is the
server-neutral one of :mod:`shardload.integrations.fill`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..fill import SHAPE_SUFFIX, Target

__all__ = [
    "DEFAULT_PACKED",
    "EXPERTS_MODULE",
    "EXPERT_PROJECTIONS",
    "OPTIONAL_SUFFIXES",
    "SHAPE_SUFFIX",
    "SKIPPED_SUFFIXES",
    "STACKED_EXPERTS",
    "VOCAB_PADDING",
    "Target",
    "is_vocab",
    "padded_vocab",
    "vllm_target",
    "vocab_range",
]

DEFAULT_PACKED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
"""The fusion vLLM's Llama-family models declare in ``packed_modules_mapping``."""

VOCAB_PADDING = 64
"""vLLM pads a vocabulary-parallel embedding or LM head to a multiple of this many rows before splitting it."""

EXPERT_PROJECTIONS: dict[str, tuple[str, int]] = {
    "w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0),
    "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0),
}  # fmt: skip
"""A stored expert projection -> (vLLM's stacked parameter, its part): Mixtral's and Qwen-MoE's names."""

OPTIONAL_SUFFIXES = tuple(f".attn.{k}_{what}" for k in ("k", "v", "q", "prob") for what in ("scale", "zero_point"))
"""KV-cache scales vLLM creates for a quantized model; a checkpoint without them gets vLLM's defaults."""

STACKED_EXPERTS: dict[str, str] = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}
"""Experts stored stacked (transformers' ``save_original_format=False``: ``experts.gate_up_proj`` [experts, gate rows
+ up rows, hidden], ``experts.down_proj``) -> vLLM's stacked parameter: the same layout, one tensor for one."""

EXPERTS_MODULE = "routed_experts"
"""The submodule of a vLLM MoE layer's ``experts`` that holds the stacked parameters (vLLM 0.32; older: none)."""

SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
"""Buffers some checkpoints store that vLLM recomputes; its own loader skips them too."""


def vllm_target(name: str, packed: Mapping[str, Sequence[str]] = DEFAULT_PACKED) -> Target:
    """The vLLM parameter that checkpoint tensor ``name`` fills (``...q_proj.weight`` -> part 0 of ``qkv_proj``)."""
    pieces = name.split(".")
    if len(pieces) >= 4 and pieces[-4] == "experts" and pieces[-3].isascii() and pieces[-3].isdigit():
        stacked = EXPERT_PROJECTIONS.get(pieces[-2])
        if stacked is not None:
            fused, part = stacked
            parts = 2 if fused == "w13" else 1
            stacked_name = ".".join([*pieces[:-3], EXPERTS_MODULE, f"{fused}_{pieces[-1]}"])
            return Target(stacked_name, part, parts, int(pieces[-3]))
    if len(pieces) >= 2 and pieces[-2] == "experts" and pieces[-1] in STACKED_EXPERTS:
        return Target(".".join([*pieces[:-1], EXPERTS_MODULE, STACKED_EXPERTS[pieces[-1]]]))
    for fused, subs in packed.items():
        for index, sub in enumerate(subs):
            if sub in pieces[:-1] and sub != fused:
                at = len(pieces) - 1 - pieces[::-1].index(sub)
                return Target(".".join([*pieces[:at], fused, *pieces[at + 1 :]]), index, len(subs))
    return Target(name)


def padded_vocab(rows: int, padding: int = VOCAB_PADDING) -> int:
    """The row count vLLM gives a vocabulary-parallel tensor of ``rows`` rows: a multiple of ``padding``."""
    return -(-rows // padding) * padding


def vocab_range(rows: int, rank: int, num_shards: int, padding: int = VOCAB_PADDING) -> tuple[int, int, int]:
    """``(start, stop, per_rank)``: the stored rows rank ``rank`` holds and its padded row count (vLLM's rule)."""
    per_rank = padded_vocab(rows, padding) // num_shards
    start = min(rank * per_rank, rows)
    return start, min(start + per_rank, rows), per_rank


def is_vocab(name: str) -> bool:
    """True for the tensors vLLM splits as a padded vocabulary (token embeddings and the LM head)."""
    return name.endswith(("embed_tokens.weight", "lm_head.weight"))
