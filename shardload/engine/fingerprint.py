"""Content fingerprints of the checkpoint files a group shares reads of (``load_rank(share_reads=)``).

Ranks whose plans agree have the same headers, but two fine-tunes of one base model have the same headers too, and
an exchange between ranks holding them would hand every rank a mix of both. So before any byte moves every rank
fingerprints its own copy of each file the group reads, and the group compares the fingerprints with the first
rank's. A fingerprint is the file's size, the sha256 a Hugging Face Hub cache names the file's blob by (where the
file is one), and an 8-byte hash of each of :data:`SAMPLES_PER_FILE` blocks of at most :data:`SAMPLE_BYTES`
bytes, at positions every rank computes alike from the tensors' headers: one inside every tensor while a file has
no more tensors than samples, the rest spread evenly over the file's tensor bytes. Paths and modification times
play no part, so identical copies on two nodes always agree. A change confined to the bytes between the samples
goes unseen; a hash record of every byte (verified loading) closes that gap.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CheckpointError
from ..sources.objects import ObjectPath

if TYPE_CHECKING:
    from ..sources.reader import RunReader
    from ..sources.tensor_info import TensorInfo

SAMPLES_PER_FILE = 64
"""Blocks sampled in every file (so a file's fingerprint is read with at most this many reads, 256 KiB)."""
SAMPLE_BYTES = 4096
"""Bytes of one sampled block (fewer in a smaller tensor); blocks start at multiples of this inside the file where
the tensor allows, so a block is one page of storage on every machine."""
DIGEST_BYTES = 8
"""Bytes of each block's hash."""
_HUB_BLOB = re.compile(r"[0-9a-f]{64}")

SIZE, SAMPLE, SHA256, UNREADABLE = 1, 2, 3, 4
"""What can differ between two copies of a file (the kinds of :class:`Difference`), and a rank that could not read
its copy to fingerprint it."""


def row_bytes() -> int:
    """Bytes of one file's encoded fingerprint: size, whether a sha256 is known, the sha256, the blocks' hashes."""
    return 8 + 1 + 32 + DIGEST_BYTES * SAMPLES_PER_FILE


@dataclass(frozen=True)
class FileSamples:
    """Where one file is sampled: distinct blocks (``src``, ``length``, sorted by ``src``), and for each of the
    file's :data:`SAMPLES_PER_FILE` slots the block it hashes (``block``) and the tensor that block lies in."""

    file: Path | ObjectPath
    src: np.ndarray
    length: np.ndarray
    block: np.ndarray
    tensor: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        """Bytes read to fingerprint this file."""
        return int(self.length.sum())


@dataclass(frozen=True)
class SamplePlan:
    """The blocks sampled in every file of a group's reads, in the order every rank lists the files."""

    files: tuple[FileSamples, ...]

    @property
    def nbytes(self) -> int:
        """Bytes one rank reads to fingerprint its copy of every file."""
        return sum(f.nbytes for f in self.files)


@dataclass(frozen=True)
class FileFingerprint:
    """What one rank's copy of a file looks like: its size, the sha256 its Hub cache names it by (None elsewhere),
    and the hash of every sampled slot (:data:`DIGEST_BYTES` each, slot after slot)."""

    size: int
    sha256: bytes | None
    digests: bytes

    def encode(self) -> bytes:
        """The fixed-width row (:func:`row_bytes`) the group exchanges."""
        return (
            self.size.to_bytes(8, "little")
            + bytes([self.sha256 is not None])
            + (self.sha256 or bytes(32))
            + self.digests
        )

    @classmethod
    def decode(cls, row: bytes) -> FileFingerprint:
        """The fingerprint :meth:`encode` wrote into ``row``."""
        return cls(int.from_bytes(row[:8], "little"), row[9:41] if row[8] else None, row[41 : row_bytes()])


@dataclass(frozen=True)
class Difference:
    """Where one rank's copy of file ``file`` (index into the plan) first differs from the reference copy:
    ``kind`` :data:`SIZE`, :data:`SAMPLE` (``slot`` names the sampled slot) or :data:`SHA256` (0: no difference;
    :data:`UNREADABLE`: the rank could not read its copy)."""

    file: int
    kind: int
    slot: int = -1


def plan_samples(tensors: Iterable[TensorInfo]) -> SamplePlan:
    """The blocks every rank samples in the files holding ``tensors`` (files in the order they are first named;
    a range stored under two names counts once)."""
    by_file: dict[Any, dict[tuple[int, int], str]] = {}
    for t in tensors:
        ranges = by_file.setdefault(t.file, {})
        if t.nbytes > 0:
            ranges.setdefault((t.offset, t.nbytes), t.name)
    return SamplePlan(tuple(_file_samples(file, ranges) for file, ranges in by_file.items()))


def _file_samples(file: Path | ObjectPath, ranges: dict[tuple[int, int], str]) -> FileSamples:
    """The sampled blocks of one file whose tensors lie at ``ranges`` ((offset, nbytes) -> name)."""
    z = np.zeros(0, dtype=np.int64)
    if not ranges:
        return FileSamples(file, z, z, np.full(SAMPLES_PER_FILE, -1, dtype=np.int64), ("",) * SAMPLES_PER_FILE)
    keys = sorted(ranges)
    offset = np.array([k[0] for k in keys], dtype=np.int64)
    nbytes = np.array([k[1] for k in keys], dtype=np.int64)
    ends = np.cumsum(nbytes)
    starts = ends - nbytes
    total = int(ends[-1])
    n = SAMPLES_PER_FILE
    own = starts + nbytes // 2 if len(keys) <= n else z  # the middle of every tensor, while samples suffice
    spread = n - len(own)
    even = (2 * np.arange(spread, dtype=np.int64) + 1) * total // (2 * spread) if spread else z
    at = np.concatenate((own, even))  # positions in the file's tensor bytes laid end to end
    i = np.searchsorted(ends, at, side="right")
    length = np.minimum(nbytes[i], SAMPLE_BYTES)
    inside = np.clip(at - starts[i] - length // 2, 0, nbytes[i] - length)
    src = offset[i] + inside
    src = np.maximum(offset[i], src // SAMPLE_BYTES * SAMPLE_BYTES)  # one storage page where the tensor allows
    pairs, block = np.unique(np.stack([src, length], axis=1), axis=0, return_inverse=True)
    names = tuple(ranges[keys[k]] for k in i.tolist())
    return FileSamples(file, pairs[:, 0].copy(), pairs[:, 1].copy(), block.reshape(-1).astype(np.int64), names)


def fingerprint(plan: SamplePlan, reader: RunReader) -> list[FileFingerprint]:
    """This rank's fingerprint of its copy of every file of ``plan``, its blocks read through ``reader`` (so they
    count in :func:`~shardload.sources.reader.count_reads`); files are read concurrently."""
    if not plan.files:
        return []
    with ThreadPoolExecutor(min(8, len(plan.files)), thread_name_prefix="shardload-fingerprint") as pool:
        return list(pool.map(lambda f: _fingerprint_file(f, reader), plan.files))


def _fingerprint_file(samples: FileSamples, reader: RunReader) -> FileFingerprint:
    """The fingerprint of one file: its size, a Hub cache's sha256, the hash of every slot's block."""
    import torch

    buf = torch.empty(samples.nbytes, dtype=torch.uint8)
    dst = np.concatenate(([0], np.cumsum(samples.length)[:-1])).astype(np.int64) if len(samples.src) else samples.src
    if len(samples.src):
        reader.read_runs(samples.file, samples.src, samples.length, np.zeros_like(dst), dst, [buf])
    data = memoryview(buf.numpy())
    hashes = [
        hashlib.blake2b(data[d : d + n], digest_size=DIGEST_BYTES).digest()
        for d, n in zip(dst.tolist(), samples.length.tolist(), strict=True)
    ]
    empty = bytes(DIGEST_BYTES)
    digests = b"".join(hashes[b] if b >= 0 else empty for b in samples.block.tolist())
    return FileFingerprint(_size(samples.file), hub_sha256(samples.file), digests)


def _size(file: Path | ObjectPath) -> int:
    """The file's size in bytes (an object's as its store lists it)."""
    if isinstance(file, ObjectPath):
        size = file.size()
        if size is None:
            raise CheckpointError("cannot fingerprint: no such object", file=str(file))
        return size
    try:
        return os.stat(file).st_size
    except OSError as err:
        raise CheckpointError(f"cannot fingerprint: {err.strerror or err}", file=str(file)) from None


def hub_sha256(file: Path | ObjectPath) -> bytes | None:
    """The sha256 of a file in a Hugging Face Hub cache, as the cache names its blob (``.../blobs/<sha256>``, the
    Hub's hash of a large file's content), without reading it; None for any other file."""
    if isinstance(file, ObjectPath):
        return None
    real = Path(os.path.realpath(file))
    if real.parent.name == "blobs" and _HUB_BLOB.fullmatch(real.name):
        return bytes.fromhex(real.name)
    return None


def encode(prints: Sequence[FileFingerprint]) -> bytes:
    """A rank's fingerprints as one buffer of ``len(prints) * row_bytes()`` bytes."""
    return b"".join(p.encode() for p in prints)


def decode(raw: bytes) -> list[FileFingerprint]:
    """The fingerprints :func:`encode` wrote."""
    n = row_bytes()
    return [FileFingerprint.decode(raw[k : k + n]) for k in range(0, len(raw), n)]


def first_difference(mine: Sequence[FileFingerprint], reference: Sequence[FileFingerprint]) -> Difference | None:
    """Where this rank's copies first differ from the reference's: a size, a sampled block (the first slot that
    differs) or, where both copies have one, the sha256 of a Hub cache; None when they agree."""
    for k, (a, b) in enumerate(zip(mine, reference, strict=True)):
        if a.size != b.size:
            return Difference(k, SIZE)
        if a.digests != b.digests:
            w = DIGEST_BYTES
            slot = next(
                s for s in range(SAMPLES_PER_FILE) if a.digests[s * w : (s + 1) * w] != b.digests[s * w : (s + 1) * w]
            )
            return Difference(k, SAMPLE, slot)
        if a.sha256 is not None and b.sha256 is not None and a.sha256 != b.sha256:
            return Difference(k, SHA256)
    return None


def well_formed(plan: SamplePlan, diff: Difference) -> bool:
    """Whether ``diff`` (as another rank reported it) names a file of ``plan``, a kind and, for a block, a slot."""
    if not (0 <= diff.file < len(plan.files) and diff.kind in (SIZE, SAMPLE, SHA256)):
        return False
    return diff.kind != SAMPLE or 0 <= diff.slot < SAMPLES_PER_FILE


def describe(plan: SamplePlan, diff: Difference, rank: int, reference: int) -> CheckpointError:
    """The one-line error every rank raises when rank ``rank``'s copies differ from rank ``reference``'s, naming
    this rank's path of the file (and the tensor, where a sampled block differs)."""
    samples = plan.files[diff.file]
    param, where = None, ""
    if diff.kind == SIZE:
        what = "has another size than"
    elif diff.kind == SHA256:
        what = "has another sha256 (as the Hugging Face Hub caches name the files) than"
    else:
        param = samples.tensor[diff.slot]
        what = "holds other bytes than"
        where = f" in this tensor (the block sampled at byte {int(samples.src[samples.block[diff.slot]])})"
    return CheckpointError(
        f"shared reads refused: rank {rank}'s copy of this file {what} rank {reference}'s{where}, though their "
        "headers agree (another fine-tune or revision of the model, or a file changed in place?): every rank "
        "sharing reads must hold the same bytes; nothing was exchanged",
        file=str(samples.file),
        param=param,
    )
