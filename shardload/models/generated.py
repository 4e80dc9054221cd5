"""The generated shard_info (``shardload plan``): a model's placements rendered as one N-agnostic document.

Placements come from the family presets (:mod:`shardload.models.presets`) or from transformers' TP tables
(:mod:`shardload.models.hf_tp_tables`), made on the model's *logical* tensors (a quantized module is seen as its
logical weight, :func:`shardload.models.stored_layouts.logical_tensors`); vocabulary splits are padded
(:mod:`shardload.models.vocab_padding`); :func:`shard_info_document` writes steps for every stored tensor through
:func:`shardload.models.stored_layouts.companion_steps`. :func:`generate` does all of it for a model directory and
checks which N the result serves.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, PlanError, ShardloadError
from ..format.shard_info import plans_for_text
from ..format.strictjson import write_atomic
from .choices import DEFAULT_VOCAB_PADDING, EXPERT_MODES, STYLES
from .families import family_for, gguf_model_type
from .placement import Placement, TensorHeader
from .presets import gguf_names, preset_placements
from .splits import ModelDims, count_problems
from .stored_layouts import companion_steps, detect_format, logical_tensors
from .vocab_padding import pad_vocab, padding_hint, padding_note

if TYPE_CHECKING:
    from ..sources.checkpoint import Checkpoint

__all__ = [
    "GeneratedShardInfo",
    "build_shard_info",
    "config_problems",
    "generate",
    "model_placements",
    "num_shards_problems",
    "plan_problems",
    "resolved_style",
    "shard_info_document",
]

MAX_CHECKED_NUM_SHARDS = 64
SCHEMA_URL = "https://shardload.dev/shard_info.schema.json"


def shard_info_document(
    placements: Mapping[str, Placement],
    tensors: Mapping[str, TensorHeader],
    *,
    quantization_config: Mapping[str, Any] | None = None,
    description: str | None = None,
) -> dict[str, Any]:
    """The N-agnostic document-form shard_info: steps for every stored tensor in ``tensors`` that ``placements`` split.

    ``placements`` are keyed by logical tensor (a quantized module's ``P.weight``); each one's steps
    come from :func:`shardload.models.stored_layouts.companion_steps`, for the tensor itself or for every
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
    if style not in STYLES:
        raise PlanError(f"style must be one of {', '.join(STYLES)}, got {style!r}")
    if experts not in EXPERT_MODES:
        raise PlanError(f"experts must be one of {', '.join(EXPERT_MODES)}, got {experts!r}")
    if resolved_style(config, style, tensors) == "hf":
        from . import hf_tp_tables

        return hf_tp_tables.hf_placements(config, tensors, experts=experts)
    return preset_placements(config, tensors, experts=experts), []


def resolved_style(config: Mapping[str, Any], style: str, tensors: Mapping[str, TensorHeader] | None = None) -> str:
    """``"hf"`` or ``"megatron"``: what ``style`` means for this config.

    ``auto`` picks hf when config.json has its own base_model_tp_plan, the built-in preset for its families
    (and GGUF names), else transformers' plan for the model_type when there is one.
    """
    if style == "megatron":
        return style
    from . import hf_tp_tables

    if style == "hf":
        if hf_tp_tables.tp_table_for(config) is None:
            raise PlanError(
                "--style hf needs a base_model_tp_plan in config.json or a transformers TP plan for model_type "
                f"{config.get('model_type')!r} (or use --style megatron)",
                file="config.json",
            )
        return style
    if config.get("base_model_tp_plan"):
        return "hf"
    model_type = config.get("model_type")
    if family_for(model_type) is not None or (tensors is not None and gguf_names(tensors)):
        return "megatron"
    return "hf" if hf_tp_tables.tp_table_for(config) is not None else "megatron"


def build_shard_info(
    config: Mapping[str, Any],
    tensors: Mapping[str, TensorHeader],
    *,
    style: str = "auto",
    experts: str = "tp",
    vocab_padding: str = DEFAULT_VOCAB_PADDING,
) -> dict[str, Any]:
    """The N-agnostic shard_info document for a model's config and stored tensors (pure; quantized too)."""
    qconfig = _planned_quantization(config, tensors)
    logical = logical_tensors(tensors, qconfig)
    placements, _ = model_placements(config, logical, style=style, experts=experts)
    placements, _ = pad_vocab(placements, logical, vocab_padding)
    return shard_info_document(placements, tensors, quantization_config=qconfig)


UNPLANNED_METHODS = ("bitsandbytes", "hqq", "aqlm", "quanto", "eetq", "spqr", "vptq", "higgs", "torchao", "bitnet",
                     "mxfp4", "fp-quant")  # fmt: skip
"""``quant_method`` values whose tensors no plan splits with their weights (bitsandbytes' per-row ``SCB`` scales and
``weight_format``, codebooks, packed blocks such as GPT-OSS's MXFP4 ``*_blocks``/``*_scales`` beside bf16 biases the
plan would split): refused rather than planned as dense weights. Any other method plans
by the names of its stored tensors (:mod:`.stored_layouts`: ``fbgemm_fp8`` and ModelOpt FP8 as scaled weights)."""
UNPLANNED_COMPANIONS = ("SCB", "weight_format", "absmax", "quant_map", "nested_absmax", "nested_quant_map")
"""Tensor names (last part) of bitsandbytes' companions, refused whatever config.json says (as are MXFP4's
``*_blocks`` beside their ``*_scales``)."""


def _planned_quantization(config: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any] | None:
    """config.json's quantization_config, for a quantization a plan splits: one of :data:`UNPLANNED_METHODS`, or a
    stored tensor of :data:`UNPLANNED_COMPANIONS` whatever config.json says, is refused (those tensors beside each
    weight would be taken for whole tensors and stay unsplit on every rank)."""
    qc = config.get("quantization_config")
    qc = qc if isinstance(qc, dict) else None
    given = (qc or {}).get("quant_method", "")
    method = str(given).lower().replace("_", "-")
    if method in UNPLANNED_METHODS:
        raise PlanError(
            f"quant_method {given!r} is not one a plan is made for: its tensors beside each weight would not be "
            "split with it; dequantize the model, or write its shard_info.json"
        )
    _no_unplanned_companions(tensors)  # the method said first, where config.json names it
    return qc


def _no_unplanned_companions(tensors: Mapping[str, Any]) -> None:
    """Refuse stored tensors of a quantization no plan splits (:data:`UNPLANNED_COMPANIONS`)."""
    for name in tensors:
        last = name.rsplit(".", 1)[-1]
        if last in UNPLANNED_COMPANIONS or ".quant_state." in name:
            raise PlanError(
                f"is a bitsandbytes companion ({last}) no plan splits with its weight; dequantize the model, or "
                "write its shard_info.json",
                param=name,
            )
        if last.endswith("_blocks") and f"{name.removesuffix('_blocks')}_scales" in tensors:
            raise PlanError(
                "is an MXFP4 weight (packed blocks beside their _scales, as GPT-OSS ships its experts) no plan "
                "splits; dequantize the model, or write its shard_info.json",
                param=name,
            )


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


def num_shards_problems(
    config: Mapping[str, Any],
    placements: Mapping[str, Placement],
    document: Mapping[str, Any],
    tensors: Mapping[str, Any],
    num_shards: Iterable[int],
    *,
    every: bool = True,
) -> dict[int, list[str]]:
    """For each N, why a generated plan cannot serve it: the reasons in config.json's terms
    (:func:`config_problems`) first, then every problem of planning ``document`` against the stored tensors
    (:func:`plan_problems`); empty for an N it serves. What :func:`generate` records as the N a plan serves, and
    ``shardload preflight`` reports (pure: config and headers only). Without ``every``, an N config.json already
    refuses is not planned (a whole plan per N: most of the 64 N a model of 8 heads is checked for)."""
    ns = list(num_shards)
    refused = {n: config_problems(config, placements, n) for n in ns}
    planned = plan_problems(document, tensors, [n for n in ns if every or not refused[n]])
    return {n: refused[n] + planned.get(n, []) for n in ns}


@dataclass
class GeneratedShardInfo:
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
    model: str | os.PathLike[str] | Checkpoint,
    *,
    style: str = "auto",
    experts: str = "tp",
    num_shards: Sequence[int] = (),
    check_up_to: int = MAX_CHECKED_NUM_SHARDS,
    vocab_padding: str = DEFAULT_VOCAB_PADDING,
    allow_single: bool = False,
    config: dict[str, Any] | None = None,
) -> GeneratedShardInfo:
    """Generate the N-agnostic shard_info of a model; raise PlanError if any of ``num_shards`` cannot work.

    ``model`` is a Hugging Face model directory (config.json; dense or quantized) or a GGUF file or
    directory (config from its metadata), or such a checkpoint already opened (headers only). The result
    records every N in 1..``check_up_to`` it plans for (also in its description), checked against every
    stored tensor, quantized companions included.
    A vocabulary that N does not divide is padded with zero rows by ``vocab_padding`` (a key of
    :data:`VOCAB_PADDING`). A plan that works for N=1 alone (of ``check_up_to`` > 1 checked) raises PlanError
    naming why N=2 fails, unless ``allow_single``. ``config``: the model config, already read from ``model``
    (None: read here).
    """
    from ..sources.checkpoint import Checkpoint, open_checkpoint
    from ..sources.source_types import open_source

    opened = model if isinstance(model, Checkpoint) else None
    model = opened.path if opened is not None else model
    for n in num_shards:
        if type(n) is not int or n < 1:
            raise PlanError(f"num_shards must be a positive integer, got {n!r}", file=str(model))
    source = open_source(opened if opened is not None else open_checkpoint(model))
    if source.derived:
        raise PlanError(f"this is {source.what}; plan the source checkpoint instead", file=source.name)
    checkpoint = source.checkpoint
    config_path = str(checkpoint.config_file())
    config = dict(checkpoint.model_config() if config is None else config)
    fmt = checkpoint.source_format
    if fmt is not None and fmt.gguf_model_type:
        config["model_type"] = gguf_model_type(str(config["model_type"]))
    tensors = checkpoint.tensors
    try:
        qconfig = _planned_quantization(config, tensors)
        logical = logical_tensors(tensors, qconfig)
        chosen = resolved_style(config, style, logical)
        placements, notes = model_placements(config, logical, style=chosen, experts=experts)
        placements, vocab = pad_vocab(placements, logical, vocab_padding)
        document = shard_info_document(placements, tensors, quantization_config=qconfig)
    except (PlanError, CheckpointError) as err:  # a value of config.json: located at its path
        raise _relocated(err, config_path) from None
    for n in num_shards:
        reasons = config_problems(config, placements, n)
        if reasons:
            raise PlanError("; ".join(reasons), file=str(model))
        problems = plan_problems(document, tensors, [n])[n]
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise PlanError(f"num_shards={n}: {problems[0]}{more}{padding_hint(problems, vocab_padding)}",
                            file=str(model))  # fmt: skip
    checked = num_shards_problems(config, placements, document, tensors, range(1, check_up_to + 1), every=False)
    supported = [n for n, problems in checked.items() if not problems]
    if check_up_to > 1 and supported in ([], [1]) and not allow_single:
        n = 2 if supported else 1
        first = checked[n][0]
        hint = padding_hint(checked[n], vocab_padding)
        raise PlanError(
            f"the plan works for {'num_shards=1 only' if supported else 'no num_shards'} (num_shards={n}: {first})"
            f"{hint}; pass --allow-single (allow_single=True) to write it anyway",
            file=str(model),
        )
    source = _tp_table_source(config, config_path) if chosen == "hf" else f"the {config.get('model_type')} preset"
    if chosen == "hf":
        notes.extend(_imported_note(config))
    quantized = [f for n in logical if n.endswith(".weight") and (f := detect_format(n, tensors, qconfig)) != "dense"]
    if quantized:
        formats = ", ".join(sorted(set(quantized)))
        source += f", quantized weights: {formats}"
        notes.append(f"{len(quantized)} quantized weight(s) ({formats}): each stored tensor follows its weight's split")
    padding = padding_note(document, tensors, supported, vocab, vocab_padding)
    if padding:
        notes.append(padding)
    document = {
        **{k: v for k, v in document.items() if k != "params"},
        "description": (
            f"Generated by `shardload plan` from {source} (experts: {experts}). N-agnostic; "
            f"{plans_for_text(supported, check_up_to)}." + (f" {padding}" if padding else "")
        ),
        "params": document["params"],
    }
    if experts == "parallel" and not any(p.style == "expert" for p in placements.values()):
        notes.append("--experts parallel: no stacked expert tensors found, nothing is expert-parallel")
    unmatched = sum(1 for n in logical if placements[n].style == "replicated" and not placements[n].rule)
    if unmatched:
        notes.append(f"{unmatched} tensor(s) matched no rule and are replicated (norms, routers, buffers, ...)")
    return GeneratedShardInfo(document, placements, supported, chosen, notes, len(tensors), source)


def _tp_table_source(config: Mapping[str, Any], config_path: str) -> str:
    """Where the hf style's plan came from, for the description."""
    from .hf_tp_tables import tp_table_for

    plan = tp_table_for(config)
    if plan is None or plan.source == "base_model_tp_plan of config.json":
        return f"base_model_tp_plan of {config_path}"
    return f"the TP plan of {plan.source}"


def _imported_note(config: Mapping[str, Any]) -> list[str]:
    """A note when the hf plan was read from the installed transformers (a type the shipped table lacks)."""
    from .hf_tp_tables import shipped_table, tp_table_for

    plan = tp_table_for(config)
    if plan is None or not plan.imported:
        return []
    table = shipped_table()["transformers"]
    return [f"model_type {plan.model_type!r} is not in shardload's table of transformers {table}: its TP plan was "
            "imported from the installed transformers"]  # fmt: skip


def _relocated(err: ShardloadError, config_path: str) -> ShardloadError:
    if err.file in (None, "config.json"):
        err.file = config_path
        err.args = (err.message,)
    return err
