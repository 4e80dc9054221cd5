"""Models in object storage: paths to objects, the store interface, and the reader of byte runs over it.

An :class:`ObjectPath` stands where a local ``Path`` does for a file of a checkpoint kept in an object store
(``s3://bucket/prefix/model.safetensors``); :mod:`shardload.sources.checkpoint` opens such a checkpoint with
range requests (a safetensors file's 8-byte length, then its header; small JSON files whole), and
:class:`~shardload.sources.object_reader.ObjectReader` reads a rank's byte runs with the ``Reader`` protocol:
runs coalesced into ranged GETs of at most :data:`REQUEST_BYTES` (runs separated by gaps of at most
:data:`MERGE_GAP` share a request while the bytes fetched for gaps stay under :data:`MAX_WASTE` of the bytes
wanted), fetched concurrently by :data:`CONCURRENCY` threads, each response read straight into the
destination tensors. The store itself (S3 through boto3: :mod:`shardload.sources.s3`) is imported only when
an object-store model is opened; every request it makes runs under the deadline and minimum rate of
:mod:`shardload.sources.deadlines`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import CheckpointError

REQUEST_BYTES = 8 << 20
"""Largest ranged GET: longer runs are split, and merged runs stop growing past it."""
MERGE_GAP = 1 << 20
"""Runs separated by at most this many bytes may share one ranged GET (the gap is fetched and dropped)..."""
MAX_WASTE = 0.05
"""... as long as the gap bytes fetched stay within this fraction of the run bytes a request carries, so a rank
fetches at most 1.05x its own bytes. Raise it (up to ``float('inf')``) to trade bytes for fewer requests where a
column slice makes many short runs and requests are costly."""
CONCURRENCY = 16
"""Ranged GETs in flight at once per reader (each on its own pooled connection)."""
MAX_SMALL_OBJECT = 256 << 20
"""Cap on a small object read whole (a JSON file, a companion file)."""


class ObjectStore:
    """One bucket (or container) of an object store: listing, sizes and ranged reads. Subclasses do the I/O.

    ``read_into(key, start, views)`` fills the memoryviews in order from byte ``start`` of the object (one ranged
    request, response bytes written straight into the views), takes only an answer that is the range asked for,
    and retries transient failures itself; permanent ones raise :class:`~shardload.errors.CheckpointError`
    naming the object and the range, never a credential.
    """

    scheme = "s3"

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self._listed: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    def uri(self, key: str) -> str:
        """The object's address as a user writes it (``s3://bucket/key``)."""
        return f"{self.scheme}://{self.bucket}/{key}"

    def list(self, prefix: str) -> dict[str, int]:
        """Every object whose key starts with ``prefix`` -> its size (one listing per prefix, then cached)."""
        with self._lock:
            found = self._listed.get(prefix)
        if found is None:
            found = self._list(prefix)
            with self._lock:
                self._listed[prefix] = found
        return found

    def size(self, key: str) -> int | None:
        """The object's size in bytes, or None when there is no such object."""
        parent = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
        with self._lock:
            listed = self._listed.get(parent)
        if listed is not None:
            return listed.get(key)
        return self._head(key)

    def read(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object (one ranged request)."""
        out = bytearray(end - start)
        if end > start:
            self.read_into(key, start, [memoryview(out)])
        return bytes(out)

    def stamp(self, key: str) -> tuple[object, ...]:
        """What tells a later read that the object changed (asked of the store each time, never cached)."""
        return (self._head(key),)

    def _list(self, prefix: str) -> dict[str, int]:
        raise NotImplementedError

    def _head(self, key: str) -> int | None:
        raise NotImplementedError

    def read_into(self, key: str, start: int, views: Sequence[memoryview]) -> None:
        raise NotImplementedError

    def put(self, key: str, data: bytes) -> None:
        """Write one small object whole (an integrity record), then keep the cached listing of its prefix true."""
        self._put(key, data)
        parent = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
        with self._lock:
            for prefix, listed in self._listed.items():
                if key.startswith(prefix) and (prefix == parent or "/" not in key[len(prefix) :]):
                    listed[key] = len(data)

    def _put(self, key: str, data: bytes) -> None:
        raise CheckpointError("this store cannot write objects", file=self.uri(key))

    def close(self) -> None:
        """Release connections (the store may be used again afterwards)."""


@dataclass(frozen=True)
class ObjectPath:
    """An object (or a prefix, for a model "directory") in an object store; stands where a local Path would."""

    store: ObjectStore
    key: str

    def __str__(self) -> str:
        return self.store.uri(self.key)

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __hash__(self) -> int:
        return hash((self.store.scheme, self.store.bucket, self.key))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and (other.store.scheme, other.store.bucket, other.key) == (
            self.store.scheme,
            self.store.bucket,
            self.key,
        )

    @property
    def name(self) -> str:
        return self.key.rstrip("/").rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        name = self.name
        return name[name.rfind(".") :] if "." in name.strip(".") else ""

    @property
    def parent(self) -> ObjectPath:
        key = self.key.rstrip("/")
        return ObjectPath(self.store, key.rsplit("/", 1)[0] if "/" in key else "")

    def __truediv__(self, name: str) -> ObjectPath:
        base = self.key.rstrip("/")
        return ObjectPath(self.store, f"{base}/{name}" if base else name)

    def children(self) -> dict[str, int]:
        """The objects directly under this prefix: name -> size."""
        prefix = self.key.rstrip("/") + "/" if self.key.strip("/") else ""
        listed = self.store.list(prefix)
        return {k[len(prefix) :]: size for k, size in listed.items() if "/" not in k[len(prefix) :]}

    def size(self) -> int | None:
        """This object's size, or None when there is no such object."""
        return self.store.size(self.key)

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def is_file(self) -> bool:
        return bool(self.key) and not self.key.endswith("/") and self.size() is not None

    def is_dir(self) -> bool:
        return bool(self.children())

    def is_symlink(self) -> bool:
        return False

    def read_small(self, limit: int, what: str) -> bytes:
        """The whole object, refused past ``limit`` bytes and past :data:`MAX_SMALL_OBJECT` (a JSON file, a
        companion); the size comes from the listing (or a HEAD) before anything is fetched."""
        return self._read_whole(limit, what, MAX_SMALL_OBJECT)

    def read_whole(self, limit: int, what: str) -> bytes:
        """The whole object, refused past ``limit`` bytes only (an integrity record, whose limit grows with the
        checkpoint it covers)."""
        return self._read_whole(limit, what, None)

    def _read_whole(self, limit: int, what: str, cap: int | None) -> bytes:
        size = self.size()
        if size is None:
            raise CheckpointError(f"cannot read {what}: no such object", file=str(self))
        if cap is not None and size > cap and limit > cap:
            raise CheckpointError(f"{what} is {size} bytes, over the {cap} byte cap on small objects", file=str(self))
        if size > limit:
            raise CheckpointError(f"{what} is {size} bytes, over the {limit} byte limit", file=str(self))
        return self.store.read(self.key, 0, size)

    def write_bytes(self, data: bytes) -> None:
        """Put ``data`` as this object (one request; a failure is one line naming the object)."""
        self.store.put(self.key, data)
