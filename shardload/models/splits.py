"""The splits every model plan shares: head and expert counts from config.json, whole-head attention splits (KV
heads replicated when N exceeds them), fused gate/up halves, and the one rule by which head and expert counts
bound N (:func:`count_problems`). Used by the built-in presets (:mod:`shardload.models.presets`) and by
transformers' plans (:mod:`shardload.models.hf_tp_tables`). Pure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, PlanError
from .placement import Placement, TensorHeader

__all__ = [
    "ATTENTION_ROLES",
    "ModelDims",
    "all_replicated",
    "attention_placement",
    "count_problems",
    "head_units",
    "packed_halves",
    "shape_error",
]

ATTENTION_ROLES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "qkv_proj": "qkv", "o_proj": "o",
                   "query": "q", "key": "k", "value": "v"}  # fmt: skip


@dataclass(frozen=True)
class ModelDims:
    """The sizes a plan needs from config.json: attention heads and, for MoE models, experts."""

    hidden_size: int | None
    num_heads: int | None
    num_kv_heads: int | None
    head_dim: int | None
    num_experts: int | None
    intermediate_size: int | None
    expert_intermediate_size: int | None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelDims:
        """Read head and expert counts (absent keys give None; GQA defaults to one KV head per head)."""
        hidden = _first_key(config, _ALIASES["hidden_size"])
        heads = _first_key(config, _ALIASES["num_attention_heads"])
        kv = _first_key(config, _ALIASES["num_key_value_heads"]) or heads
        head_dim = _int_key(config, "head_dim") or (hidden // heads if hidden and heads else None)
        experts = _int_key(config, "num_local_experts") or _int_key(config, "num_experts")
        inter = _int_key(config, "intermediate_size")
        return cls(hidden, heads, kv, head_dim, experts, inter, _int_key(config, "moe_intermediate_size") or inter)

    @classmethod
    def lenient(cls, config: Mapping[str, Any]) -> ModelDims:
        """:meth:`from_config` leaving out values that are no single positive count (per-layer lists: Gemma 3n's
        ``intermediate_size``), for plans that split by stored shapes and only need the counts."""
        return cls.from_config({k: v for k, v in config.items() if k not in _DIM_KEYS or (type(v) is int and v > 0)})


_ALIASES = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
}
"""Other names config.json files give these sizes (transformers' ``attribute_map``: GPT-J's and GPT-2's ``n_head``
and ``n_embd``, MPT's ``n_heads`` and ``d_model``, ChatGLM's ``multi_query_group_num``), the first one present read."""
_DIM_KEYS = (*(k for names in _ALIASES.values() for k in names), "head_dim", "num_local_experts", "num_experts",
             "intermediate_size", "moe_intermediate_size")  # fmt: skip


def _first_key(config: Mapping[str, Any], keys: tuple[str, ...]) -> int | None:
    return next((v for v in (_int_key(config, k) for k in keys) if v is not None), None)


def _int_key(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise CheckpointError(f"{key} must be a positive integer, got {value!r}", file="config.json")
    return value


def shape_error(name: str, reason: str) -> PlanError:
    """A located error: ``name``'s stored shape does not fit what config.json says."""
    return PlanError(reason, file="config.json", param=name)


def packed_halves(name: str, dim: int, shape: tuple[int, ...] | None, half: int | None, rule: str) -> Placement:
    """Column-parallel over two equal fused halves (gate and up) along ``dim``.

    The half size comes from the stored shape, or from config (``half``) for a logical weight.
    """
    if shape is not None:
        if shape[dim] % 2:
            raise shape_error(name, f"fused gate_up dim {dim} of size {shape[dim]} is not two equal halves")
        half = shape[dim] // 2
    if half is None:
        raise shape_error(name, "the fused gate_up size is unknown: it is not stored and config.json has no size")
    return Placement(name, "column", dim, (half, half), rule=rule)


def attention_placement(
    role: str, name: str, bias: bool, shape: tuple[int, ...] | None, dims: ModelDims, rule: str
) -> Placement:
    """Split by whole heads; KV heads are flagged so they replicate when N exceeds their count."""
    heads, kv_heads, head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
    if heads is None or kv_heads is None or head_dim is None:
        raise shape_error(name, "config.json needs num_attention_heads (and hidden_size or head_dim) to split heads")
    if role == "o":
        if bias:
            return Placement(name, "replicated", rule=rule)
        if shape is not None and shape[-1] != heads * head_dim:
            raise shape_error(
                name, f"input dim {shape[-1]} != num_attention_heads={heads} x head_dim={head_dim} from config.json"
            )
        return Placement(name, "row", 1, (heads,), head_dim, (False,), rule=rule)
    segments, kv = {
        "q": ((heads,), (False,)),
        "k": ((kv_heads,), (True,)),
        "v": ((kv_heads,), (True,)),
        "qkv": ((heads, kv_heads, kv_heads), (False, True, True)),
    }[role]
    if shape is not None and shape[0] != sum(segments) * head_dim:
        counts = f"num_attention_heads={heads}, num_key_value_heads={kv_heads}, head_dim={head_dim}"
        raise shape_error(name, f"output dim {shape[0]} does not match {counts} from config.json")
    return Placement(name, "column", 0, segments, head_dim, kv, rule=rule)


ATTENTION_SCALES = {"q_scale": False, "k_scale": True, "v_scale": True}
"""An attention module's own scales (a quantized KV cache's, compressed-tensors' ``attn_head`` strategy stores one per
head), by name: whether they follow the KV heads (else the query heads)."""


def attention_scale_placements(
    tensors: Mapping[str, Any], placements: Mapping[str, Placement], dims: ModelDims
) -> dict[str, Placement]:
    """Placements for the per-head scales (:data:`ATTENTION_SCALES`) of attention modules whose projections are
    split by heads: each rank holds the scales of the heads it holds (KV heads replicated past their count, as
    ``k_proj``'s are). A per-tensor scale stays whole; one that is neither is refused."""
    split = set()  # attention modules with a projection split by heads (a column split counted in heads)
    for p in placements.values():
        if p.style == "column" and p.segments:
            split.add(p.name.rsplit(".", 2)[0])
    out = {}
    for name, info in tensors.items():
        module, _, last = name.rpartition(".")
        if last not in ATTENTION_SCALES or module not in split:
            continue
        shape = tuple(int(d) for d in info.shape)
        if math.prod(shape) <= 1:
            continue  # one scale for the whole tensor
        kv = ATTENTION_SCALES[last]
        count = dims.num_kv_heads if kv else dims.num_heads
        if count is None or shape[0] % count:
            what = "num_key_value_heads" if kv else "num_attention_heads"
            raise shape_error(name, f"{last} {list(shape)} is neither one scale nor one per head ({what}={count}), "
                                    "and its module is split by heads")  # fmt: skip
        rule = f"{last} of an attention module split by heads: each rank its heads' scales"
        out[name] = Placement(name, "column", 0, (count,), shape[0] // count, (kv,), rule=rule)
    return out


def head_units(
    name: str, style: str, dim: int, shape: tuple[int, ...], heads: int | None, rule: str
) -> Placement | None:
    """A split of ``shape[dim]`` by whole heads when it is ``heads`` equal blocks (a per-head interleaved
    ``query_key_value``, MLA's ``q_b_proj``), else None; for an N dividing ``heads`` its bytes are a plain split's."""
    if heads is None or not shape or shape[dim] % heads or shape[dim] == heads:
        return None
    return Placement(name, style, dim, (heads,), shape[dim] // heads, rule=rule)


def count_problems(dims: ModelDims, placements: Mapping[str, Placement], num_shards: int) -> list[str]:
    """Why ``num_shards`` cannot work, in config.json's terms: the one rule every plan source is bound by.

    A plan that splits heads (a placement counted in units, or with KV flags) needs N to divide
    num_attention_heads, and to divide num_key_value_heads or be a multiple of it; one that places whole experts
    needs N to divide the expert count. Empty when N can work as far as the counts go.
    """
    n = num_shards
    reasons = []
    heads_split = any(p.unit > 1 or any(p.kv) for p in placements.values())
    if heads_split and dims.num_heads:
        h, k = dims.num_heads, dims.num_kv_heads or dims.num_heads
        if h % n:
            reasons.append(f"num_attention_heads={h} is not divisible by num_shards={n}")
        if k != h and k % n and n % k:  # without GQA the KV heads are the heads, already named
            reasons.append(
                f"num_shards={n} neither divides num_key_value_heads={k} nor is a multiple of it "
                f"(num_attention_heads={h})"
            )
    if dims.num_experts and any(p.style == "expert" for p in placements.values()) and dims.num_experts % n:
        reasons.append(f"{dims.num_experts} experts are not divisible by num_shards={n} (expert parallel)")
    return reasons


def all_replicated(tensors: Mapping[str, TensorHeader]) -> dict[str, Placement]:
    """Every tensor replicated: where a plan starts before its rules split some."""
    return {name: Placement(name, "replicated") for name in tensors}
