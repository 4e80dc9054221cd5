"""Conversion: write a pre-sharded directory (one safetensors file per rank + a manifest).

Output is streamed one parameter at a time into a temporary directory next to the target,
checksummed while written, then renamed into place: an interrupted convert never leaves a
directory that looks complete.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import __version__
from .checkpoint import INDEX_NAME, MANIFEST_NAME, open_checkpoint
from .errors import ShardloadError
from .execute import rank_file_name, sha256_file
from .plan import ModelPlan, build_plan, resolve_shard_info
from .writer import write_rank_files

MANIFEST_VERSION = 1
TMP_MARKER = ".shardload-tmp-"

Progress = Callable[[int, str], None]
"""``progress(source_bytes_done, param_name)``, called after each parameter."""


@dataclass(frozen=True)
class OutputFile:
    """One file of a converted directory, as recorded in the manifest."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert` wrote: the directory, its plan, and every output file."""

    out_dir: Path
    plan: ModelPlan
    rank_files: list[OutputFile]
    other_files: list[OutputFile]


def _copy_other_files(src_root: Path, dst: Path, skip: set[Path]) -> list[OutputFile]:
    """Copy the model directory's non-weight top-level files (config, tokenizer, ...)."""
    copied = []
    for entry in sorted(src_root.iterdir()):
        if entry.name.startswith(".") or not entry.is_file() or entry.resolve() in skip:
            continue
        if entry.name.endswith(".safetensors") or entry.name in (INDEX_NAME, MANIFEST_NAME):
            continue
        shutil.copyfile(entry, dst / entry.name)
        copied.append(OutputFile(entry.name, (dst / entry.name).stat().st_size, sha256_file(dst / entry.name)))
    return copied


def convert(
    model: str | os.PathLike[str],
    num_shards: int,
    out_dir: str | os.PathLike[str],
    shard_info: Any = None,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ConvertResult:
    """Write ``model`` pre-sharded for ``num_shards`` ranks into ``out_dir``.

    Creates ``rank-RRRRR-of-NNNNN.safetensors`` per rank and ``shard_manifest.json`` (format
    version, num_shards, resolved shard_info, sources, and size + sha256 of every file), and
    copies config/tokenizer files. An existing ``out_dir`` is refused unless ``overwrite``.

    Example::

        shardload.convert("llama-dir", 8, "llama-tp8")
        state = shardload.load_rank("llama-tp8", rank=0, num_shards=8)
    """
    out = Path(out_dir)
    checkpoint = open_checkpoint(model)
    if checkpoint.kind == "converted":
        raise ShardloadError("already a converted directory; convert the source checkpoint", file=checkpoint.name)
    info = resolve_shard_info(checkpoint, shard_info)
    plan = build_plan(info, checkpoint, num_shards)
    if out.resolve() == checkpoint.root.resolve():
        raise ShardloadError("output directory is the model directory", file=str(out))
    if out.exists() and not overwrite:
        raise ShardloadError("output directory exists (pass --overwrite / overwrite=True to replace it)", file=str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}{TMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        rank_files = _write_ranks(plan, tmp, progress)
        skip = {Path(info.source).resolve()} if Path(info.source).exists() else set()
        others = _copy_other_files(checkpoint.root, tmp, skip)
        manifest = {
            "format": "shardload.converted",
            "version": MANIFEST_VERSION,
            "shardload_version": __version__,
            "num_shards": num_shards,
            "shard_info": plan.resolved_shard_info(),
            "source": {"files": [{"path": f.name, "size": f.stat().st_size} for f in checkpoint.files]},
            "files": [f.__dict__ for f in rank_files + others],
        }
        with open(tmp / MANIFEST_NAME, "w") as fh:
            json.dump(manifest, fh, indent=2)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConvertResult(out, plan, rank_files, others)


def _write_ranks(plan: ModelPlan, tmp: Path, progress: Progress | None) -> list[OutputFile]:
    n = plan.num_shards
    written = write_rank_files(plan, [tmp / rank_file_name(r, n) for r in range(n)], progress)
    return [OutputFile(f.name, f.size, f.sha256) for f in written]


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished temporary directory into place (replacing an old ``out`` last)."""
    if out.exists() or out.is_symlink():
        trash = out.parent / f".{out.name}{TMP_MARKER}old-{secrets.token_hex(4)}"
        os.replace(out, trash)
        os.replace(tmp, out)
        if trash.is_dir() and not trash.is_symlink():
            shutil.rmtree(trash, ignore_errors=True)
        else:
            trash.unlink()
    else:
        os.replace(tmp, out)
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
