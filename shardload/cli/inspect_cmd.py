"""``shardload inspect``, ``verify`` and ``hash``: a plan or converted directory shown, outputs and sources checked,
integrity records made."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from ..errors import ShardloadError, printable
from ..format.hash_record import is_root_hash
from .common import (
    MODEL,
    BadArgument,
    OutputPath,
    _echo_json,
    _guarded,
    _mesh_arg,
    _mesh_options,
    _plugin_option,
    _ProgressBar,
    written,
)

INSPECT_N = 8


@click.command()
@_plugin_option
@click.argument("model", type=MODEL)
@click.option(
    "-n", "--num-shards", type=click.IntRange(min=1),
    help=f"N (default: the file's N; a converted directory's or pre-sharded cache's own N; else {INSPECT_N} when it "
         "plans, else the largest N below that does).",
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

    layout = _mesh_arg(mesh, world_size, pp_layers, num_shards)
    if layout is not None:
        num_shards = layout.tp

    from ..engine.load import own_layers
    from ..engine.routes import open_boxes, records_plan
    from ..planning.mesh import Mesh
    from ..sources.source_types import Boxes, PreshardedBoxes, RankFiles, SplitRecords, check_options, open_source

    source = open_source(model, layout or (Mesh(tp=num_shards) if num_shards else None))
    own = None
    if layout is not None:
        layout = own_layers(source, layout)  # a converted directory's own stages, as a load of it serves
    if isinstance(source, (RankFiles, Boxes)):
        check_options(source, {"shard_info": shard_info is not None}, None)
        boxes = open_boxes(source, False, shard_info)  # planned again over the stored tensors it was made from
        held = "records" if isinstance(source, PreshardedBoxes) else "rank files"
        how = "its own rank file" if isinstance(source, RankFiles) else f"its boxes out of those {held}"
        click.echo(f"note: {source.what} for num_shards={boxes.old.num_shards}: each rank reads {how}", err=True)
        checkpoint, info = boxes.stored, boxes.shard_info
        own = boxes.old.num_shards  # no -n: the N it was made for
    elif isinstance(source, SplitRecords):  # at its own N each rank's records are its tensors (a plan beside: checked)
        checkpoint, info = source.checkpoint, records_plan(source.checkpoint, shard_info)
        own = checkpoint.split_for
    else:
        checkpoint = source.checkpoint
        info = shard_info_for(checkpoint, shard_info)
    n = num_shards or info.num_shards or own or _inspect_n(info, checkpoint)
    plan = build_plan(info, checkpoint, n)
    stages: Any = None
    if layout is not None:  # before anything is printed: a mesh the model cannot take is the whole output
        try:
            stages = mesh_rows(plan, layout) if as_json else mesh_text(plan, layout)
        except ShardloadError as err:
            raise err.located(file=str(model)) from None
    if as_json:
        doc: dict[str, Any] = {"rows": inspect_rows(plan), "totals": totals(plan)}
        if layout is not None:
            doc["mesh"] = {**layout.to_dict(), "ranks": stages}
        _echo_json(doc)
    else:
        click.echo(inspect_text(plan))
        if layout is not None:
            click.echo("\n" + stages)


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


@click.command()
@_plugin_option
@click.argument("target", metavar="OUT", type=MODEL)  # not out_dir: verify writes nothing, an interrupt removes nothing
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
def verify(target: Path | str, source: Path | None, shard_info: Path | None, root: str | None, as_json: bool) -> None:
    """Recompute every file's checksum in converted directory OUT against its manifest; list each mismatch. OUT may
    be a source checkpoint instead: every file is re-hashed against its integrity record (`shardload hash`)."""
    if root is not None and not is_root_hash(root):
        raise BadArgument(f"--root takes a 64-digit root hash from `shardload hash`, got {root!r}")
    from ..engine.verify import VerifyReport
    from ..sources.manifest import MANIFEST_NAME
    from .report import human_bytes

    if shard_info is not None and source is None:
        raise click.UsageError("--shard-info goes with --source")
    if source is not None and not isinstance(target, Path):
        raise click.UsageError("--source compares a local converted directory OUT with MODEL")
    if isinstance(source, Path) and not (source.exists() or source.is_symlink()):
        raise BadArgument(f"{source}: no such file or directory (--source)")
    # OUT in object storage or the Hub (kept as typed): a source checkpoint, checked against its record
    converted = source is not None or (isinstance(target, Path) and (target / MANIFEST_NAME).is_file())
    if root is not None and converted:
        raise click.UsageError("--root goes with a source checkpoint's integrity record, not a converted directory")
    if not converted:
        _verify_source(target, root, as_json)
        return
    refused: ShardloadError | None = None
    try:
        report = _verify_dir_drawn(target, source, shard_info, not as_json and sys.stderr.isatty())
    except ShardloadError as err:
        if not as_json:
            raise
        refused, report = err, VerifyReport(target, 0, problems=[err])
    if as_json:
        doc = {
            "out_dir": str(target), "source": None if source is None else str(source),
            "num_shards": report.num_shards, "files": report.files, "bytes": report.nbytes,
            "problems": [p.to_dict() for p in report.problems],
        }  # fmt: skip
        if refused is not None:  # the directory could not be checked at all: also the failure document's fields
            doc |= {"error": refused.to_dict()}
            click.echo(printable(f"error: {refused.message}"), err=True)
        _echo_json(doc, report.ok)
        sys.exit(0 if report.ok else 1)
    for problem in report.problems:
        click.echo(problem.message)
    if not report.ok:
        click.echo(f"{target}: {len(report.problems)} problem(s) in {report.files} listed files", err=True)
        sys.exit(1)
    against = f"; every rank equals {source}'s" if source is not None else ""
    click.echo(
        f"{target}: {report.files} files ({human_bytes(report.nbytes)}) match shard_manifest.json "
        f"(num_shards={report.num_shards}){against}"
    )


def _verify_dir_drawn(out_dir: Any, source: Any, shard_info: Any, draw: bool) -> Any:
    """``verify_dir``, with a progress bar of the bytes checked on a terminal (``draw``)."""
    from ..engine.verify_dir import verify_dir

    if not draw:
        return verify_dir(out_dir, source=source, shard_info=shard_info)
    total = [0]

    def told(done: int, of: int) -> None:
        total[0] = of
        bar(done, "")

    with _ProgressBar("verifying", lambda: total[0]) as bar:
        return verify_dir(out_dir, source=source, shard_info=shard_info, progress=told)


def _verify_source(model: Path | str, root: str | None, as_json: bool) -> None:
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
            "root": report.root or None, "files": report.files, "bytes": report.nbytes,
            "problems": [p.to_dict() for p in report.problems],
        }  # fmt: skip
        if refused is not None:
            doc |= {"error": refused.to_dict()}
            click.echo(printable(f"error: {refused.message}"), err=True)
        _echo_json(doc, report.ok)
        sys.exit(0 if report.ok else 1)
    for problem in report.problems:
        click.echo(printable(problem.message))
    if not report.ok:
        click.echo(f"{model}: {len(report.problems)} problem(s) against {report.record}", err=True)
        sys.exit(1)
    click.echo(
        f"{model}: {report.files} files ({human_bytes(report.nbytes)}) match {report.record} (root {report.root})"
    )


@click.command(name="hash")
@click.argument("model", type=MODEL)
@click.option("-o", "--out", type=OutputPath(remote=True), help="Write the record here (default: beside MODEL).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar; print only the root hash.")
@_guarded
def hash_command(model: Path, out: str | None, quiet: bool) -> None:
    """Write MODEL's integrity record (shardload.hashes) and print its root hash, for load(verify=Verify(root=ROOT))."""
    from ..engine.hashing import hash_model
    from .report import human_bytes

    result = hash_model(model, out, progress=not quiet)
    written(result.path)
    if quiet:
        click.echo(result.root)
        return
    click.echo(
        f"{result.path}: {human_bytes(result.checkpoint_bytes)} hashed, record {human_bytes(result.record_bytes)}"
    )
    click.echo(f"root {result.root}")
