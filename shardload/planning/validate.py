"""Validation of a shard_info file: schema check, then a plan for each N; report every problem.

Validation is planning that collects problems instead of stopping at the first, so it lives here,
above the file format it checks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..errors import PlanError, ShardloadError
from ..format.shard_info import ShardInfo, recorded_num_shards
from ..sources.checkpoint import Checkpoint
from ..sources.source_types import open_source
from .consistency import placement_warnings
from .mesh import Mesh, stage_plans
from .plan import given_shard_info
from .presharded import plan_as_loaded

DEFAULT_NS = (1, 2, 4, 8)


def checked_ns(info: ShardInfo, num_shards: Sequence[int] | None) -> list[int]:
    """The N a check plans for: ``num_shards`` when given, else the file's own N, else the N its description records
    it plans for (as ``shardload plan`` writes it), else :data:`DEFAULT_NS`."""
    if num_shards:
        return list(num_shards)
    if info.num_shards:
        return [info.num_shards]
    recorded = recorded_num_shards(info.description)
    return list(recorded[0]) if recorded and recorded[0] else list(DEFAULT_NS)


def validate_file(
    path: str | os.PathLike[str],
    model: str | os.PathLike[str] | None = None,
    num_shards: Sequence[int] | None = None,
    *,
    mesh: Mesh | None = None,
) -> dict[str, Any]:
    """Check ``path`` (against ``model``'s header when given) for each N; return a JSON-ready report.

    Without ``num_shards`` the file's own N is checked, or for an N-agnostic file the N its description records it
    plans for (as ``shardload plan`` writes it), else 1, 2, 4 and 8. Without a model, an N outside that record is a
    problem (a generated file's steps cannot tell, without the tensors, that N would cut a head); ``checked_against``
    says which: ``"model"``, ``"recorded"`` (that record) or ``"declarations"`` (the steps alone). Against a model,
    ``warnings`` lists placements that plan but cannot compute (:mod:`.consistency`).
    A problem seen for only some N has those N appended to its message. With a ``mesh`` the N
    is its ``tp``, and against a model its pipeline stages must be splittable too.
    """
    report: dict[str, Any] = {"file": str(path), "model": None if model is None else str(model)}
    try:
        info = ShardInfo.load(path)
        checkpoint = _checkpoint(model) if model is not None else None
    except ShardloadError as err:
        report.update(valid=False, num_shards_checked=[], valid_for=[], problems=[err.to_dict()], warnings=[],
                      checked_against="model" if model is not None else "declarations")  # fmt: skip
        return report
    if mesh is not None:
        num_shards = [mesh.tp]
    recorded = recorded_num_shards(info.description) if info.num_shards is None else None
    ns = checked_ns(info, num_shards)
    found: dict[str, dict[str, Any]] = {}
    warned: dict[str, dict[str, Any]] = {}
    valid_for = []
    for n in ns:
        plan = plan_as_loaded(info, checkpoint, n, strict=False)
        problems = plan.problems
        if checkpoint is None and not problems and recorded is not None and n not in recorded[0]:
            listed = ", ".join(map(str, recorded[0])) or "none"
            reason = f"num_shards={n} is not among the N this file records it plans for (num_shards {listed}; "
            problems = [PlanError(f"{reason}checked 1..{recorded[1]} when it was written)", file=str(path))]
        if checkpoint is not None and not problems:
            for warning in placement_warnings(plan):
                warned.setdefault(warning.message, {**warning.to_dict(), "num_shards": []})["num_shards"].append(n)
        if mesh is not None and checkpoint is not None and not problems:
            try:
                stage_plans(plan, mesh)
            except ShardloadError as err:
                problems = [err.located(file=str(model))]
        if not problems:
            valid_for.append(n)
        for problem in problems:
            entry = found.setdefault(problem.message, {**problem.to_dict(), "num_shards": []})
            entry["num_shards"].append(n)
    for entry in [*found.values(), *warned.values()]:
        if len(entry["num_shards"]) < len(ns):
            entry["message"] += f" [num_shards={','.join(str(n) for n in entry['num_shards'])}]"
    return {
        **report,
        "checked_against": "model" if checkpoint is not None else "recorded" if recorded else "declarations",
        "form": info.form,
        "valid": not found,
        "num_shards_checked": ns,
        "valid_for": valid_for,
        "problems": list(found.values()),
        "warnings": list(warned.values()),
    }


def validate(
    shard_info: ShardInfo | dict[str, Any] | str | os.PathLike[str],
    model: str | os.PathLike[str] | None = None,
    num_shards: int | None = None,
) -> list[ShardloadError]:
    """Plan ``shard_info`` for ``num_shards`` ranks (against ``model``'s header when given); return every problem.
    Without ``num_shards``, the N ``shardload validate`` checks: the file's own, else the N its description records,
    else 1, 2, 4 and 8; a problem of only some of them ends with ``[num_shards=...]``.

    Example::

        problems = shardload.validate("shard_info.json", model="llama-dir", num_shards=8)  # [] when valid
    """
    info = given_shard_info(shard_info)
    checkpoint = _checkpoint(model) if model is not None else None
    ns = checked_ns(info, None if num_shards is None else [num_shards])
    found: dict[str, tuple[ShardloadError, list[int]]] = {}
    for n in ns:
        for problem in plan_as_loaded(info, checkpoint, n, strict=False).problems:
            found.setdefault(problem.message, (problem, []))[1].append(n)
    problems = []
    for problem, seen in found.values():
        if len(seen) < len(ns):
            problem.reason += f" [num_shards={','.join(map(str, seen))}]"
            problem.args = (problem.message,)
        problems.append(problem)
    return problems


def _checkpoint(model: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint a shard_info is checked against: ``model`` opened as a load opens it; one made from a
    checkpoint (a converted directory, a server's per-rank layout) carries its own plan and is refused."""
    source = open_source(model)
    if source.derived:
        raise PlanError(f"this is {source.what}, which carries its own plan; check a shard_info against the "
                        "checkpoint it was made from", file=source.name)  # fmt: skip
    return source.checkpoint
