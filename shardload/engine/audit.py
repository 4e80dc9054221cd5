"""Auditing a converted directory as a whole: every listed file against the manifest (size, sha256, rank
header), and, given the source it was made from, every rank's tensors against the same rank loaded from that
source with the manifest's resolved shard_info (``shardload verify OUT [--source MODEL]``)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError, ShardloadError
from ..planning.mesh import Mesh
from ..sources.checkpoint import MANIFEST_NAME, open_checkpoint
from .load import load_rank
from .verify import VerifyReport, check_entry


def verify_dir(path: str | os.PathLike[str], source: str | os.PathLike[str] | None = None) -> VerifyReport:
    """Recompute every file's sha256 in a converted directory against its manifest; list each mismatch. With
    ``source``, also compare each rank with the same rank loaded from ``source`` (one rank in memory at a time),
    so an output whose source changed since it was written is reported.

    Example::

        report = shardload.verify_dir("llama-tp8", source="llama-dir")
        for problem in report.problems:
            print(problem)
    """
    checkpoint = open_checkpoint(path)
    if checkpoint.kind != "converted" or checkpoint.manifest is None:
        raise CheckpointError(f"not a converted directory (no {MANIFEST_NAME})", file=str(path))
    manifest = checkpoint.manifest
    report = VerifyReport(checkpoint.root, manifest["num_shards"])
    for entry in manifest["files"]:
        _, problem = check_entry(checkpoint.root, entry, checksum=True)
        report.files += 1
        report.nbytes += entry["size"]
        if problem is not None:
            report.problems.append(problem)
    listed = {entry["path"] for entry in manifest["files"]}
    for extra in sorted(checkpoint.root.iterdir()):
        if extra.name.endswith(".safetensors") and extra.name not in listed:
            report.problems.append(CheckpointError("is not listed in the manifest", file=str(extra)))
    if source is not None and report.ok:
        report.problems += _against_source(checkpoint.root, Path(source), manifest)
    return report


def _against_source(out: Path, source: Path, manifest: dict) -> list[CheckpointError]:
    """Every rank of ``out`` against the same rank loaded from ``source``: names, dtypes, shapes and bytes."""
    import torch

    tp = manifest["num_shards"]
    record = manifest.get("mesh")
    layers = tuple(record["pp_layers"]) if record else None
    mesh = Mesh(pp=record["pp"], tp=tp, pp_layers=layers) if record else Mesh(tp=tp)
    problems = []
    for rank in range(mesh.world_size):
        try:
            want = load_rank(source, rank, mesh=mesh, shard_info=manifest["shard_info"])
        except ShardloadError as err:
            return [CheckpointError(f"cannot load rank {rank} from the source: {err.reason}", file=str(source))]
        got = load_rank(out, rank, mesh=mesh)
        where = str(out / f"rank {rank}")
        for name in sorted(want.keys() - got.keys()):
            problems.append(CheckpointError(f"{name!r} is in the source but not in the output", file=where))
        for name in sorted(got.keys() - want.keys()):
            problems.append(CheckpointError(f"{name!r} is in the output but not in the source", file=where))
        for name in sorted(want.keys() & got.keys()):
            a, b = want[name], got[name]
            if (a.dtype, a.shape) != (b.dtype, b.shape):
                what = f"source {a.dtype} {tuple(a.shape)}, output {b.dtype} {tuple(b.shape)}"
                problems.append(CheckpointError(f"{name!r} differs: {what}", file=where))
            elif not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                problems.append(CheckpointError(f"{name!r} differs from the source's bytes", file=where))
        del want, got
    return problems
