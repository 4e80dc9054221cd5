"""Conversion: write a pre-sharded directory (one safetensors file per rank + a manifest).

Output is streamed one parameter at a time into a temporary directory next to the target
(``.OUT.shardload-tmp-PID-XXXX``, locked while in use), checksummed while written, then renamed
into place: an interrupted convert never leaves a directory that looks complete, and the next
convert to the same target removes what a killed one left behind. Output that replaces an existing
directory, or a complete one a killed ``--overwrite`` had moved aside, is flushed to stable storage
before the rename, so a power loss cannot trade a complete old output for a half-written new one;
``fsync=True`` flushes any output, ``fsync=False`` none.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ShardloadError
from ..planning.mesh import Mesh
from ..planning.plan import ModelPlan, build_plan, resolve_shard_info
from ..sources.checkpoint import (
    INDEX_NAME,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    TMP_MARKER,
    open_checkpoint,
    rank_file_name,
    resolve_inside,
)
from ..version import __version__
from .load import layout_for, stages_of
from .writer import OutFile, OutputFile, fsync_dir, fsync_tree, write_rank_files

Progress = Callable[[int, str], None]
"""``progress(source_bytes_done, param_name)``, called after each parameter."""


@dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert` wrote: the directory, its plan, and every output file."""

    out_dir: Path
    plan: ModelPlan
    rank_files: list[OutputFile]
    other_files: list[OutputFile]
    layout: Mesh
    """The mesh written for (``tp`` = num_shards; one stage unless converted with a pipeline mesh)."""


def _copy_other_files(src_root: Path, dst: Path, skip: set[Path], durable: bool) -> list[OutputFile]:
    """Copy the model directory's non-weight top-level files (config, tokenizer, ...)."""
    copied = []
    for entry in sorted(src_root.iterdir()):
        if entry.name.startswith(".") or not entry.is_file() or entry.resolve() in skip:
            continue
        if entry.name.endswith((".safetensors", ".gguf")) or entry.name in (INDEX_NAME, MANIFEST_NAME):
            continue
        source = resolve_inside(src_root, entry.name, src_root)  # no symlink may copy files from elsewhere
        out = OutFile(dst / entry.name, durable=durable)
        try:
            with open(source, "rb") as fh:
                while block := fh.read(8 << 20):
                    out.write(block)
            copied.append(out.finish())
        finally:
            out.close()
    return copied


def convert(
    model: str | os.PathLike[str],
    num_shards: int | None,
    out_dir: str | os.PathLike[str],
    shard_info: Any = None,
    *,
    mesh: Mesh | str | Mapping[str, int] | None = None,
    overwrite: bool = False,
    fsync: bool | None = None,
    progress: Progress | None = None,
) -> ConvertResult:
    """Write ``model`` pre-sharded for ``num_shards`` ranks into ``out_dir``.

    Creates ``rank-RRRRR-of-NNNNN.safetensors`` per rank and ``shard_manifest.json`` (format
    version, num_shards, resolved shard_info, sources, and size + sha256 of every file), and
    copies config/tokenizer files. An existing ``out_dir`` is refused unless ``overwrite``.
    With a ``mesh`` that has ``pp`` > 1, there is one file per (pipeline stage, tensor rank),
    ``pp-SSSSS-of-PPPPP-rank-RRRRR-of-NNNNN.safetensors``, holding only that stage's
    parameters; ``dp`` replicas share files, and the manifest records the mesh.

    Durability: by default (``fsync=None``) the files are fsynced only when they replace an existing
    ``out_dir`` (or the complete output a killed ``overwrite`` run had moved aside), so an old output is
    never given up for one a power loss could still cut short. A new output is left to the kernel's
    writeback, as ``cp`` does: on most filesystems a file a power loss cut short fails the size check
    every load makes, and ``verify_dir`` (or ``verify=True``) finds any damage. ``fsync=True`` always
    flushes, ``False`` never does.

    Example::

        shardload.convert("llama-dir", 8, "llama-tp8")
        state = shardload.load_rank("llama-tp8", rank=0, num_shards=8)
    """
    out = Path(out_dir)
    if TMP_MARKER in out.name:
        raise ShardloadError(
            f"an output name may not contain {TMP_MARKER!r} (reserved for temporary files)", file=str(out)
        )
    checkpoint = open_checkpoint(model)
    if checkpoint.kind == "converted":
        raise ShardloadError("already a converted directory; convert the source checkpoint", file=checkpoint.name)
    info = resolve_shard_info(checkpoint, shard_info)
    layout = layout_for(num_shards, mesh, None)
    plan = build_plan(info, checkpoint, layout.tp)
    if checkpoint.presharded is not None:
        raise ShardloadError(
            f"is already pre-sharded for num_shards={checkpoint.presharded}: load it directly (load_rank reads each "
            "rank's own records); convert splits a checkpoint stored whole",
            file=checkpoint.name,
        )
    stages = stages_of(plan, layout)
    if checkpoint.root.resolve().is_relative_to(out.resolve()):
        raise ShardloadError("output directory is (or contains) the model directory", file=str(out))
    exists = out.exists() or out.is_symlink()
    if exists and not overwrite:
        raise ShardloadError("output directory exists (pass --overwrite / overwrite=True to replace it)", file=str(out))
    durable = exists if fsync is None else fsync
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with _Staging(out, fsync, synced=durable, overwrite=overwrite) as staging:
            rank_files = _write_ranks(stages, staging.dir, progress, durable)
            # The manifest holds the resolved shard_info; a copied shard_info.json would only mislead.
            skip = {checkpoint.default_shard_info().resolve()}
            if Path(info.source).exists():
                skip.add(Path(info.source).resolve())
            others = _copy_other_files(checkpoint.root, staging.dir, skip, durable)
            manifest = {
                "format": MANIFEST_FORMAT,
                "version": MANIFEST_VERSION,
                "shardload_version": __version__,
                "num_shards": layout.tp,
                "mesh": _mesh_record(layout, stages),
                "shard_info": plan.resolved_shard_info(),
                "source": {"files": [{"path": f.name, "size": f.stat().st_size} for f in checkpoint.files]},
                "files": [f.__dict__ for f in rank_files + others],
            }
            text = json.dumps(manifest, indent=2) + "\n"
            out_file = OutFile(staging.dir / MANIFEST_NAME, durable=durable)
            try:
                out_file.write(text.encode())
                out_file.finish()
            finally:
                out_file.close()
            staging.publish()
    except OSError as err:
        what = f"cannot write {Path(err.filename).name}" if err.filename else "cannot write the output"
        code = f" [{errno.errorcode[err.errno]}]" if err.errno in errno.errorcode else ""
        raise ShardloadError(
            f"{what}: {err.strerror or err}{code}; nothing was put in place and the partial output was removed",
            file=str(out),
        ) from None
    return ConvertResult(out, plan, rank_files, others, layout)


def _mesh_record(layout: Mesh, stages: list[ModelPlan]) -> dict[str, Any] | None:
    """What the manifest says about pipeline stages (None for a plain tensor-parallel convert)."""
    if layout.pp == 1:
        return None
    counts = [len(s.layers) if s.layers is not None else 0 for s in stages]
    return {"pp": layout.pp, "tp": layout.tp, "pp_layers": counts}


def _write_ranks(stages: list[ModelPlan], tmp: Path, progress: Progress | None, durable: bool) -> list[OutputFile]:
    """Write every (pipeline stage, tensor rank) file; each stage's parameters are read once."""
    files: list[OutputFile] = []
    done = 0
    for pp, plan in enumerate(stages):
        n = plan.num_shards
        names = [tmp / rank_file_name(r, n, pp, len(stages)) for r in range(n)]

        def report(source_done: int, name: str, base: int = done) -> None:
            if progress is not None:
                progress(base + source_done, name)

        files.extend(write_rank_files(plan, names, report, stage=pp, stages=len(stages), durable=durable))
        done += sum(p.source.nbytes for p in plan.params.values())
    return files


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _lock(fd: int, wait: bool) -> bool:
    """flock ``fd`` exclusively; False if another process holds it."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no advisory locks; leftovers are taken as stale
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class _Staging:
    """The temporary directory beside ``out`` that a convert writes into, and its lock.

    Every entry is named ``.OUT.shardload-tmp-TOKEN[.lock|.old]``. The ``.lock`` file is
    flock-ed for the convert's lifetime, so the next convert can tell a live one (refuse) from
    the leftovers of a killed one (remove them).

    ``fsync`` is :func:`convert`'s policy; ``synced`` says the files were fsynced as written. Whether the
    output replaces another one is decided when it is published, so an output that appeared meanwhile,
    or a complete one a killed ``--overwrite`` left beside an absent target, is never given up for
    unflushed files.
    """

    def __init__(self, out: Path, fsync: bool | None, *, synced: bool, overwrite: bool) -> None:
        self.out = out
        self.fsync = fsync
        self.synced = synced
        self.overwrite = overwrite
        self.found_old = False
        self.prefix = f".{out.name}{TMP_MARKER}"
        self.token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.dir = out.parent / f"{self.prefix}{self.token}"
        self.lock = out.parent / f"{self.prefix}{self.token}.lock"
        self.lock_fd = -1

    def __enter__(self) -> _Staging:
        self.lock_fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        try:
            if not _lock(self.lock_fd, wait=True):
                raise ShardloadError("cannot lock the temporary directory", file=str(self.lock))
            self._remove_stale()
            self.dir.mkdir()
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        _remove(self.dir)
        self._release()

    def _release(self) -> None:
        self.lock.unlink(missing_ok=True)
        os.close(self.lock_fd)

    def _remove_stale(self) -> None:
        """Remove what killed converts to the same target left; refuse if one is still running."""
        tokens: set[str] = set()
        for entry in self.out.parent.iterdir():
            if entry.name.startswith(self.prefix):
                tokens.add(entry.name[len(self.prefix) :].removesuffix(".lock").removesuffix(".old"))
        tokens.discard(self.token)
        for token in sorted(tokens):
            lock = self.out.parent / f"{self.prefix}{token}.lock"
            fd = -1
            try:
                fd = os.open(lock, os.O_RDWR)
            except FileNotFoundError:
                pass  # no lock file: its convert died before (or while) cleaning up
            if fd >= 0 and not _lock(fd, wait=False):
                os.close(fd)
                raise ShardloadError(
                    f"another convert (pid {token.split('-')[0]}) is writing this output right now", file=str(self.out)
                )
            _remove(self.out.parent / f"{self.prefix}{token}")
            old = self.out.parent / f"{self.prefix}{token}.old"
            if old.exists() or old.is_symlink():
                self.found_old = True  # a killed --overwrite's complete output: this one replaces it
            _remove(old)
            lock.unlink(missing_ok=True)
            if fd >= 0:
                os.close(fd)

    def publish(self) -> None:
        """Move the finished directory into place (an old ``out`` is moved aside first, then removed)."""
        replacing = self.out.exists() or self.out.is_symlink()
        if replacing and not self.overwrite:
            raise ShardloadError(
                "output directory appeared while converting; nothing was replaced (pass --overwrite to replace it)",
                file=str(self.out),
            )
        flush = self.fsync if self.fsync is not None else replacing or self.found_old
        if flush:
            if self.synced:
                fsync_dir(self.dir)
            else:
                fsync_tree(self.dir)
        if replacing:
            trash = self.out.parent / f"{self.prefix}{self.token}.old"
            os.replace(self.out, trash)
            try:
                os.replace(self.dir, self.out)
            except BaseException:
                os.replace(trash, self.out)
                raise
            _remove(trash)
        else:
            os.replace(self.dir, self.out)
        if flush:
            fsync_dir(self.out.parent)
