"""Human-readable reports built from a plan: the ``inspect`` table, totals, and plain-text tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import printable
from ..planning.plan import ModelPlan

if TYPE_CHECKING:
    from ..planning.mesh import Mesh


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def inspect_rows(plan: ModelPlan) -> list[dict[str, Any]]:
    """One row per stored tensor: stored shape/dtype, steps, per-rank shape and bytes, read mode."""
    rows = []
    for p in plan.params.values():
        steps = " > ".join(s.name.removeprefix("shard_funcs.") for s in p.steps) or "replicated"
        rows.append(
            {
                "parameter": p.name,
                "stored_shape": list(p.source.shape),
                "dtype": p.source.dtype,
                "steps": steps,
                "rank_shape": list(p.shape),
                "rank_dtype": p.dtype,
                "rank_bytes": p.rank_nbytes,
                "reads": "whole" if p.replicated or not p.remap else "own boxes",
            }
        )
    return rows


def totals(plan: ModelPlan) -> dict[str, Any]:
    """Bytes per rank, replicated bytes, checkpoint bytes, and max/min balance across ranks."""
    per_rank = [plan.rank_nbytes(r) for r in range(plan.num_shards)]
    return {
        "num_shards": plan.num_shards,
        "checkpoint_bytes": sum(p.source.nbytes for p in plan.params.values()),
        "bytes_per_rank": per_rank,
        "replicated_bytes": plan.replicated_nbytes,
        "balance_max_over_min": (max(per_rank) / min(per_rank)) if min(per_rank) else None,
    }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """A plain aligned text table; column indices in ``right`` are right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return "  ".join(parts).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def inspect_text(plan: ModelPlan) -> str:
    """The full ``shardload inspect`` output: parameter table, then totals."""
    rows = [
        (printable(r["parameter"]), _shape(r["stored_shape"]), r["dtype"], printable(r["steps"]),
         _shape(r["rank_shape"]), human_bytes(r["rank_bytes"]), r["reads"])
        for r in inspect_rows(plan)
    ]  # fmt: skip
    table = format_table(
        ["parameter", "stored shape", "dtype", "steps", "per-rank shape", "bytes/rank", "reads"], rows, right=(5,)
    )
    t = totals(plan)
    per_rank = t["bytes_per_rank"]
    balance = "n/a" if t["balance_max_over_min"] is None else f"{t['balance_max_over_min']:.3f}"
    lines = [
        table,
        "",
        f"num_shards: {t['num_shards']}",
        f"checkpoint bytes: {human_bytes(t['checkpoint_bytes'])} ({t['checkpoint_bytes']})",
        f"bytes per rank: {human_bytes(max(per_rank))} ({max(per_rank)})"
        + ("" if len(set(per_rank)) == 1 else f" (min {min(per_rank)})"),
        f"replicated bytes per rank: {human_bytes(t['replicated_bytes'])} ({t['replicated_bytes']})",
        f"rank balance (max/min): {balance}",
    ]
    return "\n".join(lines)


def mesh_rows(plan: ModelPlan, layout: Mesh) -> list[dict[str, Any]]:
    """One row per (pipeline stage, tensor rank): global ranks, layers, tensors, bytes held and read."""
    from ..engine.run import stages_of

    rows = []
    for pp, stage in enumerate(stages_of(plan, layout)):
        for tp in range(layout.tp):
            layers = stage.layers
            rows.append(
                {
                    "pp": pp,
                    "tp": tp,
                    "ranks": [layout.rank(dp, pp, tp) for dp in range(layout.dp)],
                    "layers": None if layers is None else [layers.start, layers.stop],
                    "tensors": len(stage.params),
                    "bytes_held": stage.rank_nbytes(tp),
                    "bytes_read": sum(p.read_nbytes(tp) for p in stage.params.values()),
                }
            )
    return rows


def mesh_text(plan: ModelPlan, layout: Mesh) -> str:
    """The ``inspect --mesh`` table: what each (stage, tensor rank) holds and reads, with dp replicas."""
    checkpoint_bytes = sum(p.source.nbytes for p in plan.params.values())
    rows = []
    for r in mesh_rows(plan, layout):
        layers = "all" if r["layers"] is None else f"{r['layers'][0]}..{r['layers'][1] - 1}"
        if r["layers"] is not None and r["layers"][0] == r["layers"][1]:
            layers = "none"
        share = r["bytes_read"] / checkpoint_bytes if checkpoint_bytes else 0.0
        ranks = ",".join(str(x) for x in r["ranks"])
        rows.append((ranks, r["pp"], r["tp"], layers, r["tensors"], human_bytes(r["bytes_held"]),
                     human_bytes(r["bytes_read"]), f"{share:.3f}"))  # fmt: skip
    headers = ["ranks", "pp", "tp", "layers", "tensors", "bytes held", "bytes read", "read/checkpoint"]
    return f"mesh {layout} ({layout.world_size} ranks)\n" + format_table(headers, rows, right=(1, 2, 4, 5, 6, 7))
