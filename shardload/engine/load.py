"""The public loaders: ``load`` (every rank in this process) and ``load_rank`` (one rank), one route for both.

Each opens the model as a typed source (:func:`~shardload.sources.source_types.open_source`), checks its options
once against the source-type table (:meth:`~.load_options.LoadOptions.check`), and hands the ranks to the route of
the source's type (:func:`~.routes.load_source`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ShardloadError
from ..format.input_log import records_inputs
from ..planning.mesh import Mesh, as_mesh
from ..sources.source_types import Source, open_source
from .devices import resolve_device
from .load_options import Destination, Tensors, Verify, load_options
from .read_strategy import ReadOptions
from .routes import load_source

if TYPE_CHECKING:
    import torch


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
    verify: bool | Verify = False,
    progress: bool | Callable[[int, int], None] = False,
    read_options: ReadOptions | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Load every rank's shard of ``model``: a list of state dicts, the one for global rank r on ``devices[r]``.

    ``model`` is any source :func:`load_rank` takes. Each stored byte is read once. With ``mesh`` (e.g.
    ``"pp=2,tp=4"``) rank r holds only its pipeline stage's parameters, tensor shard ``tp`` of them; ``num_shards``
    may then be left out (it is the mesh's ``tp``). ``verify``, ``progress`` and ``read_options`` are
    :func:`load_rank`'s (``progress=True`` draws a line per stage); the options that concern one rank's own tensors
    (a destination, a process group) are :func:`load_rank`'s alone.

    Example::

        shards = shardload.load("llama-dir", 8)          # cuda:0..7 when present, else CPU
        shards[3]["model.layers.0.self_attn.qkv_proj.weight"].shape
    """
    if devices is not None and (isinstance(devices, (str, bytes)) or not hasattr(devices, "__len__")):
        size = mesh_for(num_shards, mesh, None, str(model)).world_size
        raise ShardloadError(f"devices must be a list of {size} devices, got {devices!r}", file=str(model))
    resolved = mesh_for(num_shards, mesh, len(devices) if devices is not None else None, str(model))
    world = resolved.world_size
    devices = [resolve_device(d, str(model)) for d in devices] if devices is not None else default_devices(world)
    if len(devices) != world:
        what = f"num_shards={resolved.tp}" if mesh is None else f"{world} ranks ({resolved})"
        raise ShardloadError(f"got {len(devices)} devices for {what}", file=str(model))
    options = load_options(str(model), shard_info=shard_info, verify=verify, group=None, read_options=read_options,
                           into=None, progress=progress, legacy={})  # fmt: skip
    source = open_source(model, resolved)
    resolved = own_layers(source, resolved)
    options.check(source, resolved, devices)
    return load_source(source, resolved, range(world), devices, options, "loading")


@records_inputs
def load_rank(
    model: str | os.PathLike[str],
    rank: int | None = None,
    num_shards: int | None = None,
    device: Any = "cpu",
    shard_info: Any = None,
    *,
    mesh: Any = None,
    verify: bool | Verify = False,
    group: Any = None,
    into: Destination | Tensors | None = None,
    progress: bool | Callable[[int, int], None] = False,
    read_options: ReadOptions | None = None,
    **deprecated: Any,
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
            Where fresh tensors are made (tensors given by ``into`` stay on their own devices).
        shard_info (`str`, `dict` or :class:`ShardInfo`, *optional*):
            The plan's shard_info; default: ``shard_info.json`` beside the weights, else one made from config.json.
        mesh (:class:`Mesh`, `str`, mapping or torch ``DeviceMesh``, *optional*):
            A dp/pp/tp mesh (``"pp=2,tp=4"``): only this rank's pipeline stage is read.
        verify (`bool` or :class:`Verify`, defaults to `False`):
            True checks what the source can check before any byte is returned: a rank file whole, or for a
            source checkpoint every tile covering this rank's bytes against its integrity record;
            ``Verify(root=...)`` (the root ``shardload hash`` prints) pins that record.
        group (`True` or a torch.distributed ``ProcessGroup``, *optional*):
            The ranks of the group (True: the default group), all making this call with their own rank, split
            the reading: each byte any of them needs is read by one rank and exchanged over collectives (gloo on
            CPU, NCCL on GPU), within ``shardload.engine.exchange.EXCHANGE_BYTES`` of memory; a rank that dies
            or hangs fails the others within ``EXCHANGE_TIMEOUT`` seconds, and ranks that planned other
            checkpoints or hold other bytes under the same headers are refused before any byte moves.
        into (:class:`Destination`, mapping or callable, *optional*):
            Where the rank's tensors go: ``Destination(tensors, only=names)`` fills the caller's tensors in place
            (a mapping ``name -> tensor``, or a callable ``(name, shape, dtype) -> tensor or None`` asked once per
            tensor with this rank's shape and torch dtype; None: a fresh tensor) and reads only the stored tensors
            ``only`` names (default: all); a mapping or callable alone is ``Destination(tensors)``. Each tensor must
            be contiguous, share no memory with another, and be of exactly that shape and dtype; a mismatch, or a
            name this rank does not read, raises before any byte is read. If the load raises later, every
            destination handed over is zero-filled before the error is raised.
        progress (`bool` or callable, defaults to `False`):
            True draws a line on stderr when it is a terminal (one rank per node); a callable gets
            ``(done, total)`` read jobs, exchange rounds (``group``) or tensors (a converted directory at
            another N); ``(0, 0)`` once where nothing is read (every tensor a view of its file).
        read_options (:class:`ReadOptions`, *optional*):
            How the rank gets its bytes and the reader threads. ``strategy="view"`` (CPU only) returns a tensor
            that is one contiguous stretch of its file (a dim-0 shard, a replicated tensor, every tensor of a
            converted directory) as a copy-on-write view of a private file mapping, no copy and no new memory;
            the file must not be truncated or rewritten in place while the views live (SIGBUS), which a
            directory written by :func:`convert` never is.
        **deprecated:
            ``mmap``, ``share_reads``, ``params`` and ``out``, the spellings of one release ago, still work with a
            DeprecationWarning.

    Which sources take which options is one table (docs/python-api.md, "Options by source"); a refused one is a
    one-line error before any byte is read.

    Returns:
        `dict[str, torch.Tensor]`: this rank's tensors under the checkpoint's names, with per-rank shapes; those
        ``into`` gave are the caller's own tensors, filled.

    Example::

        state = shardload.load_rank("llama-dir", rank=1, num_shards=4, device="cuda:1")
        shared = shardload.load_rank("llama-dir", mesh="dp=2,tp=4", group=True)  # under torchrun
        stage = shardload.load_rank("llama-dir", rank=5, mesh="pp=2,tp=4")   # stage 1, tp rank 1
        views = shardload.ReadOptions(strategy="view")
        cpu = shardload.load_rank("llama-tp8", rank=0, num_shards=8, read_options=views)  # views of its file
        mine = {"model.norm.weight": module.norm.weight.data}
        shardload.load_rank("llama-dir", 1, 4, into=shardload.Destination(mine, only=mine))  # into the module
    """
    from .exchange import failing_together  # numpy's: not at import shardload

    shared = group if group not in (None, False) else deprecated.get("share_reads")
    # a group's ranks fail at once with any of them: every failure before the exchange, arguments included, is told
    with failing_together(shared, device, str(model)):
        return _load_rank(model, rank, num_shards, device, shard_info, mesh, verify, group, into, progress,
                          read_options, deprecated)  # fmt: skip


def _load_rank(model: str | os.PathLike[str], rank: int | None, num_shards: int | None, device: Any, shard_info: Any,
               mesh: Any, verify: bool | Verify, group: Any, into: Destination | Tensors | None,
               progress: bool | Callable[[int, int], None], read_options: ReadOptions | None,
               deprecated: dict[str, Any]) -> dict[str, torch.Tensor]:  # fmt: skip
    """:func:`load_rank`'s work."""
    device = resolve_device(device, str(model))
    if rank is not None and type(rank) is not int:
        raise ShardloadError(f"rank must be an int, got {rank!r}", file=str(model))
    try:
        if mesh is not None:
            resolved, rank = _mesh_rank(mesh, rank, num_shards)
        else:
            rank, num_shards = _dist_defaults(rank, num_shards)
            resolved = mesh_for(num_shards, None, None)
    except ShardloadError as err:
        raise err.located(file=str(model)) from None
    options = load_options(str(model), shard_info=shard_info, verify=verify, group=group, read_options=read_options,
                           into=into, progress=progress, legacy=deprecated)  # fmt: skip
    source = open_source(model, resolved)
    resolved = own_layers(source, resolved)
    if type(rank) is not int or not 0 <= rank < resolved.world_size:
        size = resolved.world_size
        what = f"num_shards={resolved.tp}" if mesh is None else f"a mesh of {size} ranks ({resolved})"
        raise (CheckpointError if source.splits else ShardloadError)(f"rank {rank} is out of range for {what}",
                                                                     file=str(model))  # fmt: skip
    options.check(source, resolved, [device])
    try:
        return load_source(source, resolved, [rank], [device], options, f"loading rank {rank}")[0]
    except BaseException:
        if options.into is not None:  # the caller's tensors hold no part of a load that failed
            options.into.clear()
        raise


def mesh_for(num_shards: int | None, mesh: Any, world_size: int | None, where: str | None = None) -> Mesh:
    """The mesh to work on: ``mesh`` when given (checked against ``num_shards``), else ``tp=num_shards``; a
    refusal is located at ``where`` (the model)."""
    try:
        if mesh is None:
            if num_shards is None:
                raise ShardloadError("give num_shards (or a mesh)")
            if type(num_shards) is not int or num_shards < 1:
                raise ShardloadError(f"num_shards must be a positive integer, got {num_shards!r}")
            return Mesh(tp=num_shards)
        resolved = as_mesh(mesh, world_size)
        assert resolved is not None
        if num_shards is not None and num_shards != resolved.tp:
            raise ShardloadError(f"num_shards={num_shards} disagrees with the mesh's tp={resolved.tp}")
        return resolved
    except ShardloadError as err:
        raise err.located(file=where) from None


def own_layers(source: Source, mesh: Mesh) -> Mesh:
    """``mesh`` with a converted directory's own layers per stage when it names none and has the directory's stage
    count: one mesh means the same stages whichever route reads the directory (its own files, boxes, a convert)."""
    checkpoint = source.checkpoint
    if mesh.pp_layers is not None or mesh.pp == 1 or checkpoint.kind != "converted":
        return mesh
    recorded = (checkpoint.manifest or {}).get("mesh") or {}
    layers = recorded.get("pp_layers")
    if recorded.get("pp") != mesh.pp or not layers:
        return mesh
    return replace(mesh, pp_layers=tuple(layers))


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
        resolved, own = Mesh.from_device_mesh(mesh)
        if rank is not None and rank != own:
            raise ShardloadError(f"rank={rank} disagrees with the DeviceMesh's rank {own}")
        rank = own
    else:
        import torch.distributed as dist

        group = dist.is_available() and dist.is_initialized()
        resolved = mesh_for(None, mesh, dist.get_world_size() if group else None)
        if rank is None:
            if not group:
                raise ShardloadError("rank is required when no torch.distributed process group is initialised")
            rank = dist.get_rank()
    if num_shards is not None and num_shards != resolved.tp:
        raise ShardloadError(f"num_shards={num_shards} disagrees with the mesh's tp={resolved.tp}")
    return resolved, rank
