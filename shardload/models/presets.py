"""Family presets: placements for every tensor of a model whose family (:mod:`shardload.models.families`) is known.

A family's entry maps module-path suffixes (Hugging Face or GGUF names) to roles; :func:`role_placement` says
how each role is split (whole attention heads, fused halves, experts). Pure: config and tensor headers only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import PlanError
from .families import family_for, model_types
from .placement import Placement, TensorHeader
from .splits import (
    ModelDims,
    all_replicated,
    attention_placement,
    attention_scale_placements,
    head_units,
    packed_halves,
    shape_error,
)
from .stored_layouts import refuse_unknown_parts

__all__ = ["gguf_names", "preset_placements", "role_placement"]


def _star(path: str) -> str:
    return ".".join("*" if part.isascii() and part.isdigit() else part for part in path.split("."))


def _match(path: str, patterns: Mapping[str, str]) -> str | None:
    """The pattern whose starred form ``path`` (digits starred) equals or ends with at a dot boundary, the longest
    one where several do. ``patterns`` maps each starred form to its pattern (see :func:`_starred`)."""
    parts = _star(path).split(".")
    for i in range(len(parts)):  # longest suffix first
        pattern = patterns.get(".".join(parts[i:]))
        if pattern is not None:
            return pattern
    return None


def _starred(patterns: Iterable[str]) -> dict[str, str]:
    """Each pattern's starred form mapped to the pattern (the first of patterns that star alike)."""
    out: dict[str, str] = {}
    for pattern in patterns:
        out.setdefault(_star(pattern), pattern)
    return out


def _targets(tensors: Mapping[str, TensorHeader], patterns: Iterable[str]) -> Iterable[tuple[str, str, str | None]]:
    """Yield ``(tensor name, matched pattern, parameter)`` for every tensor a pattern names.

    A pattern names a whole tensor (parameter None: stacked experts, ``cls.predictions.bias``) or
    a module, whose ``weight`` and ``bias`` it covers (a quantized module's logical ``weight`` too,
    in :func:`shardload.models.stored_layouts.logical_tensors`).
    """
    starred = _starred(patterns)
    for name in tensors:
        whole = _match(name, starred)
        if whole is not None:
            yield name, whole, None
            continue
        module, _, param = name.rpartition(".")
        pattern = _match(module, starred) if module and param in ("weight", "bias") else None
        if pattern is not None:
            yield name, pattern, param


def role_placement(
    role: str, name: str, param: str | None, shape: tuple[int, ...] | None, dims: ModelDims, experts: str, rule: str
) -> Placement:
    """The placement for one tensor of a module with a preset role."""
    bias = param == "bias"
    if role == "vocab":
        return Placement(name, "vocab", 0, rule=rule)
    if role == "lm_head":
        return Placement(name, "column", 0, rule=rule)
    if role in ("q", "k", "v", "qkv", "o"):
        return attention_placement(role, name, bias, shape, dims, rule)
    if role == "column":
        return Placement(name, "column", 0, rule=rule)
    if role == "row":
        return Placement(name, "replicated", rule=rule) if bias else Placement(name, "row", 1, rule=rule)
    if role in ("heads_column", "heads_row"):  # num_attention_heads blocks of any size (latent attention's)
        if bias and role == "heads_row":
            return Placement(name, "replicated", rule=rule)
        style, dim = ("column", 0) if role == "heads_column" else ("row", 1)
        return head_units(name, style, dim, shape or (), dims.num_heads, rule) or Placement(name, style, dim, rule=rule)
    if role == "gate_up":
        return packed_halves(name, 0, shape, dims.intermediate_size, rule)
    if role in ("expert_column", "expert_row"):
        if experts == "parallel":
            raise PlanError(
                "--experts parallel needs expert weights stacked as [num_experts, ...], but this checkpoint "
                "stores one tensor per expert and every rank receives every stored tensor; re-save it stacked "
                "(transformers: save_pretrained(..., save_original_format=False)) or use --experts tp",
                param=name,
            )
        if role == "expert_column":
            return Placement(name, "column", 0, rule=rule)
        return Placement(name, "replicated", rule=rule) if bias else Placement(name, "row", 1, rule=rule)
    # stacked experts: [num_experts, out, in] weights, [num_experts, out] biases
    if shape is not None and dims.num_experts is not None and shape[0] != dims.num_experts:
        raise shape_error(
            name, f"stacked expert tensor {list(shape)} does not lead with num_experts={dims.num_experts}"
        )
    if experts == "parallel":
        return Placement(name, "expert", 0, rule=rule)
    if role == "stacked_transposed_column":  # [num_experts, in, out]: split the outputs, the last dim
        return Placement(name, "column", 2 if shape is None else len(shape) - 1, rule=rule)
    if role == "stacked_gate_up":
        return packed_halves(name, 1, shape, dims.expert_intermediate_size, rule)
    if role == "stacked_column":
        return Placement(name, "column", 1, rule=rule)
    return Placement(name, "replicated", rule=rule) if bias else Placement(name, "row", 2, rule=rule)


def preset_placements(
    config: Mapping[str, Any], tensors: Mapping[str, TensorHeader], *, experts: str = "tp"
) -> dict[str, Placement]:
    """Placements for every tensor from the built-in preset of config's model_type (HF or GGUF tensor names)."""
    model_type = config.get("model_type")
    family = family_for(model_type)
    if family is None:
        known = ", ".join(model_types())
        raise PlanError(
            f"model_type {model_type!r}: no plan source knows this architecture (no base_model_tp_plan applies; "
            f"built-in presets: {known}); write a shard_info.json for it beside the weights (docs/format.md)",
            file="config.json",
        )
    gguf = gguf_names(tensors)
    if gguf and family.gguf_roles is None:  # its roles name HF tensors: none would match
        raise PlanError(
            f"model_type {model_type!r}: the built-in preset knows its Hugging Face tensor names, not llama.cpp's "
            "GGUF names (blk.N.attn_q, ...); write a shard_info.json for it, or load the Hugging Face checkpoint",
            file="config.json",
        )
    roles = family.gguf_roles if gguf else family.roles
    dims = ModelDims.from_config(config)
    placements = all_replicated(tensors)
    for name, pattern, param in _targets(tensors, roles):
        info = tensors.get(name)
        rule = f"preset {model_type}: {pattern}"
        placements[name] = role_placement(
            roles[pattern], name, param, None if info is None else tuple(info.shape), dims, experts, rule
        )
    placements.update(attention_scale_placements(tensors, placements, dims))
    starred = _starred(roles)
    unplaced = {name: info for name, info in tensors.items() if not placements[name].rule}
    refuse_unknown_parts(unplaced, lambda module: "the preset" if _match(module, starred) is not None else None)
    return placements


def gguf_names(tensors: Mapping[str, TensorHeader]) -> bool:
    """Whether tensors follow llama.cpp's GGUF naming (``token_embd``, ``blk.N.attn_q``)."""
    return any(name.startswith("blk.") or name.startswith("token_embd.") for name in tensors)
