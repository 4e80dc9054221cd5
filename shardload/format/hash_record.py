"""The integrity record (``shardload.hashes``): per file, its size, its byte regions and one hash per tile
(leaf), and the root hash of the whole record. Parsing treats the record as hostile input: strict JSON,
bounded sizes, every region and leaf count checked before anything is used. Layout: docs/integrity.md."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import ShardloadError
from . import strictjson

RECORD_NAME = "shardload.hashes"
MAGIC = b"SLHASH1\n"
VERSION = 1
HASH_BYTES = 32
LEAF_BYTES = 128 << 10
"""The most bytes a tile holds (a tensor's tiles hold more than half of it, but for its last row block and band)."""
MIN_BAND = 256
"""The narrowest column band (bytes) a tile is cut into."""
MAX_HEADER = 64 << 20
"""The most bytes the record's JSON part may have."""
MAX_FILES = 1 << 16
MAX_REGIONS = 1 << 22
MAX_LEAVES = 1 << 28
HASHES = ("blake3", "sha256")


class RecordError(ShardloadError):
    """An integrity record that cannot be used: malformed, over a bound, or not matching a pinned root."""


def hasher(name: str) -> Any:
    """The constructor of hash function ``name`` (``blake3`` or ``sha256``): called on bytes, ``.digest()`` gives 32."""
    if name == "blake3":
        try:
            from blake3 import blake3
        except ImportError:
            raise RecordError("this record uses blake3; install the blake3 package (pip install blake3)") from None
        return blake3
    if name == "sha256":
        return hashlib.sha256
    raise RecordError(f"unknown hash {name!r} (known: {', '.join(HASHES)})")


def default_hash() -> str:
    """The hash a new record uses: blake3 when installed (3.4x sha256's speed here), else sha256."""
    try:
        import blake3  # noqa: F401
    except ImportError:
        return "sha256"
    return "blake3"


@dataclass(frozen=True)
class Tiling:
    """One way of cutting a region into tiles: ``tile_rows`` rows by ``tile_bytes`` bytes (the last row block and
    band may be shorter), numbered row block by row block, band by band."""

    rows: int
    row_bytes: int
    tile_rows: int
    tile_bytes: int

    @property
    def row_blocks(self) -> int:
        return -(-self.rows // self.tile_rows)

    @property
    def bands(self) -> int:
        return -(-self.row_bytes // self.tile_bytes)

    @property
    def leaves(self) -> int:
        return self.row_blocks * self.bands

    def tile(self, index: int) -> tuple[int, int, int, int]:
        """Tile ``index``'s first row, row count, first byte within a row and byte width."""
        block, band = divmod(index, self.bands)
        r0 = block * self.tile_rows
        c0 = band * self.tile_bytes
        return r0, min(self.tile_rows, self.rows - r0), c0, min(self.tile_bytes, self.row_bytes - c0)


@dataclass(frozen=True)
class Region:
    """A stretch of a file seen as ``length // row_bytes`` rows of ``row_bytes`` bytes, hashed once per tiling
    (a tensor has a row-block tiling and a column-band tiling, so a split along either dim reads only its tiles)."""

    offset: int
    length: int
    row_bytes: int
    tilings: tuple[tuple[int, int], ...]

    @property
    def rows(self) -> int:
        return self.length // self.row_bytes

    @property
    def end(self) -> int:
        return self.offset + self.length

    def tiling(self, k: int) -> Tiling:
        tile_rows, tile_bytes = self.tilings[k]
        return Tiling(self.rows, self.row_bytes, tile_rows, tile_bytes)

    @property
    def leaves(self) -> int:
        return sum(self.tiling(k).leaves for k in range(len(self.tilings)))


def linear_region(offset: int, length: int, leaf: int = LEAF_BYTES) -> Region:
    """Bytes hashed in consecutive leaves of ``leaf`` bytes (headers, gaps, tensors without a row shape)."""
    return Region(offset, length, length, ((1, min(leaf, length)),))


def _ceil_to(n: int, parts: int, unit: int) -> int:
    """``n / parts`` rounded up to a multiple of ``unit``."""
    piece = -(-n // parts)
    return -(-piece // unit) * unit


def _pow2_below(n: int) -> int:
    """The largest power of two at most ``n`` (1 for n < 2)."""
    return 1 << max(0, n.bit_length() - 1)


def tensor_region(offset: int, rows: int, row_bytes: int, itemsize: int, leaf: int = LEAF_BYTES) -> Region:
    """A tensor of ``rows`` rows of ``row_bytes`` bytes with two tilings of at most ``leaf`` bytes per tile: row
    blocks of a power-of-two row count (whole rows where a row fits), so splits of dim 0 fall on block edges; and
    column bands of ``row_bytes / 2**k`` bytes (at least :data:`MIN_BAND`, up to 64 bands) a power-of-two count of
    rows tall, so splits of the last dim fall on band edges."""
    length = rows * row_bytes
    if length <= leaf:
        return Region(offset, length, row_bytes, ((rows, row_bytes),))
    if row_bytes <= leaf:
        by_rows = (min(rows, _pow2_below(leaf // row_bytes)), row_bytes)
    else:
        parts = 2
        while -(-row_bytes // parts) > leaf:
            parts *= 2
        by_rows = (1, _ceil_to(row_bytes, parts, itemsize))
    bands = 1
    while bands < 64 and row_bytes // (bands * 2) >= MIN_BAND:
        bands *= 2
    width = _ceil_to(row_bytes, bands, itemsize)
    if bands == 1 or width >= by_rows[1]:
        return Region(offset, length, row_bytes, (by_rows,))
    by_cols = (min(rows, _pow2_below(leaf // width)), width)
    return Region(offset, length, row_bytes, (by_rows, by_cols))


@dataclass
class FileHashes:
    """One file of the record: its name relative to the checkpoint, size, regions and leaf hashes."""

    name: str
    size: int
    regions: list[Region]
    leaves: bytes

    def leaf(self, index: int) -> bytes:
        return self.leaves[index * HASH_BYTES : (index + 1) * HASH_BYTES]


@dataclass
class HashRecord:
    """A checkpoint's integrity record: the hash function, the leaf size and every file's hashes."""

    hash: str
    leaf_bytes: int
    files: list[FileHashes]

    def to_bytes(self) -> bytes:
        """The record's file content (deterministic: the same checkpoint always gives the same bytes)."""
        head = {
            "format": "shardload-hashes",
            "version": VERSION,
            "hash": self.hash,
            "leaf_bytes": self.leaf_bytes,
            "files": [
                {
                    "name": f.name,
                    "size": f.size,
                    "regions": [[r.offset, r.length, r.row_bytes, [list(t) for t in r.tilings]] for r in f.regions],
                }
                for f in self.files
            ],
        }
        text = json.dumps(head, separators=(",", ":"), sort_keys=True).encode()
        return MAGIC + struct.pack("<Q", len(text)) + text + b"".join(f.leaves for f in self.files)

    def file(self, name: str) -> FileHashes | None:
        """The entry for file ``name`` (relative to the checkpoint), or None."""
        for f in self.files:
            if f.name == name:
                return f
        return None


def root_of(data: bytes) -> str:
    """The root hash of a record's bytes (sha256, hex): the one string a deployment pins."""
    return hashlib.sha256(data).hexdigest()


def is_root_hash(text: str) -> bool:
    """Whether ``text`` reads as a root hash (64 hex digits, case and surrounding space aside), as one is pinned."""
    pin = text.strip().lower()
    return len(pin) == 64 and all(c in "0123456789abcdef" for c in pin)


def _int(value: Any, what: str, where: str, low: int = 0, high: int = 1 << 62) -> int:
    if type(value) is not int or not low <= value <= high:
        raise RecordError(f"{what} must be an integer in [{low}, {high}], got {value!r}", file=where)
    return value


def parse_record(data: bytes, where: str) -> HashRecord:
    """Check and decode a record's bytes; any deviation from the documented layout is a :class:`RecordError`."""
    if len(data) < 16 or data[:8] != MAGIC:
        raise RecordError("not a shardload integrity record (bad magic)", file=where)
    (n,) = struct.unpack("<Q", data[8:16])
    if n > MAX_HEADER or 16 + n > len(data):
        raise RecordError(f"JSON part of {n} bytes does not fit the record ({len(data)} bytes)", file=where)
    try:
        head = strictjson.loads(data[16 : 16 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise RecordError(f"JSON part is invalid: {err}", file=where) from None
    if not isinstance(head, dict) or set(head) != {"format", "version", "hash", "leaf_bytes", "files"}:
        raise RecordError("JSON part must hold exactly format, version, hash, leaf_bytes and files", file=where)
    if head["format"] != "shardload-hashes" or head["version"] != VERSION:
        raise RecordError(f"unsupported record format {head['format']!r} version {head['version']!r}", file=where)
    if head["hash"] not in HASHES:
        raise RecordError(f"unknown hash {head['hash']!r}", file=where)
    leaf = _int(head["leaf_bytes"], "leaf_bytes", where, 1, 1 << 30)
    files = head["files"]
    if not isinstance(files, list) or not 0 < len(files) <= MAX_FILES:
        raise RecordError(f"files must be a list of 1 to {MAX_FILES} entries", file=where)
    out: list[FileHashes] = []
    pos = 16 + n
    total_regions = 0
    names: set[str] = set()
    for entry in files:
        if not isinstance(entry, dict) or set(entry) != {"name", "size", "regions"}:
            raise RecordError("each file entry must hold exactly name, size and regions", file=where)
        name = entry["name"]
        if not isinstance(name, str) or not name or name in names or len(name) > 4096:
            raise RecordError(f"bad or repeated file name {name!r}", file=where)
        names.add(name)
        size = _int(entry["size"], f"{name}: size", where)
        raw = entry["regions"]
        if not isinstance(raw, list):
            raise RecordError(f"{name}: regions must be a list", file=where)
        total_regions += len(raw)
        if total_regions > MAX_REGIONS:
            raise RecordError(f"more than {MAX_REGIONS} regions", file=where)
        regions: list[Region] = []
        cursor = 0
        count = 0
        for r in raw:
            if not isinstance(r, list) or len(r) != 4 or not isinstance(r[3], list) or not 1 <= len(r[3]) <= 2:
                raise RecordError(f"{name}: a region must be [offset, length, row_bytes, [[tile_rows, tile_bytes], "
                                  "...]] with one or two tilings", file=where)  # fmt: skip
            off, length, row_bytes = (_int(v, f"{name}: region", where) for v in r[:3])
            if off != cursor or length == 0 or row_bytes == 0 or length % row_bytes:
                raise RecordError(f"{name}: regions must tile the file in order without gaps (at byte {cursor})",
                                  file=where)  # fmt: skip
            tilings = []
            for t in r[3]:
                if not isinstance(t, list) or len(t) != 2:
                    raise RecordError(f"{name}: a tiling must be [tile_rows, tile_bytes]", file=where)
                tile_rows = _int(t[0], f"{name}: tile_rows", where, 1, length // row_bytes)
                tile_bytes = _int(t[1], f"{name}: tile_bytes", where, 1, row_bytes)
                if tile_rows * tile_bytes > leaf:
                    raise RecordError(f"{name}: a tile at byte {off} is larger than leaf_bytes", file=where)
                tilings.append((tile_rows, tile_bytes))
            region = Region(off, length, row_bytes, tuple(tilings))
            regions.append(region)
            cursor += length
            count += region.leaves
            if count > MAX_LEAVES:
                raise RecordError(f"{name}: more than {MAX_LEAVES} leaves", file=where)
        if cursor != size:
            raise RecordError(f"{name}: regions cover {cursor} bytes, the file has {size}", file=where)
        nbytes = count * HASH_BYTES
        if pos + nbytes > len(data):
            raise RecordError(f"{name}: leaf table is cut short", file=where)
        out.append(FileHashes(name, size, regions, data[pos : pos + nbytes]))
        pos += nbytes
    if pos != len(data):
        raise RecordError(f"{len(data) - pos} bytes after the last leaf table", file=where)
    return HashRecord(head["hash"], leaf, out)
