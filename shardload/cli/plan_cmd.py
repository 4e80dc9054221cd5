"""``shardload plan``, ``preflight`` and ``validate``: a shard_info made, the N a model allows, a shard_info checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ..errors import ShardloadError, printable
from ..models.choices import EXPERT_MODES, STYLES, VOCAB_PADDING
from .common import (
    MAX_LISTED_N,
    MODEL,
    OUT,
    BadArgument,
    _echo_json,
    _guarded,
    _mesh_arg,
    _mesh_options,
    _plugin_option,
    json_on_stderr_when,
    summarised,
    written,
)

PADDING_CHOICES = {"vllm": "server", **{rule: rule for rule in VOCAB_PADDING if rule != "server"}}
"""``--vocab-padding``'s values, as users know them (``vllm``: the servers' multiple of 64), -> the models' rules."""


def _padding_rule(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """``--vocab-padding``'s value as the models' rule."""
    return PADDING_CHOICES[value]


def _vocab_padding_option(text: str) -> Any:
    """``--vocab-padding`` (as users know its values; the models' rule reaches the command), with its help."""
    return click.option("--vocab-padding", type=click.Choice(list(PADDING_CHOICES)), default="vllm",
                        show_default=True, callback=_padding_rule, help=text)  # fmt: skip


STDOUT = "-"
"""``-o -``: the plan goes to stdout."""


def _plan_to_stdout(model: Any, out: Path | None) -> bool:
    """Whether ``plan`` writes its file to stdout: ``-o -``, or no ``-o`` for a Hub id or an object-store model."""
    from ..sources.location import model_kind

    if out is not None:
        return str(out) == STDOUT
    return model is not None and model_kind(model) != "local"


@click.command()
@_plugin_option
@click.argument("model", type=MODEL)
@click.option(
    "-o",
    "--out",
    type=OUT,
    help="Output file (default MODEL/shard_info.json, or stdout for a Hub id or an s3:// model; - for stdout).",
)
@click.option(
    "--style",
    type=click.Choice(STYLES),
    default="auto",
    show_default=True,
    help="hf: transformers' TP plan (config.json's, else shardload's table, else the installed transformers'); "
    "megatron: built-in preset; auto: config.json's plan, else the preset, else transformers' plan.",
)
@click.option(
    "--experts",
    type=click.Choice(EXPERT_MODES),
    default="tp",
    show_default=True,
    help="MoE experts: tp splits inside each expert; parallel puts whole experts on ranks.",
)
@click.option(
    "-n",
    "--num-shards",
    "num_shards",
    type=click.IntRange(min=1),
    multiple=True,
    help="Fail, writing nothing, unless the plan works for N (repeatable).",
)
@_vocab_padding_option(
    "A vocabulary N does not divide gets zero rows: vllm to a multiple of 64 (vLLM's rows per rank), plain to a "
    "multiple of N, none not at all (such an N fails)."
)
@click.option(
    "--allow-single", is_flag=True, help="Write the file even when it works for num_shards=1 only (else exit 1)."
)
@click.option("--overwrite", is_flag=True, help="Replace the output file if it exists.")
@click.option("-q", "--quiet", is_flag=True, help="No notes and no summary line.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary (with -o -, to stderr).")
@_guarded
@json_on_stderr_when(lambda kwargs: _plan_to_stdout(kwargs.get("model"), kwargs.get("out")))
def plan(
    model: Path,
    out: Path | None,
    style: str,
    experts: str,
    num_shards: tuple[int, ...],
    vocab_padding: str,
    allow_single: bool,
    overwrite: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Write an N-agnostic shard_info.json for MODEL (dense, quantized or GGUF) from its config and tensor names."""
    from ..models.generated import generate
    from ..sources.location import hub_cache_dir, model_kind

    kind = model_kind(model)
    if kind != "local":  # never written into the Hub cache or a bucket: to -o, else to stdout
        target = out if out is not None else Path(STDOUT)
        cache = hub_cache_dir() if kind == "hub" else None
        if cache is not None and str(target) != STDOUT and target.resolve().is_relative_to(cache.resolve()):
            raise ShardloadError("lies inside the Hugging Face cache; write the plan elsewhere", file=str(target))
    else:
        root = model if model.is_dir() else model.parent
        target = out if out is not None else root / "shard_info.json"
    to_stdout = _plan_to_stdout(model, out)
    if not to_stdout:
        _check_plan_target(target, overwrite)
    result = generate(
        model, style=style, experts=experts, num_shards=num_shards, vocab_padding=vocab_padding,
        allow_single=allow_single,
    )  # fmt: skip
    if to_stdout:
        click.echo(json.dumps(result.document, indent=2))
    else:
        try:
            result.save(target)
        except OSError as err:
            raise ShardloadError(f"cannot write the plan: {err.strerror or err}", file=str(target)) from None
        written(target)
    if as_json:
        summary_doc = {
            "written": None if to_stdout else str(target), "style": result.style, "experts": experts,
            "sharded": result.sharded, "replicated": result.replicated, "num_shards": list(result.supported),
            "notes": list(result.notes),
        }  # fmt: skip
        _echo_json(summary_doc, err=to_stdout)
        return
    if quiet:
        return
    for note in result.notes:
        click.echo(printable(f"note: {note}"), err=True)
    ns = ", ".join(map(str, result.supported))
    counts = f"{result.sharded} sharded, {result.replicated} replicated"
    summary = f"{counts} ({result.style}, experts {experts}); num_shards {ns}"
    click.echo(summary if to_stdout else f"wrote {target}: {summary}", err=to_stdout)


def _check_plan_target(target: Path, overwrite: bool) -> None:
    """Refuse a plan's output path that cannot take it, or whose file it would destroy: a folder, a missing parent,
    an existing file without ``--overwrite``, and with it any file that is not a shard_info (a model's weights or
    config.json named by mistake); an empty file is no loss."""
    from ..format.shard_info import MAX_FILE_BYTES

    if not target.parent.is_dir():
        raise ShardloadError(f"cannot write the plan: there is no folder {target.parent}", file=str(target))
    if not (target.exists() or target.is_symlink()):
        return
    if not target.is_file():
        raise ShardloadError("is not a regular file: the plan is written to a new path, or over a shard_info file",
                             file=str(target))  # fmt: skip
    if not overwrite:
        raise ShardloadError("exists (pass --overwrite to replace it)", file=str(target))
    try:
        with open(target, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
        document = json.loads(data) if data.strip() else {"params": {}}
    except (OSError, ValueError):
        document = None
    seed_form = isinstance(document, dict) and all(isinstance(v, list) for v in document.values())
    if not (seed_form or (isinstance(document, dict) and isinstance(document.get("params"), dict))):
        raise ShardloadError("exists and is not a shard_info file (writing the plan there would replace it): give a "
                             "new path, or the path of a shard_info file to replace", file=str(target))  # fmt: skip


@click.command()
@_plugin_option
@click.argument("model", type=MODEL)
@click.option("-n", "--num-shards", "num_shards", type=click.IntRange(min=1), multiple=True,
              help="N to check (repeatable; exit 1 unless each works). Default: the powers of two up to 64 and the "
                   "divisors of the head and expert counts.")  # fmt: skip
@click.option("--style", type=click.Choice(STYLES), default="auto", show_default=True,
              help="Where the plan made from config.json comes from, as for `shardload plan`.")  # fmt: skip
@_vocab_padding_option("How a vocabulary N does not divide is padded (as plan pads it).")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report (always JSON, errors too).")
@_guarded
def preflight(model: Path, num_shards: tuple[int, ...], style: str, vocab_padding: str, as_json: bool) -> None:
    """Which tensor-parallel sizes N (and expert splits) MODEL allows, before downloading any weight.

    Reads config.json, the index and each safetensors header only (a Hub id from the local cache, else over HTTP by
    range requests; an s3:// model by range requests), prints each N with the first reason it is refused, and the
    bytes it read.
    """
    from ..models.preflight import preflight as run_preflight
    from .report import human_bytes

    report = run_preflight(model, num_shards, style=style, vocab_padding=vocab_padding)
    ok = all(report.works(n) for n in num_shards) if num_shards else any(report.works(n) for n in report.checked)
    if as_json:
        _echo_json(report.to_dict(), ok)
        sys.exit(0 if ok else 1)
    doc = report.to_dict()
    counts = [f"{k}={doc[k]}" for k in ("num_attention_heads", "num_key_value_heads", "num_experts") if doc[k]]
    what = f"{doc['model_type'] or 'no model_type'}, {', '.join(counts)}" if counts else doc["model_type"] or "?"
    click.echo(printable(f"{model}: {what}; planned with {report.plan_source}"))
    files = ", ".join(f"{report.name(p)} {human_bytes(b)}" + (f" in {c} reads" if c > 1 else "")
                      for p, (c, b) in report.per_file().items())  # fmt: skip
    tensors, past = human_bytes(report.checkpoint_bytes), report.tensor_bytes_read
    data = f"{human_bytes(past)} of the {tensors}" if past else f"none of the {tensors}"
    click.echo(printable(f"read {human_bytes(report.fetched)} ({files}): {data} of tensor data"))
    for check in report.checks:
        if check.experts in report.refused:
            continue
        where = f"tp={check.num_shards}" if check.experts is None else (
            f"tp={check.num_shards} ep={check.ep} (experts {check.experts})")  # fmt: skip
        if check.ok:
            kv = f" (each KV head on {check.kv_replicas} ranks)" if check.kv_replicas > 1 else ""
            click.echo(f"{where}: ok{kv}")
        else:
            more = f" (and {len(check.reasons) - 1} more)" if len(check.reasons) > 1 else ""
            click.echo(printable(f"{where}: refused: {check.reasons[0]}{more}"))
    checked = ", ".join(map(str, report.checked))
    for mode in report.modes:
        label = (
            "" if mode is None else (" with experts tp (ep=1)" if mode == "tp" else " with experts parallel (ep=tp)")
        )
        allowed = ", ".join(map(str, report.allowed(mode))) or "none"
        why = f": refused for every N: {report.refused[mode]}" if mode in report.refused else ""
        click.echo(printable(f"allowed{label}: tp {allowed} (checked {checked}){why}"))
    sys.exit(0 if ok else 1)


@click.command()
@_plugin_option
@click.argument("shard_info_paths", metavar="SHARD_INFO...", type=click.Path(path_type=Path), nargs=-1, required=True)
@click.option("--model", type=MODEL, help="Check against this checkpoint's tensors.")
@click.option("-n", "--num-shards", "num_shards", type=click.IntRange(min=1), multiple=True,
              help="N to check (repeatable). Default: the file's N, else the N it records it plans for "
                   "(shardload plan writes them), else 1, 2, 4, 8.")  # fmt: skip
@click.option("--list-valid-n", is_flag=True,
              help=f"Check every N in 1..{MAX_LISTED_N} (or the -n values), print each failing N's first problem "
                   "and the N that work; exit 0 when some N works.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report.")
@click.option("--strict", is_flag=True, help="Fail on warnings too (with --model: placements that cannot compute).")
@_mesh_options
@_guarded
def validate(
    shard_info_paths: tuple[Path, ...],
    model: Path | None,
    num_shards: tuple[int, ...],
    list_valid_n: bool,
    as_json: bool,
    strict: bool,
    mesh: str | None,
    world_size: int | None,
    pp_layers: str | None,
) -> None:
    """Check each SHARD_INFO against the schema, then plan it for each N and report every problem.

    With --mesh the N is the mesh's tp, and (with --model) the pipeline stages are checked too. Several files (as a
    pre-commit hook passes them) are checked one after the other; the exit code is 1 when any fails.
    """
    layout = _mesh_arg(mesh, world_size, pp_layers)
    if layout is not None and (list_valid_n or (num_shards and set(num_shards) != {layout.tp})):
        raise click.UsageError(f"--mesh fixes N to its tp={layout.tp}: drop --num-shards / --list-valid-n")
    ns = list(num_shards) or (list(range(1, MAX_LISTED_N + 1)) if list_valid_n else None)
    if as_json and len(shard_info_paths) > 1:
        raise click.UsageError("--json reports on one SHARD_INFO: give one file (or run validate once per file)")
    for shard_info_path in shard_info_paths:
        if not (shard_info_path.exists() or shard_info_path.is_symlink()) or shard_info_path.is_dir():
            what = "is a directory: give the shard_info.json file" if shard_info_path.is_dir() else "no such file"
            raise BadArgument(f"{shard_info_path}: {what} (and the model with --model)")
    if isinstance(model, Path) and not (model.exists() or model.is_symlink()):
        raise BadArgument(f"{model}: no such file or directory")
    results = [_validate_one(path, model, ns, layout, list_valid_n, as_json, strict) for path in shard_info_paths]
    sys.exit(0 if all(results) else 1)


def _validate_one(
    shard_info_path: Path, model: Path | None, ns: list[int] | None, layout: Any, list_valid_n: bool, as_json: bool,
    strict: bool,
) -> bool:  # fmt: skip
    """``validate`` of one file: print its report; whether it passes."""
    from ..planning.validate import validate_file

    report = validate_file(shard_info_path, model, ns, mesh=layout)
    ok = bool(report["valid_for"]) if list_valid_n else report["valid"]
    ok = ok and not (strict and report["warnings"])
    if as_json:
        _echo_json({**report, "verdict": "pass" if ok else "fail"}, ok)
    elif list_valid_n:
        for problem in report["problems"]:
            if "num_shards" not in problem:  # the file itself is bad: no N was planned
                click.echo(problem["message"])
        for n in report["num_shards_checked"]:
            found = [p for p in report["problems"] if n in p.get("num_shards", ())]
            if found:
                more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
                click.echo(f"num_shards={n}: {found[0]['message'].rsplit(' [num_shards=', 1)[0]}{more}")
        valid = ", ".join(str(n) for n in report["valid_for"]) or "none"
        click.echo(f"{shard_info_path}: valid for num_shards {valid}")
    else:
        for line in summarised(report["problems"]):
            click.echo(line)
        for line in summarised(report["warnings"]):
            click.echo(f"warning: {line}" if not line.startswith("... and") else line, err=True)
        if report["valid"] and ok:
            checked = ", ".join(str(n) for n in report["num_shards_checked"])
            what = f"mesh {layout}" if layout is not None else f"num_shards {checked}"
            if report["checked_against"] == "declarations":  # no tensors, no record of the N it plans for
                what += (" (its declarations only: the file records no N it plans for, and --model checks each "
                         "parameter's first step against the checkpoint's tensors)")  # fmt: skip
            click.echo(f"{shard_info_path}: valid for {what}")
        elif report["valid"]:
            click.echo(f"{shard_info_path}: {len(report['warnings'])} warning(s), which fail --strict", err=True)
    return ok
