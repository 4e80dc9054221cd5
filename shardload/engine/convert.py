"""Conversion: write a pre-sharded directory (one safetensors file per rank + a manifest).

Output is streamed one parameter at a time into a temporary directory next to the target
(``.OUT.shardload-tmp-PID-XXXX``, locked while in use), hashed while written, then renamed
into place: an interrupted convert never leaves a directory that looks complete, and the next
convert to the same target removes what a killed one left behind. Output that replaces an existing
directory, or a complete one a killed ``--overwrite`` had moved aside, is flushed to stable storage
before the rename, so a power loss cannot trade a complete old output for a half-written new one;
``fsync=True`` flushes any output, ``fsync=False`` none.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ShardloadError
from ..format.input_log import records_inputs
from ..models.plan_source import shard_info_for
from ..planning.mesh import Mesh
from ..planning.plan import ModelPlan, build_plan
from ..sources.checkpoint import (
    local_output,
    rank_file_name,
)
from ..sources.manifest import digest_to_write
from ..sources.object_reader import reader_for
from ..sources.source_types import Boxes, SplitRecords, as_boxes, open_source
from .integrity import verifier, wrapped
from .load import mesh_for, own_layers
from .load_options import Verify, verify_value
from .output import (
    StagingDir,
    check_output,
    integrity_entry,
    publish_with_manifest,
    rank_files_manifest,
    source_paths,
    stamp_sources,
    write_error,
)
from .reshard import RECORD_KEY, source_record, write_shards
from .routes import boxes_to_write
from .run import stages_of
from .writer import WrittenFile, new_conversion, write_output_record, write_rank_files, written_record

Progress = Callable[[int, str], None]
"""``progress(source_bytes_done, param_name)``, called after each parameter."""


@dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert` wrote: the directory, its plan, and every output file."""

    out_dir: Path
    plan: ModelPlan
    rank_files: list[WrittenFile]
    other_files: list[WrittenFile]
    layout: Mesh
    """The mesh written for (``tp`` = num_shards; one stage unless converted with a pipeline mesh)."""


@records_inputs
def convert(
    model: str | os.PathLike[str],
    num_shards: int | None,
    out_dir: str | os.PathLike[str],
    shard_info: Any = None,
    *,
    mesh: Mesh | str | Mapping[str, int] | None = None,
    overwrite: bool = False,
    fsync: bool | None = None,
    progress: Progress | None = None,
    verify: bool | Verify = False,
    sha256: bool = False,
) -> ConvertResult:
    """Write ``model`` pre-sharded for ``num_shards`` ranks into ``out_dir``.

    Creates ``rank-RRRRR-of-NNNNN.safetensors`` per rank, their integrity record ``shardload.hashes`` and
    ``shard_manifest.json`` (format version, num_shards, resolved shard_info, sources, and every file's size and
    checksum: a rank file's ``leaves_sha256``, the sha256 of its leaves in the record, which the manifest lists
    with its sha256), and copies config/tokenizer files. ``sha256=True`` hashes every rank file's bytes with
    sha256 too and writes a version-1 manifest listing it, as shardload did before version 2 (older readers read
    only that; it costs a pass of sha256 over every byte written). A source stored split (a converted directory at
    another N, a pre-sharded cache) is written the same way.
    An existing ``out_dir`` is refused unless ``overwrite``.
    With a ``mesh`` that has ``pp`` > 1, there is one file per (pipeline stage, tensor rank),
    ``pp-SSSSS-of-PPPPP-rank-RRRRR-of-NNNNN.safetensors``, holding only that stage's
    parameters; ``dp`` replicas share files, and the manifest records the mesh.

    Durability: by default (``fsync=None``) the files are fsynced only when they replace an existing
    ``out_dir`` (or the complete output a killed ``overwrite`` run had moved aside), so an old output is
    never given up for one a power loss could still cut short. A new output is left to the kernel's
    writeback, as ``cp`` does: on most filesystems a file a power loss cut short fails the size check
    every load makes, and ``verify_dir`` (or ``verify=True``) finds any damage. ``fsync=True`` always
    flushes, ``False`` never does.

    ``verify`` (True, or the source's root hash from ``shardload hash``) checks every byte read from the source
    against its integrity record; nothing is published when one differs. Every output gets its own record
    (``shardload.hashes`` over the rank files, its root in the manifest's ``integrity``), so a converted directory
    is loaded with ``verify`` the same way.

    Example::

        shardload.convert("llama-dir", 8, "llama-tp8")
        state = shardload.load_rank("llama-tp8", rank=0, num_shards=8)
    """
    out = local_output(out_dir, "out_dir")
    verify = verify_value(verify, str(model))
    resolved = mesh_for(num_shards, mesh, None, str(model))
    source = as_boxes(open_source(model, resolved))
    resolved = own_layers(source, resolved)
    if isinstance(source, Boxes):  # already split (another conversion, a pre-sharded cache, a server's layout)
        shards = boxes_to_write(source, verify, shard_info, resolved)
        done = write_shards(shards, resolved, out, overwrite=overwrite, fsync=fsync, progress=progress, sha256=sha256)
        return ConvertResult(out, done.plan, done.rank_files, done.other_files, resolved)
    if isinstance(source, SplitRecords):
        raise ShardloadError(
            f"is already pre-sharded for num_shards={resolved.tp}: load it directly (load_rank reads each rank's own "
            "records); convert splits a checkpoint stored whole",
            file=source.name,
        )
    checkpoint = source.checkpoint
    stamps = stamp_sources(checkpoint.files)
    info = shard_info_for(checkpoint, shard_info)
    wrap = verifier(checkpoint, verify, checkpoint.name)
    plan = build_plan(info, checkpoint, resolved.tp)
    stages = stages_of(plan, resolved)
    sources = source_paths(checkpoint.root, checkpoint.files)
    if Path(info.source).exists():
        sources.append(Path(info.source))
    exists = check_output(out, sources, overwrite=overwrite)
    durable = exists if fsync is None else fsync
    try:
        with StagingDir(out, fsync, synced=durable, overwrite=overwrite) as staging:
            conversion = new_conversion()
            files = [{"path": f.name, "size": st[2]} for f, st in stamps]
            manifest = rank_files_manifest(resolved, stages, plan.resolved_shard_info(), files, conversion, sha256)
            with wrapped(reader_for(checkpoint.path), wrap) as reader:
                manifest[RECORD_KEY] = source_record(plan, info, reader)
            digest = digest_to_write(manifest)  # each rank file's seal: this plan
            rank_files = _write_ranks(stages, staging.dir, progress, durable, wrap, conversion, digest, sha256)
            record = write_output_record(staging.dir, written_record(rank_files), durable)  # hashed as written
            manifest["integrity"] = integrity_entry(record)
            others = [record, *publish_with_manifest(staging, checkpoint.root, stamps, [*rank_files, record], manifest,
                                                     durable)]  # fmt: skip
    except OSError as err:
        raise write_error(err, out) from None
    return ConvertResult(out, plan, rank_files, others, resolved)


def _write_ranks(
    stages: list[ModelPlan],
    tmp: Path,
    progress: Progress | None,
    durable: bool,
    wrap: Any = None,
    conversion: str | None = None,
    digest: str | None = None,
    sha256: bool = False,
) -> list[WrittenFile]:
    """Write every (pipeline stage, tensor rank) file, each sealed with ``digest``; each stage's parameters are read
    once."""
    files: list[WrittenFile] = []
    done = 0
    for pp, plan in enumerate(stages):
        n = plan.num_shards
        names = [tmp / rank_file_name(r, n, pp, len(stages)) for r in range(n)]

        def report(source_done: int, name: str, base: int = done) -> None:
            if progress is not None:
                progress(base + source_done, name)

        files.extend(write_rank_files(plan, names, report, stage=pp, stages=len(stages), durable=durable, wrap=wrap,
                                      conversion=conversion, digest=digest, sha256=sha256))  # fmt: skip
        done += sum(p.source.nbytes for p in plan.params.values())
    return files
