"""Auditing a converted directory as a whole: every listed file against the manifest (size, sha256, rank
header), and, given the source it was made from, the manifest's plan against the plan the source gives, then every
rank's tensors against the same rank made from that source (``shardload verify OUT [--source MODEL]``)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ShardloadError, short_repr
from ..models.plan_source import shard_info_for
from ..planning.mesh import Mesh
from ..planning.plan import ModelPlan, build_plan
from ..sources.checkpoint import open_checkpoint, read_json
from ..sources.manifest import MANIFEST_NAME
from ..sources.source_types import open_source
from .convert_targets import LayoutTarget, layout_for_manifest
from .load import load_rank
from .reshard import RECORD_KEY, open_shards
from .steps import same_bytes
from .verify import OutputRecord, VerifyReport, check_entry
from .verify_source import refuse_vllm_save

Progress = Callable[[int, int], None]
"""``progress(done, total)``: bytes of the output checked so far (twice over with a source: hashed, then compared)."""


def verify_dir(
    path: str | os.PathLike[str],
    source: str | os.PathLike[str] | None = None,
    shard_info: Any = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Recompute every file's checksum in a converted directory against its manifest (its sha256, or its leaves in
    the directory's integrity record, which the manifest pins); list each mismatch. With
    ``source``, also compare the manifest's plan with the plan the source gives (its shard_info.json, or one
    planned from its config.json; ``shard_info`` when the output was converted with another), then each rank
    with the same rank made from ``source`` (one rank of each in memory at a time), so an output whose source or
    manifest changed since it was written is reported. ``progress(done, total)`` is called after each file and
    each rank compared.

    Example::

        report = shardload.verify_dir("llama-tp8", source="llama-dir")
        for problem in report.problems:
            print(problem)
    """
    found = _target_manifest(Path(path))
    if found is not None:  # a registered convert --layout target's output: its own manifest and source checks
        target, own = found
        report = _check_files(VerifyReport(Path(path), own["num_shards"]), Path(path), own, _Count(own, None, progress),
                              target.rank_of)  # fmt: skip
        if source is not None and report.ok and target.against_source is not None:
            report.problems += target.against_source(Path(path), source, own, shard_info)
        return report
    refuse_vllm_save(path)
    checkpoint = open_checkpoint(path)
    if checkpoint.kind != "converted" or checkpoint.manifest is None:
        raise CheckpointError(f"not a converted directory (no {MANIFEST_NAME})", file=str(path))
    manifest = checkpoint.manifest
    count = _Count(manifest, source, progress)
    report = _check_files(VerifyReport(checkpoint.root, manifest["num_shards"]), checkpoint.root, manifest, count)
    if report.ok and RECORD_KEY in manifest:  # what a load at another N reads: its record, the rank headers
        try:
            open_shards(checkpoint)
        except ShardloadError as err:
            report.problems.append(err)
    if source is not None and report.ok:
        report.problems += _against_source(checkpoint.root, source, manifest, shard_info, count)
    return report


class _Count:
    """What :func:`verify_dir` has checked, told to its ``progress``: each file's bytes as it is hashed, then the
    output's bytes again, a rank's share at a time, as the ranks are compared with the source."""

    def __init__(self, manifest: dict, source: Any, progress: Progress | None) -> None:
        self.nbytes = sum(int(e.get("size", 0)) for e in manifest.get("files", []))
        self.total = self.nbytes * (2 if source is not None else 1)
        self.done, self.progress = 0, progress

    def add(self, nbytes: int) -> None:
        self.done = min(self.total, self.done + nbytes)
        if self.progress is not None:
            self.progress(self.done, self.total)


def _target_manifest(path: Path) -> tuple[LayoutTarget, dict] | None:
    """The target and manifest (checked) of a directory a registered ``convert --layout`` target wrote, or None
    for anything else."""
    manifest_path = path / MANIFEST_NAME
    if not path.is_dir() or not manifest_path.is_file():
        return None
    manifest = read_json(manifest_path, "manifest")
    target = layout_for_manifest(manifest)
    if target is None:
        return None
    if target.check_manifest is not None:
        target.check_manifest(manifest, manifest_path)
    return target, manifest


def _check_files(
    report: VerifyReport,
    root: Path,
    manifest: dict,
    count: _Count,
    rank_of: Callable[[str], int | None] | None = None,
) -> VerifyReport:
    """Every file the manifest lists (size, checksum, rank header: a target layout's rank files are those
    ``rank_of`` names) and any safetensors file it does not."""
    record = OutputRecord(root, manifest)  # read once, for the files listed by their leaves
    for entry in manifest["files"]:
        rank = None if rank_of is None else rank_of(entry["path"])
        _, problem = check_entry(root, entry, True, manifest, rank=rank, record=record)
        report.files += 1
        report.nbytes += entry["size"]
        count.add(entry["size"])
        if problem is not None:
            report.problems.append(problem)
    listed = {entry["path"] for entry in manifest["files"]}
    for extra in sorted(root.iterdir()):
        if extra.name.endswith(".safetensors") and extra.name not in listed:
            report.problems.append(CheckpointError("is not listed in the manifest", file=str(extra)))
    return report


MAX_PLAN_DIFFERENCES = 20
"""Parameters whose plans differ that ``verify --source`` names one by one; the rest are counted."""


def plan_differences(recorded: Any, given: dict[str, Any], where: str) -> list[CheckpointError]:
    """Each parameter whose steps in the manifest's plan (``recorded``) differ from the source's (``given``)."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("params"), dict):
        return [CheckpointError("the manifest records no plan to compare with the source's", file=where)]
    given = json.loads(json.dumps(given))  # tuples as lists, as the manifest stores them
    theirs, ours = recorded["params"], given["params"]
    problems = []
    if recorded.get("num_shards") != given["num_shards"]:
        problems.append(CheckpointError(
            f"the manifest's plan is for num_shards={short_repr(recorded.get('num_shards'))}, the source's for "
            f"{given['num_shards']}", file=where,
        ))  # fmt: skip
    names = [n for n in sorted(set(theirs) | set(ours)) if theirs.get(n) != ours.get(n)]
    for name in names[:MAX_PLAN_DIFFERENCES]:
        problems.append(CheckpointError(
            f"the manifest's plan differs from the plan the source gives (manifest: {short_repr(theirs.get(name))}; "
            f"source: {short_repr(ours.get(name))})", file=where, param=name,
        ))  # fmt: skip
    if len(names) > MAX_PLAN_DIFFERENCES:
        more = len(names) - MAX_PLAN_DIFFERENCES
        problems.append(CheckpointError(f"and {more} more parameters whose plans differ", file=where))
    return problems


def _source_plan(source: Any, num_shards: int, shard_info: Any) -> ModelPlan:
    """The plan ``source`` itself gives for ``num_shards`` ranks (``shard_info`` when given)."""
    opened = open_source(source)
    if opened.derived:
        raise CheckpointError(f"is {opened.what}; --source names the checkpoint it was made from", file=str(source))
    checkpoint = opened.checkpoint
    return build_plan(shard_info_for(checkpoint, shard_info), checkpoint, num_shards)


def _against_source(out: Path, source: Any, manifest: dict, shard_info: Any, count: _Count) -> list[CheckpointError]:
    """The manifest's plan against the source's, then every rank of ``out`` against the same rank loaded from
    ``source``: names, dtypes, shapes and bytes."""
    tp = manifest["num_shards"]
    try:
        plan = _source_plan(source, tp, shard_info)
    except ShardloadError as err:
        return [CheckpointError(f"cannot plan the source for num_shards={tp}: {err.message}", file=str(source))]
    given = plan.resolved_shard_info()
    differences = plan_differences(manifest.get("shard_info"), given, str(out / MANIFEST_NAME))
    if differences:
        return differences
    record = manifest.get("mesh")
    layers = tuple(record["pp_layers"]) if record else None
    mesh = Mesh(pp=record["pp"], tp=tp, pp_layers=layers) if record else Mesh(tp=tp)
    problems = []
    for rank in range(mesh.world_size):
        try:
            want = load_rank(source, rank, mesh=mesh, shard_info=given)
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
            elif not same_bytes(a, b):
                problems.append(CheckpointError(f"{name!r} differs from the source's bytes", file=where))
        del want, got
        count.add(-(-count.nbytes // mesh.world_size))
    return problems
