"""How each type of source loads ranks: one function per type of :mod:`shardload.sources.source_types`.

:func:`load_source` is the one route ``load`` and ``load_rank`` share: the options were checked against the
source-type table already, so a route only reads. Whole tensors are planned and read run by run (or their reading
shared by a process group); rank files are read whole; split records are a rank's own part; every kind of boxes
(another conversion's rank files, a pre-sharded cache at another N, a registered split format) is opened as old rank
tensors and each rank assembled from its boxes of them (:mod:`.reshard`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from ..errors import ShardloadError
from ..format import input_log
from ..format.shard_info import ShardInfo
from ..models.plan_source import shard_info_for
from ..planning.mesh import Mesh, MeshCoord
from ..planning.plan import ModelPlan, ParamPlan, build_plan
from ..planning.presharded import records_info
from ..sources.checkpoint import Checkpoint, read_header
from ..sources.object_reader import reader_for
from ..sources.source_types import (
    Boxes,
    ConvertedBoxes,
    PreshardedBoxes,
    RankFiles,
    SavedBoxes,
    Source,
    SplitRecords,
    WholeTensors,
    check_options,
)
from .host_stripes import host_stripes
from .integrity import converted_verifier, manifest_root, verifier, wrapped
from .load_options import LoadOptions
from .paths import data_path_for
from .reshard import ShardsSource, assemble_ranks, open_presharded, open_shards
from .run import materialize, run_plan, stages_of
from .steps import same_bytes
from .transfer import Transfer, reader_for_plan
from .verify import rank_file

if TYPE_CHECKING:
    import torch


States = list[dict[str, "torch.Tensor"]]


def load_source(
    source: Source, mesh: Mesh, ranks: Sequence[int], devices: Sequence[Any], options: LoadOptions, label: str
) -> States:
    """Global ranks ``ranks`` of ``mesh`` (rank ``ranks[k]`` on ``devices[k]``) read out of ``source`` by the
    route of its type (its options checked already; a split format's rank files hashed now, after that check, for
    ``verify=True``); ``label`` names the load on a progress line. Every local file the load took the identity of
    is checked again at the end, whichever route read it (a split source's second part, a cache's record files)."""
    source = source.checked() if options.verify is True else source
    for kind in type(source).__mro__:
        if kind in _ROUTES:
            states = _ROUTES[kind](source, mesh, ranks, devices, options, label)
            input_log.check_recorded()
            return states
    raise TypeError(f"no route loads a {type(source).__name__}")


def open_boxes(source: Source, verify: bool | str, shard_info: Any = None) -> ShardsSource:
    """The old rank tensors of a split source, opened (and with ``verify`` each rank file checked whole) for
    boxes to be read out of them: rank files (a converted directory, at any mesh), a pre-sharded cache, or what a
    registered split format opened."""
    if isinstance(source, SavedBoxes):
        return cast("ShardsSource", source.opened)  # what a split format opens is a ShardsSource (OpenedSplit)
    if isinstance(source, (RankFiles, ConvertedBoxes)):
        return open_shards(source.checkpoint, verify=verify is True)
    if isinstance(source, (PreshardedBoxes, SplitRecords)):
        return open_presharded(source.checkpoint, shard_info_for(source.checkpoint, shard_info))
    raise ShardloadError(f"{source.what} is not stored split; nothing to read boxes of", file=source.name)


def boxes_to_write(source: Source, verify: bool | str, shard_info: Any, mesh: Mesh | None) -> ShardsSource:
    """A split source opened for a writer (``convert``, a ``--layout`` target) to read every rank's boxes of: the
    options a writer takes checked against the source-type table first, then its rank files (with ``verify=True``
    each hashed whole)."""
    given = {"shard_info": shard_info is not None, "verify_root": isinstance(verify, str), "verify": bool(verify)}
    check_options(source, given, mesh)  # before any file is hashed
    return open_boxes(source.checked() if verify is True else source, verify, shard_info)


def _boxes(source: Source, mesh: Mesh, ranks: Sequence[int], devices: Sequence[Any], options: LoadOptions,
           label: str) -> States:  # fmt: skip
    """Each rank assembled from its boxes of the old rank tensors."""
    progress = progress_for(options.progress, label, "tensors")
    return assemble_ranks(open_boxes(source, options.verify, options.shard_info), mesh, ranks, devices, progress)


def _whole(source: Source, mesh: Mesh, ranks: Sequence[int], devices: Sequence[Any], options: LoadOptions,
           label: str) -> States:  # fmt: skip
    """A source of whole tensors: planned for ``mesh``, each pipeline stage's ranks read together (each byte once;
    data-parallel replicas copied), or one rank's reading shared by a process group. A rank loading beside others
    on its host reads its stripe of the files first (:mod:`.host_stripes`), while it plans."""
    checkpoint = source.checkpoint
    wrap = verifier(checkpoint, options.verify, source.name)
    with host_stripes(source, mesh, ranks, options) as stripes:  # this rank's stripe of the files, read meanwhile
        plan = build_plan(shard_info_for(checkpoint, options.shard_info), checkpoint, mesh.tp)
        stages = stages_of(plan, mesh)
        stripes.wait()
        if options.group is not None:
            (rank,) = ranks
            return [_whole_shared(source, plan, stages, mesh, mesh.coord(rank), devices[0], options, wrap, label)]
        return _by_stage(stages, plan, mesh, ranks, devices, options, wrap, label)


def _by_stage(stages: list[ModelPlan], plan: ModelPlan, mesh: Mesh, ranks: Sequence[int], devices: Sequence[Any],
              options: LoadOptions, wrap: Any, label: str) -> States:  # fmt: skip
    """``ranks`` read stage by stage: the distinct tensor-parallel ranks of a stage in one pass (one at a time for
    views of the files), a data-parallel replica copied from the first rank of its tensor-parallel rank."""
    result: dict[int, dict[str, torch.Tensor]] = {}
    by_pp: dict[int, list[int]] = {}
    for rank in ranks:
        by_pp.setdefault(mesh.coord(rank).pp, []).append(rank)
    for pp, members in by_pp.items():
        first: dict[int, int] = {}  # tp -> the first of ranks holding it
        for rank in members:
            first.setdefault(mesh.coord(rank).tp, rank)
        groups = [[tp] for tp in first] if options.mmap else [list(first)]
        where = f"{label} stage {pp}" if len(by_pp) > 1 or (mesh.pp > 1 and len(ranks) > 1) else label
        for tps in groups:
            devs = [devices[ranks.index(first[tp])] for tp in tps]
            states = _read_stage(stages[pp], plan, tps, devs, options, wrap, progress_for(options.progress, where))
            for tp, state in zip(tps, states, strict=True):
                result[first[tp]] = state
        for rank in members:
            if rank not in result:
                state = result[first[mesh.coord(rank).tp]]
                device = devices[ranks.index(rank)]
                result[rank] = {k: t.to(device, copy=True) for k, t in state.items()}
    return [result[rank] for rank in ranks]


def _read_stage(stage: ModelPlan, plan: ModelPlan, tps: list[int], devices: list[Any], options: LoadOptions,
                wrap: Any, progress: Any) -> States:  # fmt: skip
    """One stage's ranks ``tps`` read; with a destination (one rank), narrowed to it and read into its tensors."""
    fill = options.into
    if fill is None:
        return run_plan(stage, tps, devices, mmap=options.mmap, progress=progress, wrap=wrap,
                        read_options=options.read_options)  # fmt: skip
    stage = fill.select(stage, plan)
    dests = fill.destinations(stage)
    out = {n: t.detach() for n, t in dests.items()}
    state = run_plan(stage, tps, devices, mmap=options.mmap, progress=progress, wrap=wrap,
                     read_options=options.read_options, out=out)[0]  # fmt: skip
    return [{**state, **dests}]  # the caller's own tensors, not their detached aliases


def _whole_shared(source: Source, plan: ModelPlan, stages: list[ModelPlan], mesh: Mesh, coord: MeshCoord,
                  device: Any, options: LoadOptions, wrap: Any, label: str) -> dict[str, torch.Tensor]:  # fmt: skip
    """One rank of a source of whole tensors, the reading of the group's chunks shared (:mod:`.exchange`); with a
    verifier, what the peers sent is checked too."""
    from ..planning.group_reads import plan_digest
    from .exchange import load_shared

    group = share_group(options.group, source.name)

    def slot_params(key: tuple[int, int]) -> tuple[list[ParamPlan], int]:
        return list(stages[key[0]].params.values()), key[1]

    digest = plan_digest(plan, stages) + str(mesh).encode()
    progress = progress_for(options.progress, label, "exchange rounds")
    with wrapped(reader_for_plan(plan.params.values()), wrap) as reader:
        # what the peers sent is checked too, before the ranks agree: a broken or hostile peer cannot inject bytes,
        # and every rank fails with the receiver
        check = (
            (lambda state: check_received(stages[coord.pp].params.values(), coord.tp, state, reader)) if wrap else None
        )
        return load_shared(slot_params, digest, (coord.pp, coord.tp), device, reader, group, progress, source.name,
                           check)  # fmt: skip


def _rank_files(source: Source, mesh: Mesh, ranks: Sequence[int], devices: Sequence[Any], options: LoadOptions,
                label: str) -> States:  # fmt: skip
    """A converted directory at its own mesh: each rank's own file read whole (or shared by a group)."""
    checkpoint = source.checkpoint
    if options.group is not None:
        (rank,) = ranks
        progress = progress_for(options.progress, label, "exchange rounds")
        return [_rank_files_shared(checkpoint, mesh, mesh.coord(rank), devices[0], options.verify,
                                   share_group(options.group, source.name), progress)]  # fmt: skip
    return [
        _rank_file(checkpoint, mesh, mesh.coord(rank), device, options,
                   progress_for(options.progress, label if len(ranks) == 1 else f"{label} rank {rank}"))
        for rank, device in zip(ranks, devices, strict=True)
    ]  # fmt: skip


def _rank_file(
    checkpoint: Checkpoint,
    mesh: Mesh,
    coord: MeshCoord,
    device: Any,
    options: LoadOptions,
    progress: Callable[[int, int], None] | None,
) -> dict[str, torch.Tensor]:
    """One rank's file of a converted directory: its tensors (a destination: those named, or into its tensors)."""
    verify, fill, read_options = options.verify, options.into, options.read_options
    wrap = converted_verifier(checkpoint, verify)
    path = rank_file(checkpoint, coord.tp, mesh, stage=coord.pp, checksum=verify is True and wrap is None)
    infos = list(read_header(path).values())
    if fill is not None and fill.params is not None:
        fill.known({info.name for info in infos})
        infos = [info for info in infos if info.name in fill.params]
    with (
        wrapped(
            reader_for(path, read_options and read_options.object_cost), wrap and (lambda r: wrap(r, {path: infos}))
        ) as reader,
        Transfer(
            reader,
            path=data_path_for([device], mmap=options.mmap),
            read_options=read_options,
            defer=True,
            progress=progress,
        ) as transfer,
    ):
        if fill is not None and fill.out is not None:  # whole stored tensors, each read into its destination
            from ..planning.group_reads import whole_tensors

            plans = {p.name: p for p in whole_tensors(infos)}
            dests = fill.destinations(ModelPlan(1, ShardInfo(source="<a rank file>"), None, plans))
            state = {n: transfer.param(p, [0], [device], out=[dests[n].detach()] if n in dests else None)[0]
                     for n, p in plans.items()}  # fmt: skip
            transfer.wait()
            return {**state, **dests}
        tensors = transfer.tensors(infos, device)
        transfer.wait()
    return {info.name: t for info, t in zip(infos, tensors, strict=True)}


def _rank_files_shared(
    checkpoint: Checkpoint,
    mesh: Mesh,
    coord: MeshCoord,
    device: Any,
    verify: bool | str,
    group: Any,
    progress: Callable[[int, int], None] | None,
) -> dict[str, torch.Tensor]:
    """A rank of a converted directory, the reading of the group's rank files shared (dp replicas read each once).
    ``verify`` checks every byte read through the output's record, and what peers sent too: against the pinned root,
    or with ``verify=True`` the root the manifest names (the record that lists the rank files' leaves). Every
    file's size is checked."""
    from ..planning.group_reads import whole_tensors
    from .exchange import load_shared

    own = (coord.pp, coord.tp)
    if verify is True:  # the bytes a peer sends for this rank's file are checked too, not only the file's own copy
        verify = manifest_root(checkpoint)
    wrap = converted_verifier(checkpoint, verify)

    def slot_params(key: tuple[int, int]) -> tuple[list[ParamPlan], int]:
        path = rank_file(checkpoint, key[1], mesh, stage=key[0])
        return whole_tensors(read_header(path).values()), 0

    manifest = json.dumps(checkpoint.manifest, sort_keys=True, default=str).encode()
    digest = hashlib.sha256(manifest + str(mesh).encode()).digest()
    files: dict[Any, list[Any]] = {}
    if wrap is not None:  # every rank file a peer may read for this rank (headers only: a few KiB each)
        keys = [(pp, tp) for pp in range(mesh.pp) for tp in range(mesh.tp)]
        files = {path: list(read_header(path).values()) for path in (rank_file(checkpoint, tp, mesh, stage=pp)
                                                                     for pp, tp in keys)}  # fmt: skip
    with wrapped(reader_for(checkpoint.path), wrap and (lambda r: wrap(r, files))) as reader:
        # the bytes peers sent for this rank's file are checked against the record too, before the ranks agree
        check = (lambda state: check_received(slot_params(own)[0], 0, state, reader)) if wrap is not None else None
        return load_shared(slot_params, digest, own, device, reader, group, progress, str(checkpoint.path), check)


def _split_records(source: Source, mesh: Mesh, ranks: Sequence[int], devices: Sequence[Any], options: LoadOptions,
                   label: str) -> States:  # fmt: skip
    """A cache pre-sharded for this N: each rank's own part of every split parameter, and every tensor stored whole."""
    checkpoint = source.checkpoint
    wrap = verifier(checkpoint, options.verify, source.name)
    build_plan(records_plan(checkpoint, options.shard_info), checkpoint, mesh.tp)  # checks N and the steps
    result = []
    for rank, device in zip(ranks, devices, strict=True):
        tp = mesh.coord(rank).tp
        view = checkpoint.rank_view(tp)
        plan = build_plan(ShardInfo(source=f"<rank {tp}'s part of {checkpoint.name}>"), view, 1)
        where = label if len(ranks) == 1 else f"{label} rank {rank}"
        result.extend(_read_stage(plan, plan, [0], [device], options, wrap, progress_for(options.progress, where)))
    return result


def records_plan(checkpoint: Checkpoint, shard_info: Any) -> ShardInfo:
    """The shard_info a cache pre-sharded for the N it is loaded at is planned with (:func:`records_info` of the
    shard_info given, or beside it)."""
    return records_info(checkpoint, shard_info_for(checkpoint, shard_info))


_ROUTES: Mapping[type[Source], Callable[..., States]] = {
    WholeTensors: _whole,
    RankFiles: _rank_files,
    SplitRecords: _split_records,
    Boxes: _boxes,
}
"""Each type of source, the function that loads its ranks (a subclass takes its nearest base's)."""


def share_group(group: Any, where: str) -> Any:
    """The process group ``group`` names (True: the default group; returned as None), checked to be usable."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ShardloadError("group= needs an initialised torch.distributed process group", file=where)
    if group is True:
        return None
    if isinstance(group, dist.ProcessGroup):
        if dist.get_rank(group) < 0:
            raise ShardloadError("group= names a process group this rank is not a member of", file=where)
        return group
    raise ShardloadError(f"group= must be True, False or a torch.distributed ProcessGroup, got {group!r}",
                         file=where)  # fmt: skip


def progress_for(progress: Any, label: str, unit: str = "read jobs") -> Callable[[int, int], None] | None:
    """The progress callback of a load: a callable as given; True draws a line on a terminal, under
    torch.distributed only on the node's first rank (``LOCAL_RANK`` 0, else global rank 0)."""
    if callable(progress):
        return progress
    if progress is not True:
        return None
    import torch.distributed as dist

    local = os.environ.get("LOCAL_RANK")
    if local is not None:
        first = local == "0"
    else:
        first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    return progress_line(label, unit) if first else None


def progress_line(label: str, unit: str = "read jobs") -> Callable[[int, int], None] | None:
    """A callback drawing ``label: done/total unit (pct)`` on stderr, or None when stderr is not a terminal."""
    import sys

    if not sys.stderr.isatty():
        return None

    def draw(done: int, total: int) -> None:
        sys.stderr.write(f"\r{label}: {done}/{total} {unit} ({100 * done // total if total else 100}%)")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return draw


def check_received(params: Iterable[ParamPlan], rank: int, state: Mapping[str, torch.Tensor], reader: Any) -> None:
    """Check a rank's tensors, received from its ``share_reads`` group, against the integrity record ``reader`` (a
    :class:`~shardload.sources.verified.VerifiedReader`) checks with: each tile covering the rank's runs is hashed
    from the received bytes (completed from storage where a tile reaches past them); a tensor read whole (a
    compute step) is read again, checked, and compared."""
    import numpy as np

    from ..planning.runs import param_runs
    from ..sources.verified import IntegrityError, ReceivedBytes, VerifiedReader, buffer_array

    culprit = "a peer of the group sharing reads sent bytes that differ from the checkpoint"
    for p in params:
        got = state[p.name]
        runs = param_runs(p, [rank])
        if runs is not None and not len(runs.src):
            continue
        if runs is None:
            expected = materialize(p, reader, [rank])[0]
            if not same_bytes(expected, got.cpu()):
                raise IntegrityError(f"bytes received for this parameter: {culprit}", file=str(p.source.file),
                                     param=p.name)  # fmt: skip
            continue
        cpu = got.detach().cpu().contiguous()
        inner = ReceivedBytes(runs.src, runs.length, runs.dst, buffer_array(cpu), reader.inner)
        check = VerifiedReader(inner, reader.files, reader.hash_name)
        check.culprit = culprit
        check.read_runs(p.source.file, runs.src, runs.length, np.zeros(len(runs.src), dtype=np.int64), runs.dst, [cpu])
