"""Placement: how one weight is split across ranks, the record between deciding a split and writing its steps.

The family presets (:mod:`shardload.models.presets`) and transformers' TP tables
(:mod:`shardload.models.hf_tp_tables`) decide a :class:`Placement` for every tensor a model holds, or for the
logical weight of a quantized module; :func:`shardload.models.stored_layouts.companion_steps` writes the shard_info
steps for every stored tensor a placement covers; :func:`placement_from_steps` reads a dense tensor's steps back
into one (to carry a hand-written shard_info over to a quantized checkpoint). Pure data: no tensor is read here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ..errors import PlanError, StepArgumentError
from ..format import expr

__all__ = ["STYLES", "Header", "Placement", "TensorHeader", "placement_from_steps"]

STYLES = ("column", "row", "replicated", "vocab", "expert")
"""column: output features split (outputs concatenated); row: input features split (partial sums
all-reduced); vocab: embedding rows split (masked lookup, all-reduced); expert: whole experts of a
stacked ``[num_experts, ...]`` tensor per rank; replicated: every rank holds the tensor."""


class TensorHeader(Protocol):
    """What planning needs of a tensor (``shardload.sources.tensor_info.TensorInfo`` and :class:`Header` have it)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> str: ...


@dataclass(frozen=True)
class Header:
    """Shape and dtype of a tensor that is not read from a file header (a quantized module's logical weight)."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Placement:
    """How one tensor, stored or logical (``W[..., out, in]`` of a quantized module), is split across ranks.

    ``dim`` is the split dim of the (logical) tensor (None when replicated); ``segments`` are the
    sizes of the fused parts along ``dim`` in ``unit``s (empty: one part); ``kv`` flags the
    segments that hold KV heads, replicated when N exceeds their head count; ``rule`` says which
    preset or tp_plan entry decided it ("" when none matched); ``pad_to``, for a vocabulary, pads the split dim
    with zero rows where N does not divide it, up to a multiple of ``pad_to`` (64, or ``"num_shards"``), with
    ``shard_funcs.pad_dim`` (None: no padding, so such an N fails).
    """

    name: str
    style: str
    dim: int | None = None
    segments: tuple[int, ...] = ()
    unit: int = 1
    kv: tuple[bool, ...] = ()
    rule: str = ""
    pad_to: int | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))
        object.__setattr__(self, "kv", tuple(bool(f) for f in self.kv))
        if self.style not in STYLES:
            raise ValueError(f"{self.name}: style must be one of {STYLES}, got {self.style!r}")
        if (self.dim is None) != (self.style == "replicated"):
            raise ValueError(f"{self.name}: a {self.style} placement {'needs' if self.dim is None else 'takes no'} dim")
        if self.kv and len(self.kv) != len(self.segments):
            raise ValueError(f"{self.name}: kv flags {self.kv} do not match segments {self.segments}")
        if self.unit < 1 or any(s < 1 for s in self.segments):
            raise ValueError(f"{self.name}: unit and segments must be positive")
        if self.pad_to is not None and (self.dim is None or self.segmented):
            raise ValueError(f"{self.name}: only an unsegmented split pads (pad_to={self.pad_to!r})")

    @property
    def segmented(self) -> bool:
        """Whether the split must respect units or fused parts (``shard_segments``), not just divide the dim."""
        return len(self.segments) > 1 or self.unit > 1 or any(self.kv)


def placement_from_steps(name: str, steps: Sequence[Any]) -> Placement:
    """Read a dense tensor's shard_info steps back into a :class:`Placement` (to carry them over).

    Understood: no steps or ``replicate``; ``shard_dim``, alone or after ``pad_dim`` on the same dim;
    ``reorder_segments`` + ``shard_dim`` on one dim; ``shard_segments`` without a pack factor. Arguments
    must not depend on num_shards except N.
    """
    calls = [(_step_name(s), _step_args(s)) for s in steps]
    names = [c[0] for c in calls]
    try:
        if not calls or names == ["shard_funcs.replicate"]:
            return Placement(name, "replicated")
        if names == ["shard_funcs.shard_dim"]:
            return _dim_placement(name, _int(calls[0][1][0]))
        if names == ["shard_funcs.pad_dim", "shard_funcs.shard_dim"]:
            dim, multiple = _int(calls[0][1][0]), calls[0][1][1]
            if _int(calls[1][1][0]) != dim:
                raise StepArgumentError("pad_dim and shard_dim work on different dims")
            pad_to = "num_shards" if multiple == "num_shards" else _int(multiple)
            return replace(_dim_placement(name, dim), pad_to=pad_to)
        if names == ["shard_funcs.reorder_segments", "shard_funcs.shard_dim"]:
            args = calls[0][1]
            dim = _int(args[0])
            if _int(calls[1][1][0]) != dim:
                raise StepArgumentError("reorder_segments and shard_dim work on different dims")
            unit = _int(args[3]) if len(args) > 3 else 1
            return _dim_placement(name, dim, tuple(_int(s) for s in args[1]), unit)
        if names == ["shard_funcs.shard_segments"]:
            args = calls[0][1]
            if len(args) > 5 and _int(args[5]) != 1:
                raise StepArgumentError("a dense tensor's shard_segments must have pack 1")
            unit = _int(args[4]) if len(args) > 4 else 1
            segments = tuple(_int(s) for s in args[1])
            kv = tuple(bool(_int(f)) for f in args[2])
            return _dim_placement(name, _int(args[0]), segments, unit, kv)
    except (StepArgumentError, IndexError, TypeError, ValueError) as err:
        raise PlanError(f"cannot carry steps {names} over to quantized tensors: {err}", param=name) from None
    raise PlanError(
        f"cannot carry steps {names} over to quantized tensors: only replicate, shard_dim, pad_dim + shard_dim, "
        "reorder_segments + shard_dim and shard_segments are understood",
        param=name,
    )


def _int(value: Any) -> int:
    return expr.evaluate(value, None)


def _step_name(step: Any) -> str:
    return step.func if hasattr(step, "func") else str(step[0])


def _step_args(step: Any) -> list[Any]:
    return list(step.args) if hasattr(step, "args") else list(step[2:])


def _dim_placement(
    name: str, dim: int, segments: tuple[int, ...] = (), unit: int = 1, kv: tuple[bool, ...] = ()
) -> Placement:
    return Placement(name, "row" if dim in (1, -1) else "column", dim, segments, unit, kv, rule="carried over")
