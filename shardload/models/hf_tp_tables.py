"""transformers' TP tables (its ``tp_plan`` attributes: module pattern -> parallel style), read and translated into
placements.

transformers keeps a model's TP plan on its config class (``LlamaConfig.base_model_tp_plan``,
patterns relative to the base model) and on its model class (``LlamaForCausalLM._tp_plan``:
``lm_head``); ``save_pretrained`` writes neither into config.json. A plan comes from, first that
has one: config.json's own ``base_model_tp_plan``; the table shipped in this package (``hf_tp_plans.json``,
written from transformers by ``scripts/gen_hf_tp_plans.py``), read as JSON; the installed transformers, imported
lazily and only here, for a model type the table lacks. :func:`hf_placements` turns the plan into one
:class:`~shardload.models.placement.Placement` per tensor, matching names and splitting tensors as
transformers' ``from_pretrained(tp_plan="auto")`` does (:data:`STYLES`), except where transformers
is wrong: KV heads that N cannot split are replicated (``splits.attention_placement``), a packed
bias follows its weight's halves.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

from ..errors import PlanError
from .placement import Placement, TensorHeader
from .splits import (
    ATTENTION_ROLES,
    ModelDims,
    all_replicated,
    attention_placement,
    attention_scale_placements,
    head_units,
    packed_halves,
)
from .stored_layouts import refuse_unknown_parts

__all__ = [
    "STYLES",
    "TABLE_FILE",
    "HfTpTable",
    "checkpoint_tp_table",
    "generic_name",
    "hf_placements",
    "installed_entry",
    "known_table",
    "model_class_entry",
    "tp_table_for",
    "shipped_table",
    "transformers_entry",
]

TABLE_FILE = "hf_tp_plans.json"

# style -> (what the weight gets, what transformers does at run time). Weight rules:
#   column: Shard(ndim - 2) (the output dim; a bias's only dim); row: Shard(-1), bias replicated;
#   packed_column / packed_row: the two fused halves (gate, up) each split, rank r holds part r of both;
#   vocab: embedding rows (Shard(0)); embedding_column: Shard(1); expert: whole experts (Shard(0));
#   replicated: the style only hooks the module's forward (activations), its own tensors stay whole.
STYLES: dict[str, tuple[str, str]] = {
    "colwise": ("column", "input replicated, output stays split on the last dim (whole heads on q/k/v)"),
    "colwise_gather_output": ("column", "output all-gathered after the matmul: a plain split, heads ignored"),
    "colwise_rep": ("column", "older name of colwise_gather_output"),
    "local_colwise": ("column", "older transformers: colwise on local tensors"),
    "rowwise": ("row", "input split on the last dim, partial sums all-reduced (whole heads on o_proj)"),
    "rowwise_split_input": ("row", "replicated input split locally first, then all-reduced: a plain split"),
    "rowwise_rep": ("row", "older name of rowwise_split_input"),
    "local_rowwise": ("row", "older transformers: rowwise on local tensors"),
    "packed_colwise": ("packed_column", "fused gate_up on the output dim (dim 1 of stacked experts)"),
    "packed_rowwise": ("packed_row", "fused gate_up on the last dim (experts stored [E, in, 2I])"),
    "local_packed_rowwise": ("packed_row", "older transformers: packed_rowwise on local tensors"),
    "embedding_rowwise": ("vocab", "vocab-parallel lookup, partial rows all-reduced"),
    "embedding_colwise": ("embedding_column", "hidden dim split, looked-up slices all-gathered"),
    "grouped_gemm": ("expert", "expert parallel (base_model_ep_plan): whole experts per rank"),
    "moe_tp_experts": ("replicated", "run time only: every rank runs its part of every expert, outputs all-reduced"),
    "moe_identity_expert": ("replicated", "run time only: an identity expert's input divided by N before the sum"),
    "ep_dispatch_experts": ("replicated", "run time only: tokens dispatched to the ranks holding their experts"),
    "ep_router": ("replicated", "older transformers, run time only: router masks other ranks' experts"),
    "mla_kv_a_proj": ("replicated", "run time only: MLA kv_a_proj output, its rope part's gradient all-reduced"),
    "replicated_with_grad_allreduce": ("replicated", "run time only: a norm over split heads, gradient all-reduced"),
    "sequence_parallel": ("replicated", "run time only: activations split on the sequence dim"),
    "all_reduce": ("replicated", "run time only: the module's partial output all-reduced"),
    "local_params": ("replicated", "run time only: the module runs on its parameters' local parts"),
    "replicate": ("replicated", "every rank holds the whole tensor"),
    "gather": ("replicated", "older transformers, run time only: output all-gathered"),
    "local": ("replicated", "older transformers, run time only"),
    "isolated": ("replicated", "older transformers, run time only"),
}
_DEFAULT_HEAD = {"lm_head": "colwise_gather_output"}  # what transformers' causal-LM classes declare


@dataclass(frozen=True)
class HfTpTable:
    """One model type's TP plan: the base model's (``tp_plan``, ``ep_plan``), the model class's own
    (``head_plan``: ``lm_head``), the base model's attribute name (``prefix``), tied weights, a phrase
    saying where it came from, and whether transformers was imported for it (a type the shipped table lacks)."""

    model_type: str
    tp_plan: dict[str, str]
    source: str
    ep_plan: dict[str, str] = field(default_factory=dict)
    head_plan: dict[str, str] = field(default_factory=lambda: dict(_DEFAULT_HEAD))
    prefix: str = "model"
    tied: dict[str, str] = field(default_factory=dict)
    model_class: str = ""
    imported: bool = False

    @classmethod
    def from_entry(cls, model_type: str, entry: Mapping[str, Any], source: str) -> HfTpTable:
        """An HfTpTable from one entry of the shipped table (or of :func:`transformers_entry`)."""
        return cls(
            model_type,
            dict(entry["tp_plan"]),
            source,
            dict(entry.get("ep_plan") or {}),
            dict(entry.get("head_plan") or {}),
            str(entry.get("prefix") or ""),
            dict(entry.get("tied") or {}),
            str(entry.get("model_class") or ""),
        )


# --- where a plan comes from ------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def shipped_table() -> dict[str, Any]:
    """The table shipped in the package: ``{"transformers": version, "models": {model_type: entry}}``."""
    text = (resources.files("shardload.models") / TABLE_FILE).read_text(encoding="utf-8")
    return json.loads(text)


def _transformers_installed() -> bool:
    return importlib.util.find_spec("transformers") is not None


@functools.cache
def transformers_entry(model_type: str, model_cls: type | None = None) -> dict[str, Any] | None:
    """The table entry for ``model_type`` read from the installed transformers (None: it has no TP plan).

    The model class (``lm_head``'s plan, the base model's prefix, tied weights) is the one transformers' auto
    mappings give for the config class, or ``model_cls``. Imports transformers: for planning only, never at
    import; names are only looked up in transformers' own registries, keyed by the config class.
    """
    from transformers import CONFIG_MAPPING

    try:
        config_cls = CONFIG_MAPPING[model_type]
    except (KeyError, ValueError, ImportError, AttributeError):
        return None
    tp_plan = dict(getattr(config_cls, "base_model_tp_plan", None) or {})
    if not tp_plan:
        return None
    entry: dict[str, Any] = {"config_class": config_cls.__name__, "tp_plan": tp_plan}
    ep_plan = dict(getattr(config_cls, "base_model_ep_plan", None) or {})
    if ep_plan:
        entry["ep_plan"] = ep_plan
    model_cls = model_cls or _auto_model_class(config_cls)
    if model_cls is not None:
        entry.update(model_class_entry(model_cls))
    return entry


def model_class_entry(model_cls: type) -> dict[str, Any]:
    """What a model class adds to its base model's plan: its name, ``base_model_prefix``, its own ``_tp_plan``
    (``lm_head``) and ``_tied_weights_keys``."""
    head = getattr(model_cls, "_tp_plan", None)
    tied = getattr(model_cls, "_tied_weights_keys", None)
    return {
        "model_class": model_cls.__name__,
        "prefix": str(getattr(model_cls, "base_model_prefix", "") or ""),
        "head_plan": {str(k): str(v) for k, v in dict(head or {}).items()},
        "tied": {str(k): str(v) for k, v in tied.items()} if isinstance(tied, dict) else {},
    }


def _auto_model_class(config_cls: type) -> type | None:
    """The class ``from_pretrained`` builds for a text checkpoint: the causal LM, else the base model (None for a
    sub-config no auto mapping lists)."""
    from transformers.models.auto import modeling_auto

    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING, modeling_auto.MODEL_MAPPING):
        try:
            found = mapping[config_cls]
        except (KeyError, ValueError, ImportError, AttributeError, RuntimeError):
            continue
        return found[0] if isinstance(found, (list, tuple)) else found
    return None


def installed_entry(model_type: str) -> dict[str, Any] | None:
    """:func:`transformers_entry` when transformers is installed, else None."""
    if not _transformers_installed():
        return None
    try:
        return transformers_entry(model_type)
    except ImportError:
        return None


def _installed_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def tp_table_for(config: Mapping[str, Any]) -> HfTpTable | None:
    """The TP plan for a config.json: its own ``base_model_tp_plan``, else the shipped table's, else (a model type
    the table lacks) the installed transformers' (None: none of them has one). The model class's parts come from
    the table or transformers."""
    model_type = str(config.get("model_type") or "")
    known = known_table(model_type) if model_type else None
    if config.get("base_model_tp_plan"):
        plan = _plan_dict(config, "base_model_tp_plan")
        ep = _plan_dict(config, "base_model_ep_plan") if config.get("base_model_ep_plan") else {}
        source = "base_model_tp_plan of config.json"
        if known is None:
            return HfTpTable(model_type, plan, source, ep)
        return replace(known, tp_plan=plan, source=source, ep_plan=ep)
    return known


def known_table(model_type: str) -> HfTpTable | None:
    """``model_type``'s plan from the shipped table; only a type the table lacks imports transformers (the source
    says so). None: neither has a TP plan for it."""
    table = shipped_table()
    entry = table["models"].get(model_type)
    if entry is not None:
        source = f"transformers {table['transformers']} ({_classes(entry)}; shardload's table)"
        return HfTpTable.from_entry(model_type, entry, source)
    entry = installed_entry(model_type)
    if entry is None:
        return None
    source = (
        f"transformers {_installed_version()} ({_classes(entry)}; imported: model_type {model_type!r} is not in "
        f"shardload's table of transformers {table['transformers']})"
    )
    return replace(HfTpTable.from_entry(model_type, entry, source), imported=True)


def _classes(entry: Mapping[str, Any]) -> str:
    """The transformers attributes an entry was read from, for a plan's source."""
    classes = f"{entry.get('config_class') or '?'}.base_model_tp_plan"
    if entry.get("head_plan") and entry.get("model_class"):
        classes += f" + {entry['model_class']}._tp_plan"
    return classes


def _plan_dict(config: Mapping[str, Any], key: str) -> dict[str, str]:
    plan = config.get(key)
    ok = isinstance(plan, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items())
    if not ok:
        raise PlanError(f"{key} must be an object of module pattern -> style name", file="config.json")
    return dict(plan)


# --- plan -> placements -----------------------------------------------------------------------

_LAYER_NUMBER = re.compile(r"\.\d+(\.|$)")


def generic_name(name: str) -> str:
    """``name`` with layer numbers as ``*`` (``model.layers.3.mlp`` -> ``model.layers.*.mlp``), as transformers
    writes plan keys: only numbers between dots or after the last dot."""
    return _LAYER_NUMBER.sub(lambda m: ".*" + m.group(1), name)


def checkpoint_tp_table(plan: HfTpTable, tensors: Mapping[str, TensorHeader], *, experts: str = "tp") -> dict[str, str]:
    """The plan keyed by stored names (``model.layers.*.mlp.up_proj``), as ``from_pretrained`` assembles it."""
    return {name: style for name, (_, style) in _checkpoint_keys(plan, tensors, experts).items()}


def _checkpoint_keys(plan: HfTpTable, tensors: Mapping[str, TensorHeader], experts: str) -> dict[str, tuple[str, str]]:
    """The plan keyed by stored names (``model.layers.*.mlp.up_proj``), as ``from_pretrained`` assembles it.

    The model class's own entries (``lm_head``) apply when the checkpoint holds the base model under its
    prefix; the base model gets ``embed_tokens: embedding_rowwise`` unless its plan names the embeddings;
    with ``experts="parallel"`` the ep plan replaces the tp rules on the expert modules.
    """
    base = dict(plan.tp_plan)
    if experts == "parallel":
        if not plan.ep_plan:
            raise PlanError(
                f"--experts parallel with --style hf needs a base_model_ep_plan, and {plan.source} has none "
                "(or use --style megatron)",
                file="config.json",
            )
        under = re.compile(rf"(?:{'|'.join(map(re.escape, plan.ep_plan))})(?:\..+)?").fullmatch
        base = {k: v for k, v in base.items() if not under(k)} | plan.ep_plan
    prefix = _base_prefix(plan, base, tensors)
    dot = f"{prefix}." if prefix else ""
    embed = tensors.get(f"{dot}embed_tokens.weight")
    if base and "embed_tokens" not in base and embed is not None and len(embed.shape) == 2:
        base = {"embed_tokens": "embedding_rowwise", **base}
    full = {k: (k, v) for k, v in plan.head_plan.items()} if prefix else {}
    full.update({dot + k: (k, v) for k, v in base.items()})
    return full


def _base_prefix(plan: HfTpTable, base: Mapping[str, str], tensors: Mapping[str, TensorHeader]) -> str:
    """Where the base model sits in the checkpoint: the leading name under which most tensors match its plan
    (``model``; transformers' ``base_model_prefix`` can differ from the attribute, as Llama 4's
    ``language_model`` does), or "" for a checkpoint of the base model itself."""
    candidates = {""} | {n.split(".", 1)[0] for n in tensors if "." in n}
    if plan.prefix:
        candidates.add(plan.prefix)

    def matches(prefix: str) -> int:
        dot = f"{prefix}." if prefix else ""
        return sum(1 for n in tensors if n.startswith(dot) and _style_for(n[len(dot) :], base) is not None)

    return max(sorted(candidates), key=lambda p: (matches(p), p == plan.prefix))


def _style_for(name: str, plan: Mapping[str, str]) -> tuple[str, str] | None:
    """(pattern, style) for a stored tensor: its own generic name, else its module's (transformers' rule)."""
    generic = generic_name(name)
    if generic in plan:
        return generic, plan[generic]
    module = generic.rpartition(".")[0]
    if module and module in plan:
        return module, plan[module]
    return None


def hf_placements(
    config: Mapping[str, Any],
    tensors: Mapping[str, TensorHeader],
    *,
    experts: str = "tp",
    plan: HfTpTable | None = None,
) -> tuple[dict[str, Placement], list[str]]:
    """Placements from transformers' TP plan for ``config`` (:func:`tp_table_for`), and notes.

    Notes name plan entries that matched no tensor. Tensors no entry matches are replicated.
    """
    plan = plan or tp_table_for(config)
    if plan is None:
        raise PlanError(
            f"--style hf: config.json has no base_model_tp_plan and transformers has no TP plan for model_type "
            f"{config.get('model_type')!r} (or use --style megatron)",
            file="config.json",
        )
    full_keys = _checkpoint_keys(plan, tensors, experts)
    full = {p: style for p, (_, style) in full_keys.items()}
    full_keys = {p: key for p, (key, _) in full_keys.items()}
    dims = ModelDims.lenient(config)
    placements = all_replicated(tensors)
    used: set[str] = set()
    for name, info in tensors.items():
        found = _style_for(name, full)
        if found is None:
            fused = _fused_placement(name, tuple(info.shape), full, dims)
            if fused is not None:
                used.update(fused[1])
                placements[name] = fused[0]
            continue
        pattern, style = found
        used.add(pattern)
        placements[name] = _style_placement(style, pattern, name, tuple(info.shape), dims)
    placements.update(attention_scale_placements(tensors, placements, dims))
    unnamed = {name: info for name, info in tensors.items() if generic_name(name) not in full}
    refuse_unknown_parts(unnamed, lambda module: _splitter(full.get(module)), generic_name)
    notes = [
        f"tp_plan entry {key!r} ({full[p]}) matched no tensor"
        for p, key in full_keys.items()
        if p not in used and key != "embed_tokens" and f"{p}.weight" not in plan.tied  # a tied head is not stored
    ]
    return placements, notes


def _splitter(style: str | None) -> str | None:
    """Who splits a module the plan gives ``style`` (None: not in the plan; "": kept whole), for
    :func:`~shardload.models.stored_layouts.refuse_unknown_parts`: transformers' rule would cut marlin's ``P.B`` as
    if it were the module's weight."""
    if style is None:
        return None
    return "" if STYLES.get(style, ("replicated",))[0] in ("replicated", "expert") else f"tp_plan {style!r}"


_COLUMN_STYLES = ("colwise", "local_colwise")
_QKV = ("q", "k", "v", "qkv")
# Where transformers' colwise/rowwise keep heads local, tensors whose split dim is whole heads though config's
# head_dim does not describe them: per-head interleaved q/k/v (GPT-NeoX), MLA's per-head projections, and the
# output projections that read them. Only inside an attention module.
_ATTENTION_MODULES = ("attention", "self_attn", "attn", "self_attention")
_HEAD_OUTPUTS = ("query_key_value", "q_b_proj", "kv_b_proj")
_HEAD_INPUTS = ("dense", "proj", "o_proj")


def _style_placement(style: str, pattern: str, name: str, shape: tuple[int, ...], dims: ModelDims) -> Placement:
    """The placement transformers' ``style`` gives a tensor of ``shape`` (see :data:`STYLES`)."""
    if style not in STYLES:
        supported = ", ".join(sorted(STYLES))
        raise PlanError(
            f"tp_plan entry {pattern!r}: unsupported style {style!r} (supported: {supported})",
            file="config.json",
            param=name,
        )
    rule, _ = STYLES[style]
    why = f"tp_plan {pattern}: {style}"
    ndim = len(shape)
    bias = ndim == 1
    out_dim = 0 if bias else ndim - 2
    parent, _, last = pattern.rpartition(".")
    attention = ATTENTION_ROLES.get(last)
    in_attention = parent.rpartition(".")[2] in _ATTENTION_MODULES
    if rule == "replicated" or ndim == 0:
        return Placement(name, "replicated", rule=why)
    if rule == "column":
        if last in _FUSED and ndim <= 2:  # a fused tensor, whatever transformers does with its output: see _FUSED
            fused = f"{why}; stored fused: each rank its part of every piece, as runtimes keeping outputs local need"
            if _FUSED[last][1] == "qkv":
                heads = _heads_or_none("qkv", name, bias, shape, dims, fused)
                if heads is not None:
                    return heads
            else:
                return packed_halves(name, out_dim, shape, None, fused)
        if style in _COLUMN_STYLES and ndim <= 2:
            heads = _heads_or_none(attention, name, bias, shape, dims, why) if attention in _QKV else None
            if heads is None and in_attention and (attention == "q" or last in _HEAD_OUTPUTS):
                heads = head_units(name, "column", out_dim, shape, dims.num_heads, why)
            if heads is not None:
                return heads
        return Placement(name, "column", out_dim, rule=why)
    if rule == "row":
        if bias:
            return Placement(name, "replicated", rule=why)
        if style in ("rowwise", "local_rowwise") and ndim == 2:
            heads = _heads_or_none("o", name, False, shape, dims, why) if attention == "o" else None
            if heads is None and in_attention and (attention == "o" or last in _HEAD_INPUTS):
                heads = head_units(name, "row", 1, shape, dims.num_heads, why)
            if heads is not None:
                return heads
        return Placement(name, "row", ndim - 1, rule=why)
    if rule == "packed_column":
        return packed_halves(name, out_dim, shape, None, why)
    if rule == "packed_row":
        if bias:
            return Placement(name, "replicated", rule=why)
        return Placement(name, "row", ndim - 1, packed_halves(name, ndim - 1, shape, None, why).segments, rule=why)
    if rule == "vocab":
        return Placement(name, "vocab", 0, rule=why)
    if rule == "embedding_column":
        return Placement(name, "column", ndim - 1, rule=why)
    return Placement(name, "expert", 0, rule=why)  # "expert"


# a stored tensor the plan does not name -> the plan entries (siblings) whose split it takes, and how. A plan that
# names it (transformers' colwise_gather_output on GLM-4's and Phi-3's) gets the same split: transformers gathers
# that output before chunking it, so a plain split is right there, but vLLM's fused layers (and any runtime that
# keeps a column-parallel output local) need every rank to hold its own part of each piece.
_FUSED = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), "qkv"),
    "gate_up_proj": (("gate_proj", "up_proj"), "gate_up"),
}
_EXPERT_COLUMN = ("w1", "w3", "gate_proj", "up_proj")
_EXPERT_ROW = ("w2", "down_proj")


def _fused_placement(
    name: str, shape: tuple[int, ...], plan: Mapping[str, str], dims: ModelDims
) -> tuple[Placement, list[str]] | None:
    """Where the plan names separate modules but the checkpoint stores them otherwise (the preset knowledge):
    a fused ``qkv_proj`` / ``gate_up_proj`` whose parts the plan splits column-wise gets whole heads / both halves
    split; one expert's ``experts.E.w1`` (``gate_proj``, ...) of stacked experts the plan splits gets the same
    split of its own ``[out, in]``. Returns the placement and the plan entries it followed, or None."""
    module, _, param = generic_name(name).rpartition(".")
    parent, _, last = module.rpartition(".")
    if param not in ("weight", "bias"):
        return None
    if last in _FUSED:
        parts, role = _FUSED[last]
        keys = [f"{parent}.{p}" for p in parts]
        if not all(plan.get(k) in _COLUMN_STYLES for k in keys):
            return None
        why = f"tp_plan {', '.join(keys)}: colwise, stored fused as {last}"
        if role == "qkv" and len(shape) <= 2:
            heads = _heads_or_none("qkv", name, param == "bias", shape, dims, why)
            return (heads, keys) if heads is not None else None
        return packed_halves(name, 0, shape, None, why), keys
    experts, _, number = parent.rpartition(".")
    if number == "*" and last in _EXPERT_COLUMN + _EXPERT_ROW and len(shape) <= 2:
        if f"{experts}.gate_up_proj" not in plan:  # transformers' Mixtral conversion renames block_sparse_moe
            experts = experts.replace(".block_sparse_moe.", ".mlp.")
        gate_up, down = plan.get(f"{experts}.gate_up_proj"), plan.get(f"{experts}.down_proj")
        why = f"tp_plan {experts}: stacked experts stored one by one"
        if last in _EXPERT_COLUMN and gate_up == "packed_colwise":
            return Placement(name, "column", 0, rule=why), [f"{experts}.gate_up_proj"]
        if last in _EXPERT_ROW and down == "rowwise":
            placement = Placement(name, "replicated" if param == "bias" else "row", None if param == "bias" else 1)
            return replace(placement, rule=why), [f"{experts}.down_proj"]
    return None


def _heads_or_none(
    role: str, name: str, bias: bool, shape: tuple[int, ...], dims: ModelDims, why: str
) -> Placement | None:
    """A whole-head split (KV heads replicated when N exceeds them), or None where the config's head counts do not
    describe this tensor (then the split is plain, as transformers does it)."""
    try:
        return attention_placement(role, name, bias, shape, dims, why)
    except PlanError:
        return None
