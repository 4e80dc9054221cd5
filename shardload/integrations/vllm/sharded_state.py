"""vLLM's ``sharded_state`` layout as a source: a directory ``convert --layout vllm`` or vLLM's own ``save_model``
wrote, opened for any N (:func:`open_vllm_shards`), and registered as a split format (:mod:`.split_format`), so
every entry point (``load``, ``load_rank``, ``convert``, the loader) reads it as boxes of its rank files. Never
imports vLLM.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ...engine.reshard import RECORD_KEY, ShardsSource, read_record
from ...errors import CheckpointError, ShardloadError, short_repr
from ...format.shard_info import ShardInfo
from ...sources.checkpoint import Checkpoint
from ...sources.manifest import (
    LEAVES_KEY,
    LEAVES_MANIFEST_VERSION,
    MANIFEST_VERSIONS,
    VLLM_MANIFEST_FORMAT,
    check_leaves_record,
    manifest_file_entry,
    manifest_ranks,
)
from ...sources.tensor_info import TensorInfo
from .layout import plan_layout
from .names import vocab_range
from .saved import check_contents, read_vllm_save, saved_shard_info

FILE_PATTERN = "model-rank-{rank}-part-0.safetensors"
"""vLLM's ``ShardedStateLoader`` file name for tensor-parallel rank ``rank`` (one part per rank)."""
_RANK_FILE_RE = re.compile(r"model-rank-(0|[1-9][0-9]{0,8})-part-(0|[1-9][0-9]{0,8})\.safetensors")
"""A file vLLM's ``ShardedStateLoader`` reads: rank, part (shardload writes part 0 only)."""


def rank_of(path: str) -> int | None:
    """The rank whose file ``path`` (as a manifest lists it) is, None for any other file."""
    match = _RANK_FILE_RE.fullmatch(path)
    return int(match[1]) if match and match[2] == "0" else None


def check_vllm_manifest(manifest: Any, where: Path) -> None:
    """Check a ``sharded_state`` output's manifest as :func:`~shardload.sources.manifest.check_manifest` checks
    the plain layout's: num_shards within the rank cap, plain file names listed once, every rank's file listed
    exactly once and no rank file of another N."""

    def bad(reason: str) -> CheckpointError:
        return CheckpointError(f"inconsistent manifest: {reason}", file=str(where))

    if not isinstance(manifest, dict) or manifest.get("format") != VLLM_MANIFEST_FORMAT:
        raise bad(f"'format' is not {VLLM_MANIFEST_FORMAT!r}")
    version = manifest.get("version")
    if type(version) is not int or version not in MANIFEST_VERSIONS:
        reads = " and ".join(str(v) for v in MANIFEST_VERSIONS)
        raise bad(f"unsupported version {short_repr(version)} (this shardload reads {reads})")
    n, files = manifest_ranks(manifest, bad)
    seen: set[str] = set()
    ranks: set[int] = set()
    for entry in files:
        path = manifest_file_entry(entry, seen, where)
        match = _RANK_FILE_RE.fullmatch(path)
        if LEAVES_KEY in entry and (version < LEAVES_MANIFEST_VERSION or not match):
            raise bad(f"lists {path} by its {LEAVES_KEY}, which only a version-{LEAVES_MANIFEST_VERSION} manifest's "
                      "rank files are")  # fmt: skip
        if match:
            if match[2] != "0" or int(match[1]) >= n:
                raise bad(f"lists {path}, which is not a rank file of num_shards={n}")
            ranks.add(int(match[1]))
    check_leaves_record(manifest, files, bad)
    missing = [r for r in range(n) if r not in ranks]
    if missing:
        name = FILE_PATTERN.format(rank=missing[0])
        raise bad(f"lists no file {name} ({len(missing)} of {n} rank files unlisted)")


def open_vllm_shards(model: Any, verify: bool = False) -> ShardsSource | None:
    """A ``sharded_state`` directory ``convert --layout vllm`` or vLLM's own ``save_model`` wrote, as a source for
    any N (None when ``model`` is no such directory): its record (or the header rebuilt from config.json) planned
    again for its own N says which rows of which vLLM rank tensor hold each plain rank tensor (fused parts and
    stacked experts are row blocks; the vocabulary is padded per vLLM's rule). Every rank file is checked (listed,
    size, each tensor's shape and dtype; with ``verify`` its sha256) before any tensor byte is read."""
    from ...engine.verify import OutputRecord, check_entry
    from ...sources.checkpoint import read_json
    from ...sources.manifest import MANIFEST_NAME
    from ...sources.safetensors_header import read_header

    if not isinstance(model, (str, os.PathLike)) or not Path(model).is_dir():
        return None
    root = Path(model)
    where = root / MANIFEST_NAME
    if not where.is_file():
        return _open_vllm_save(root, verify)
    manifest = read_json(where, "manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != VLLM_MANIFEST_FORMAT:
        return None
    check_vllm_manifest(manifest, where)
    n_old = manifest["num_shards"]
    if manifest.get("expert_parallel") is True:
        raise CheckpointError(
            f"is vLLM's sharded_state layout for num_shards={n_old} with expert parallelism: not a source for "
            "another N or layout yet; serve it with load_format='sharded_state' at that N, or convert the source",
            file=str(where),
        )
    record = manifest.get(RECORD_KEY)
    if not isinstance(record, dict):
        raise CheckpointError(
            f"is vLLM's sharded_state layout for num_shards={n_old} without a source record (written by vLLM itself "
            "or an older shardload): serve it with load_format='sharded_state' at that N, or convert the source "
            "checkpoint",
            file=str(where),
        )
    shell = Checkpoint(root, root, "converted", {}, [], manifest)
    info, stored, values = read_record(record, shell, str(where))
    entries = {e["path"]: e for e in manifest["files"]}
    found: dict[int, dict[str, TensorInfo]] = {}
    record = OutputRecord(root, manifest)  # read once, for the rank files listed by their leaves
    for r in range(n_old):
        path, problem = check_entry(root, entries[FILE_PATTERN.format(rank=r)], verify, manifest, rank=r,
                                    record=record)  # fmt: skip
        if problem is not None:
            raise problem
        found[r] = read_header(path)
    return _vllm_source(shell, info, stored, values, n_old, found, [where], "the manifest's plan")


def _open_vllm_save(root: Path, verify: bool) -> ShardsSource | None:
    """A directory vLLM's own ``save_model`` wrote (no manifest; config.json copied beside it) as a source for any
    N: the original checkpoint's header rebuilt (:mod:`.saved`), planned for the directory's N as ``convert
    --layout vllm`` plans it, every rank file checked against that plan (None: ``root`` holds no such files)."""
    save = read_vllm_save(root)
    if save is None:
        return None
    if verify:
        raise ShardloadError(
            "verify=True checks rank files against a manifest's sha256, and vLLM's save_model writes none: convert "
            "without verify (every rank file's shapes and dtypes are still checked), or convert the original",
            file=str(root),
        )
    info = saved_shard_info(save.stored, save.num_shards)
    shell = Checkpoint(root, root, "converted", {}, [])
    extra = [p for paths in save.files.values() for p in paths[1:]] + [root / "config.json"]
    source = _vllm_source(shell, info, save.stored, {}, save.num_shards, save.headers, extra, "config.json")
    layout = plan_layout(save.stored, save.num_shards, info)
    body = [t for t in layout.tensors if not t.vocab and t.constant is None]
    whole = [t.name for t in body if all(layout.plan.params[p].replicated for p in t.parts)]
    split = next((t.name for t in body if t.name not in whole), None)
    check_contents(save, whole, split if save.num_shards > 1 else None)
    return source


def _vllm_source(
    shell: Checkpoint,
    info: ShardInfo,
    stored: Checkpoint,
    values: dict[str, bytes],
    n_old: int,
    found: dict[int, dict[str, TensorInfo]],
    extra: list[Path],
    said_by: str,
) -> ShardsSource:
    """A ``sharded_state`` directory of ``n_old`` ranks as a source for any N: ``stored`` planned for ``n_old`` as
    ``convert --layout vllm`` plans it, each rank's tensors ``found`` checked against that plan (every tensor, of
    its shape and dtype, nothing else), and each plain rank tensor located as rows of a vLLM rank tensor."""
    from ...planning.mesh import Mesh
    from ...planning.plan import ModelPlan, Piece
    from ...planning.registry import Box
    from ...planning.reshard import FixedPlan

    layout = plan_layout(stored, n_old, info)
    across = next((t.name for t in layout.tensors if t.dim or t.transposed or t.first_rank_only), None)
    if across is not None:  # its parts are columns of the rank tensor, not row blocks, or not the stored values
        raise CheckpointError(
            f"is vLLM's sharded_state layout for num_shards={n_old} of a GPTQ, AWQ or GPT-OSS model, whose rank "
            "tensors join their parts along the columns or change them: not a source for another N or layout yet; "
            "convert the source checkpoint",
            file=str(extra[0] if extra else stored.path),
            param=across,
        )
    files: dict[tuple[int, int], Path] = {}
    headers: dict[tuple[int, int], dict[str, TensorInfo]] = {}
    expected = {t.name for t in layout.tensors}
    for r in range(n_old):
        own: dict[str, TensorInfo] = {}
        first = min((t.file for t in found[r].values()), default=None)
        for name, got in found[r].items():
            if name not in expected:
                raise CheckpointError(f"is no tensor of {said_by}'s plan for num_shards={n_old}", file=str(got.file),
                                      param=name)  # fmt: skip
        for t in layout.tensors:
            got = found[r].get(t.name)
            if got is None or (got.shape, got.dtype) != (tuple(t.shape), t.dtype):
                said = "missing" if got is None else f"{got.dtype} {list(got.shape)}"
                path = got.file if got is not None else first
                raise CheckpointError(f"is {said}, but {said_by}'s plan gives {t.dtype} {list(t.shape)}",
                                      file=str(path), param=t.name)  # fmt: skip
            if t.vocab:
                own[t.parts[0]] = got
                continue
            offset = got.offset
            per = len(t.parts) // max(1, t.experts)
            for k, name in enumerate(t.parts):
                part = layout.plan.params[name]
                nbytes = part.rank_nbytes
                own[name] = TensorInfo(name, part.dtype, tuple(part.shape), got.file, offset, nbytes)
                offset += nbytes
                if t.experts and (k + 1) % per == 0:
                    offset = got.offset + (k + 1) // per * (got.nbytes // t.experts)
        if first is not None:
            files[(0, r)] = first
        headers[(0, r)] = own
    old_params: dict[str, Any] = dict(layout.plan.params)
    for name, whole_info in layout.vocab_plan.params.items():
        rows = whole_info.source.shape[0]
        rest: Box = tuple((0, n) for n in whole_info.source.shape[1:])
        boxes = []
        for r in range(n_old):
            start, stop, _ = vocab_range(rows, r, n_old)
            boxes.append([Piece(((start, stop), *rest), ((0, stop - start), *rest))] if stop > start else [])
        shape = (vocab_range(rows, 0, n_old)[2], *whole_info.source.shape[1:])
        old_params[name] = FixedPlan(name, whole_info.source, n_old, shape, whole_info.dtype, boxes)
    old = ModelPlan(n_old, info, stored, old_params)
    holder = dict.fromkeys(old_params, 0)
    return ShardsSource(shell, info, stored, old, Mesh(tp=n_old), files, headers, holder, values, extra)


def rank_path(out_dir: str | os.PathLike[str], rank: int) -> Path:
    """The file vLLM reads for tensor-parallel rank ``rank`` of a ``sharded_state`` directory."""
    return Path(out_dir) / FILE_PATTERN.format(rank=rank)
