"""Models in object storage: paths to objects, the store interface, and what a request costs.

An :class:`ObjectPath` stands where a local ``Path`` does for a file of a checkpoint kept in an object store
(``s3://bucket/prefix/model.safetensors``); :mod:`shardload.sources.checkpoint` opens such a checkpoint with
range requests (a safetensors file's 8-byte length, then its header; small JSON files whole), and
:class:`~shardload.sources.object_reader.ObjectReader` reads a rank's byte runs with the ``Reader`` protocol:
runs grouped into ranged GETs by an :class:`ObjectCost` (request latency, bandwidth, concurrency), which says
for each gap between two runs whether fetching it (one request fewer) or skipping it (fewer bytes) is faster,
fetched concurrently, each response read straight into the destination tensors. The store itself (S3 through
boto3: :mod:`shardload.sources.s3`) is imported only when an object-store model is opened; every request it
makes runs under the deadline and minimum rate of :mod:`shardload.sources.deadlines`.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import CheckpointError, ShardloadError
from ..format import input_log

REQUEST_BYTES = 8 << 20
"""Largest ranged GET by default (:attr:`ObjectCost.request_bytes`): longer runs are split, and merged runs stop
growing past it."""
CONCURRENCY = 16
"""Ranged GETs in flight at once per reader by default (:attr:`ObjectCost.concurrency`), each on its own pooled
connection."""
MAX_CONCURRENCY = 256
"""Most ranged GETs an :class:`ObjectCost` may keep in flight (the store's connection pool holds this many)."""
MAX_SMALL_OBJECT = 256 << 20
"""Cap on a small object read whole (a JSON file, a companion file)."""
COST_ENV = "SHARDLOAD_S3_COST"
"""The environment variable that sets the request cost of loads given none (:func:`cost_from_environment`)."""
PROBE_SMALL = 4096
"""Bytes of each of the probe's small GETs (:func:`measure_cost`), timed for the latency."""
PROBE_LARGE = 4 << 20
"""Bytes of the probe's one large GET, timed for the bandwidth."""


@dataclass(frozen=True)
class ObjectCost:
    """What a ranged GET costs: the model a reader plans its requests by (docs/object-storage.md).

    ``concurrency`` requests are in flight at once; each waits ``latency`` seconds for its first byte, then
    streams at ``bandwidth / concurrency`` bytes/s (``bandwidth``: all of them together). ``R`` requests moving
    ``S`` bytes then take about ``R * latency / concurrency + S / bandwidth`` seconds (:meth:`seconds`), so a gap
    of ``g`` bytes between two runs is fetched, sparing a request, when ``g / bandwidth < latency /
    concurrency``, that is when ``g`` is under :attr:`merge_gap`, and skipped otherwise. Requests carry at most
    ``request_bytes``. :meth:`exact` never fetches a gap, :meth:`merged` fetches every one that fits a request.
    """

    latency: float = 0.03
    """Seconds from sending a request to its first byte (S3 in its region: tens of milliseconds)."""
    bandwidth: float = 1.5e9
    """Bytes per second the store delivers to this reader, ``concurrency`` requests together (S3: about 90 MB/s
    per connection)."""
    concurrency: int = field(default_factory=lambda: CONCURRENCY)
    """Ranged GETs in flight at once (the reader's pool of request threads)."""
    request_bytes: int = field(default_factory=lambda: REQUEST_BYTES)
    """Largest ranged GET: a longer run is split, and runs merged through gaps stop growing past it."""

    def __post_init__(self) -> None:
        for name in ("latency", "bandwidth"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or math.isnan(value) or value < 0 or (name == "bandwidth" and not value):
                raise ShardloadError(f"ObjectCost.{name} must be a number >= 0 (bandwidth > 0), got {value!r}")
        if not self.latency and math.isinf(self.bandwidth):
            raise ShardloadError("ObjectCost: latency 0 with an infinite bandwidth says nothing about any gap")
        if type(self.concurrency) is not int or not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise ShardloadError(
                f"ObjectCost.concurrency must be an int from 1 to {MAX_CONCURRENCY}, got {self.concurrency!r}"
            )
        if type(self.request_bytes) is not int or self.request_bytes < 1:
            raise ShardloadError(f"ObjectCost.request_bytes must be an int >= 1, got {self.request_bytes!r}")

    @classmethod
    def exact(cls, concurrency: int | None = None) -> ObjectCost:
        """Requests cost nothing: every run is fetched alone, exactly its bytes (adjacent runs still share one)."""
        return cls(latency=0.0, concurrency=concurrency or CONCURRENCY)

    @classmethod
    def merged(cls, concurrency: int | None = None) -> ObjectCost:
        """Bytes cost nothing: runs are merged through every gap that fits a request (fewest requests)."""
        return cls(bandwidth=math.inf, concurrency=concurrency or CONCURRENCY)

    @property
    def merge_gap(self) -> float:
        """Gaps between runs shorter than this many bytes are fetched: ``latency * bandwidth / concurrency``."""
        return self.latency * self.bandwidth / self.concurrency

    def fetches(self, gap: int) -> bool:
        """Whether one request through a gap of ``gap`` bytes is faster than two requests around it."""
        return gap * self.concurrency < self.latency * self.bandwidth

    def seconds(self, requests: int, nbytes: int) -> float:
        """The model's time for ``requests`` ranged GETs moving ``nbytes`` in all."""
        return requests * self.latency / self.concurrency + nbytes / self.bandwidth

    @classmethod
    def parse(cls, text: str, where: str = COST_ENV) -> ObjectCost | Literal["measure"]:
        """``exact``, ``merged``, ``measure`` or ``latency=S,bandwidth=B[,concurrency=N][,request_bytes=N]``;
        anything else is one line naming ``where``."""
        text = text.strip()
        if text == "measure":
            return "measure"
        if text in ("exact", "merged"):
            return cls.exact() if text == "exact" else cls.merged()
        usage = (
            "expected exact, merged, measure or latency=SECONDS,bandwidth=BYTES_PER_S[,concurrency=N]"
            f"[,request_bytes=N], got {text[:80]!r}"
        )
        values = parse_fields(text, COST_FIELDS)
        if values is None or not {"latency", "bandwidth"} <= values.keys():
            raise ShardloadError(usage, param=where)
        try:
            return cls(**values)
        except ShardloadError as err:
            raise ShardloadError(err.reason, param=where) from None


COST_FIELDS: dict[str, type] = {"latency": float, "bandwidth": float, "concurrency": int, "request_bytes": int}
"""Each field of :class:`ObjectCost` and the type of its value."""


def parse_fields(text: str, kinds: Mapping[str, type]) -> dict[str, Any] | None:
    """``name=value,...`` as values by name, each name one of ``kinds`` (at most once) and its value of that type
    (``int`` or ``float``); None where the text is not that."""
    values: dict[str, Any] = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or name not in kinds or name in values:
            return None
        try:
            values[name] = kinds[name](value)
        except (ValueError, OverflowError):
            return None
    return values


def cost_from_environment() -> ObjectCost | Literal["measure"] | None:
    """The request cost :data:`COST_ENV` sets (None when it is unset or empty), read when a load starts."""
    value = os.environ.get(COST_ENV, "")
    return ObjectCost.parse(value) if value.strip() else None


def measure_cost(
    store: ObjectStore, key: str, concurrency: int | None = None, clock: Callable[[], float] = time.perf_counter
) -> ObjectCost:
    """Time a few ranged GETs of one object: three small ones for the latency (their median), then one large
    one for a connection's bandwidth, taken as each of ``concurrency`` requests' share."""
    concurrency = concurrency or CONCURRENCY
    size = store.size(key) or 0
    small = min(size, PROBE_SMALL)
    if small <= 0:
        return ObjectCost(concurrency=concurrency)
    buf = memoryview(bytearray(max(small, min(size, PROBE_LARGE))))
    times = []
    for _ in range(3):
        began = clock()
        store.read_into(key, 0, [buf[:small]])
        times.append(clock() - began)
    latency = sorted(times)[1]
    large = min(size, PROBE_LARGE)
    if large < 16 * small:  # too small an object to time a transfer: the latency alone is measured
        return ObjectCost(latency=latency, concurrency=concurrency)
    began = clock()
    store.read_into(key, 0, [buf[:large]])
    took = clock() - began
    per_request = large / max(took - latency, took / 10, 1e-9)
    return ObjectCost(latency=latency, bandwidth=per_request * concurrency, concurrency=concurrency)


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
        """Listings by prefix outside a load; a load keeps its own in its input log (one listing per load)."""
        self._lock = threading.Lock()
        self._measured: ObjectCost | None = None
        self._probe_lock = threading.Lock()

    def uri(self, key: str) -> str:
        """The object's address as a user writes it (``s3://bucket/key``)."""
        return f"{self.scheme}://{self.bucket}/{key}"

    def _listings(self) -> dict[str, dict[str, int]]:
        """The listings by prefix this call may use: the running load's own (a model updated between two loads of
        one process is listed afresh by the second), else the store's."""
        log = input_log.current()
        if log is None:
            return self._listed
        return log.listings.setdefault((self.scheme, self.bucket), {})

    def forget_listings(self) -> None:
        """Drop the listings kept outside a load, so the next call lists afresh (a load's own are kept: it lists
        each prefix once)."""
        if input_log.current() is None:
            with self._lock:
                self._listed.clear()

    def list(self, prefix: str) -> dict[str, int]:
        """Every object whose key starts with ``prefix`` -> its size (one listing per prefix and load, then
        kept for that load)."""
        listings = self._listings()
        with self._lock:
            found = listings.get(prefix)
        if found is None:
            found = self._list(prefix)
            with self._lock:
                listings[prefix] = found
        return found

    def size(self, key: str) -> int | None:
        """The object's size in bytes, or None when there is no such object."""
        parent = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
        listings = self._listings()
        with self._lock:
            listed = listings.get(parent)
        if listed is not None:
            return listed.get(key)
        return self._head(key)

    def read(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object (one ranged request)."""
        out = bytearray(end - start)
        if end > start:
            self.read_into(key, start, [memoryview(out)])
        return bytes(out)

    def measured_cost(self, key: str, concurrency: int | None = None) -> ObjectCost:
        """This store's :class:`ObjectCost`, measured once (:func:`measure_cost` on object ``key``), then kept."""
        with self._probe_lock:
            if self._measured is None:
                self._measured = measure_cost(self, key, concurrency)
            return self._measured

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
        listings = self._listings()
        with self._lock:
            for prefix, listed in listings.items():
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
        data = self.store.read(self.key, 0, size)
        input_log.note(self, data)
        return data

    def write_bytes(self, data: bytes) -> None:
        """Put ``data`` as this object (one request; a failure is one line naming the object)."""
        self.store.put(self.key, data)
