"""Converted directories as a source for any N: each new rank reads only its boxes, out of the old rank files.

``convert`` records in the manifest how the directory was planned (:func:`source_record`: the shard_info as given,
every stored tensor's shape and dtype, and the values of the few small tensors a compute step rewrites). From it
the old plan (N_old) and the new plan (any N the shard_info allows) are rebuilt over the same stored tensors, and
:mod:`shardload.planning.reshard` intersects their boxes. Every old rank file is checked (present, its size, the
rank its header names, each tensor's shape and dtype against the old plan) before a byte of data is read; the
reads of the boxes themselves are :mod:`.box_reads`'.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, PlanError, ShardloadError
from ..format.shard_info import ShardInfo
from ..planning.mesh import Mesh, stage_plans
from ..planning.plan import ModelPlan, ParamPlan, build_plan
from ..planning.presharded import STORED, whole_view
from ..planning.reshard import OldPart, boxes_copyable, old_parts, whole
from ..sources.checkpoint import Checkpoint
from ..sources.dtypes import DTYPES, itemsize, to_torch
from ..sources.manifest import (
    MANIFEST_NAME,
    manifest_stages,
    rank_file_name,
)
from ..sources.object_reader import reader_for
from ..sources.reader import FileMaps, Reader
from ..sources.safetensors_header import read_header
from ..sources.tensor_info import TensorInfo
from .box_reads import read_parts
from .verify import OutputRecord, check_entry

if TYPE_CHECKING:
    import torch

    from ..sources.reader import RunReader
    from .writer import WrittenFile

RECORD_KEY = "source_plan"
"""The manifest key of a converted directory's source record."""
VALUE_BYTES = 4096
"""A stored tensor a compute step rewrites is recorded whole in the manifest up to this size (a ``weight_shape``)."""


def source_record(plan: ModelPlan, shard_info: ShardInfo, reader: RunReader) -> dict[str, Any] | None:
    """What a converted directory needs to be planned again for another N: the shard_info as given, each stored
    tensor's dtype and shape, and the bytes of small tensors a compute step rewrites. None when the shard_info
    cannot be written as JSON (a step given as a Python object)."""
    try:
        doc = json.loads(json.dumps(shard_info.to_dict()))
    except (TypeError, ValueError):
        return None
    tensors = {name: [p.source.logical_dtype, list(p.source.shape)] for name, p in plan.params.items()}
    values: dict[str, str] = {}
    for name, p in plan.params.items():
        if not boxes_copyable(p) and p.source.nbytes <= VALUE_BYTES and p.source.decode is None:
            values[name] = bytes(reader.tensor(p.source).view(-1).view(_u8()).numpy()).hex()
    return {"shard_info": doc, "tensors": tensors, "values": values}


def _u8() -> Any:
    import torch

    return torch.uint8


@dataclass
class ShardsSource:
    """A converted directory opened as a source: its old plan, every old rank file's header, checked."""

    checkpoint: Checkpoint
    shard_info: ShardInfo
    stored: Checkpoint
    """The stored tensors the directory was planned from (shapes and dtypes only: no file is behind them)."""
    old: ModelPlan
    old_layout: Mesh
    files: dict[tuple[int, int], Path]
    """The old rank files by (stage, rank) (empty for a pre-sharded cache, whose records share files)."""
    headers: dict[tuple[int, int], dict[str, TensorInfo]]
    holder: dict[str, int]
    """Parameter name -> the old pipeline stage whose files it is read from."""
    values: dict[str, bytes]
    extra_files: list[Path] = field(default_factory=list)
    """Files of the source besides ``files`` that an output may not overwrite (its manifest, its cache table)."""
    _parts: dict[Any, list[OldPart]] = field(default_factory=dict, repr=False)
    _maps: FileMaps = field(default_factory=FileMaps, repr=False)

    @property
    def name(self) -> str:
        return str(self.checkpoint.root)

    def plan(self, layout: Mesh) -> list[ModelPlan]:
        """The new plan for ``layout``, one per pipeline stage (refused in one line when the shard_info does not
        allow its tp)."""
        if layout.pp_layers is not None or layout.pp > 1:
            plan = build_plan(self.shard_info, self.stored, layout.tp)
            return stage_plans(plan, layout)
        return [build_plan(self.shard_info, self.stored, layout.tp)]

    def parts(self, new: ParamPlan, rank: int) -> list[OldPart]:
        """The boxes of old rank tensors that make ``rank``'s tensor of ``new`` (shared by equal structures)."""
        old = self.old.params[new.name]
        key = (type(old).__name__, _steps_key(old), _steps_key(new), new.source.shape, rank)
        if key not in self._parts:
            self._parts[key] = old_parts(old, [p for p in new.pieces(rank) or () if all(b > a for a, b in p.src)])
        return self._parts[key]

    def tensor(self, new: ParamPlan, rank: int, reader: RunReader) -> torch.Tensor:
        """``rank``'s tensor of ``new`` on the CPU, read out of the old rank files (padding written as zeros)."""
        import torch

        from .steps import run_steps

        old = self.old.params[new.name]
        if boxes_copyable(new) and boxes_copyable(old) and self._held(new.name):
            dest = torch.empty(new.shape, dtype=to_torch(new.dtype))
            for box in new.zeros(rank):
                dest[tuple(slice(a, b) for a, b in box)] = 0
            self._read(new.name, self.parts(new, rank), dest, reader)
            return dest
        part = run_steps(new, self._stored_tensor(old, reader))[rank]
        return torch.empty(part.shape, dtype=part.dtype).copy_(part)  # its own memory, a fresh tensor's strides

    def _stored_tensor(self, old: ParamPlan, reader: RunReader) -> torch.Tensor:
        """The whole stored tensor of ``old``: rebuilt from the old ranks' boxes, or from the manifest's record."""
        import torch

        info = old.source
        if old.replicated and info.file.name != STORED:  # stored whole in the source itself (a TVM cache's norm)
            return reader.tensor(info)
        if info.nbytes == 0:  # nothing stored, nothing to rebuild
            return torch.empty(info.shape, dtype=to_torch(info.dtype))
        held = self._held(old.name)
        if boxes_copyable(old) and held:
            dest = torch.empty(info.shape, dtype=to_torch(info.dtype))
            self._read(old.name, old_parts(old, whole(old)), dest, reader)
            return dest
        raw = self.values.get(old.name)
        if (raw is None or len(raw) != info.nbytes) and held and _invertible(old):
            return self._undone(old, reader)
        if raw is None or len(raw) != info.nbytes:
            funcs = ", ".join(s.name for s in old.steps if not s.func.remap) or "a dtype change"
            why = f"hold the result of a compute step ({funcs}), which cannot be undone" if held else "hold none of it"
            raise PlanError(
                f"its num_shards={old.num_shards} files {why}, and the manifest does not record the stored tensor; "
                "convert the source checkpoint",
                file=self.name, param=old.name,
            )  # fmt: skip
        return torch.frombuffer(bytearray(raw), dtype=to_torch(info.dtype)).reshape(info.shape).clone()

    def _undone(self, old: ParamPlan, reader: RunReader) -> torch.Tensor:
        """The stored tensor back from every old rank's result of its one invertible compute step, checked by
        running the step on it again: the old ranks' tensors must come back, element for element."""
        import torch

        from .steps import run_steps, same_bytes

        stage, step = self.holder[old.name], old.steps[0]
        out = torch.stack([reader.tensor(self.headers[(stage, r)][old.name]) for r in range(old.num_shards)])
        assert step.func.inverse is not None
        stored = step.func.inverse(out, *step.args).contiguous()
        try:
            same = tuple(stored.shape) == old.source.shape and same_bytes(run_steps(old, stored), out)
        except ShardloadError:
            same = False
        if not same:
            raise PlanError(
                f"its num_shards={old.num_shards} files hold results of {step.name} that no one stored tensor gives",
                file=self.name, param=old.name,
            )  # fmt: skip
        return stored

    def _held(self, name: str) -> bool:
        """Whether the old rank files hold ``name`` at all (a server's layout may keep no compressed-tensors
        ``weight_shape``: the manifest records its value instead)."""
        return any(name in header for header in self.headers.values())

    def _read(self, name: str, parts: Sequence[OldPart], dest: torch.Tensor, reader: RunReader) -> None:
        """Read ``parts`` of the old rank files into ``dest`` (a contiguous CPU tensor), one run list per file."""
        stage = self.holder[name]
        populate = {"populate": True} if isinstance(reader, Reader) else {}  # map dest's pages in one call
        maps = self._maps if isinstance(reader, Reader) and reader.can_map else None
        by_rank: dict[int, list[OldPart]] = {}
        for part in parts:
            by_rank.setdefault(part.rank, []).append(part)
        for rank, group in sorted(by_rank.items()):
            read_parts(reader, self.headers[(stage, rank)][name], group, dest, maps, populate)


def _invertible(plan: ParamPlan) -> bool:
    """Whether ``plan`` is one compute step with an inverse (a rank-local g_idx), on a tensor stored as it is."""
    return len(plan.steps) == 1 and plan.steps[0].func.inverse is not None and plan.source.decode is None


def record_of(
    source: ShardsSource, written: ModelPlan | None = None, reader: RunReader | None = None
) -> dict[str, Any]:
    """The ``source_plan`` record of a directory written from ``source`` with plan ``written`` (so it serves any N in
    turn): the source's recorded values, and those of small tensors ``written`` rewrites that the source's files hold
    whole (a server's layout keeps a compressed-tensors ``weight_shape`` that the plain plan rewrites), read through
    ``reader``."""
    tensors = {name: [t.logical_dtype, list(t.shape)] for name, t in source.stored.tensors.items()}
    values = {name: raw.hex() for name, raw in source.values.items()}
    for name, p in written.params.items() if written is not None and reader is not None else ():
        if name not in values and not boxes_copyable(p) and p.source.nbytes <= VALUE_BYTES and p.source.decode is None:
            stored = source._stored_tensor(source.old.params[name], reader)
            values[name] = bytes(stored.contiguous().view(-1).view(_u8()).numpy()).hex()
    return {"shard_info": json.loads(json.dumps(source.shard_info.to_dict())), "tensors": tensors, "values": values}


def _steps_key(plan: ParamPlan) -> tuple[object, ...]:
    return tuple((s.name, repr(s.args), s.in_shape, s.in_dtype) for s in plan.steps)


def open_shards(checkpoint: Checkpoint, *, verify: bool = False) -> ShardsSource:
    """Open converted directory ``checkpoint`` as a source for another N: its record, its old plan, and every rank
    file checked against the manifest (present, size, the rank its header names, and with ``verify`` its checksum)
    and against the old plan (each tensor's shape and dtype), before any tensor byte is read."""
    manifest = checkpoint.manifest or {}
    where = str(checkpoint.root / MANIFEST_NAME)
    n_old = manifest["num_shards"]
    record = manifest.get(RECORD_KEY)
    if not isinstance(record, dict):
        raise CheckpointError(
            f"was converted for num_shards={n_old} without a source record (an older shardload, or a shard_info "
            "that is not JSON); load it with that N, or convert the source checkpoint",
            file=where,
        )
    info, stored, values = read_record(record, checkpoint, where)
    try:
        old = build_plan(info, stored, n_old)
    except ShardloadError as err:
        raise CheckpointError(f"its source record does not plan for its own num_shards={n_old}: {err}",
                              file=where) from None  # fmt: skip
    if old.resolved_shard_info()["params"] != manifest["shard_info"].get("params"):
        raise CheckpointError("its source record disagrees with its shard_info", file=where)
    mesh = manifest.get("mesh")
    old_layout = Mesh(pp=mesh["pp"], tp=n_old, pp_layers=tuple(mesh["pp_layers"])) if mesh else Mesh(tp=n_old)
    stages = manifest_stages(manifest)
    entries = {e["path"]: e for e in manifest["files"]}
    files: dict[tuple[int, int], Path] = {}
    headers: dict[tuple[int, int], dict[str, TensorInfo]] = {}
    hashes = OutputRecord(checkpoint.root, manifest)  # read once, for rank files listed by their leaves
    for s in range(stages):
        for r in range(n_old):
            entry = entries[rank_file_name(r, n_old, s, stages)]
            path, problem = check_entry(checkpoint.root, entry, verify, manifest, record=hashes)
            if problem is not None:
                raise problem
            files[(s, r)] = path
            headers[(s, r)] = read_header(path)
    holder = _check_headers(old, headers, stages, n_old)
    extra = [checkpoint.root / MANIFEST_NAME]
    return ShardsSource(checkpoint, info, stored, old, old_layout, files, headers, holder, values, extra)


def read_record(
    record: dict[str, Any], checkpoint: Checkpoint, where: str
) -> tuple[ShardInfo, Checkpoint, dict[str, bytes]]:
    """The shard_info, the stored tensors (as a header-only checkpoint) and the recorded values of a source record."""

    def bad(reason: str) -> CheckpointError:
        return CheckpointError(f"inconsistent manifest: '{RECORD_KEY}' {reason}", file=where)

    tensors, values = record.get("tensors"), record.get("values", {})
    if not isinstance(tensors, dict) or not isinstance(values, dict):
        raise bad("needs a 'tensors' object and a 'values' object")
    info = ShardInfo.from_dict(record.get("shard_info"), source=f"<{RECORD_KEY} of {where}>")
    stored: dict[str, TensorInfo] = {}
    nowhere = checkpoint.root / STORED
    for name, entry in tensors.items():
        ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and entry[0] in DTYPES
        ok = ok and isinstance(entry[1], list)
        if not ok or not all(type(d) is int and d >= 0 for d in entry[1]):
            raise CheckpointError(f"inconsistent manifest: bad stored tensor entry {entry!r}", file=where, param=name)
        shape = tuple(entry[1])
        stored[name] = TensorInfo(name, entry[0], shape, nowhere, 0, prod(shape) * itemsize(entry[0]))
    raw: dict[str, bytes] = {}
    for name, text in values.items():
        try:
            raw[name] = bytes.fromhex(text)
        except (TypeError, ValueError):
            raise CheckpointError(
                "inconsistent manifest: a recorded value is not hex", file=where, param=name
            ) from None
    return info, Checkpoint(checkpoint.root, checkpoint.root, "safetensors", stored), raw


def _check_headers(
    old: ModelPlan, headers: dict[tuple[int, int], dict[str, TensorInfo]], stages: int, n_old: int
) -> dict[str, int]:
    """Every old rank file must hold its stage's tensors, each of the old plan's shape and dtype; returns the
    stage each parameter is read from."""
    holder: dict[str, int] = {}
    for s in range(stages):
        names = set(headers[(s, 0)])
        for r in range(n_old):
            found = headers[(s, r)]
            for name, info in found.items():
                want = old.params.get(name)
                if want is None:
                    raise CheckpointError("is no parameter of the directory's plan", file=str(info.file), param=name)
                if (info.shape, info.dtype) != (tuple(want.shape), want.dtype):
                    raise CheckpointError(
                        f"is {info.dtype} {list(info.shape)}, but the manifest's plan gives rank {r} "
                        f"{want.dtype} {list(want.shape)}",
                        file=str(info.file), param=name,
                    )  # fmt: skip
            if set(found) != names:
                other = sorted(names ^ set(found))[0]
                raise CheckpointError(
                    f"rank files of one stage hold different tensors ({other!r} is in one, not the other)",
                    file=str(next(iter(found.values())).file if found else rank_file_name(r, n_old, s, stages)),
                )
            for name in found:
                holder.setdefault(name, s)
    missing = [name for name in old.params if name not in holder]
    if missing:
        raise CheckpointError("is held by no rank file", file=str(old.checkpoint.root if old.checkpoint else ""),
                              param=missing[0])  # fmt: skip
    return holder


def assemble_ranks(
    source: ShardsSource,
    layout: Mesh,
    ranks: Sequence[int],
    devices: Sequence[Any],
    progress: Callable[[int, int], None] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Global ranks ``ranks`` of ``layout`` (rank ``ranks[k]`` on ``devices[k]``), read out of ``source`` (a
    directory converted for another layout, a pre-sharded cache); each rank reads only the boxes it needs.
    ``progress(done, total)`` counts the tensors assembled. The load that asks checks every file it read at its
    end (:func:`shardload.format.input_log.check_recorded`)."""
    stages = source.plan(layout)
    out: list[dict[str, torch.Tensor]] = []
    total = sum(len(stages[layout.coord(rank).pp].params) for rank in ranks)
    done = 0
    with reader_for(source.checkpoint.path) as reader:
        for rank, device in zip(ranks, devices, strict=True):
            coord = layout.coord(rank)
            state = {}
            for param in stages[coord.pp].params.values():
                state[param.name] = source.tensor(param, coord.tp, reader).to(device)
                done += 1
                if progress is not None:
                    progress(done, total)
            out.append(state)
    return out


@dataclass(frozen=True)
class Written:
    """What :func:`write_shards` wrote: the new plan, the rank files, the other files."""

    plan: ModelPlan
    rank_files: list[WrittenFile]
    other_files: list[WrittenFile]


def write_shards(
    source: ShardsSource,
    layout: Mesh,
    out: Path,
    *,
    overwrite: bool,
    fsync: bool | None,
    progress: Any = None,
    sha256: bool = False,
) -> Written:
    """Write ``source`` (a directory converted for another layout, a pre-sharded cache) as a directory converted for
    ``layout``, streamed one tensor at a time, with the integrity record every convert writes (hashed as written;
    ``sha256``: each file's sha256 too, in a version-1 manifest); everything is planned and checked before the
    output is created."""
    from ..sources.manifest import digest_to_write
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
    from .writer import FileWriter, file_order, new_conversion, rank_header, write_output_record, written_record

    checkpoint = source.checkpoint
    stages = source.plan(layout)
    files = sorted(set(source.files.values()) | {f for f in source.extra_files if f.name != MANIFEST_NAME})
    stamps = stamp_sources(files)
    exists = check_output(out, source_paths(checkpoint.root, [*files, *source.extra_files]), overwrite=overwrite)
    durable = exists if fsync is None else fsync
    whole_plan = build_plan(source.shard_info, source.stored, layout.tp)  # the manifest's, and the caller's
    with reader_for(checkpoint.path) as reader:
        record = record_of(source, whole_plan, reader)
    conversion = new_conversion()
    sizes = [{"path": f.name, "size": f.stat().st_size} for f in files]
    manifest = rank_files_manifest(layout, stages, whole_plan.resolved_shard_info(), sizes, conversion, sha256)
    manifest[RECORD_KEY] = record
    digest = digest_to_write(manifest)  # each rank file's seal: this plan
    written: list[WrittenFile] = []
    try:
        with (
            StagingDir(out, fsync, synced=durable, overwrite=overwrite) as staging,
            reader_for(checkpoint.path) as reader,
        ):
            for pp, plan in enumerate(stages):
                for r in range(layout.tp):
                    name = staging.dir / rank_file_name(r, layout.tp, pp, len(stages))
                    handle = FileWriter(name, durable=durable, leaves=True, sha256=sha256)
                    try:
                        handle.write_header(rank_header(plan, r, pp, len(stages), conversion, digest))
                        for param in file_order(plan):
                            t = source.tensor(param, r, reader)
                            if t.numel():
                                handle.write(t.view(-1).view(_u8()).numpy().data)
                            if progress is not None:
                                progress(0, param.name)
                        written.append(handle.finish())
                    finally:
                        handle.close()
            output = write_output_record(staging.dir, written_record(written), durable)  # hashed as written
            manifest["integrity"] = integrity_entry(output)
            others = [output, *publish_with_manifest(staging, checkpoint.root, stamps, [*written, output], manifest,
                                                     durable)]  # fmt: skip
    except OSError as err:
        raise write_error(err, out) from None
    return Written(whole_plan, written, others)


def open_presharded(checkpoint: Checkpoint, shard_info: ShardInfo) -> ShardsSource:
    """A TVM/MLC cache pre-sharded for N_old (``NAME_shard-K-of-N`` records) as a source for another N:
    ``shard_info`` says how each whole parameter splits (its form for any N); each pre-sharded parameter's whole
    shape is the one whose plan for N_old gives exactly its records' shape (:func:`whole_view`)."""
    n_old = checkpoint.split_for
    assert n_old is not None
    virtual = whole_view(checkpoint, shard_info)
    old_info = ShardInfo({k: v for k, v in shard_info.params.items() if k in checkpoint.shards},
                         source=shard_info.source)  # fmt: skip
    old = build_plan(old_info, virtual, n_old)
    headers = {
        (0, r): {**{n: t for n, t in checkpoint.tensors.items() if n not in checkpoint.shards},
                 **{n: parts[r] for n, parts in checkpoint.shards.items()}}
        for r in range(n_old)
    }  # fmt: skip
    holder = dict.fromkeys(virtual.tensors, 0)
    extra = sorted({t.file for t in checkpoint.tensors.values()} | set(checkpoint.files))
    return ShardsSource(checkpoint, shard_info, virtual, old, Mesh(tp=n_old), {}, headers, holder, {}, extra)
