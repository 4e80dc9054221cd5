"""Filling a server's model with one rank's tensors: the server-neutral part of an inference-server integration.

A server (vLLM, SGLang, TensorRT-LLM) keeps its tensor-parallel model as named parameters: some fuse several stored
tensors (``qkv_proj`` = [q rows; k rows; v rows]), some stack a mixture-of-experts layer's experts, the vocabulary
ones pad their rows. An integration maps each stored tensor to a :class:`Target` (its own names), reads the rank
through :func:`shardload.load_rank` (in place where :func:`place_slots` finds a slot), then :func:`copy_into` its
parameters, which checks every shape and that every part is filled once. :func:`vocab_ranges` and
:func:`expert_maps` read what the server's model says of its vocabulary rows and expert placement, given the server's
embedding class and where its layers keep their expert map. Messages name the server (``server``). Imports no
server; torch only inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ShardloadError
from .api import ModelPlan, ParamPlan, build_plan, to_torch

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "SHAPE_SUFFIX",
    "FillReport",
    "Target",
    "KeptWhole",
    "copy_into",
    "expert_maps",
    "place_slots",
    "row_span",
    "vocab_mismatches",
    "vocab_ranges",
]

SHAPE_SUFFIX = ".weight_shape"
"""compressed-tensors' packed weights' logical shape: a server keeps the stored (unsplit) value, and for a fused
parameter one vector, its last part's."""

VocabSpan = tuple[int, int, int, int]
"""A vocabulary-parallel parameter on this rank: (first stored row, stop, stored rows in all, padded rows per rank)."""


@dataclass(frozen=True)
class Target:
    """Where a stored tensor goes in a server's model: the parameter, its part among ``parts`` fused ones (0 of 1:
    unfused)."""

    name: str
    part: int = 0
    parts: int = 1
    expert: int | None = None
    """For a stacked expert parameter: the expert (the index into its first dim)."""
    every_slot: bool = False
    """A module stored fused with one value for the server's per-part slots (Phi-3's ``qkv_proj.weight_scale`` in
    vLLM's ``[3]``): the value goes into each slot."""

    @property
    def fused(self) -> bool:
        return self.parts > 1


@dataclass
class FillReport:
    """What filling a model did: parameters filled, stored tensors used, and where the plan came from."""

    filled: int = 0
    tensors: int = 0
    source: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass
class _Fused:
    parts: list[torch.Tensor | None]
    names: list[str | None]


def expert_maps(model: nn.Module, table_of: Callable[[Any], Any]) -> dict[str, list[int]]:
    """Under expert parallelism: each stacked expert parameter -> its layer's map of global expert -> this rank's
    slot (-1: another rank's), as the server placed them; ``table_of(module)``: a layer's map (a tensor), or None.
    Empty without expert parallelism."""
    maps: dict[str, list[int]] = {}
    for prefix, module in model.named_modules():
        table = table_of(module)
        if table is None:
            continue
        slots = [int(x) for x in table.tolist()]
        for pname, _ in module.named_parameters(recurse=False):
            maps[f"{prefix}.{pname}" if prefix else pname] = slots
    return maps


def vocab_ranges(model: nn.Module, targets: Mapping[str, Any], embedding: type) -> dict[str, VocabSpan]:
    """For each vocabulary-parallel parameter: ``(first stored row on this rank, stop, stored rows in all, padded
    rows per rank)``, from each module of class ``embedding`` (vLLM's and SGLang's ``VocabParallelEmbedding``: its
    ``shard_indices`` and ``org_vocab_size``)."""
    ranges = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, embedding):
            continue
        name = f"{prefix}.weight" if prefix else "weight"
        if name in targets:
            si = module.shard_indices
            ranges[name] = (si.org_vocab_start_index, si.org_vocab_end_index, module.org_vocab_size,
                            si.num_org_elements_padded)  # fmt: skip
    return ranges


def rows(span: tuple[int, ...]) -> int:
    """The stored rows a vocabulary span covers on this rank."""
    return span[1] - span[0]


def vocab_mismatches(
    plan: ModelPlan, routes: Mapping[str, Target | None], vocab: Mapping[str, VocabSpan], rank: int
) -> set[str]:
    """Stored vocabulary tensors whose planned rank slice is not the server's row range, then only padding (they are
    read whole instead): a padding rule other than the server's moves the rows."""
    wrong = set()
    for name, param in plan.params.items():
        target = routes[name]
        if target is None or target.name not in vocab or param.replicated:
            continue
        if row_span(param, rank) != vocab[target.name][:2]:
            wrong.add(name)
    return wrong


def row_span(param: ParamPlan, rank: int) -> tuple[int, int] | None:
    """The stored rows ``rank`` gets when its slice is whole rows, in order, followed by nothing but whole rows of
    padding (zeros, :meth:`ParamPlan.zeros`); else None."""
    pieces = param.pieces(rank)
    if not pieces:
        return None
    full = [(0, n) for n in param.source.shape[1:]]
    rows = sorted((p.src[0], p.dst[0]) for p in pieces)
    if any(list(p.src[1:]) != full for p in pieces) or param.shape[1:] != param.source.shape[1:]:
        return None
    start, stop = rows[0][0][0], rows[0][0][0]
    for src, dst in rows:
        if src[0] != stop or dst[0] != stop - start:
            return None
        stop = src[1]
    at = stop - start
    for box in sorted(param.zeros(rank)):
        if list(box[1:]) != full or box[0][0] != at:
            return None
        at = box[0][1]
    return (start, stop) if at == param.shape[0] else None


def place_slots(
    plan: ModelPlan,
    targets: Mapping[str, Any],
    routes: Mapping[str, Target | None],
    vocab: Mapping[str, VocabSpan],
    narrow: set[str],
) -> dict[str, torch.Tensor]:
    """For each stored tensor whose rank slice fits its place in a server's parameter exactly: that place (a view)."""

    def fits(view: torch.Tensor, name: str) -> bool:
        p = plan.params[name]
        return tuple(view.shape) == tuple(p.shape) and view.dtype == to_torch(p.dtype) and view.is_contiguous()

    slots: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, str]] = {}
    for name, target in routes.items():
        if target is None or name not in plan.params:
            continue
        data = targets[target.name].data
        if target.expert is not None:
            if target.expert < data.shape[0] and data.dim() > 1:  # an [E] parameter's one value: copied after
                view = data[target.expert]
                rows = view.shape[0] // target.parts
                view = view.narrow(0, target.part * rows, rows)
                if fits(view, name):
                    slots[name] = view
        elif target.fused:
            fused.setdefault(target.name, {})[target.part] = name
        elif target.name in vocab and name not in narrow:
            rows = plan.params[name].shape[0] if plan.params[name].shape else 0  # stored rows, then any padding
            if 0 < rows <= data.shape[0] and fits(data[:rows], name):
                slots[name] = data[:rows]
        elif fits(data, name):
            slots[name] = data
    for vname, parts in fused.items():
        param = targets[vname]
        dim = getattr(param, "output_dim", None)
        names = [parts.get(i) for i in range(routes[next(iter(parts.values()))].parts)]  # type: ignore[union-attr]
        if dim not in (0, None) or any(n is None for n in names):
            continue  # assembled by concatenation (and checked) after the reads
        views, at = {}, 0
        for n in names:
            assert n is not None
            rows = plan.params[n].shape[0] if plan.params[n].shape else 0
            if at + rows > param.data.shape[0]:
                break
            views[n] = param.data.narrow(0, at, rows)
            at += rows
        if at == param.data.shape[0] and len(views) == len(names) and all(fits(v, n) for n, v in views.items()):
            slots.update(views)
    return slots


def copy_into(
    targets: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    routes: Mapping[str, Target | None],
    vocab: Mapping[str, VocabSpan],
    narrow: set[str],
    where: str,
    direct: set[str] = frozenset(),  # type: ignore[assignment]
    adjust: Callable[[str], Callable[[torch.Tensor], torch.Tensor] | None] = lambda name: None,
    *,
    server: str,
) -> set[str]:
    """Copy each rank tensor into its ``server`` parameter (those in ``direct`` were read there; those ``adjust`` names
    changed first); return the parameters filled."""
    import torch

    filled: set[str] = set()
    fused: dict[str, _Fused] = {}
    experts: dict[str, set[tuple[int, int]]] = {}
    expert_parts: dict[str, int] = {}
    for name, tensor in tensors.items():
        target = routes.get(name)
        if target is None:
            continue
        change = adjust(name)
        tensor = tensor if change is None else change(tensor)
        param = targets[target.name]
        if target.expert is not None:
            seen = experts.setdefault(target.name, set())
            expert_parts[target.name] = target.parts
            if (target.expert, target.part) in seen:
                raise ShardloadError(f"a second stored tensor for expert {target.expert} of {target.name!r}",
                                     file=where, param=name)  # fmt: skip
            if name not in direct:
                others = any((target.expert, p) in seen for p in range(target.parts) if p != target.part)
                _fill_expert(param, tensor, target, where, name, server, others)
            seen.add((target.expert, target.part))
            if len(seen) == param.shape[0] * target.parts:
                filled.add(target.name)
            continue
        if target.name in filled:
            raise ShardloadError(
                f"a second stored tensor for {server} parameter {target.name!r}", file=where, param=name
            )
        if not target.fused:
            if target.name in vocab:
                _fill_vocab(param, tensor, vocab[target.name], name in narrow, where, name, name in direct, server)
            elif name not in direct:
                if tensor.numel() == 1 and (param.numel() == 1 or target.every_slot):  # a per-tensor scale
                    tensor = tensor.reshape(()).expand(param.shape)  # stored as [] or [1]; in each slot
                _check_shape(param, tensor.shape, where, name, target.name, server)
                param.data.copy_(tensor)
            filled.add(target.name)
            continue
        group = fused.setdefault(target.name, _Fused([None] * target.parts, [None] * target.parts))
        if group.parts[target.part] is not None:
            raise ShardloadError(f"a second stored tensor for part {target.part} of {target.name!r}", file=where,
                                 param=name)  # fmt: skip
        group.parts[target.part], group.names[target.part] = tensor, name
        if all(n in direct for n in group.names):
            del fused[target.name]
            filled.add(target.name)
        elif all(p is not None for p in group.parts):
            dim = getattr(param, "output_dim", None)
            dim = 0 if dim is None else dim
            parts = [p.reshape(1) if p.dim() == 0 else p for p in group.parts if p is not None]  # 0-d: AutoFP8's
            whole = parts[-1] if target.name.endswith(SHAPE_SUFFIX) else torch.cat(parts, dim=dim)
            _check_shape(param, whole.shape, where, " + ".join(n for n in group.names if n), target.name, server)
            param.data.copy_(whole)
            del fused[target.name]
            filled.add(target.name)
    for vname, seen in experts.items():
        if vname not in filled:
            parts = range(expert_parts[vname])
            absent = sorted({e for e in range(targets[vname].shape[0]) for p in parts if (e, p) not in seen})
            raise ShardloadError(f"expert(s) {absent[:8]} of {server}'s stacked parameter {vname!r} are not all in the "
                                 "checkpoint", file=where)  # fmt: skip
    for vname, group in fused.items():
        absent = [i for i, p in enumerate(group.parts) if p is None]
        raise ShardloadError(f"part(s) {absent} of {server}'s fused parameter {vname!r} are not in the checkpoint",
                             file=where, param=next(n for n in group.names if n))  # fmt: skip
    return filled


@dataclass
class KeptWhole:
    """The steps a shard_info gives stored tensors a server keeps whole (compressed-tensors ``weight_shape``), run
    on each value as it is read, their results dropped: what they check in the values (the last pack of a split dim
    only partly filled) refuses the N there, as a load would."""

    plans: dict[str, ParamPlan]

    @classmethod
    def of(cls, checkpoint: Any, info: Any, names: Iterable[str], num_shards: int) -> KeptWhole:
        """The plans of those of ``names`` that ``info`` gives steps, for ``num_shards`` ranks (headers only)."""
        from ..format.shard_info import ShardInfo

        params = {n: info.params[n] for n in names if info.params.get(n)}
        if not params or num_shards == 1:
            return cls({})
        plan = build_plan(ShardInfo(params, info.num_shards, source=info.source), checkpoint, num_shards)
        return cls({name: plan.params[name] for name in params})

    def check(self, name: str, value: torch.Tensor) -> None:
        """Run ``name``'s steps on its whole stored ``value`` (a few bytes), raising what they raise."""
        from ..engine.steps import run_steps

        if name in self.plans:
            run_steps(self.plans[name], value)


def _fill_expert(
    param: Any, tensor: torch.Tensor, target: Target, where: str, name: str, server: str, others: bool = False
) -> None:
    """One expert's projection into a stacked parameter: ``w13`` = [gate rows; up rows], ``w2`` whole; a ``w13``
    holding one value per expert (a static input scale) takes gate's and up's, which must agree (``others``: a
    part of this expert was filled already)."""
    assert target.expert is not None
    if target.expert >= param.shape[0]:
        raise ShardloadError(
            f"{server}'s {target.name!r} holds {param.shape[0]} experts on this rank, not expert {target.expert}",
            file=where,
            param=name,
        )
    dest = param.data[target.expert]
    if dest.dim() == 0 and target.parts > 1 and tensor.numel() == 1:
        value = tensor.reshape(()).to(dest.dtype)
        if others and abs(float(dest) - float(value)) > 1e-5:  # vLLM's own tolerance; then, as vLLM, the last one
            raise ShardloadError(
                f"{server}'s {target.name!r} holds one value per expert, and expert {target.expert}'s parts store "
                f"{float(dest)} and {float(value)}: they must be equal",
                file=where,
                param=name,
            )
        dest.copy_(value)
        return
    if target.parts > 1:
        rows = dest.shape[0] // target.parts
        dest = dest.narrow(0, target.part * rows, rows)
    if tensor.dim() == 0 and dest.numel() == 1:  # a per-tensor scale stored without a shape
        tensor = tensor.reshape(dest.shape)
    _check_shape(dest, tensor.shape, where, name, f"{target.name}[{target.expert}]", server)
    dest.copy_(tensor)


def _check_shape(param: Any, shape: Sequence[int], where: str, name: str, vname: str, server: str) -> None:
    if tuple(param.shape) != tuple(shape):
        raise ShardloadError(
            f"{server}'s {vname!r} on this rank is {list(param.shape)}, the plan gives {list(shape)}: the plan (a "
            f"shard_info.json, or the one made from config.json) splits it otherwise than {server}",
            file=where,
            param=name,
        )


def _fill_vocab(
    param: Any,
    tensor: torch.Tensor,
    span: VocabSpan,
    whole: bool,
    where: str,
    name: str,
    placed: bool,
    server: str,
) -> None:
    """A padded vocabulary shard: the stored rows ``span`` covers (already there when ``placed``), then zeros.
    ``tensor`` is the whole vocabulary when ``whole``, else this rank's stored rows, perhaps followed by padding."""
    start, stop, _, _ = span
    if placed:
        param.data[stop - start :].zero_()
        return
    rows = tensor.narrow(0, start, stop - start) if whole else tensor[: stop - start]
    fits = rows.shape[0] == stop - start <= param.shape[0] and tuple(rows.shape[1:]) == tuple(param.shape[1:])
    if not fits:
        raise ShardloadError(
            f"{server}'s vocabulary shard is {list(param.shape)} holding stored rows {start}..{stop}; the plan gives "
            f"{list(tensor.shape)}",
            file=where,
            param=name,
        )
    param.data[: rows.shape[0]].copy_(rows)
    param.data[rows.shape[0] :].zero_()
