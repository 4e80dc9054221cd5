"""Execution: run a plan's I/O and steps to produce per-rank tensors on their devices.

Remap-only parameters are read run by run straight from the file into each rank's tensor
(see :mod:`shardload.engine.transfer`), so a rank reads only its own bytes and every byte is read once;
parameters with a compute step are read whole, run through their step functions, and split.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeAlias

from ..errors import CheckpointError, ShardloadError
from ..format.input_log import records_inputs
from ..format.shard_info import ShardInfo
from ..models.plan_source import shard_info_for
from ..planning.mesh import Mesh, MeshCoord, as_mesh, stage_plans
from ..planning.plan import ModelPlan, ParamPlan, build_plan
from ..sources.checkpoint import open_checkpoint, read_header
from ..sources.dtypes import to_torch
from ..sources.object_reader import reader_for
from ..sources.objects import ObjectPath
from ..sources.reader import RunReader
from .devices import resolve_device
from .integrity import converted_verifier, verifier, wrapped
from .paths import data_path_for
from .read_strategy import ReadOptions
from .reshard import (
    ShardsSource,
    load_ranks,
    needs_reshard,
    open_presharded,
    open_shards,
    presharded_verify,
    shards_verify,
)
from .transfer import Transfer, reader_for_plan
from .verify import rank_file
from .vllm_plan import open_vllm_shards

if TYPE_CHECKING:
    import torch

    from ..sources.checkpoint import Checkpoint

    Destinations: TypeAlias = (
        Mapping[str, torch.Tensor] | Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor | None]
    )
    """``load_rank``'s ``out``: tensor name -> the caller's tensor, or ``(name, shape, dtype) -> tensor or None``."""


def materialize(plan: ParamPlan, files: RunReader, ranks: Sequence[int]) -> list[torch.Tensor]:
    """Build this parameter's shards for ``ranks`` on the CPU (fresh, contiguous tensors), reading synchronously."""
    with Transfer(files, read_options=ReadOptions(threads=0)) as transfer:
        shards = transfer.param(plan, ranks)
        transfer.wait()
    return shards


def iter_shards(
    plan: ModelPlan, ranks: Sequence[int], wrap: Callable[[RunReader], RunReader] | None = None
) -> Iterator[tuple[ParamPlan, list[torch.Tensor]]]:
    """Stream ``(param plan, shards for ranks)`` one parameter at a time, in checkpoint order, on the CPU
    (``wrap``: a verifying reader)."""
    with wrapped(reader_for_plan(plan.params.values()), wrap) as reader, Transfer(reader) as transfer:
        for param in plan.params.values():
            shards = transfer.param(param, ranks)
            transfer.wait()
            yield param, shards


@dataclass(frozen=True)
class Fill:
    """``load_rank``'s ``params`` and ``out``: which stored tensors a rank reads, and into whose tensors."""

    params: frozenset[str] | None
    out: Destinations | None
    where: str

    @classmethod
    def of(cls, params: Collection[str] | None, out: Destinations | None, where: str) -> Fill | None:
        """The arguments checked for type (None when both are left out)."""
        if params is None and out is None:
            return None
        if params is not None and (isinstance(params, (str, bytes)) or not isinstance(params, Collection)):
            raise ShardloadError(f"params must be a collection of tensor names, got {params!r}", file=where)
        if out is not None and not (isinstance(out, Mapping) or callable(out)):
            raise ShardloadError(f"out must be a mapping of names to tensors or a callable, got {out!r}", file=where)
        return cls(None if params is None else frozenset(params), out, where)

    def known(self, names: Collection[str]) -> None:
        """Raise when ``params`` names a tensor that is not among ``names`` (all the checkpoint holds)."""
        unknown = sorted(set(self.params or ()) - set(names))
        if unknown:
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise ShardloadError(f"params names a tensor the checkpoint does not hold{more}", file=self.where,
                                 param=unknown[0])  # fmt: skip

    def select(self, stage: ModelPlan, whole: ModelPlan) -> ModelPlan:
        """``stage`` (a pipeline stage of the plan ``whole``, or all of it) narrowed to ``params``."""
        if self.params is None:
            return stage
        self.known(whole.params)
        return replace(stage, params={n: p for n, p in stage.params.items() if n in self.params})

    def destinations(self, plan: ModelPlan) -> dict[str, torch.Tensor]:
        """The caller's tensors by name, each checked against the rank's shape and dtype in ``plan``."""
        import torch

        if self.out is None:
            return {}
        if not isinstance(self.out, Mapping):
            given = {n: self.out(n, tuple(p.shape), to_torch(p.dtype)) for n, p in plan.params.items()}
            found = {n: t for n, t in given.items() if t is not None}
        else:
            found = dict(self.out)
        for name, t in found.items():
            p = plan.params.get(name)
            if p is None:
                raise ShardloadError("out names a tensor this rank does not read (not in the checkpoint, not in "
                                     "params, or another pipeline stage's)", file=self.where, param=name)  # fmt: skip
            if not isinstance(t, torch.Tensor):
                raise ShardloadError(f"out gives a {type(t).__name__}, not a tensor", file=self.where, param=name)
            want = (list(p.shape), to_torch(p.dtype))
            if (list(t.shape), t.dtype) != want:
                raise ShardloadError(f"out tensor is {list(t.shape)} {t.dtype}, this rank's tensor is {want[0]} "
                                     f"{want[1]}", file=self.where, param=name)  # fmt: skip
            if not t.is_contiguous() or t.device.type == "meta":
                what = "on the meta device (no memory)" if t.device.type == "meta" else "not contiguous"
                raise ShardloadError(f"out tensor is {what}; give a contiguous tensor of {want[0]}", file=self.where,
                                     param=name)  # fmt: skip
        _disjoint(found, self.where)
        return found


def _disjoint(tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Raise when two of the caller's (contiguous) tensors share memory: their reads would overwrite each other."""
    spans = sorted(
        (str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
        for name, t in tensors.items()
        if t.numel()
    )
    for (device, _, end, first), (other, start, _, name) in itertools.pairwise(spans):
        if device == other and start < end:
            raise ShardloadError(f"out tensor shares memory with {first}'s; give each tensor its own memory",
                                 file=where, param=name)  # fmt: skip


def default_devices(num_shards: int) -> list[str]:
    """``cuda:0..N-1`` when that many GPUs are visible, otherwise the CPU for every rank."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= num_shards:
        return [f"cuda:{r}" for r in range(num_shards)]
    return ["cpu"] * num_shards


@records_inputs
def load(
    model: str | os.PathLike[str],
    num_shards: int | None = None,
    devices: Sequence[Any] | None = None,
    shard_info: Any = None,
    *,
    mesh: Mesh | str | Mapping[str, int] | None = None,
    verify: bool | str = False,
    progress: bool | Callable[[int, int], None] = False,
    read_options: ReadOptions | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Load every rank's shard of ``model``: a list of state dicts, the one for global rank r on ``devices[r]``.

    ``model`` is a directory (``model.safetensors`` or an HF index), a ``.safetensors`` file,
    or a directory written by :func:`convert`. Each stored byte is read once. With ``mesh``
    (e.g. ``"pp=2,tp=4"``) rank r holds only its pipeline stage's parameters, tensor shard
    ``tp`` of them; ``num_shards`` may then be left out (it is the mesh's ``tp``). ``verify``
    checks a converted directory's sha256 sums (sizes are always checked), and every byte read from a source
    checkpoint against its integrity record (``verify=True``, or the record's root hash to pin it; see
    :func:`hash_checkpoint`). ``progress=True`` draws a
    progress line on stderr when it is a terminal; a callable gets ``(read jobs done, total)`` per stage.
    ``read_options`` (:class:`ReadOptions`) tunes how ranks read: strategy, threads, cold-read planning, object-store
    request cost.

    Example::

        shards = shardload.load("llama-dir", 8)          # cuda:0..7 when present, else CPU
        shards[3]["model.layers.0.self_attn.qkv_proj.weight"].shape
    """
    layout = layout_for(num_shards, mesh, len(devices) if devices is not None else None)
    world = layout.world_size
    if devices is not None and (isinstance(devices, (str, bytes)) or not hasattr(devices, "__len__")):
        raise ShardloadError(f"devices must be a list of {world} devices, got {devices!r}", file=str(model))
    devices = [resolve_device(d, str(model)) for d in devices] if devices is not None else default_devices(world)
    if len(devices) != world:
        what = f"num_shards={layout.tp}" if mesh is None else f"{world} ranks ({layout})"
        raise ShardloadError(f"got {len(devices)} devices for {what}", file=str(model))
    sharded = _sharded_state(model, shard_info, verify)
    if sharded is not None:  # vLLM's layout: every rank reads its boxes of the vLLM rank files
        return load_ranks(sharded, layout, range(world), devices)
    checkpoint = open_checkpoint(model)
    if checkpoint.kind == "converted":
        if shard_info is not None:
            raise ShardloadError("a converted directory carries its own shard_info; do not pass one", file=str(model))
        if needs_reshard(checkpoint, layout):  # converted for another N: each rank reads its boxes of the old files
            shards = open_shards(checkpoint, verify=shards_verify(verify, checkpoint.name))
            return load_ranks(shards, layout, range(world), devices)
        return [load_rank(model, r, layout.tp, devices[r], mesh=layout, verify=verify, read_options=read_options)
                for r in range(world)]  # fmt: skip
    if checkpoint.presharded is not None and checkpoint.presharded != layout.tp:  # cut for another N: reshard
        presharded_verify(verify, checkpoint.name)
        return load_ranks(open_presharded(checkpoint, shard_info_for(checkpoint, shard_info)), layout, range(world),
                          devices)  # fmt: skip
    wrap = verifier(checkpoint, verify, str(model))
    if checkpoint.presharded is not None:
        return [
            _load_presharded_rank(
                checkpoint, shard_info, layout, layout.coord(r), devices[r], False, wrap, read_options
            )
            for r in range(world)
        ]
    plan = build_plan(shard_info_for(checkpoint, shard_info), checkpoint, layout.tp)
    result: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for pp, stage in enumerate(stages_of(plan, layout)):
        first = [layout.rank(0, pp, tp) for tp in range(layout.tp)]
        report = _progress_line(f"loading stage {pp}" if layout.pp > 1 else "loading") if progress is True else None
        call = report or (progress if callable(progress) else None)
        devs = [devices[r] for r in first]
        states = run_plan(stage, range(layout.tp), devs, progress=call, wrap=wrap, read_options=read_options)
        for tp, state in enumerate(states):
            result[first[tp]] = state
            for dp in range(1, layout.dp):  # data-parallel replicas: the same tensors, copied
                rank = layout.rank(dp, pp, tp)
                result[rank] = {k: t.to(devices[rank], copy=True) for k, t in state.items()}
    return result


def _progress_line(label: str, unit: str = "read jobs") -> Callable[[int, int], None] | None:
    """A callback drawing ``label: done/total unit (pct)`` on stderr, or None when stderr is not a terminal."""
    import sys

    if not sys.stderr.isatty():
        return None

    def draw(done: int, total: int) -> None:
        sys.stderr.write(f"\r{label}: {done}/{total} {unit} ({100 * done // total}%)")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return draw


def run_plan(
    plan: ModelPlan,
    ranks: Sequence[int],
    devices: Sequence[Any],
    *,
    staged: bool = False,
    mmap: bool = False,
    progress: Callable[[int, int], None] | None = None,
    wrap: Callable[[RunReader], RunReader] | None = None,
    read_options: ReadOptions | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Every parameter of ``plan`` for ``ranks`` (rank ``ranks[k]`` on ``devices[k]``): all set up, then read by
    the reader threads and this one.

    ``staged`` sends CPU destinations through the staging buffers too (to test that path on the CPU);
    ``mmap`` (one CPU rank) maps what it can instead of reading it (see :func:`load_rank`); ``wrap`` wraps the
    reader (a verifying reader, :func:`~shardload.engine.integrity.verified_reader`); ``read_options`` sets the
    reader threads and a single rank's read strategy; ``out`` (one rank) gives checked destinations by name
    (:meth:`Fill.destinations`), filled in place of fresh tensors.
    """
    result: list[dict[str, torch.Tensor]] = [{} for _ in ranks]
    import torch

    one_rank = len(ranks) == 1 and torch.device(devices[0]).type in ("cpu", "cuda")
    with (
        wrapped(reader_for_plan(plan.params.values(), read_options), wrap) as reader,
        Transfer(
            reader,
            path=data_path_for(devices, mmap=mmap, one_rank=one_rank, staged=staged),
            read_options=read_options,
            defer=True,  # every parameter set up, then read (cold reads at once): see Transfer
            progress=progress,
        ) as transfer,
    ):
        for param in plan.params.values():
            dest = None if out is None else out.get(param.name)
            for k, t in enumerate(transfer.param(param, ranks, devices, out=None if dest is None else [dest])):
                result[k][param.name] = t
        transfer.wait()
    return result


def layout_for(num_shards: int | None, mesh: Any, world_size: int | None) -> Mesh:
    """The mesh to work on: ``mesh`` when given (checked against ``num_shards``), else ``tp=num_shards``."""
    if mesh is None:
        if num_shards is None:
            raise ShardloadError("give num_shards (or a mesh)")
        return Mesh(tp=num_shards)
    layout = as_mesh(mesh, world_size)
    assert layout is not None
    if num_shards is not None and num_shards != layout.tp:
        raise ShardloadError(f"num_shards={num_shards} disagrees with the mesh's tp={layout.tp}")
    return layout


def stages_of(plan: ModelPlan, layout: Mesh) -> list[ModelPlan]:
    """One plan per pipeline stage of ``layout`` (the plan itself when there is one stage)."""
    return [plan] if layout.pp == 1 else stage_plans(plan, layout)


def _dist_defaults(rank: int | None, num_shards: int | None) -> tuple[int, int]:
    if rank is not None and num_shards is not None:
        return rank, num_shards
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ShardloadError("rank and num_shards are required when no torch.distributed process group is initialised")
    return (dist.get_rank() if rank is None else rank), (dist.get_world_size() if num_shards is None else num_shards)


def _mesh_rank(mesh: Any, rank: int | None, num_shards: int | None) -> tuple[Mesh, int]:
    """Resolve ``mesh`` (Mesh, string, mapping or torch DeviceMesh) and this process's global rank."""
    if hasattr(mesh, "get_coordinate") and hasattr(mesh, "mesh_dim_names"):
        layout, own = Mesh.from_device_mesh(mesh)
        if rank is not None and rank != own:
            raise ShardloadError(f"rank={rank} disagrees with the DeviceMesh's rank {own}")
        rank = own
    else:
        import torch.distributed as dist

        group = dist.is_available() and dist.is_initialized()
        layout = layout_for(None, mesh, dist.get_world_size() if group else None)
        if rank is None:
            if not group:
                raise ShardloadError("rank is required when no torch.distributed process group is initialised")
            rank = dist.get_rank()
    if num_shards is not None and num_shards != layout.tp:
        raise ShardloadError(f"num_shards={num_shards} disagrees with the mesh's tp={layout.tp}")
    return layout, rank


_BOXES_READ_OPTIONS = "{what}, which read_options does not steer (leave read_options out)"
"""The refusal of ``read_options`` where a rank is assembled from boxes of rank files (``engine/reshard.py``)."""
_NO_SHARE_READS = "share_reads and mmap do not apply there (load without them)"
"""The refusal of share_reads and mmap there (said so, not "without share_reads", which reads as if it were missing)."""


@records_inputs
def load_rank(
    model: str | os.PathLike[str],
    rank: int | None = None,
    num_shards: int | None = None,
    device: Any = "cpu",
    shard_info: Any = None,
    *,
    mesh: Any = None,
    verify: bool | str = False,
    mmap: bool = False,
    share_reads: Any = False,
    progress: bool | Callable[[int, int], None] = False,
    read_options: ReadOptions | None = None,
    params: Collection[str] | None = None,
    out: Destinations | None = None,
) -> dict[str, torch.Tensor]:
    """Load only rank ``rank``'s shard of ``model``, reading only the bytes it needs; optionally into your tensors.

    Args:
        model (`str` or `os.PathLike`):
            A model directory (``model.safetensors``, an HF index), a ``.safetensors`` or ``.gguf`` file, a TVM
            tensor cache, a directory written by :func:`convert`, an ``s3://`` path or a Hub id.
        rank (`int`, *optional*):
            The rank to load (the global rank with ``mesh``). Default: the torch.distributed group's rank.
        num_shards (`int`, *optional*):
            N, the tensor-parallel size. Default: the group's world size (or the mesh's ``tp``).
        device (`str` or `torch.device`, defaults to ``"cpu"``):
            Where fresh tensors are made (tensors given by ``out`` stay on their own devices).
        shard_info (`str`, `dict` or :class:`ShardInfo`, *optional*):
            The plan's shard_info; default: ``shard_info.json`` beside the weights, else one made from config.json.
        mesh (:class:`Mesh`, `str`, mapping or torch ``DeviceMesh``, *optional*):
            A dp/pp/tp mesh (``"pp=2,tp=4"``): only this rank's pipeline stage is read.
        verify (`bool` or `str`, defaults to `False`):
            A converted file's sha256; for a source checkpoint, True (or the root hash ``shardload hash`` prints,
            which pins the record) checks every tile covering this rank's bytes before any byte is returned.
        mmap (`bool`, defaults to `False`):
            CPU only: a tensor that is one contiguous stretch of its file (a dim-0 shard, a replicated tensor,
            every tensor of a converted directory) comes back as a copy-on-write view of a private file mapping,
            no copy and no new memory; the rest is read as usual. The file must not be truncated or rewritten
            in place while the views live (SIGBUS), which a directory written by :func:`convert` never is.
        share_reads (`bool` or a torch.distributed ``ProcessGroup``, defaults to `False`):
            The ranks of the group (True: the default group), all making this call with their own rank, split
            the reading: each byte any of them needs is read by one rank and exchanged over collectives (gloo on
            CPU, NCCL on GPU), within ``shardload.engine.exchange.EXCHANGE_BYTES`` of memory; a rank that dies
            or hangs fails the others within ``EXCHANGE_TIMEOUT`` seconds, and ranks that planned other
            checkpoints or hold other bytes under the same headers are refused before any byte moves.
        progress (`bool` or callable, defaults to `False`):
            True draws a line on stderr when it is a terminal (one rank per node); a callable gets
            ``(done, total)`` read jobs or exchange rounds.
        read_options (:class:`ReadOptions`, *optional*):
            How the rank gets its bytes (``strategy="map"``, ``"read"``, ``"auto"``) and the reader threads; not
            with ``share_reads``, nor where the rank is assembled from boxes of rank files (a sharded_state
            directory, a directory converted for another N).
        params (collection of `str`, *optional*):
            The stored tensors to read (default: all). The others are neither read nor returned; a name the
            checkpoint does not hold is an error.
        out (mapping or callable, *optional*):
            Caller-owned tensors to fill in place instead of fresh ones (a server's parameter memory): a mapping
            ``name -> tensor``, or a callable ``(name, shape, dtype) -> tensor or None`` called once per tensor
            with this rank's shape and torch dtype (None: a fresh tensor). Each must be contiguous, share no
            memory with another, and be of exactly that shape and dtype; a mismatch, or a name this rank does not
            read, raises before any byte is read.
            Not with ``mmap`` or ``share_reads``, nor on a checkpoint read for another N than it was cut for.
            If the load raises later, the destinations' contents are unspecified.

    Returns:
        `dict[str, torch.Tensor]`: this rank's tensors under the checkpoint's names, with per-rank shapes; those
        ``out`` gave are the caller's own tensors, filled.

    Example::

        state = shardload.load_rank("llama-dir", rank=1, num_shards=4, device="cuda:1")
        shared = shardload.load_rank("llama-dir", mesh="dp=2,tp=4", share_reads=True)  # under torchrun
        stage = shardload.load_rank("llama-dir", rank=5, mesh="pp=2,tp=4")   # stage 1, tp rank 1
        cpu = shardload.load_rank("llama-tp8", rank=0, num_shards=8, mmap=True)  # views of rank 0's file
        mine = {"model.norm.weight": module.norm.weight.data}
        shardload.load_rank("llama-dir", 1, 4, params=mine, out=mine)  # one tensor, read into the module
    """
    device = resolve_device(device, str(model))
    if rank is not None and type(rank) is not int:
        raise ShardloadError(f"rank must be an int, got {rank!r}", file=str(model))
    if mesh is not None:
        layout, rank = _mesh_rank(mesh, rank, num_shards)
    else:
        rank, num_shards = _dist_defaults(rank, num_shards)
        if type(num_shards) is not int or num_shards < 1:
            raise ShardloadError(f"num_shards must be a positive integer, got {num_shards!r}", file=str(model))
        layout = Mesh(tp=num_shards)
    sharded = _sharded_state(model, shard_info, verify)
    if sharded is not None:  # vLLM's layout: this rank reads its boxes of the vLLM rank files
        if type(rank) is not int or not 0 <= rank < layout.world_size:
            raise CheckpointError(f"rank {rank} is out of range for {layout}", file=str(model))
        boxes = "a sharded_state directory is read in boxes of vLLM's rank files"
        if mmap or (share_reads is not False and share_reads is not None):
            raise ShardloadError(f"{boxes}; {_NO_SHARE_READS}", file=str(model))
        if params is not None or out is not None:
            raise ShardloadError(f"{boxes}, without params or out (load the rank, then copy)", file=str(model))
        if read_options is not None:
            raise ShardloadError(_BOXES_READ_OPTIONS.format(what=boxes), file=str(model))
        return load_ranks(sharded, layout, [rank], [device])[0]
    checkpoint = open_checkpoint(model)
    if type(rank) is not int or not 0 <= rank < layout.world_size:
        what = f"num_shards={layout.tp}" if mesh is None else f"a mesh of {layout.world_size} ranks ({layout})"
        error = CheckpointError if checkpoint.kind == "converted" else ShardloadError
        raise error(f"rank {rank} is out of range for {what}", file=str(model))
    coord = layout.coord(rank)
    shared = share_reads is not False and share_reads is not None
    group = _share_group(share_reads, str(model), mmap) if shared else None
    if shared and checkpoint.presharded is not None:
        raise ShardloadError(
            "share_reads works on a source checkpoint or a converted directory; a pre-sharded one is read rank by "
            "rank (load it without share_reads)",
            file=str(model),
        )
    if mmap and isinstance(checkpoint.path, ObjectPath):
        raise ShardloadError(
            "mmap=True maps local files; this model is in object storage (load without mmap, or convert it to a "
            "local directory first)",
            file=str(model),
        )
    if mmap and _device_type(device) != "cpu":
        raise ShardloadError(
            f"mmap=True maps files into host memory; it needs device='cpu', not {device!r}", file=str(model)
        )
    if shared and read_options is not None:
        raise ShardloadError(
            "read_options applies to a rank reading for itself; share_reads reads each chunk as exact runs (leave "
            "read_options out)",
            file=str(model),
        )
    fill = Fill.of(params, out, str(model))
    if fill and (shared or (out is not None and mmap)):
        what = "share_reads exchanges a group's chunks" if shared else "mmap=True returns views of the file"
        raise ShardloadError(f"params= and out= apply to a rank reading its own tensors; {what} (one or the other)",
                             file=str(model))  # fmt: skip
    call = _rank_progress(progress, f"loading rank {rank}", "exchange rounds" if shared else "read jobs")
    if checkpoint.kind == "converted":
        if shard_info is not None:
            raise ShardloadError("a converted directory carries its own shard_info; do not pass one", file=str(model))
        if needs_reshard(checkpoint, layout):  # converted for another N: this rank reads its boxes of the old files
            boxes = (f"was converted for num_shards={checkpoint.manifest['num_shards']}: loading it for {layout} "
                     "reads boxes of several rank files")  # fmt: skip
            if shared or mmap or fill:
                without = ", without params or out" if fill else f"; {_NO_SHARE_READS}"
                raise ShardloadError(f"{boxes}{without}", file=str(model))
            if read_options is not None:
                raise ShardloadError(_BOXES_READ_OPTIONS.format(what=boxes), file=str(model))
            shards = open_shards(checkpoint, verify=shards_verify(verify, checkpoint.name))
            return load_ranks(shards, layout, [rank], [device])[0]
        if shared:
            return _load_converted_shared(checkpoint, layout, coord, device, verify, group, call)
        return _load_converted_rank(checkpoint, layout, coord, device, verify, mmap, read_options, fill)
    wrap = verifier(checkpoint, verify, str(model))
    if wrap is not None and mmap:
        raise ShardloadError("verify and mmap=True exclude each other (a view of the file is not a checked copy)",
                             file=str(model))  # fmt: skip
    if checkpoint.presharded is not None:
        return _load_presharded_rank(checkpoint, shard_info, layout, coord, device, mmap, wrap, read_options, fill)
    plan = build_plan(shard_info_for(checkpoint, shard_info), checkpoint, layout.tp)
    stages = stages_of(plan, layout)
    if shared:
        from ..planning.group_reads import plan_digest
        from .exchange import load_shared

        def slot_params(key: tuple[int, int]) -> tuple[list[ParamPlan], int]:
            return list(stages[key[0]].params.values()), key[1]

        digest = plan_digest(plan, stages) + str(layout).encode()
        with wrapped(reader_for_plan(plan.params.values()), wrap) as reader:
            state = load_shared(slot_params, digest, (coord.pp, coord.tp), device, reader, group, call, str(model))
            if wrap is not None:  # what the peers sent is checked too: a broken or hostile peer cannot inject bytes
                check_received(stages[coord.pp].params.values(), coord.tp, state, reader)
            return state
    if fill is None:
        return run_plan(
            stages[coord.pp], [coord.tp], [device], mmap=mmap, progress=call, wrap=wrap, read_options=read_options
        )[0]
    stage = fill.select(stages[coord.pp], plan)
    dests = fill.destinations(stage)
    state = run_plan(
        stage, [coord.tp], [device], mmap=mmap, progress=call, wrap=wrap, read_options=read_options,
        out={n: t.detach() for n, t in dests.items()},
    )[0]  # fmt: skip
    return {**state, **dests}  # the caller's own tensors, not their detached aliases


def _sharded_state(model: Any, shard_info: Any, verify: bool | str) -> ShardsSource | None:
    """``model`` opened as a vLLM ``sharded_state`` directory (``convert --layout vllm`` or vLLM's ``save_model``
    output), or None when it is none."""
    sharded = open_vllm_shards(model, verify=verify is True)
    if sharded is not None:
        shards_verify(verify, str(model))  # a pinned root cannot be checked here: refused, not skipped
        if shard_info is not None:
            raise ShardloadError("a sharded_state directory carries its own shard_info; do not pass one",
                                 file=str(model))  # fmt: skip
    return sharded


def check_received(params: Iterable[ParamPlan], rank: int, state: Mapping[str, torch.Tensor], reader: Any) -> None:
    """Check a rank's tensors, received from its ``share_reads`` group, against the integrity record ``reader`` (a
    :class:`~shardload.sources.verified.VerifiedReader`) checks with: each tile covering the rank's runs is hashed
    from the received bytes (completed from storage where a tile reaches past them); a tensor read whole (a
    compute step) is read again, checked, and compared."""
    import numpy as np
    import torch

    from ..planning.runs import param_runs
    from ..sources.verified import IntegrityError, ReceivedBytes, VerifiedReader, buffer_array

    culprit = "a peer of the share_reads group sent bytes that differ from the checkpoint"
    for p in params:
        got = state[p.name]
        runs = param_runs(p, [rank])
        if runs is not None and not len(runs.src):
            continue
        if runs is None:
            expected = materialize(p, reader, [rank])[0]
            if not torch.equal(expected, got.cpu()):
                raise IntegrityError(f"bytes received for this parameter: {culprit}", file=str(p.source.file),
                                     param=p.name)  # fmt: skip
            continue
        cpu = got.detach().cpu().contiguous()
        inner = ReceivedBytes(runs.src, runs.length, runs.dst, buffer_array(cpu), reader.inner)
        check = VerifiedReader(inner, reader.files, reader.hash_name)
        check.culprit = culprit
        check.read_runs(p.source.file, runs.src, runs.length, np.zeros(len(runs.src), dtype=np.int64), runs.dst, [cpu])


def _load_converted_shared(
    checkpoint: Checkpoint,
    layout: Mesh,
    coord: MeshCoord,
    device: Any,
    verify: bool | str,
    group: Any,
    progress: Callable[[int, int], None] | None,
) -> dict[str, torch.Tensor]:
    """A rank of a converted directory, the reading of the group's rank files shared (dp replicas read each once).
    ``verify=True`` checks this rank's own file's sha256 (reading it once more); a pinned root checks every byte
    read through the output's record, and what peers sent too. Every file's size is checked."""
    import hashlib
    import json

    from ..planning.group_reads import whole_tensors
    from .exchange import load_shared

    own = (coord.pp, coord.tp)
    wrap = converted_verifier(checkpoint, verify)

    def slot_params(key: tuple[int, int]) -> tuple[list[ParamPlan], int]:
        path = rank_file(checkpoint, key[1], layout, stage=key[0], checksum=verify is True and key == own)
        return whole_tensors(read_header(path).values()), 0

    manifest = json.dumps(checkpoint.manifest, sort_keys=True, default=str).encode()
    digest = hashlib.sha256(manifest + str(layout).encode()).digest()
    files: dict[Any, list[Any]] = {}
    if wrap is not None:  # every rank file a peer may read for this rank (headers only: a few KiB each)
        keys = [(pp, tp) for pp in range(layout.pp) for tp in range(layout.tp)]
        files = {path: list(read_header(path).values()) for path in (rank_file(checkpoint, tp, layout, stage=pp)
                                                                     for pp, tp in keys)}  # fmt: skip
    with wrapped(reader_for(checkpoint.path), wrap and (lambda r: wrap(r, files))) as reader:
        state = load_shared(slot_params, digest, own, device, reader, group, progress, str(checkpoint.path))
        if wrap is not None:  # the bytes peers sent for this rank's file are checked against the record too
            check_received(slot_params(own)[0], 0, state, reader)
        return state


def _share_group(share_reads: Any, where: str, mmap: bool) -> Any:
    """The process group ``share_reads`` names (True: the default group), checked to be usable."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ShardloadError("share_reads needs an initialised torch.distributed process group", file=where)
    if mmap:
        raise ShardloadError("share_reads and mmap=True exclude each other (views of a file are not exchanged)",
                             file=where)  # fmt: skip
    if share_reads is True:
        return None
    if isinstance(share_reads, dist.ProcessGroup):
        if dist.get_rank(share_reads) < 0:
            raise ShardloadError("share_reads names a process group this rank is not a member of", file=where)
        return share_reads
    raise ShardloadError(f"share_reads must be True, False or a torch.distributed ProcessGroup, got {share_reads!r}",
                         file=where)  # fmt: skip


def _rank_progress(progress: Any, label: str, unit: str) -> Callable[[int, int], None] | None:
    """The progress callback of one rank: a callable as given; True draws a line on a terminal, under
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
    return _progress_line(label, unit) if first else None


def _device_type(device: Any) -> str:
    import torch

    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        return str(device)


def _load_converted_rank(
    checkpoint: Checkpoint,
    layout: Mesh,
    coord: MeshCoord,
    device: Any,
    verify: bool | str,
    mmap: bool,
    read_options: ReadOptions | None = None,
    fill: Fill | None = None,
) -> dict[str, torch.Tensor]:
    """A rank of a converted directory for its own N: its rank file's tensors (``fill``: those named, or into the
    caller's tensors)."""
    wrap = converted_verifier(checkpoint, verify)
    if wrap is not None and mmap:
        raise ShardloadError("verify and mmap=True exclude each other (a view of the file is not a checked copy)",
                             file=str(checkpoint.path))  # fmt: skip
    path = rank_file(checkpoint, coord.tp, layout, stage=coord.pp, checksum=verify is True and wrap is None)
    infos = list(read_header(path).values())
    if fill is not None and fill.params is not None:
        fill.known({info.name for info in infos})
        infos = [info for info in infos if info.name in fill.params]
    with (
        wrapped(
            reader_for(path, read_options and read_options.object_cost), wrap and (lambda r: wrap(r, {path: infos}))
        ) as reader,
        Transfer(reader, path=data_path_for([device], mmap=mmap), read_options=read_options, defer=True) as transfer,
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


def _load_presharded_rank(
    checkpoint: Checkpoint,
    shard_info: Any,
    layout: Mesh,
    coord: MeshCoord,
    device: Any,
    mmap: bool,
    wrap: Callable[[RunReader], RunReader] | None = None,
    read_options: ReadOptions | None = None,
    fill: Fill | None = None,
) -> dict[str, torch.Tensor]:
    """A rank of a source stored already split (a pre-sharded TVM cache): its own part of each split parameter,
    and every tensor stored whole."""
    if checkpoint.presharded != layout.tp:  # cut for another N: this rank's boxes of the records
        if mmap or fill:
            raise ShardloadError(
                f"is pre-sharded for num_shards={checkpoint.presharded}: loading it for {layout} reads boxes of "
                f"several records, without {'params or out' if fill else 'mmap'}",
                file=checkpoint.name,
            )
        if wrap is not None:
            presharded_verify(True, checkpoint.name)
        source = open_presharded(checkpoint, shard_info_for(checkpoint, shard_info))
        return load_ranks(source, layout, [layout.rank(coord.dp, coord.pp, coord.tp)], [device])[0]
    build_plan(shard_info_for(checkpoint, shard_info), checkpoint, layout.tp)  # checks N and the steps
    if layout.pp != 1:
        raise ShardloadError("pipeline stages of a pre-sharded checkpoint are not supported", file=checkpoint.name)
    view = checkpoint.rank_view(coord.tp)
    plan = build_plan(ShardInfo(source=f"<rank {coord.tp}'s part of {checkpoint.name}>"), view, 1)
    if fill is None:
        return run_plan(plan, [0], [device], mmap=mmap, wrap=wrap, read_options=read_options)[0]
    plan = fill.select(plan, plan)
    dests = fill.destinations(plan)
    out = {n: t.detach() for n, t in dests.items()}
    return {**run_plan(plan, [0], [device], mmap=mmap, wrap=wrap, read_options=read_options, out=out)[0], **dests}
