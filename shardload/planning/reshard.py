"""Resharding plans: which boxes of which old rank tensors make a new rank's tensor (no data read).

A directory converted for N_old holds, for every parameter, the pieces its old plan gave each old rank: boxes of
the stored tensor. The new plan's pieces are boxes of the same stored tensor, so intersecting the two gives, for
each new rank, boxes of old rank tensors and where they land; reorganizing steps (fused QKV, GQA replication,
padding) need no inverse. A stored element held by several old ranks (a replicated KV head) is read from the first.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanError
from ..sources.tensor_info import TensorInfo
from .plan import ParamPlan, Piece
from .registry import Box, Shape


@dataclass(frozen=True)
class OldPart:
    """Copy box ``src`` of old rank ``rank``'s tensor into box ``dst`` of the new rank's tensor."""

    rank: int
    src: Box
    dst: Box


def intersect(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` hold, or None when they share no element."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def subtract(a: Box, b: Box) -> list[Box]:
    """Disjoint boxes covering ``a`` minus ``b`` (``b`` inside ``a``)."""
    rest: list[Box] = []
    core = list(a)
    for d, ((a0, a1), (b0, b1)) in enumerate(zip(a, b, strict=True)):
        if a0 < b0:
            rest.append((*core[:d], (a0, b0), *core[d + 1 :]))
        if b1 < a1:
            rest.append((*core[:d], (b1, a1), *core[d + 1 :]))
        core[d] = (b0, b1)
    return rest


def translate(src: Box, dst: Box, sub: Box) -> Box:
    """The part of ``dst`` that sub-box ``sub`` of ``src`` lands on (a piece maps ``src`` onto ``dst`` element for
    element, its dims of extent other than 1 paired in order)."""
    big_src = [i for i, (a, b) in enumerate(src) if b - a != 1]
    big_dst = [j for j, (a, b) in enumerate(dst) if b - a != 1]
    out = list(dst)
    for i, j in zip(big_src, big_dst, strict=True):
        out[j] = (dst[j][0] + sub[i][0] - src[i][0], dst[j][0] + sub[i][1] - src[i][0])
    return tuple(out)


def old_parts(old: ParamPlan | FixedPlan, wanted: list[Piece]) -> list[OldPart]:
    """The boxes of ``old``'s rank tensors that fill ``wanted`` (stored box -> destination box), each stored element
    taken once, from the lowest old rank holding it. Raises a PlanError when no old rank holds some element."""
    held = [(r, p) for r in range(old.num_shards) for p in _pieces(old, r)]
    parts: list[OldPart] = []
    for want in wanted:
        remaining = [want.src]
        for rank, piece in held:
            if not remaining:
                break
            left: list[Box] = []
            for box in remaining:
                common = intersect(box, piece.src)
                if common is None:
                    left.append(box)
                    continue
                parts.append(
                    OldPart(rank, translate(piece.src, piece.dst, common), translate(want.src, want.dst, common))
                )
                left.extend(subtract(box, common))
            remaining = left
        if remaining:
            raise PlanError(
                f"stored elements {list(remaining[0])} are held by no rank of the num_shards={old.num_shards} files",
                param=old.name,
            )
    return parts


def _pieces(plan: ParamPlan | FixedPlan, rank: int) -> list[Piece]:
    pieces = plan.pieces(rank)
    if pieces is None:
        raise PlanError("its old plan has a compute step: its rank files are not boxes of the stored tensor",
                        param=plan.name)  # fmt: skip
    return [p for p in pieces if all(b > a for a, b in p.src)]


def whole(plan: ParamPlan | FixedPlan) -> list[Piece]:
    """The whole stored tensor of ``plan`` as one wanted piece (to rebuild it for a compute step)."""
    full = tuple((0, n) for n in plan.source.shape)
    return [Piece(full, full)] if all(n > 0 for n in plan.source.shape) else []


def boxes_copyable(plan: ParamPlan | FixedPlan) -> bool:
    """Whether ``plan``'s rank tensors are boxes of its stored tensor, element for element (every step a remap
    that keeps the dtype)."""
    return plan.remap and plan.source.dtype == plan.dtype


@dataclass
class FixedPlan:
    """An old plan given by its boxes rather than by steps: rank r holds ``boxes[r]`` (stored box -> rank box),
    for a layout no shard_info describes (vLLM's vocabulary, padded to a multiple of 64 whatever N divides)."""

    name: str
    source: TensorInfo
    num_shards: int
    shape: Shape
    dtype: str
    boxes: list[list[Piece]]
    steps: tuple[()] = ()
    remap: bool = True
    replicated: bool = False

    def pieces(self, rank: int) -> list[Piece]:
        """The stored boxes rank ``rank`` holds and where."""
        return self.boxes[rank]
