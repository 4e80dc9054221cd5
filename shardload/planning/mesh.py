"""Device meshes: named ``dp`` x ``pp`` x ``tp`` layouts and which parameters each pipeline stage holds.

Ranks are numbered row-major over ``(dp, pp, tp)``, as torch's ``DeviceMesh`` numbers a mesh
created with ``mesh_dim_names=("dp", "pp", "tp")``: ``rank = (dp_index * pp + pp_index) * tp + tp_index``.
``tp`` is the shard_info's ``num_shards``; ``pp`` splits the decoder layers into contiguous
stages; ``dp`` replicas hold identical shards.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ShardloadError
from ..format.shard_info import MAX_RANKS

if TYPE_CHECKING:
    from .plan import ModelPlan

AXES = ("dp", "pp", "tp")
LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.([0-9]+)\.")
LAST_STAGE_RE = re.compile(r"(?:^|\.)(?:lm_head|norm|final_layernorm|final_layer_norm|ln_f|norm_f)\.")
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


@dataclass(frozen=True)
class MeshCoord:
    """Where one global rank sits in the mesh."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class Mesh:
    """Sizes of the ``dp``, ``pp`` and ``tp`` axes, plus an optional per-stage layer count."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    pp_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if type(size) is not int or size < 1:
                raise ShardloadError(f"mesh axis {axis} must be a positive integer, got {size!r}")
        if self.dp * self.pp * self.tp > MAX_RANKS:
            raise ShardloadError(f"mesh {self} has {self.dp * self.pp * self.tp} ranks, over the limit of {MAX_RANKS}")
        if self.pp_layers is not None and len(self.pp_layers) != self.pp:
            raise ShardloadError(f"--pp-layers gives {len(self.pp_layers)} stages but the mesh has pp={self.pp}")

    @property
    def world_size(self) -> int:
        """Number of ranks in the mesh."""
        return self.dp * self.pp * self.tp

    @classmethod
    def parse(cls, text: str, world_size: int | None = None, pp_layers: Sequence[int] | str | None = None) -> Mesh:
        """Parse ``"pp=2,tp=4"`` (one axis may be ``-1``, inferred from ``world_size``)."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in AXES:
                raise ShardloadError(f"bad mesh {text!r}: expected axis=size with axes {', '.join(AXES)}")
            if name in sizes:
                raise ShardloadError(f"bad mesh {text!r}: axis {name} given twice")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ShardloadError(f"bad mesh {text!r}: size of {name} is not an integer") from None
        if not sizes:
            raise ShardloadError("empty mesh: give at least one of pp=, tp=, dp=")
        inferred = [a for a, s in sizes.items() if s == -1]
        if len(inferred) > 1:
            raise ShardloadError(f"bad mesh {text!r}: only one axis may be -1")
        bad = [a for a, s in sizes.items() if s < 1 and s != -1]
        if bad:
            raise ShardloadError(f"bad mesh {text!r}: axis {bad[0]} must be >= 1 or -1")
        known = 1
        for s in sizes.values():
            known *= s if s != -1 else 1
        if inferred:
            if world_size is None:
                raise ShardloadError(f"mesh {text!r} has a -1 axis: give the world size to infer it")
            if world_size % known:
                raise ShardloadError(f"mesh {text!r}: world size {world_size} is not divisible by {known}")
            sizes[inferred[0]] = world_size // known
        elif world_size is not None and known != world_size:
            raise ShardloadError(f"mesh {text!r} has {known} ranks, but the world size is {world_size}")
        layers = _parse_layers(pp_layers)
        return cls(sizes.get("dp", 1), sizes.get("pp", 1), sizes.get("tp", 1), layers)

    @classmethod
    def from_device_mesh(cls, device_mesh: Any) -> tuple[Mesh, int]:
        """The Mesh of a torch ``DeviceMesh`` with named axes, and this process's global rank."""
        names = tuple(device_mesh.mesh_dim_names or ())
        if not names or set(names) - set(AXES):
            raise ShardloadError(f"DeviceMesh needs mesh_dim_names drawn from {AXES}, got {names or None}")
        if tuple(a for a in AXES if a in names) != names:
            raise ShardloadError(f"DeviceMesh axes must be in (dp, pp, tp) order, got {names}")
        shape = dict(zip(names, device_mesh.mesh.shape, strict=True))
        mesh = cls(shape.get("dp", 1), shape.get("pp", 1), shape.get("tp", 1))
        coord = dict(zip(names, device_mesh.get_coordinate() or (), strict=True))
        return mesh, mesh.rank(coord.get("dp", 0), coord.get("pp", 0), coord.get("tp", 0))

    def coord(self, rank: int) -> MeshCoord:
        """The (dp, pp, tp) coordinates of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ShardloadError(f"rank {rank} is out of range for a mesh of {self.world_size} ranks ({self})")
        rest, tp = divmod(rank, self.tp)
        dp, pp = divmod(rest, self.pp)
        return MeshCoord(dp, pp, tp)

    def rank(self, dp: int, pp: int, tp: int) -> int:
        """The global rank at coordinates (dp, pp, tp)."""
        return (dp * self.pp + pp) * self.tp + tp

    def stages(self, num_layers: int) -> list[range]:
        """The contiguous decoder-layer range of each pipeline stage (as even as possible)."""
        if self.pp_layers is not None:
            if sum(self.pp_layers) != num_layers:
                raise ShardloadError(f"--pp-layers {list(self.pp_layers)} adds up to {sum(self.pp_layers)}, "
                                     f"but the model has {num_layers} layers")  # fmt: skip
            counts = list(self.pp_layers)
        else:
            if self.pp > max(num_layers, 1):
                raise ShardloadError(f"pp={self.pp} is more stages than the model's {num_layers} layers")
            base, extra = divmod(num_layers, self.pp)
            counts = [base + (1 if i < extra else 0) for i in range(self.pp)]
        out, start = [], 0
        for c in counts:
            out.append(range(start, start + c))
            start += c
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON form, as recorded in a converted directory's manifest."""
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "pp_layers": list(self.pp_layers or []) or None}

    def __str__(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in AXES)


def _parse_layers(value: Sequence[int] | str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise ShardloadError(f"bad --pp-layers {value!r}: expected comma-separated integers") from None
    layers = tuple(value)
    if not layers or any(type(v) is not int or v < 0 for v in layers):
        raise ShardloadError(f"bad --pp-layers {list(layers)}: expected non-negative integers")
    return layers


def as_mesh(mesh: Mesh | str | Mapping[str, int] | None, world_size: int | None = None) -> Mesh | None:
    """Accept a Mesh, a ``"pp=2,tp=4"`` string or a ``{"pp": 2, "tp": 4}`` mapping."""
    if mesh is None or isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, str):
        return Mesh.parse(mesh, world_size)
    if isinstance(mesh, Mapping):
        return Mesh.parse(",".join(f"{k}={v}" for k, v in mesh.items() if k != "pp_layers"), world_size,
                          mesh.get("pp_layers"))  # fmt: skip
    raise ShardloadError(f"mesh must be a Mesh, a 'pp=2,tp=4' string or a mapping, got {type(mesh).__name__}")


def _config(root: Path) -> dict[str, Any]:
    """config.json of the model, or {} when there is none (stages then follow names). One that is there but cannot
    be read raises: ranks that read it and ranks that could not would cut the stages differently."""
    from ..sources.checkpoint import read_config

    return read_config(root, missing_ok=True)


def layer_count(root: Path, names: Sequence[str]) -> int:
    """Number of decoder layers: from config.json when it says, else from the tensor names. A config counting more
    layers than the names store is refused: the last stages would hold no layer of their own."""
    indices = [_layer(m, n) for n in names if (m := LAYER_RE.search(n))]
    stored = max(indices) + 1 if indices else 0
    config = _config(root)
    for key in LAYER_COUNT_KEYS:
        value = config.get(key)
        if type(value) is int and value >= 0:
            if indices and value > stored:
                raise ShardloadError(
                    f"{key} is {value}, but the checkpoint stores layers 0..{stored - 1}: a pipeline stage would "
                    "hold layers that are not there",
                    file=str(root / "config.json"),
                )
            return value
    return stored


def _layer(match: re.Match[str], name: str) -> int:
    """The layer number a name holds (ASCII digits only), refused past nine digits."""
    digits = match.group(1)
    if len(digits) > 9:
        raise ShardloadError(f"layer number of {len(digits)} digits is not a layer index", param=name)
    return int(digits)


def tied_embeddings(root: Path) -> bool:
    """Whether config.json says the input embeddings double as the output head."""
    return bool(_config(root).get("tie_word_embeddings", False))


def param_stages(name: str, stages: list[range], tied: bool) -> list[int]:
    """The pipeline stages that hold parameter ``name``.

    Layer ``i``'s parameters live on the stage whose range holds ``i``; the output head and final
    norm on the last stage; everything else (embeddings) on the first, and with tied embeddings
    the embedding also on the last stage, which uses it as the head.
    """
    last = len(stages) - 1
    match = LAYER_RE.search(name)
    if match:
        layer = _layer(match, name)
        for i, r in enumerate(stages):
            if layer in r:
                return [i]
        raise ShardloadError(f"layer {layer} is outside the model's {stages[-1].stop} layers", param=name)
    if LAST_STAGE_RE.search(name + "."):
        return [last]
    if tied and "embed" in name:
        return sorted({0, last})
    return [0]


def stage_plans(plan: ModelPlan, mesh: Mesh) -> list[ModelPlan]:
    """Split a ``tp``-way plan into one plan per pipeline stage, each holding only that stage's parameters."""
    from .plan import ModelPlan

    if plan.num_shards != mesh.tp:
        raise ShardloadError(f"plan is for num_shards={plan.num_shards}, the mesh has tp={mesh.tp}")
    root = plan.checkpoint.root if plan.checkpoint is not None else Path(".")
    names = list(plan.params)
    stages = mesh.stages(layer_count(root, names))
    tied = tied_embeddings(root) or ("lm_head.weight" not in plan.params and mesh.pp > 1)
    held: list[dict[str, Any]] = [{} for _ in range(mesh.pp)]
    for name, param in plan.params.items():
        for s in param_stages(name, stages, tied):
            held[s][name] = param
    return [
        ModelPlan(plan.num_shards, plan.shard_info, plan.checkpoint, params, list(plan.problems), layers=stages[i])
        for i, params in enumerate(held)
    ]
