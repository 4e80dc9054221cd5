"""``shardload convert`` and ``shardload quantize``: the commands that write a converted or quantized output."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..engine.convert_targets import BUILT_IN as BUILT_IN_LAYOUT
from ..engine.convert_targets import LayoutTarget, layouts
from ..engine.quantize import SCHEMES as QUANT_SCHEMES
from ..errors import ShardloadError, printable
from ..format.hash_record import is_root_hash
from .common import (
    MAX_LISTED_N,
    MODEL,
    OUT,
    BadArgument,
    _echo_json,
    _guarded,
    _LayoutChoice,
    _mesh_arg,
    _mesh_options,
    _plugin_option,
    _ProgressBar,
    written,
)


@click.command()
@_plugin_option
@click.argument("model", type=MODEL)
@click.option("-n", "--num-shards", type=click.IntRange(min=1), help="Tensor-parallel size N (or give --mesh).")
@click.option("-o", "--out", "out_dir", type=OUT, required=True, help="Output directory.")
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
    "--sha256",
    "sha256",
    is_flag=True,
    help="Also hash every rank file with sha256 and write a version-1 manifest listing it, which older shardload "
    "reads (default: a version-2 manifest naming each rank file by its leaves in the output's integrity record).",
)
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
    sha256: bool,
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

    if verify not in (None, "record") and not is_root_hash(verify):
        raise BadArgument(f"--verify takes a 64-digit root hash from `shardload hash` (or no value: check MODEL's "
                          f"record), got {verify!r}")  # fmt: skip
    from ..engine.load_options import Verify

    pinned = Verify(root=verify) if verify and verify != "record" else None
    if layout_name != BUILT_IN_LAYOUT:
        checked = pinned or verify == "record"
        _convert_to(layouts()[layout_name], model, num_shards, out_dir, shard_info, overwrite, fsync, quiet, as_json,
                    mesh, checked, expert_parallel, sha256)  # fmt: skip
        return
    if expert_parallel:
        raise click.UsageError(_expert_parallel_refusal())
    layout = _mesh_arg(mesh, world_size, pp_layers, num_shards)
    if layout is None and num_shards is None:
        raise click.UsageError("give --num-shards (or --mesh)")
    options = {"overwrite": overwrite, "mesh": layout, "fsync": fsync, "verify": pinned or verify == "record",
               "sha256": sha256}  # fmt: skip

    if not quiet and not as_json and sys.stderr.isatty():
        with _ProgressBar("converting", lambda: _source_bytes(model)) as progress:
            result = run_convert(model, num_shards, out_dir, shard_info, progress=progress, **options)
    else:
        result = run_convert(model, num_shards, out_dir, shard_info, **options)
    written(result.out_dir)
    if as_json:
        doc = {
            "out_dir": str(result.out_dir), "num_shards": result.layout.tp, "mesh": str(result.layout),
            "rank_files": [f.entry() for f in result.rank_files],
            "other_files": [f.entry() for f in result.other_files],
        }  # fmt: skip
        _echo_json(doc)
        return
    if quiet:
        return
    from ..engine.run import stages_of

    stages = stages_of(result.plan, result.layout)
    rows = []
    for i, f in enumerate(result.rank_files):
        pp, tp = divmod(i, result.layout.tp)
        where = (pp, tp) if len(stages) > 1 else (tp,)
        rows.append((*where, f.path, len(stages[pp].params), human_bytes(f.size), f.size, f.checksum[:16]))
    headers = ["pp", "rank"] if len(stages) > 1 else ["rank"]
    checksum = "sha256" if all(f.sha256 for f in result.rank_files) else "leaves_sha256"
    right = tuple(range(len(headers))) + tuple(i + len(headers) for i in (1, 2, 3))
    click.echo(format_table([*headers, "file", "tensors", "size", "bytes", checksum], rows, right=right))
    from ..engine.output import MARKER
    from ..format.hash_record import RECORD_NAME
    from ..sources.manifest import MANIFEST_NAME

    copied = [f for f in result.other_files if f.path not in (MARKER, RECORD_NAME, MANIFEST_NAME)]  # not our own
    extra = f" and {len(copied)} copied file(s)" if copied else ""
    click.echo(f"\nwrote {len(result.rank_files)} rank files{extra} to {result.out_dir}")


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
    sha256: bool = False,
) -> None:
    """``convert --layout NAME`` of a registered target (a server's own per-rank files, ``num_shards`` ranks)."""
    from .report import format_table, human_bytes

    if mesh is not None or num_shards is None:
        raise click.UsageError(target.mesh_refusal)
    if expert_parallel and not target.expert_parallel:
        raise click.UsageError(_expert_parallel_refusal())
    if sha256 and not target.sha256:
        raise click.UsageError(f"--layout {target.name} takes no --sha256 (its files are listed as it lists them)")
    more = {"sha256": True} if sha256 else {}  # only to a target that takes it
    files = target.convert(model, num_shards, out_dir, shard_info, overwrite=overwrite, fsync=fsync, verify=verify,
                           expert_parallel=expert_parallel, **more)  # fmt: skip
    written(out_dir)
    if as_json:
        _echo_json({"out_dir": str(out_dir), "num_shards": num_shards, "layout": target.name,
                    "rank_files": [f.entry() for f in files]})  # fmt: skip
        return
    if quiet:
        return
    rows = [(r, f.path, human_bytes(f.size), f.size, f.checksum[:16]) for r, f in enumerate(files)]
    checksum = "sha256" if all(f.sha256 for f in files) else "leaves_sha256"
    click.echo(format_table(["rank", "file", "size", "bytes", checksum], rows, right=(0, 2, 3)))
    click.echo(f"\n{target.served(out_dir, num_shards, expert_parallel)}")


@click.command()
@_plugin_option
@click.argument("model", type=MODEL)
@click.option("-o", "--out", "out_dir", type=OUT, required=True, help="Output directory.")
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
    options = {"shard_info": shard_info, "overwrite": overwrite}
    if sys.stderr.isatty():
        with _ProgressBar("quantizing", lambda: _source_bytes(model)) as progress:
            result = run_quantize(model, out_dir, chosen, progress=progress, **options)
    else:
        result = run_quantize(model, out_dir, chosen, **options)
    written(result.out_dir)
    if max_n is not None:  # said once it is done: a refused run prints its error alone
        ns = ", ".join(str(1 << k) for k in range(max_n.bit_length()))
        fewer = "" if max_n == INT4_MAX_N else f" only (none of groups 128, 64, 32 keeps N = {INT4_MAX_N})"
        group = chosen.removeprefix("int4-g")
        line = f"int4: group size {group} chosen from {model}: every quantized input dim splits into whole groups"
        click.echo(printable(f"{line} at N = {ns}{fewer} (--scheme int4-gG picks another)"))
    fmt = result.scheme.format
    click.echo(f"quantized {len(result.quantized)} weights to {chosen} (compressed-tensors {fmt}) in {result.out_dir}")
    for name, reason in result.skipped.items():
        click.echo(printable(f"  kept {name}: {reason}"))
    if not result.shard_info:
        click.echo(printable(f"no shard_info.json in the source: wrote none ({_plan_hint(result.out_dir)})"))
    else:
        valid = ", ".join(str(n) for n in result.valid_for) or "none"
        click.echo(f"{result.out_dir / 'shard_info.json'}: valid for num_shards {valid} (checked 1..{MAX_LISTED_N})")


def _plan_hint(model: Path) -> str:
    """``shardload plan MODEL makes one`` when it does, else why it cannot (a hint names no command that fails)."""
    from ..models.generated import generate

    try:
        generate(model)  # as `shardload plan` runs it
    except ShardloadError as err:
        return f"and none can be planned: {err.message}"
    return f"shardload plan {model} makes one"
