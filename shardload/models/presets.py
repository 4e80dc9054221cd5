"""Model plans: decide, from config.json and tensor names, how each weight is tensor-parallel.

Decisions come from built-in architecture presets (Llama, Mistral, Qwen2/3, Phi-3, Mixtral,
Qwen-MoE and BERT families, by Hugging Face or GGUF tensor names) or from HF transformers' own
TP plans (:mod:`shardload.models.hf_plans`: config.json's ``base_model_tp_plan``, the installed
transformers', or the table shipped with shardload). Each decision is a
:class:`~shardload.models.placement.Placement` (tensor, parallel style, dim, fused segments in units,
KV flags) made on the model's *logical* tensors: a quantized module is seen as its logical
weight (:func:`shardload.models.quant_plan.logical_tensors`). :func:`model_placements` makes them and
:func:`shard_info_document` renders a whole N-agnostic file, writing steps for every stored
tensor (packed weights, scales, zero points, ...) through :func:`shardload.models.quant_plan.companion_steps`.
Everything here is pure: config and tensor headers only, no tensor data.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import PlanError
from ..format.strictjson import write_atomic
from .placement import Placement, TensorHeader
from .quant_plan import companion_steps, detect_format, logical_tensors
from .splits import ModelDims, all_replicated, attention_placement, count_problems, packed_halves, shape_error

__all__ = [
    "GeneratedPlan",
    "ModelDims",
    "build_shard_info",
    "config_problems",
    "generate",
    "hf_placements",
    "model_placements",
    "pad_vocab",
    "plan_problems",
    "preset_placements",
    "resolved_style",
    "shard_info_document",
]

PLAN_STYLES = ("auto", "megatron", "hf")
EXPERT_MODES = ("tp", "parallel")
VOCAB_PADDING: dict[str, int | str | None] = {"vllm": 64, "plain": "num_shards", "none": None}
"""How a vocabulary N does not divide is padded (``pad_to`` of its placements): ``vllm`` to a multiple of 64 as
vLLM's ``pad_vocab_size`` does (the default: rank r then holds vLLM's rows), ``plain`` to a multiple of N (the
least padding; every N), ``none`` not at all (such an N fails). An N that divides the vocabulary pads nothing."""
DEFAULT_VOCAB_PADDING = "vllm"
MAX_CHECKED_NUM_SHARDS = 64
SCHEMA_URL = "https://shardload.dev/shard_info.schema.json"


# --- built-in presets ----------------------------------------------------------------------

DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe")
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")

# Module (or, for stacked experts, parameter) path suffixes -> role; digits in paths match "*".
DECODER_ROLES: dict[str, str] = {
    "embed_tokens": "vocab",
    "lm_head": "lm_head",
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.qkv_proj": "qkv",
    "self_attn.o_proj": "o",
    "mlp.gate_proj": "column",
    "mlp.up_proj": "column",
    "mlp.gate_up_proj": "gate_up",
    "mlp.down_proj": "row",
    "shared_expert.gate_proj": "column",
    "shared_expert.up_proj": "column",
    "shared_expert.down_proj": "row",
    "experts.*.w1": "expert_column",
    "experts.*.w3": "expert_column",
    "experts.*.gate_proj": "expert_column",
    "experts.*.up_proj": "expert_column",
    "experts.*.w2": "expert_row",
    "experts.*.down_proj": "expert_row",
    "experts.gate_up_proj": "stacked_gate_up",
    "experts.gate_proj": "stacked_column",
    "experts.up_proj": "stacked_column",
    "experts.down_proj": "stacked_row",
}
ENCODER_ROLES: dict[str, str] = {
    "embeddings.word_embeddings": "vocab",
    "attention.self.query": "q",
    "attention.self.key": "k",
    "attention.self.value": "v",
    "attention.output.dense": "o",
    "intermediate.dense": "column",
    "output.dense": "row",
    "cls.predictions.decoder": "lm_head",
    "cls.predictions.bias": "lm_head",
    "lm_head.decoder": "lm_head",
    "lm_head.bias": "lm_head",
}
# GGUF tensor names (llama.cpp's convention) -> role, for every decoder architecture above
GGUF_ROLES: dict[str, str] = {
    "token_embd": "vocab",
    "output": "lm_head",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_qkv": "qkv",
    "attn_output": "o",
    "ffn_gate": "column",
    "ffn_up": "column",
    "ffn_down": "row",
    "ffn_gate_shexp": "column",
    "ffn_up_shexp": "column",
    "ffn_down_shexp": "row",
    "ffn_gate_exps": "stacked_column",
    "ffn_up_exps": "stacked_column",
    "ffn_down_exps": "stacked_row",
}
GGUF_OVERRIDES: dict[str, dict[str, str]] = {"phi3": {"ffn_up": "gate_up"}}  # Phi-3 stores gate and up fused


def _star(path: str) -> str:
    return ".".join("*" if part.isascii() and part.isdigit() else part for part in path.split("."))


def _match(path: str, patterns: Iterable[str]) -> str | None:
    """The longest pattern that ``path`` (digits starred) equals or ends with at a dot boundary."""
    starred = _star(path)
    best = None
    for pattern in patterns:
        p = _star(pattern)
        if (starred == p or starred.endswith("." + p)) and (best is None or len(p) > len(_star(best))):
            best = pattern
    return best


def _targets(tensors: Mapping[str, TensorHeader], patterns: Iterable[str]) -> Iterable[tuple[str, str, str | None]]:
    """Yield ``(tensor name, matched pattern, parameter)`` for every tensor a pattern names.

    A pattern names a whole tensor (parameter None: stacked experts, ``cls.predictions.bias``) or
    a module, whose ``weight`` and ``bias`` it covers (a quantized module's logical ``weight`` too,
    in :func:`shardload.models.quant_plan.logical_tensors`).
    """
    patterns = list(patterns)
    for name in tensors:
        whole = _match(name, patterns)
        if whole is not None:
            yield name, whole, None
            continue
        module, _, param = name.rpartition(".")
        pattern = _match(module, patterns) if module and param in ("weight", "bias") else None
        if pattern is not None:
            yield name, pattern, param


def _role_placement(
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
    if model_type in DECODER_TYPES and _gguf_names(tensors):
        roles = {**GGUF_ROLES, **GGUF_OVERRIDES.get(str(model_type), {})}
    elif model_type in DECODER_TYPES:
        roles = DECODER_ROLES
    elif model_type in ENCODER_TYPES:
        roles = ENCODER_ROLES
    else:
        known = ", ".join(DECODER_TYPES + ENCODER_TYPES)
        raise PlanError(
            f"model_type {model_type!r}: no plan source knows this architecture (no base_model_tp_plan applies; "
            f"built-in presets: {known}); write a shard_info.json for it beside the weights, or pass one with "
            "--shard-info (shard_info= in Python)",
            file="config.json",
        )
    dims = ModelDims.from_config(config)
    placements = all_replicated(tensors)
    for name, pattern, param in _targets(tensors, roles):
        info = tensors.get(name)
        rule = f"preset {model_type}: {pattern}"
        placements[name] = _role_placement(
            roles[pattern], name, param, None if info is None else tuple(info.shape), dims, experts, rule
        )
    return placements


def _gguf_names(tensors: Mapping[str, TensorHeader]) -> bool:
    """Whether tensors follow llama.cpp's GGUF naming (``token_embd``, ``blk.N.attn_q``)."""
    return any(name.startswith("blk.") or name.startswith("token_embd.") for name in tensors)


# --- HF transformers tp_plan (shardload.models.hf_plans) ---------------------------------------


def hf_placements(
    config: Mapping[str, Any], tensors: Mapping[str, TensorHeader], *, experts: str = "tp"
) -> tuple[dict[str, Placement], list[str]]:
    """Placements from transformers' own TP plan for config's model_type (see :mod:`shardload.models.hf_plans`)."""
    from . import hf_plans

    return hf_plans.hf_placements(config, tensors, experts=experts)


# --- vocabulary padding ----------------------------------------------------------------------

LM_HEADS = ("lm_head", "embed_out", "output", "lm_head.decoder", "cls.predictions.decoder", "cls.predictions")
"""Modules that project onto the vocabulary (HF ``lm_head``, GPT-NeoX ``embed_out``, GGUF ``output``, BERT/RoBERTa
masked-LM heads); their weight and bias split along the vocabulary like the embedding."""


def _vocab_rows(name: str, placement: Placement, tensors: Mapping[str, TensorHeader]) -> int | None:
    """The vocabulary size when ``placement`` splits a vocabulary (an embedding, or an LM head along its rows)."""
    info = tensors.get(name)
    if info is None or placement.dim is None or placement.segmented:
        return None
    shape = tuple(info.shape)
    dim = placement.dim % len(shape) if shape else 0
    if placement.style == "vocab" and dim == 0:
        return shape[0]
    module, _, param = name.rpartition(".")
    top = module.split(".", 1)[-1] if module.startswith(("model.", "transformer.")) else module
    head = (param in ("weight", "bias") and top in LM_HEADS) or name in ("cls.predictions.bias", "lm_head.bias")
    if placement.style == "column" and head and dim == 0:
        return shape[0]
    return None


def pad_vocab(
    placements: Mapping[str, Placement], tensors: Mapping[str, TensorHeader], rule: str = DEFAULT_VOCAB_PADDING
) -> tuple[dict[str, Placement], int | None]:
    """``placements`` with every vocabulary split (embeddings, LM head weight and bias) padded by ``rule`` (a key of
    :data:`VOCAB_PADDING`) where N does not divide it, and the vocabulary size (None: none is split)."""
    if rule not in VOCAB_PADDING:
        raise PlanError(f"vocab padding must be one of {', '.join(VOCAB_PADDING)}, got {rule!r}")
    out = dict(placements)
    vocab = None
    for name, placement in placements.items():
        rows = _vocab_rows(name, placement, tensors)
        if rows is None:
            continue
        vocab = max(vocab or 0, rows)
        if VOCAB_PADDING[rule] is not None:
            out[name] = replace(placement, pad_to=VOCAB_PADDING[rule])
    return out, vocab


# --- placements -> steps -> document ----------------------------------------------------------


def shard_info_document(
    placements: Mapping[str, Placement],
    tensors: Mapping[str, TensorHeader],
    *,
    quantization_config: Mapping[str, Any] | None = None,
    description: str | None = None,
) -> dict[str, Any]:
    """The N-agnostic document-form shard_info: steps for every stored tensor in ``tensors`` that ``placements`` split.

    ``placements`` are keyed by logical tensor (a quantized module's ``P.weight``); each one's steps
    come from :func:`shardload.models.quant_plan.companion_steps`, for the tensor itself or for every
    stored tensor of its module.
    """
    params: dict[str, Any] = {}
    for placement in placements.values():
        if placement.style == "replicated":
            continue
        for name, steps in companion_steps(placement, tensors, quantization_config).items():
            if steps:
                params[name] = steps
    doc: dict[str, Any] = {"$schema": SCHEMA_URL, "version": 1, "num_shards": None}
    if description:
        doc["description"] = description
    doc["params"] = params
    return doc


def model_placements(
    config: Mapping[str, Any], tensors: Mapping[str, TensorHeader], *, style: str = "auto", experts: str = "tp"
) -> tuple[dict[str, Placement], list[str]]:
    """Placements (one per tensor of ``tensors``: stored, or logical for quantized modules) and notes.

    ``style``: ``"hf"`` follows config's base_model_tp_plan, ``"megatron"`` the built-in preset,
    ``"auto"`` the tp_plan when config has one. ``experts``: ``"tp"`` splits inside each expert,
    ``"parallel"`` gives each rank whole experts.
    """
    if style not in PLAN_STYLES:
        raise PlanError(f"style must be one of {', '.join(PLAN_STYLES)}, got {style!r}")
    if experts not in EXPERT_MODES:
        raise PlanError(f"experts must be one of {', '.join(EXPERT_MODES)}, got {experts!r}")
    if resolved_style(config, style, tensors) == "hf":
        return hf_placements(config, tensors, experts=experts)
    return preset_placements(config, tensors, experts=experts), []


def resolved_style(config: Mapping[str, Any], style: str, tensors: Mapping[str, TensorHeader] | None = None) -> str:
    """``"hf"`` or ``"megatron"``: what ``style`` means for this config.

    ``auto`` picks hf when config.json has its own base_model_tp_plan, the built-in preset for its families
    (and GGUF names), else transformers' plan for the model_type when there is one.
    """
    if style == "megatron":
        return style
    from . import hf_plans

    if style == "hf":
        if hf_plans.plan_for(config) is None:
            raise PlanError(
                "--style hf needs a base_model_tp_plan in config.json or a transformers TP plan for model_type "
                f"{config.get('model_type')!r} (or use --style megatron)",
                file="config.json",
            )
        return style
    if config.get("base_model_tp_plan"):
        return "hf"
    model_type = config.get("model_type")
    if model_type in DECODER_TYPES + ENCODER_TYPES or (tensors is not None and _gguf_names(tensors)):
        return "megatron"
    return "hf" if hf_plans.plan_for(config) is not None else "megatron"


def build_shard_info(
    config: Mapping[str, Any],
    tensors: Mapping[str, TensorHeader],
    *,
    style: str = "auto",
    experts: str = "tp",
    vocab_padding: str = DEFAULT_VOCAB_PADDING,
) -> dict[str, Any]:
    """The N-agnostic shard_info document for a model's config and stored tensors (pure; quantized too)."""
    qconfig = _quantization_config(config)
    logical = logical_tensors(tensors, qconfig)
    placements, _ = model_placements(config, logical, style=style, experts=experts)
    placements, _ = pad_vocab(placements, logical, vocab_padding)
    return shard_info_document(placements, tensors, quantization_config=qconfig)


def _quantization_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
    qc = config.get("quantization_config")
    return qc if isinstance(qc, dict) else None


# --- which N work -------------------------------------------------------------------------


def config_problems(config: Mapping[str, Any], placements: Mapping[str, Placement], num_shards: int) -> list[str]:
    """Reasons, in config.json's terms (head and expert counts), that ``num_shards`` cannot work
    (:func:`shardload.models.splits.count_problems`)."""
    return count_problems(ModelDims.lenient(config), placements, num_shards)


def plan_problems(
    document: Mapping[str, Any], tensors: Mapping[str, Any], num_shards: Iterable[int]
) -> dict[int, list[str]]:
    """For each N, every message from planning ``document`` against the stored tensors (pure: headers only)."""
    from ..format.shard_info import ShardInfo
    from ..planning.plan import build_plan
    from ..sources.checkpoint import Checkpoint

    info = ShardInfo.from_dict(dict(document), source="")
    checkpoint = Checkpoint(Path("<model>"), Path("."), "safetensors", dict(tensors))
    return {n: [p.message for p in build_plan(info, checkpoint, n, strict=False).problems] for n in num_shards}


# --- a model directory ------------------------------------------------------------------------


@dataclass
class GeneratedPlan:
    """A generated shard_info with its placements, the N it plans for, and notes for the user."""

    document: dict[str, Any]
    placements: dict[str, Placement]
    supported: list[int]
    style: str
    notes: list[str] = field(default_factory=list)
    stored: int = 0
    source: str = ""
    """What the placements came from, e.g. ``the llama preset`` or ``base_model_tp_plan of config.json``."""

    @property
    def sharded(self) -> int:
        """Number of stored tensors with steps (the rest are replicated)."""
        return len(self.document["params"])

    @property
    def replicated(self) -> int:
        """Number of stored tensors without steps."""
        return self.stored - self.sharded

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the document to ``path`` atomically (temporary file beside it, then rename)."""
        write_atomic(path, self.document)


def generate(
    model: str | os.PathLike[str],
    *,
    style: str = "auto",
    experts: str = "tp",
    num_shards: Sequence[int] = (),
    check_up_to: int = MAX_CHECKED_NUM_SHARDS,
    vocab_padding: str = DEFAULT_VOCAB_PADDING,
    allow_single: bool = False,
) -> GeneratedPlan:
    """Generate the N-agnostic shard_info of a model; raise PlanError if any of ``num_shards`` cannot work.

    ``model`` is a Hugging Face model directory (config.json; dense or quantized) or a GGUF file or
    directory (config from its metadata). The result records every N in 1..``check_up_to`` it plans
    for (also in its description), checked against every stored tensor, quantized companions included.
    A vocabulary that N does not divide is padded with zero rows by ``vocab_padding`` (a key of
    :data:`VOCAB_PADDING`). A plan that works for N=1 alone (of ``check_up_to`` > 1 checked) raises PlanError
    naming why N=2 fails, unless ``allow_single``.
    """
    from ..sources.checkpoint import open_checkpoint, read_config
    from ..sources.gguf import model_config

    for n in num_shards:
        if type(n) is not int or n < 1:
            raise PlanError(f"num_shards must be a positive integer, got {n!r}", file=str(model))
    checkpoint = open_checkpoint(model)
    if checkpoint.kind == "converted":
        raise PlanError("this is a converted directory; plan the source checkpoint instead", file=checkpoint.name)
    gguf = checkpoint.kind == "gguf"
    config_path = str(checkpoint.files[0]) if gguf else str(checkpoint.root / "config.json")
    config = model_config(checkpoint.path) if gguf else read_config(checkpoint.root)
    qconfig = _quantization_config(config)
    tensors = checkpoint.tensors
    try:
        logical = logical_tensors(tensors, qconfig)
        chosen = resolved_style(config, style, logical)
        placements, notes = model_placements(config, logical, style=chosen, experts=experts)
        placements, vocab = pad_vocab(placements, logical, vocab_padding)
        document = shard_info_document(placements, tensors, quantization_config=qconfig)
    except PlanError as err:
        raise _relocated(err, config_path) from None
    for n in num_shards:
        reasons = config_problems(config, placements, n)
        if reasons:
            raise PlanError("; ".join(reasons), file=str(model))
        problems = plan_problems(document, tensors, [n])[n]
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise PlanError(f"num_shards={n}: {problems[0]}{more}{_padding_hint(problems, vocab_padding)}",
                            file=str(model))  # fmt: skip
    checked = plan_problems(document, tensors, range(1, check_up_to + 1))
    supported = [n for n, problems in checked.items() if not problems and not config_problems(config, placements, n)]
    if check_up_to > 1 and supported in ([], [1]) and not allow_single:
        n = 2 if supported else 1
        first = (config_problems(config, placements, n) or checked[n])[0]
        hint = _padding_hint(checked[n], vocab_padding)
        raise PlanError(
            f"the plan works for {'num_shards=1 only' if supported else 'no num_shards'} (num_shards={n}: {first})"
            f"{hint}; pass --allow-single (allow_single=True) to write it anyway",
            file=str(model),
        )
    source = _plan_source(config, config_path) if chosen == "hf" else f"the {config.get('model_type')} preset"
    quantized = [f for n in logical if n.endswith(".weight") and (f := detect_format(n, tensors, qconfig)) != "dense"]
    if quantized:
        formats = ", ".join(sorted(set(quantized)))
        source += f", quantized weights: {formats}"
        notes.append(f"{len(quantized)} quantized weight(s) ({formats}): each stored tensor follows its weight's split")
    padding = _padding_note(document, tensors, supported, vocab, vocab_padding)
    if padding:
        notes.append(padding)
    document = {
        **{k: v for k, v in document.items() if k != "params"},
        "description": (
            f"Generated by `shardload plan` from {source} (experts: {experts}). N-agnostic; plans for "
            f"num_shards {', '.join(map(str, supported))} (checked 1..{check_up_to})."
            + (f" {padding}" if padding else "")
        ),
        "params": document["params"],
    }
    if experts == "parallel" and not any(p.style == "expert" for p in placements.values()):
        notes.append("--experts parallel: no stacked expert tensors found, nothing is expert-parallel")
    unmatched = sum(1 for n in logical if placements[n].style == "replicated" and not placements[n].rule)
    if unmatched:
        notes.append(f"{unmatched} tensor(s) matched no rule and are replicated (norms, routers, buffers, ...)")
    return GeneratedPlan(document, placements, supported, chosen, notes, len(tensors), source)


def _padding_hint(problems: Sequence[str], rule: str) -> str:
    """A pointer to ``--vocab-padding plain`` when a vocabulary split is among ``problems``."""
    if rule == "plain" or not any("pad_dim" in p or "embed" in p or "lm_head" in p for p in problems):
        return ""
    return "; --vocab-padding plain pads a vocabulary to a multiple of N"


def _padding_note(
    document: Mapping[str, Any], tensors: Mapping[str, TensorHeader], supported: Sequence[int], vocab: int | None,
    rule: str,
) -> str:  # fmt: skip
    """One sentence recording the padded vocabulary size for each N it is padded for ("" when none is)."""
    padded = [name for name, steps in document["params"].items() if steps and steps[0][0] == "shard_funcs.pad_dim"]
    if not padded or vocab is None:
        return ""
    multiple = VOCAB_PADDING[rule]

    def size(n: int) -> int:  # shard_funcs.pad_dim's rule, for an N the plan was checked for
        m = n if multiple == "num_shards" else int(multiple or 1)
        return vocab if vocab % n == 0 else -(-vocab // m) * m

    sizes = [(n, size(n)) for n in supported]
    listed = ", ".join(f"{size} rows for N={n}" for n, size in sizes if size != vocab) or "no N listed pads"
    return (
        f"Vocabulary of {vocab} rows ({', '.join(padded)}) padded with zero rows where N does not divide it "
        f"({rule} rule: {listed}); a server masks the logits of rows >= {vocab}."
    )


def _plan_source(config: Mapping[str, Any], config_path: str) -> str:
    """Where the hf style's plan came from, for the description."""
    from .hf_plans import plan_for

    plan = plan_for(config)
    if plan is None or plan.source == "base_model_tp_plan of config.json":
        return f"base_model_tp_plan of {config_path}"
    return f"the TP plan of {plan.source}"


def _relocated(err: PlanError, config_path: str) -> PlanError:
    if err.file in (None, "config.json"):
        err.file = config_path
        err.args = (err.message,)
    return err
