"""The ``shardload`` command line: example, plan, preflight, convert, validate, inspect, verify, quantize, hash.

Bad input prints one line per problem (``file: parameter: step K (function): reason``) and
exits 1; usage errors exit 2; no tracebacks for anything shardload can name.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..engine.convert_targets import BUILT_IN as BUILT_IN_LAYOUT
from ..engine.convert_targets import LayoutTarget, layout_names, layouts
from ..engine.quantize import SCHEMES as QUANT_SCHEMES
from ..errors import ShardloadError, printable
from ..models.choices import DEFAULT_VOCAB_PADDING, EXPERT_MODES, STYLES, VOCAB_PADDING
from ..version import __version__


class ModelArgument(click.ParamType):
    """A MODEL argument: a local path (a Path, as before), or kept as typed when it is an object-store URI
    (``s3://bucket/prefix``) or a Hugging Face Hub id (``org/name[@revision]``) that names no local path."""

    name = "model"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from ..sources.location import model_kind

        if isinstance(value, Path) or model_kind(value) == "local":
            return Path(value)
        return value


MODEL = ModelArgument()


class _LayoutChoice(click.Choice):
    """``convert --layout``'s choices: the built-in layout and every registered target, read when first asked (the
    installed integrations' entry points load then, not when the command line starts)."""

    def __init__(self) -> None:
        super().__init__([BUILT_IN_LAYOUT])

    @property  # type: ignore[override]
    def choices(self) -> tuple[str, ...]:
        return layout_names()

    @choices.setter
    def choices(self, value: Any) -> None:
        pass

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return value if value == BUILT_IN_LAYOUT else super().convert(value, param, ctx)


INSPECT_N = 8
MAX_LISTED_N = 16


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


def _json_requested(args: list[str]) -> bool:
    """Whether the command line asks for ``--json`` (before any ``--``)."""
    return "--json" in (args[: args.index("--")] if "--" in args else args)


def _echo_failure(error: dict[str, Any], exit_code: int) -> None:
    """The ``--json`` document of a command that failed: ``{"ok": false, "exit_code": ..., "error": {...}}``."""
    click.echo(json.dumps({"ok": False, "exit_code": exit_code, "error": error}, indent=2))


class BadArgument(click.ClickException):
    """A usage error shown as one ``error:`` line (a missing file or model), exit 2."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        """Print ``error: MESSAGE`` on stderr."""
        click.echo(printable(f"error: {self.format_message()}"), err=True)


class _Group(click.Group):
    """The command group; with ``--json`` a usage error (from parsing, an option's callback or a command's body)
    prints its JSON document on stdout too, before click prints the usage message and exits 2."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:  # fmt: skip
        given = list(args)
        try:
            ctx = super().make_context(info_name, args, parent, **extra)
        except click.ClickException as err:
            self._report(given, err)
            raise
        ctx.meta["shardload.args"] = given
        return ctx

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as err:
            self._report(ctx.meta.get("shardload.args", []), err)
            raise

    @staticmethod
    def _report(args: list[str], err: click.ClickException) -> None:
        if _json_requested(args):
            kind = "UsageError" if err.exit_code == 2 else type(err).__name__
            _echo_failure({"kind": kind, "message": printable(err.format_message())}, err.exit_code)


class _Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C, so every partial output is removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_STOP_SIGNALS = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated(signum)


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn shardload and OS errors into a one-line message and exit 1 (with ``--json``, a JSON document on stdout
    too); SIGINT, SIGTERM and SIGHUP (Kubernetes, Slurm and ``timeout`` stop a job with SIGTERM) clean up and
    exit 128 + the signal number."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in _STOP_SIGNALS:
                previous[signum] = signal.signal(signum, _terminate)
        as_json = bool(kwargs.get("as_json"))
        try:
            return fn(*args, **kwargs)
        except ShardloadError as err:
            if as_json:
                _echo_failure(err.to_dict(), 1)
            _fail(err.message)
        except BrokenPipeError:  # `| head` closed the pipe: stop quietly, as a command killed by SIGPIPE would
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(128 + 13)
        except OSError as err:
            where = f"{err.filename}: " if err.filename else ""
            message = printable(f"{where}{err.strerror or err}")
            if as_json:
                _echo_failure({"kind": type(err).__name__, "message": message}, 1)
            _fail(message)
        except KeyboardInterrupt:
            click.echo(_stopped("interrupted", kwargs.get("out_dir")), err=True)
            sys.exit(130)
        except _Terminated as err:
            click.echo(_stopped(f"terminated by {signal.Signals(err.signum).name}", kwargs.get("out_dir")), err=True)
            sys.exit(128 + err.signum)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    return wrapper


def _stopped(what: str, out_dir: Path | None) -> str:
    """The line a command stopped by a signal prints: what stopped it and, for one that writes a directory, which
    (its staging directory is removed on the way out; an existing OUT stays as it was)."""
    if out_dir is None:
        return what
    return printable(f"{what}: {out_dir} was not written (the partial output was removed)")


class _ProgressBar:
    """Bytes done, on stderr; the bar first appears at the first update, after planning, so a note printed while
    planning (a plan made from config.json) stands on its own line above it."""

    def __init__(self, label: str, total: Callable[[], int]) -> None:
        self.label, self.total = label, total
        self.bar: Any = None
        self.done = 0

    def __call__(self, done: int, name: str) -> None:
        if self.bar is None:
            self.bar = click.progressbar(length=self.total(), label=self.label, file=sys.stderr, show_pos=False)
            self.bar.__enter__()
        self.bar.update(done - self.done)
        self.done = done

    def __enter__(self) -> _ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


SUMMARY_AFTER = 3
"""``validate`` prints a reason seen for many parameters this many times, then one line counting the rest."""


def summarised(problems: list[dict[str, Any]]) -> list[str]:
    """Problem lines, each reason printed for at most :data:`SUMMARY_AFTER` parameters, then counted."""
    seen: dict[str, int] = {}
    lines = []
    for problem in problems:
        key = f"{problem.get('step')}|{problem.get('function')}|{problem['reason']}|{problem.get('num_shards')}"
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= SUMMARY_AFTER:
            lines.append(problem["message"])
    for key, count in seen.items():
        if count > SUMMARY_AFTER:
            reason = key.split("|", 3)[2]
            lines.append(f"... and {count - SUMMARY_AFTER} more parameters with the same problem ({reason})")
    return lines


def _mesh_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add --mesh, --world-size and --pp-layers to a command."""
    fn = click.option(
        "--pp-layers", help="Decoder layers per pipeline stage, e.g. 10,14 (default: as even as possible)."
    )(fn)
    fn = click.option("--world-size", type=click.IntRange(min=1), help="Number of ranks, to infer a -1 mesh axis.")(fn)
    return click.option("--mesh", help="Device mesh, e.g. pp=2,tp=4 (axes dp, pp, tp; one may be -1).")(fn)


def _mesh_arg(mesh: str | None, world_size: int | None, pp_layers: str | None) -> Any:
    """The Mesh the options describe, or None when --mesh is absent."""
    from ..planning.mesh import Mesh

    if mesh is None:
        if world_size is not None or pp_layers is not None:
            raise click.UsageError("--world-size and --pp-layers need --mesh")
        return None
    return Mesh.parse(mesh, world_size, pp_layers)


def _load_plugins(ctx: click.Context, param: click.Parameter, modules: tuple[str, ...]) -> None:
    """Import the --plugin modules (they register step functions) before the command runs."""
    from .plugins import PluginError, load_plugin

    for module in modules:
        try:
            load_plugin(module)
        except PluginError as err:
            raise click.UsageError(str(err)) from None


_PLUGIN_HELP = (
    "Import MODULE (a dotted name, or a .py file) first, so the step functions it registers can be used; "
    "repeatable. Installed packages register theirs through the 'shardload.steps' entry point group."
)


def _plugin_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add --plugin to a command (also accepted before the command name)."""
    return click.option(
        "--plugin", "plugins", metavar="MODULE", multiple=True, expose_value=False, is_eager=True,
        callback=_load_plugins, help=_PLUGIN_HELP,
    )(fn)  # fmt: skip


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="shardload")
@_plugin_option
def main() -> None:
    """Shard one safetensors checkpoint for any tensor-parallel size, at load time."""
    _show_plan_notes()


class _NoteHandler(logging.Handler):
    """Prints a ``shardload.plan`` record (a plan made from config.json) as one ``note:`` line on stderr, naming
    MODEL as typed (a Hub id, not the snapshot directory it resolved to)."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        ctx = click.get_current_context(silent=True)
        typed = ctx.params.get("model") if ctx is not None else None
        args = record.args if isinstance(record.args, tuple) else ()
        if typed is not None and len(args) == 2 and str(args[0]) != str(typed):  # plan_source's "%s: %s"
            message = f"{typed}: {args[1]}"
        click.echo(printable(f"note: {message}"), err=True)


def _show_plan_notes() -> None:
    """Route the plan-source line the API logs at INFO to stderr, once per process."""
    logger = logging.getLogger("shardload.plan")
    if not any(isinstance(h, _NoteHandler) for h in logger.handlers):
        logger.addHandler(_NoteHandler())
    logger.setLevel(logging.INFO)


@main.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--overwrite", is_flag=True, help="Replace OUT_DIR if it exists.")
@click.option("--multi-file", is_flag=True, help="Split weights over two files with an index.json.")
@_guarded
def example(out_dir: Path, overwrite: bool, multi_file: bool) -> None:
    """Write the built-in example model (a tiny Phi-3: fused QKV with GQA, fused gate_up, float16) to OUT_DIR."""
    from .example import write_example

    out = write_example(out_dir, overwrite=overwrite, multi_file=multi_file)
    click.echo(f"wrote example model to {out}")


@main.command()
@_plugin_option
@click.argument("model", type=MODEL)
@click.option("-n", "--num-shards", type=click.IntRange(min=1), help="Tensor-parallel size N (or give --mesh).")
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), required=True, help="Output directory.")
@click.option("--shard-info", type=click.Path(path_type=Path), help="shard_info.json (default MODEL/shard_info.json).")
@click.option("--overwrite", is_flag=True, help="Replace the output directory if it exists.")
@click.option(
    "--fsync/--no-fsync",
    default=None,
    help="Flush the output to stable storage before it appears (default: only when it replaces an existing one).",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary table.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON (no progress bar).")
@click.option(
    "--layout",
    "layout_name",
    type=_LayoutChoice(),
    default="shardload",
    show_default=True,
    help="shardload: rank files + manifest (load_rank, load_format='shardload'); another: a server's own layout, "
    "from its integration (vllm: vLLM's sharded_state files, served by stock vLLM with load_format='sharded_state').",
)
@click.option(
    "--verify", "verify", is_flag=False, flag_value="record", default=None, metavar="[ROOT]",
    help="Check every byte read against MODEL's integrity record (shardload hash); with ROOT, pin the record too.",
)  # fmt: skip
@click.option(
    "--expert-parallel",
    is_flag=True,
    help="With --layout vllm: each rank's experts whole, for vLLM's enable_expert_parallel=True.",
)
@_mesh_options
@_guarded
def convert(
    model: Path,
    num_shards: int | None,
    out_dir: Path,
    shard_info: Path | None,
    overwrite: bool,
    fsync: bool | None,
    quiet: bool,
    as_json: bool,
    layout_name: str,
    verify: str | None,
    expert_parallel: bool,
    mesh: str | None,
    world_size: int | None,
    pp_layers: str | None,
) -> None:
    """Write MODEL pre-sharded for N ranks: rank-RRRRR-of-NNNNN.safetensors + shard_manifest.json.

    With --mesh pp=P,tp=T there is one file per (stage, tensor rank), holding only that stage's layers.
    With --layout vllm, vLLM's model-rank-R-part-0.safetensors files instead (tensor parallel only).
    """
    from ..engine.convert import convert as run_convert
    from .report import format_table, human_bytes

    if verify not in (None, "record") and not _root_hash(verify):
        raise BadArgument(f"--verify takes a 64-digit root hash from `shardload hash` (or no value: check MODEL's "
                          f"record), got {verify!r}")  # fmt: skip
    if layout_name != BUILT_IN_LAYOUT:
        checked = verify == "record" or verify or False
        _convert_to(layouts()[layout_name], model, num_shards, out_dir, shard_info, overwrite, fsync, quiet, as_json,
                    mesh, checked, expert_parallel)  # fmt: skip
        return
    if expert_parallel:
        raise click.UsageError(_expert_parallel_refusal())
    layout = _mesh_arg(mesh, world_size, pp_layers)
    if layout is None and num_shards is None:
        raise click.UsageError("give --num-shards (or --mesh)")
    options = {"overwrite": overwrite, "mesh": layout, "fsync": fsync, "verify": verify == "record" or verify or False}

    if not quiet and not as_json and sys.stderr.isatty():
        with _ProgressBar("converting", lambda: _source_bytes(model)) as progress:
            result = run_convert(model, num_shards, out_dir, shard_info, progress=progress, **options)
    else:
        result = run_convert(model, num_shards, out_dir, shard_info, **options)
    if as_json:
        doc = {
            "out_dir": str(result.out_dir), "num_shards": result.layout.tp, "mesh": str(result.layout),
            "rank_files": [f.entry() for f in result.rank_files],
            "other_files": [f.entry() for f in result.other_files],
        }  # fmt: skip
        click.echo(json.dumps(doc, indent=2))
        return
    if quiet:
        return
    from ..engine.run import stages_of

    stages = stages_of(result.plan, result.layout)
    rows = []
    for i, f in enumerate(result.rank_files):
        pp, tp = divmod(i, result.layout.tp)
        where = (pp, tp) if len(stages) > 1 else (tp,)
        rows.append((*where, f.path, len(stages[pp].params), human_bytes(f.size), f.size, f.sha256[:16]))
    headers = ["pp", "rank"] if len(stages) > 1 else ["rank"]
    right = tuple(range(len(headers))) + tuple(i + len(headers) for i in (1, 2, 3))
    click.echo(format_table([*headers, "file", "tensors", "size", "bytes", "sha256"], rows, right=right))
    from ..engine.output import MARKER
    from ..format.hash_record import RECORD_NAME
    from ..sources.manifest import MANIFEST_NAME

    copied = [f for f in result.other_files if f.path not in (MARKER, RECORD_NAME, MANIFEST_NAME)]  # not our own
    extra = f" and {len(copied)} copied file(s)" if copied else ""
    click.echo(f"\nwrote {len(result.rank_files)} rank files{extra} to {result.out_dir}")


def _root_hash(text: str) -> bool:
    """Whether ``text`` reads as a root hash (64 hex digits), as load(verify=ROOT) takes it."""
    pin = text.strip().lower()
    return len(pin) == 64 and all(c in "0123456789abcdef" for c in pin)


def _source_bytes(model: Path) -> int:
    """The tensor bytes of MODEL: a progress bar's length."""
    from ..sources.checkpoint import open_checkpoint

    return open_checkpoint(model).nbytes


def _expert_parallel_refusal() -> str:
    """``--expert-parallel`` given with a layout that does not take it: the layouts that do."""
    taking = [name for name, target in sorted(layouts().items()) if target.expert_parallel]
    return (
        f"--expert-parallel goes with --layout {' or '.join(taking)}"
        if taking
        else "no --layout takes --expert-parallel"
    )


def _convert_to(
    target: LayoutTarget,
    model: Path,
    num_shards: int | None,
    out_dir: Path,
    shard_info: Path | None,
    overwrite: bool,
    fsync: bool | None,
    quiet: bool,
    as_json: bool,
    mesh: str | None,
    verify: bool | str = False,
    expert_parallel: bool = False,
) -> None:
    """``convert --layout NAME`` of a registered target (a server's own per-rank files, ``num_shards`` ranks)."""
    from .report import format_table, human_bytes

    if mesh is not None or num_shards is None:
        raise click.UsageError(target.mesh_refusal)
    if expert_parallel and not target.expert_parallel:
        raise click.UsageError(_expert_parallel_refusal())
    files = target.convert(model, num_shards, out_dir, shard_info, overwrite=overwrite, fsync=fsync, verify=verify,
                           expert_parallel=expert_parallel)  # fmt: skip
    if as_json:
        click.echo(json.dumps({"out_dir": str(out_dir), "num_shards": num_shards, "layout": target.name,
                               "rank_files": [f.entry() for f in files]}, indent=2))  # fmt: skip
        return
    if quiet:
        return
    rows = [(r, f.path, human_bytes(f.size), f.size, f.sha256[:16]) for r, f in enumerate(files)]
    click.echo(format_table(["rank", "file", "size", "bytes", "sha256"], rows, right=(0, 2, 3)))
    click.echo(f"\n{target.served(out_dir, num_shards, expert_parallel)}")


@main.command()
@_plugin_option
@click.argument("model", type=MODEL)
@click.option(
    "-o",
    "--out",
    type=click.Path(path_type=Path),
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
@click.option(
    "--vocab-padding",
    type=click.Choice(list(VOCAB_PADDING)),
    default=DEFAULT_VOCAB_PADDING,
    show_default=True,
    help="A vocabulary N does not divide gets zero rows: vllm to a multiple of 64 (vLLM's rows per rank), "
    "plain to a multiple of N, none not at all (such an N fails).",
)
@click.option(
    "--allow-single", is_flag=True, help="Write the file even when it works for num_shards=1 only (else exit 1)."
)
@click.option("--overwrite", is_flag=True, help="Replace the output file if it exists.")
@click.option("-q", "--quiet", is_flag=True, help="No notes and no summary line.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary (with -o -, to stderr).")
@_guarded
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
        target = out if out is not None else Path("-")
        cache = hub_cache_dir() if kind == "hub" else None
        if cache is not None and str(target) != "-" and target.resolve().is_relative_to(cache.resolve()):
            raise ShardloadError("lies inside the Hugging Face cache; write the plan elsewhere", file=str(target))
    else:
        root = model if model.is_dir() else model.parent
        target = out if out is not None else root / "shard_info.json"
    to_stdout = str(target) == "-"
    if not to_stdout and target.exists() and not overwrite:
        raise ShardloadError("exists (pass --overwrite to replace it)", file=str(target))
    result = generate(
        model, style=style, experts=experts, num_shards=num_shards, vocab_padding=vocab_padding,
        allow_single=allow_single,
    )  # fmt: skip
    if to_stdout:
        click.echo(json.dumps(result.document, indent=2))
    else:
        result.save(target)
    if as_json:
        summary_doc = {
            "written": None if to_stdout else str(target), "style": result.style, "experts": experts,
            "sharded": result.sharded, "replicated": result.replicated, "num_shards": list(result.supported),
            "notes": list(result.notes),
        }  # fmt: skip
        click.echo(json.dumps(summary_doc, indent=2), err=to_stdout)
        return
    if quiet:
        return
    for note in result.notes:
        click.echo(printable(f"note: {note}"), err=True)
    ns = ", ".join(map(str, result.supported))
    counts = f"{result.sharded} sharded, {result.replicated} replicated"
    summary = f"{counts} ({result.style}, experts {experts}); num_shards {ns}"
    click.echo(summary if to_stdout else f"wrote {target}: {summary}", err=to_stdout)


@main.command()
@_plugin_option
@click.argument("model", type=MODEL)
@click.option("-n", "--num-shards", "num_shards", type=click.IntRange(min=1), multiple=True,
              help="N to check (repeatable; exit 1 unless each works). Default: the powers of two up to 64 and the "
                   "divisors of the head and expert counts.")  # fmt: skip
@click.option("--style", type=click.Choice(STYLES), default="auto", show_default=True,
              help="Where the plan made from config.json comes from, as for `shardload plan`.")  # fmt: skip
@click.option("--vocab-padding", type=click.Choice(list(VOCAB_PADDING)), default=DEFAULT_VOCAB_PADDING,
              show_default=True, help="How a vocabulary N does not divide is padded (as plan pads it).")  # fmt: skip
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
        click.echo(json.dumps({"ok": ok, "exit_code": 0 if ok else 1, **report.to_dict()}, indent=2))
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


@main.command()
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
        click.echo(json.dumps({**report, "verdict": "pass" if ok else "fail"}, indent=2))
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
            click.echo(f"{shard_info_path}: valid for {what}")
        elif report["valid"]:
            click.echo(f"{shard_info_path}: {len(report['warnings'])} warning(s), which fail --strict", err=True)
    return ok


@main.command()
@_plugin_option
@click.argument("model", type=MODEL)
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), required=True, help="Output directory.")
@click.option("--scheme", type=click.Choice(["int4", *QUANT_SCHEMES]), default="int4", show_default=True,
              help="int4-gG: 4-bit, a scale per G inputs; int4: G chosen from the model (128, 64 or 32, the largest "
                   "that keeps N up to 8); int8 and fp8: a scale per output channel.")  # fmt: skip
@click.option("--shard-info", type=click.Path(path_type=Path), help="shard_info.json (default MODEL/shard_info.json).")
@click.option("--overwrite", is_flag=True, help="Replace the output directory if it exists.")
@_guarded
def quantize(model: Path, out_dir: Path, scheme: str, shard_info: Path | None, overwrite: bool) -> None:
    """Quantize MODEL's linear weights once (compressed-tensors layout) with an N-agnostic shard_info."""
    from ..engine.quantize import INT4_MAX_N, resolve_scheme
    from ..engine.quantize import quantize as run_quantize

    chosen, max_n = resolve_scheme(model, scheme)
    if max_n is not None:
        ns = ", ".join(str(1 << k) for k in range(max_n.bit_length()))
        fewer = "" if max_n == INT4_MAX_N else f" only (none of groups 128, 64, 32 keeps N = {INT4_MAX_N})"
        group = chosen.removeprefix("int4-g")
        line = f"int4: group size {group} chosen from {model}: every quantized input dim splits into whole groups"
        click.echo(printable(f"{line} at N = {ns}{fewer} (--scheme int4-gG picks another)"))
        scheme = chosen
    options = {"shard_info": shard_info, "overwrite": overwrite}
    if sys.stderr.isatty():
        with _ProgressBar("quantizing", lambda: _source_bytes(model)) as progress:
            result = run_quantize(model, out_dir, scheme, progress=progress, **options)
    else:
        result = run_quantize(model, out_dir, scheme, **options)
    fmt = result.scheme.format
    click.echo(f"quantized {len(result.quantized)} weights to {scheme} (compressed-tensors {fmt}) in {result.out_dir}")
    for name, reason in result.skipped.items():
        click.echo(printable(f"  kept {name}: {reason}"))
    if not result.shard_info:
        click.echo(printable(f"no shard_info.json in the source: wrote none ({_plan_hint(result.out_dir)})"))
    else:
        valid = ", ".join(str(n) for n in result.valid_for) or "none"
        click.echo(f"shard_info.json: valid for num_shards {valid} (checked 1..{MAX_LISTED_N})")


def _plan_hint(model: Path) -> str:
    """``shardload plan MODEL makes one`` when it does, else why it cannot (a hint names no command that fails)."""
    from ..models.generated import generate

    try:
        generate(model)  # as `shardload plan` runs it
    except ShardloadError as err:
        return f"and none can be planned: {err.message}"
    return f"shardload plan {model} makes one"


@main.command()
@_plugin_option
@click.argument("model", type=MODEL)
@click.option(
    "-n", "--num-shards", type=click.IntRange(min=1),
    help=f"N (default: the file's N, else {INSPECT_N} when it plans, else the largest N below that does).",
)  # fmt: skip
@click.option("--shard-info", type=click.Path(path_type=Path), help="shard_info.json (default MODEL/shard_info.json).")
@click.option("--json", "as_json", is_flag=True, help="Print rows and totals as JSON.")
@_mesh_options
@_guarded
def inspect(
    model: Path,
    num_shards: int | None,
    shard_info: Path | None,
    as_json: bool,
    mesh: str | None,
    world_size: int | None,
    pp_layers: str | None,
) -> None:
    """Print each parameter's stored and per-rank shape, steps and bytes, with per-rank totals.

    With --mesh, also a row per (pipeline stage, tensor rank): its layers, tensors, bytes held and read.
    """
    from ..models.plan_source import shard_info_for
    from ..planning.plan import build_plan
    from .report import inspect_rows, inspect_text, mesh_rows, mesh_text, totals

    layout = _mesh_arg(mesh, world_size, pp_layers)
    if layout is not None:
        if num_shards is not None and num_shards != layout.tp:
            raise click.UsageError(f"--num-shards disagrees with the mesh's tp={layout.tp}")
        num_shards = layout.tp

    from ..engine.routes import open_boxes
    from ..planning.mesh import Mesh
    from ..sources.source_types import Boxes, PreshardedBoxes, RankFiles, SplitRecords, open_source

    source = open_source(model, layout or (Mesh(tp=num_shards) if num_shards else None))
    if isinstance(source, (RankFiles, Boxes)) and not isinstance(source, SplitRecords):
        refusal = source.refusal("shard_info", None) if shard_info is not None else None
        if refusal is not None:
            raise ShardloadError(refusal, file=str(model))
        boxes = open_boxes(source, False, shard_info)  # planned again over the stored tensors it was made from
        held = "records" if isinstance(source, PreshardedBoxes) else "rank files"
        click.echo(f"note: {source.what} for num_shards={boxes.old.num_shards}: each rank reads its boxes out of "
                   f"those {held}", err=True)  # fmt: skip
        checkpoint, info = boxes.stored, boxes.shard_info
    else:
        checkpoint = source.checkpoint
        info = shard_info_for(checkpoint, shard_info)
    n = num_shards or info.num_shards or _inspect_n(info, checkpoint)
    plan = build_plan(info, checkpoint, n)
    if as_json:
        doc: dict[str, Any] = {"rows": inspect_rows(plan), "totals": totals(plan)}
        if layout is not None:
            doc["mesh"] = {**layout.to_dict(), "ranks": mesh_rows(plan, layout)}
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(inspect_text(plan))
        if layout is not None:
            click.echo("\n" + mesh_text(plan, layout))


def _inspect_n(info: Any, checkpoint: Any) -> int:
    """``inspect``'s N when none is given: :data:`INSPECT_N` when it plans, else the largest N below it that does
    (said on stderr, with why the larger ones fail); :data:`INSPECT_N` again when none does (its error follows)."""
    from ..planning.plan import build_plan

    first = None
    for n in range(INSPECT_N, 0, -1):
        problems = build_plan(info, checkpoint, n, strict=False).problems
        if not problems:
            if n == INSPECT_N:
                click.echo(f"note: no -n given: inspecting num_shards={n}", err=True)
            else:
                click.echo(printable(f"note: no -n given: inspecting num_shards={n}, the largest N up to "
                                     f"{INSPECT_N} this plan works for (num_shards={INSPECT_N}: {first})"),
                           err=True)  # fmt: skip
            return n
        if first is None:
            first = problems[0].message
    return INSPECT_N


@main.command()
@click.argument("out_dir", metavar="OUT", type=click.Path(path_type=Path))
@click.option(
    "--source", "source", type=MODEL, metavar="MODEL",
    help="Also compare OUT's plan with the plan MODEL gives, then every rank with the same rank made from MODEL "
         "(the checkpoint OUT was made from).",
)  # fmt: skip
@click.option("--shard-info", type=click.Path(path_type=Path),
              help="With --source: the shard_info OUT was converted with (default: MODEL's own plan).")  # fmt: skip
@click.option("--root", "root", metavar="HEX",
              help="A source checkpoint: fail unless its record's root hash is HEX (`shardload hash`).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report (exit code as without).")
@_guarded
def verify(out_dir: Path, source: Path | None, shard_info: Path | None, root: str | None, as_json: bool) -> None:
    """Recompute every file's sha256 in converted directory OUT against its manifest; list each mismatch. OUT may
    be a source checkpoint instead: every file is re-hashed against its integrity record (`shardload hash`)."""
    from ..engine.verify import VerifyReport
    from ..engine.verify_dir import verify_dir
    from ..sources.manifest import MANIFEST_NAME
    from .report import human_bytes

    if shard_info is not None and source is None:
        raise click.UsageError("--shard-info goes with --source")
    converted = source is not None or (out_dir / MANIFEST_NAME).is_file()
    if root is not None and converted:
        raise click.UsageError("--root goes with a source checkpoint's integrity record, not a converted directory")
    if not converted:
        _verify_source(out_dir, root, as_json)
        return
    refused: ShardloadError | None = None
    try:
        report = verify_dir(out_dir, source=source, shard_info=shard_info)
    except ShardloadError as err:
        if not as_json:
            raise
        refused, report = err, VerifyReport(out_dir, 0, problems=[err])
    if as_json:
        doc = {
            "out_dir": str(out_dir), "source": None if source is None else str(source), "ok": report.ok,
            "num_shards": report.num_shards, "files": report.files, "bytes": report.nbytes,
            "problems": [p.to_dict() for p in report.problems],
        }  # fmt: skip
        if refused is not None:  # the directory could not be checked at all: also the failure document's fields
            doc |= {"exit_code": 1, "error": refused.to_dict()}
            click.echo(printable(f"error: {refused.message}"), err=True)
        click.echo(json.dumps(doc, indent=2))
        sys.exit(0 if report.ok else 1)
    for problem in report.problems:
        click.echo(problem.message)
    if not report.ok:
        click.echo(f"{out_dir}: {len(report.problems)} problem(s) in {report.files} listed files", err=True)
        sys.exit(1)
    against = f"; every rank equals {source}'s" if source is not None else ""
    click.echo(
        f"{out_dir}: {report.files} files ({human_bytes(report.nbytes)}) match shard_manifest.json "
        f"(num_shards={report.num_shards}){against}"
    )


def _verify_source(model: Path, root: str | None, as_json: bool) -> None:
    """``shardload verify MODEL`` on a source checkpoint: one line per problem, exit 1 when there is any."""
    from ..engine.verify_source import SourceReport, verify_source
    from .report import human_bytes

    refused: ShardloadError | None = None
    try:
        report = verify_source(model, root, progress=not as_json)
    except ShardloadError as err:
        if not as_json:
            raise
        refused, report = err, SourceReport(model, None, "", problems=[err])
    if as_json:
        doc = {
            "model": str(model), "record": None if report.record is None else str(report.record),
            "root": report.root or None, "ok": report.ok, "files": report.files, "bytes": report.nbytes,
            "problems": [p.to_dict() for p in report.problems],
        }  # fmt: skip
        if refused is not None:
            doc |= {"exit_code": 1, "error": refused.to_dict()}
            click.echo(printable(f"error: {refused.message}"), err=True)
        click.echo(json.dumps(doc, indent=2))
        sys.exit(0 if report.ok else 1)
    for problem in report.problems:
        click.echo(printable(problem.message))
    if not report.ok:
        click.echo(f"{model}: {len(report.problems)} problem(s) against {report.record}", err=True)
        sys.exit(1)
    click.echo(
        f"{model}: {report.files} files ({human_bytes(report.nbytes)}) match {report.record} (root {report.root})"
    )


@main.command(name="hash")
@click.argument("model", type=MODEL)
@click.option("-o", "--out", type=click.Path(path_type=Path), help="Write the record here (default: beside MODEL).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar; print only the root hash.")
@_guarded
def hash_command(model: Path, out: Path | None, quiet: bool) -> None:
    """Write MODEL's integrity record (shardload.hashes) and print its root hash, for load(verify=ROOT)."""
    from ..engine.hashing import hash_model
    from .report import human_bytes

    result = hash_model(model, out, progress=not quiet)
    if quiet:
        click.echo(result.root)
        return
    click.echo(
        f"{result.path}: {human_bytes(result.checkpoint_bytes)} hashed, record {human_bytes(result.record_bytes)}"
    )
    click.echo(f"root {result.root}")
