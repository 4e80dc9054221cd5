"""The one guard and the one staging area every command that writes a directory goes through.

- :func:`check_output`: OUT may never be, contain, lie inside, or sit above a source file or directory,
  compared after resolving symlinks (a Hugging Face snapshot's links into ``blobs/`` count as the files they
  point to). An existing OUT is replaced only with ``overwrite``, and only when it is an empty directory or an
  earlier output of shardload: one holding :data:`MARKER` (every output shardload writes gets one) or a
  ``shard_manifest.json`` (converted outputs written before the marker existed). Anything else, a user's
  directory or a file, is refused: nothing of the user's is ever deleted.
- :class:`StagingDir`: the temporary directory beside OUT that ``convert``, ``quantize`` and ``example`` write
  into, locked while in use, renamed into place when complete (an old OUT moved aside first and flushed
  over when it is replaced), removed when the command fails or is interrupted. Each command removes what a
  killed run of any of them left for the same OUT, and refuses while one is still running.
- :func:`write_error`: the one-line error for an ``OSError`` while writing (disk full, read-only, quota).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ShardloadError
from ..format import input_log
from ..sources.checkpoint import SHARD_INFO_NAME, TMP_MARKER, read_small_file
from ..sources.companions import companion_files
from ..sources.manifest import (
    CONVERSION_KEY,
    LEAVES_MANIFEST_VERSION,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MANIFEST_VERSION,
)
from ..sources.objects import ObjectPath
from .writer import FileWriter, WrittenFile, fsync_dir, fsync_tree

if TYPE_CHECKING:
    from ..planning.mesh import Mesh
    from ..planning.plan import ModelPlan

MARKER = ".shardload-output"
"""The file that marks a directory as written by shardload (so ``--overwrite`` may replace it)."""
MARKER_TEXT = "This directory was written by shardload; `--overwrite` may replace it.\n"
MAX_COMPANION_BYTES = 256 << 20
"""Cap on one companion file (tokenizer.json files reach tens of MB; a GiB is no tokenizer)."""


def _real(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return Path(os.path.abspath(path))


def source_paths(root: Path, files: Iterable[Path]) -> list[Path]:
    """A source's directory and files, plus where each file's symlink really points (HF cache blobs)."""
    if isinstance(root, ObjectPath):
        return []  # in object storage: no local file to protect
    files = list(files)
    return [root, *files, *(_real(f) for f in files)]


def check_output(out: Path, sources: Iterable[Path], *, overwrite: bool) -> bool:
    """Refuse an OUT that would overwrite a source or a user's data; return whether OUT exists (to be replaced)."""
    if TMP_MARKER in out.name:
        raise ShardloadError(
            f"an output name may not contain {TMP_MARKER!r} (reserved for temporary files)", file=str(out)
        )
    target = _real(out)
    found = [(src, _real(src)) for src in sources]
    for src, real in found:
        if target == real:
            raise ShardloadError(f"is the source {src}; write the output elsewhere", file=str(out))
    for src, real in found:
        if real.is_relative_to(target):
            raise ShardloadError(f"contains the source {src}; write the output elsewhere", file=str(out))
    for src, real in found:
        if target.is_relative_to(real) and real.is_dir():
            raise ShardloadError(f"lies inside the source directory {src}; write the output elsewhere", file=str(out))
    for _src, real in found:  # a Hugging Face cache entry (blobs/, snapshots/, refs/) belongs to the source whole
        if real.parent.name == "blobs" and (real.parent.parent / "snapshots").is_dir():
            if target.is_relative_to(real.parent.parent):
                raise ShardloadError(
                    f"lies inside the Hugging Face cache entry {real.parent.parent}; write the output elsewhere",
                    file=str(out),
                )
    exists = out.exists() or out.is_symlink()
    if not exists:
        return False
    if not overwrite:
        raise ShardloadError("output directory exists (pass --overwrite / overwrite=True to replace it)", file=str(out))
    _check_replaceable(out)
    return True


def _check_replaceable(out: Path) -> None:
    """Refuse to replace anything but an empty directory or an earlier output of shardload."""
    if out.is_symlink() or not out.is_dir():
        raise ShardloadError(
            "exists and is not a directory shardload wrote; --overwrite replaces only those", file=str(out)
        )
    if any(out.iterdir()) and not ((out / MARKER).is_file() or (out / MANIFEST_NAME).is_file()):
        raise ShardloadError(
            f"is not an output of shardload (no {MARKER} or {MANIFEST_NAME} in it); --overwrite replaces only "
            "empty directories and earlier outputs, so nothing here was deleted",
            file=str(out),
        )


def mark(directory: Path, *, durable: bool = False) -> WrittenFile:
    """Mark a directory being written as an output of shardload (fsynced with the rest when ``durable``)."""
    marker = FileWriter(directory / MARKER, durable=durable)
    try:
        marker.write(MARKER_TEXT.encode())
        return marker.finish()
    finally:
        marker.close()


def copy_companions(root: Path, dst: Path, skip: set[str], durable: bool) -> list[WrittenFile]:
    """Copy the model directory's companion files (:mod:`shardload.sources.companions`) into ``dst``; each is
    opened without following a FIFO or a device and read to its size at opening."""
    copied = []
    for source in companion_files(root, skip):
        data = read_small_file(source, MAX_COMPANION_BYTES, "companion file")
        out = FileWriter(dst / source.name, durable=durable)
        try:
            out.write(data)
            copied.append(out.finish())
        finally:
            out.close()
    return copied


Stamp = tuple[Path, tuple[int, int, int, int]]


def stamp_sources(files: Iterable[Path]) -> list[Stamp]:
    """Device, inode, size and modification time of each source file (an object's size, ETag and time), to tell
    later whether it changed."""
    return [(f, _stamp(f)) for f in files]


def _stamp(path: Path | ObjectPath) -> Any:
    if isinstance(path, ObjectPath):
        return path.store.stamp(path.key)
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_sources_unchanged(stamps: list[Stamp]) -> None:
    """Refuse to publish an output whose source files were replaced, rewritten or resized while it was written: each
    against its identity when its header was parsed (change time included, which no tool sets back), then against
    ``stamps``."""
    input_log.check_unchanged([path for path, _ in stamps], input_log.current())
    for path, before in stamps:
        try:
            now = _stamp(path)
        except (OSError, CheckpointError):
            now = None
        if now != before:
            raise CheckpointError(
                "source file changed while it was read (replaced, rewritten or resized); nothing was put in place",
                file=str(path),
            )


def write_error(err: OSError, out: Path) -> ShardloadError:
    """The one-line error for a failed write (``[ENOSPC]`` and friends named): nothing was put in place."""
    what = f"cannot write {Path(err.filename).name}" if err.filename else "cannot write the output"
    code = f" [{errno.errorcode[err.errno]}]" if err.errno in errno.errorcode else ""
    return ShardloadError(
        f"{what}: {err.strerror or err}{code}; nothing was put in place and the partial output was removed",
        file=str(out),
    )


def remove(path: Path) -> None:
    """Remove a file, a link or a directory tree, ignoring what is already gone."""
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


class StagingDir:
    """The temporary directory beside ``out`` that a command writes into, and its lock.

    Every entry is named ``.OUT.shardload-tmp-TOKEN[.lock|.old]``. The ``.lock`` file is flock-ed for the
    command's lifetime, so the next command writing OUT can tell a live one (refuse) from the leftovers of a
    killed one (remove them). The directory is marked (:data:`MARKER`) as soon as it is made.

    ``fsync`` is the command's policy (None: flush only what replaces an output); ``synced`` says the files
    were fsynced as written. Whether the output replaces another one is decided when it is published, so an
    output that appeared meanwhile, or a complete one a killed ``--overwrite`` left beside an absent target,
    is never given up for unflushed files.
    """

    def __init__(self, out: Path, fsync: bool | None, *, synced: bool, overwrite: bool) -> None:
        self.out = out
        self.fsync = fsync
        self.synced = synced
        self.overwrite = overwrite
        self.found_old = False
        self.left_aside: list[Path] = []
        self.prefix = f".{out.name}{TMP_MARKER}"
        self.token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.dir = out.parent / f"{self.prefix}{self.token}"
        self.lock = out.parent / f"{self.prefix}{self.token}.lock"
        self.lock_fd = -1
        self.marker: WrittenFile | None = None

    def __enter__(self) -> StagingDir:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.lock_fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        try:
            if not _lock(self.lock_fd, wait=True):
                raise ShardloadError("cannot lock the temporary directory", file=str(self.lock))
            self._remove_stale()
            self.dir.mkdir()
            self.marker = mark(self.dir, durable=self.synced)
        except BaseException:
            remove(self.dir)
            self._release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        remove(self.dir)
        self._release()

    def _release(self) -> None:
        self.lock.unlink(missing_ok=True)
        os.close(self.lock_fd)

    def _remove_stale(self) -> None:
        """Remove what killed runs writing the same target left; refuse if one is still running."""
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
                pass  # no lock file: its run died before (or while) cleaning up
            if fd >= 0 and not _lock(fd, wait=False):
                os.close(fd)
                raise ShardloadError(
                    f"another shardload run (pid {token.split('-')[0]}) is writing this output right now",
                    file=str(self.out),
                )
            remove(self.out.parent / f"{self.prefix}{token}")
            old = self.out.parent / f"{self.prefix}{token}.old"
            if old.exists() or old.is_symlink():
                self.found_old = True  # a killed --overwrite's complete output: this one replaces it
                self.left_aside.append(old)  # removed once this output is in place, not before
            lock.unlink(missing_ok=True)
            if fd >= 0:
                os.close(fd)

    def publish(self) -> None:
        """Move the finished directory into place (an old ``out`` is moved aside first, then removed)."""
        replacing = self.out.exists() or self.out.is_symlink()
        if replacing and not self.overwrite:
            raise ShardloadError(
                "output directory appeared while writing; nothing was replaced (pass --overwrite to replace it)",
                file=str(self.out),
            )
        if replacing:
            _check_replaceable(self.out)  # what appeared meanwhile gets the same rule as what was there
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
            published.append(self.out)
            remove(trash)  # the old output's tree: seconds for a large one, the new one already in place
        else:
            os.replace(self.dir, self.out)
            published.append(self.out)
        if flush:
            fsync_dir(self.out.parent)
        for old in self.left_aside:
            remove(old)


def rank_files_manifest(
    mesh: Mesh,
    stages: Sequence[ModelPlan],
    shard_info: dict[str, Any],
    sources: list[dict[str, Any]],
    conversion: str,
    sha256: bool,
) -> dict[str, Any]:
    """The manifest of a converted directory in the plain layout, as far as is known before its rank files are
    written (the caller adds its source record, then its ``integrity``): version 2, each rank file to be listed by
    its leaves in the record, or with ``sha256`` version 1; the pipeline stages' layers when ``mesh`` has several."""
    from ..version import __version__

    layers = [len(s.layers) if s.layers is not None else 0 for s in stages]
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION if sha256 else LEAVES_MANIFEST_VERSION,
        "shardload_version": __version__,
        "num_shards": mesh.tp,
        CONVERSION_KEY: conversion,
        "mesh": None if mesh.pp == 1 else {"pp": mesh.pp, "tp": mesh.tp, "pp_layers": layers},
        "shard_info": shard_info,
        "source": {"files": sources},
    }


def integrity_entry(record: WrittenFile) -> dict[str, str]:
    """A manifest's ``integrity``: the output's record and its sha256 (the root a verified load can pin)."""
    return {"record": record.path, "root": record.sha256}


published: deque[Path] = deque(maxlen=16)
"""The last outputs this process has put in place, newest last: a command stopped after its output was in place
says so (the command line clears it when a command starts; a server calling ``convert`` for ever keeps 16)."""


INDENTED_MANIFEST_BYTES = 1 << 20
"""A manifest is written indented, for people, up to this size; past it compact."""


def publish_with_manifest(
    staging: StagingDir,
    model_root: Path,
    stamps: list[Stamp],
    written: list[WrittenFile],
    manifest: dict[str, Any],
    durable: bool,
    replaced: frozenset[str] = frozenset(),
) -> list[WrittenFile]:
    """Finish a converted output: copy the model's companion files (never its shard_info.json: the manifest says
    how the output was planned; nor those ``replaced``, which the caller wrote), add the output marker, write
    ``manifest`` with ``files`` listing every file, and publish once the sources are checked unchanged. Returns the
    companion files and the marker."""
    others = copy_companions(model_root, staging.dir, {SHARD_INFO_NAME, *replaced}, durable)
    assert staging.marker is not None
    others.append(staging.marker)
    record = {**manifest, "files": [f.entry() for f in written + others]}
    out_file = FileWriter(staging.dir / MANIFEST_NAME, durable=durable)
    try:
        text = json.dumps(record, indent=2)
        if len(text) > INDENTED_MANIFEST_BYTES:  # its tensor list grows with the model: compact keeps it a third
            text = json.dumps(record, separators=(",", ":"))
        out_file.write((text + "\n").encode())
        out_file.finish()
    finally:
        out_file.close()
    check_sources_unchanged(stamps)
    staging.publish()
    return others
