"""Auditing a converted directory as a whole: every listed file against the manifest (size, sha256, rank
header), and, given the source it was made from, every rank's tensors against the same rank loaded from that
source with the manifest's resolved shard_info (``shardload verify OUT [--source MODEL]``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ShardloadError
from ..planning.mesh import Mesh
from ..sources.checkpoint import MANIFEST_NAME, VLLM_MANIFEST_FORMAT, open_checkpoint, read_json
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
    vllm = _vllm_manifest(Path(path))
    if vllm is not None:
        if source is not None:
            raise CheckpointError(
                "--source compares shardload's rank layout; this directory is in vLLM's sharded_state layout "
                "(its files are still checked against the manifest without --source)",
                file=str(path),
            )
        return _check_files(VerifyReport(Path(path), vllm["num_shards"]), Path(path), vllm)
    checkpoint = open_checkpoint(path)
    if checkpoint.kind != "converted" or checkpoint.manifest is None:
        raise CheckpointError(f"not a converted directory (no {MANIFEST_NAME})", file=str(path))
    manifest = checkpoint.manifest
    report = _check_files(VerifyReport(checkpoint.root, manifest["num_shards"]), checkpoint.root, manifest)
    if source is not None and report.ok:
        report.problems += _against_source(checkpoint.root, source, manifest)
    return report


def _vllm_manifest(path: Path) -> dict | None:
    """The manifest of a directory written by ``convert --layout vllm`` (checked), or None for anything else."""
    manifest_path = path / MANIFEST_NAME
    if not path.is_dir() or not manifest_path.is_file():
        return None
    manifest = read_json(manifest_path, "manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != VLLM_MANIFEST_FORMAT:
        return None
    files = manifest.get("files")
    n = manifest.get("num_shards")
    entries_ok = isinstance(files, list) and all(
        isinstance(e, dict) and isinstance(e.get("path"), str) and type(e.get("size")) is int
        and isinstance(e.get("sha256"), str) for e in files
    )  # fmt: skip
    if type(n) is not int or n < 1 or not entries_ok:
        raise CheckpointError("inconsistent manifest: needs num_shards >= 1 and files with path, size and sha256",
                              file=str(manifest_path))  # fmt: skip
    return manifest


def _check_files(report: VerifyReport, root: Path, manifest: dict) -> VerifyReport:
    """Every file the manifest lists (size, sha256, rank header) and any safetensors file it does not."""
    for entry in manifest["files"]:
        _, problem = check_entry(root, entry, checksum=True)
        report.files += 1
        report.nbytes += entry["size"]
        if problem is not None:
            report.problems.append(problem)
    listed = {entry["path"] for entry in manifest["files"]}
    for extra in sorted(root.iterdir()):
        if extra.name.endswith(".safetensors") and extra.name not in listed:
            report.problems.append(CheckpointError("is not listed in the manifest", file=str(extra)))
    return report


def _against_source(out: Path, source: Any, manifest: dict) -> list[CheckpointError]:
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
