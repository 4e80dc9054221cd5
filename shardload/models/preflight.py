"""``shardload preflight``: which tensor-parallel sizes N a model allows, and for a mixture-of-experts model with
which expert split, found from its config.json, its index and its safetensors headers alone, before any weight is
downloaded; with the bytes read to find out.

Nothing here decides an N on its own: a model with a ``shard_info.json`` beside its weights is planned with that
file for each N (:func:`shardload.planning.plan.build_plan`, what a load does); else the plan is made from
config.json by :func:`shardload.models.generated.generate` and each N is checked by
:func:`shardload.models.generated.num_shards_problems`, what ``shardload plan`` checks (head and KV-head counts,
expert counts, every stored tensor's steps: quantization groups and packs, FP8 blocks, vocabulary padding).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PlanError, ShardloadError
from ..format import input_log
from .choices import DEFAULT_VOCAB_PADDING

MAX_DEFAULT_N = 64
"""The default N go up to this (as ``shardload plan`` checks 1..64)."""


@dataclass
class Check:
    """One N (and expert split) checked: allowed when ``reasons`` is empty, else refused for ``reasons[0]``."""

    num_shards: int
    experts: str | None
    """``"tp"`` (each expert split over the N ranks: EP=1), ``"parallel"`` (whole experts per rank: EP=N), or None
    (no experts split: a dense model, or a shard_info.json that fixes the split)."""
    reasons: list[str]
    kv_replicas: int = 1
    """Ranks that hold each KV head (N over num_key_value_heads when N exceeds them), 1 when none is replicated."""

    @property
    def ok(self) -> bool:
        return not self.reasons

    @property
    def ep(self) -> int:
        """The expert-parallel size: N for whole experts per rank, else 1."""
        return self.num_shards if self.experts == "parallel" else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_shards": self.num_shards, "tp": self.num_shards, "ep": self.ep, "experts": self.experts,
            "ok": self.ok, "reason": self.reasons[0] if self.reasons else None, "problems": len(self.reasons),
            "kv_head_replicas": self.kv_replicas,
        }  # fmt: skip


@dataclass
class Preflight:
    """What ``shardload preflight`` found for one model."""

    model: str
    plan_source: str
    config: dict[str, Any]
    checked: list[int]
    checks: list[Check]
    modes: list[str | None]
    reads: list[tuple[str, int]] = field(default_factory=list)
    """Every read made, in order: path and bytes, each from the file's first byte."""
    header_ends: dict[str, int] = field(default_factory=dict)
    """Each safetensors file's first tensor byte (8 + its header's length)."""
    checkpoint_bytes: int = 0
    root: str = ""
    """The directory (or prefix) the model's files lie in."""
    refused: dict[str | None, str] = field(default_factory=dict)
    """An expert split refused for every N, and why (``--experts parallel`` on experts stored one tensor each)."""

    def name(self, path: str) -> str:
        """A read file as named in the model's directory (``config.json``)."""
        base = self.root.rstrip("/") + "/"
        return path[len(base) :] if self.root and path.startswith(base) else Path(path).name

    def allowed(self, mode: str | None) -> list[int]:
        """The N allowed with expert split ``mode``."""
        return [c.num_shards for c in self.checks if c.experts == mode and c.ok]

    def works(self, n: int) -> bool:
        """Whether N is allowed with some expert split."""
        return any(c.ok for c in self.checks if c.num_shards == n)

    @property
    def fetched(self) -> int:
        """Bytes read, in all."""
        return sum(n for _, n in self.reads)

    @property
    def tensor_bytes_read(self) -> int:
        """Bytes read past a safetensors header, into tensor data (0 unless something read weights)."""
        return sum(max(0, n - self.header_ends[p]) for p, n in self.reads if p in self.header_ends)

    def per_file(self) -> dict[str, tuple[int, int]]:
        """Path -> (reads, bytes)."""
        out: dict[str, tuple[int, int]] = {}
        for path, n in self.reads:
            count, total = out.get(path, (0, 0))
            out[path] = (count + 1, total + n)
        return out

    def to_dict(self) -> dict[str, Any]:
        dims = _dims(self.config)
        return {
            "model": self.model,
            "plan_source": self.plan_source,
            "model_type": self.config.get("model_type"),
            "num_attention_heads": dims.num_heads,
            "num_key_value_heads": dims.num_kv_heads,
            "num_experts": dims.num_experts,
            "checked": self.checked,
            "modes": [
                {
                    "experts": m,
                    "ep": "num_shards" if m == "parallel" else 1,
                    "allowed": self.allowed(m),
                    "refused": self.refused.get(m),
                }
                for m in self.modes
            ],
            "results": [c.to_dict() for c in self.checks],
            "fetched": {
                "bytes": self.fetched,
                "reads": [{"file": self.name(p), "path": p, "bytes": n} for p, n in self.reads],
                "tensor_bytes": self.tensor_bytes_read,
                "checkpoint_tensor_bytes": self.checkpoint_bytes,
            },
        }


def _dims(config: dict[str, Any]) -> Any:
    from .splits import ModelDims

    return ModelDims.lenient(config)


def default_num_shards(config: dict[str, Any]) -> list[int]:
    """The N checked when none is given: the powers of two up to :data:`MAX_DEFAULT_N`, and the divisors (up to it)
    of num_attention_heads and of the expert count, the other N a head or expert split can take."""
    dims = _dims(config)
    ns = {1 << k for k in range(MAX_DEFAULT_N.bit_length()) if 1 << k <= MAX_DEFAULT_N}
    for count in (dims.num_heads, dims.num_experts):
        if count:
            ns |= {d for d in range(1, min(count, MAX_DEFAULT_N) + 1) if count % d == 0}
    return sorted(ns)


def preflight(
    model: str | os.PathLike[str],
    num_shards: Sequence[int] = (),
    *,
    style: str = "auto",
    vocab_padding: str = DEFAULT_VOCAB_PADDING,
) -> Preflight:
    """Check which N ``model`` allows, reading config.json, the index, shard_info.json when there is one, and each
    safetensors file's header only (a Hub id from the local cache when it is there, else over HTTP by range
    requests, never downloading a weight; an ``s3://`` model by range requests). ``num_shards``: the N to check
    (default :func:`default_num_shards`)."""
    from ..sources.location import NotCachedError, hub_snapshot, model_kind

    for n in num_shards:
        if type(n) is not int or n < 1:
            raise PlanError(f"num_shards must be a positive integer, got {n!r}", file=str(model))
    if model_kind(model) != "hub":
        return _preflight(model, model, num_shards, style, vocab_padding)
    try:
        target = hub_snapshot(str(model), cache_only=True)
    except NotCachedError:  # online, not cached: config, index and headers over HTTP
        from ..sources.hub_remote import open_hub

        with tempfile.TemporaryDirectory(prefix="shardload-preflight-") as work:
            remote = open_hub(str(model), Path(work))
            try:
                return _preflight(model, remote, num_shards, style, vocab_padding)
            except ShardloadError as err:
                raise remote.relabel(err) from None
    return _preflight(model, target, num_shards, style, vocab_padding)


def _preflight(
    model: str | os.PathLike[str], target: Any, num_shards: Sequence[int], style: str, vocab_padding: str
) -> Preflight:
    """:func:`preflight` of ``target``: a path or URI to open, or a Hub model opened over HTTP."""
    from ..planning.plan import _blocking_rank, build_plan, resolve_shard_info
    from ..sources.checkpoint import open_checkpoint, read_config
    from ..sources.hub_remote import HubRemote
    from ..sources.source_types import open_source
    from .generated import generate, num_shards_problems

    remote = target if isinstance(target, HubRemote) else None
    with input_log.recording() as log:
        start = len(log.reads)  # an enclosing recording's earlier reads are not this check's
        source = open_source(remote.checkpoint if remote else open_checkpoint(target))
        if source.derived:
            raise PlanError(f"this is {source.what}; check the source checkpoint instead", file=str(model))
        checkpoint = source.checkpoint
        if not checkpoint.plain_safetensors:
            raise PlanError(
                f"preflight checks a safetensors checkpoint (this is {checkpoint.kind}: plan it with `shardload plan`)",
                file=str(model),
            )
        default = checkpoint.default_shard_info()
        config = read_config(checkpoint.root, missing_ok=True)
        ns = sorted(set(num_shards)) or default_num_shards(config)
        checks: list[Check] = []
        refused = {}
        if default.exists() or default.is_symlink():  # the file a load plans with
            info = resolve_shard_info(checkpoint, None)
            source, modes = f"{default.name} beside the weights", [None]
            for n in ns:
                problems = sorted(build_plan(info, checkpoint, n, strict=False).problems, key=_blocking_rank)
                checks.append(Check(n, None, [p.message for p in problems]))
        else:
            made_from = checkpoint.config_file()
            if not (made_from.exists() or made_from.is_symlink()):  # as `shardload plan` says it
                raise PlanError(f"no {default.name} beside the weights and no {made_from.name} to plan one from; "
                                "write a shard_info.json (docs/format.md)", file=str(model))  # fmt: skip
            dims = _dims(config)
            modes = ["tp", "parallel"] if dims.num_experts else [None]
            source = ""
            by_mode: dict[str | None, dict[int, list[str]]] = {}
            refused: dict[str | None, str] = {}
            kv_split: dict[str | None, bool] = {}
            for mode in modes:
                try:
                    made = generate(checkpoint, style=style, experts=mode or "tp", check_up_to=0,
                                    vocab_padding=vocab_padding, config=config)  # fmt: skip
                except PlanError as err:
                    if mode != "parallel":
                        raise
                    refused[mode] = err.message
                    by_mode[mode] = {n: [err.message] for n in ns}
                    continue
                source = source or f"{checkpoint.config_file().name} ({made.source})"
                kv_split[mode] = any(any(p.kv) for p in made.placements.values())
                if mode == "parallel" and not any(p.style == "expert" for p in made.placements.values()):
                    refused[mode] = "no stacked expert tensors: nothing would be expert-parallel (--experts parallel)"
                    by_mode[mode] = {n: [refused[mode]] for n in ns}
                    continue
                by_mode[mode] = num_shards_problems(config, made.placements, made.document, checkpoint.tensors, ns)
            for n in ns:
                for mode in modes:
                    kv = dims.num_kv_heads
                    replicas = n // kv if kv_split.get(mode) and kv and n > kv and n % kv == 0 else 1
                    checks.append(Check(n, mode, by_mode[mode][n], replicas))
        reads = log.reads[start:]
    header_ends = {}
    for path in checkpoint.files:
        starts = [t.offset for t in checkpoint.tensors.values() if t.file == path]
        if starts:
            header_ends[remote.url(path) if remote else str(path)] = min(starts)
    root = str(checkpoint.root)
    if remote:  # what came over HTTP, not the reads of the JSON files it was written to; files named by URL
        reads, root = list(remote.reads), remote.root
        for check in checks:
            check.reasons = [remote.text(r) for r in check.reasons]
        refused = {mode: remote.text(r) for mode, r in refused.items()}
    return Preflight(
        str(model), source, config, ns, checks, modes, reads, header_ends, checkpoint.nbytes, root, refused
    )
