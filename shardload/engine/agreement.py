"""Whether the ranks that load one model side by side read one version of it: a checkpoint replaced between two ranks'
loads gives each rank a consistent state dict of a different version, which no single load can see.

Each rank sums up what its load recorded (:mod:`shardload.format.input_log`) as one row per file: the bytes it parsed
(headers, ``config.json``, ``shard_info.json``, an index, a manifest), the file's size, an object's version (its ETag),
and a local file's identity (device, inode, modification and change times). Every file two ranks both read must agree on
what they parsed and its size; ranks that read one object address on its version; ranks on one host (same boot, hostname
and mount namespace) that read one path, on a file system whose inode numbers are stable, on the identity: a file
replaced by a rename, or rewritten, between their loads is then one line on every rank. Copies that differ only in
tensor bytes the ranks did not parse (two fine-tunes with equal headers on two hosts, or at two paths) are not told
apart here; a verified load (``verify=True``) checks every byte it reads against the record.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ShardloadError
from ..format import input_log
from ..format.input_log import InputLog
from .exchange import _comm_device, _global

if TYPE_CHECKING:
    import torch

STABLE_INODES = input_log.LEASE_FILE_SYSTEMS | {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "ceph", "cifs", "smb3"}
"""File systems whose inode numbers name one file for every process: there, two ranks reading one path must see one
inode, modification and change times. A FUSE mount (rclone, goofys) may number a file anew at each lookup: not
compared."""
ROW = struct.Struct("<8s8s8s8s8s")
"""One file's row: its name's hash, what every copy must agree on, its path's hash, its object version (compared
between ranks that read one address) and its identity (between ranks of one host that read one path)."""


@dataclass(frozen=True)
class FileRow:
    """One file a load read, summed up: ``name`` (relative to the model), and the hashes the ranks compare: its
    ``content`` (what any copy must agree on), its ``path``, its ``version`` (an object's ETag, compared between
    ranks that read one address: a mirror made by another tool may have other ETags) and its ``identity`` (inode and
    times, compared between ranks of one host that read one path)."""

    name: str
    content: bytes
    path: bytes
    version: bytes
    identity: bytes

    @property
    def key(self) -> bytes:
        return _digest(self.name.encode())


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return h.digest()


def _relative(key: str, root: str) -> str:
    prefix = root.rstrip("/") + "/"
    return key[len(prefix) :] if key.startswith(prefix) else key.rsplit("/", 1)[-1]


def file_rows(log: InputLog, root: str) -> list[FileRow]:
    """The rows of every file ``log`` recorded, sorted by name; names are relative to ``root`` (the model)."""
    rows = []
    for key in sorted(set(log.data) | set(log.stamps) | set(log.versions)):
        stamp = log.stamps.get(key)
        data = log.data.get(key)
        size = b"" if stamp is None else struct.pack("<Q", stamp[2])
        parsed = b"" if data is None else hashlib.sha256(data).digest()
        version = str(log.versions.get(key, "")).encode()
        stable = stamp is not None and input_log.file_system(stamp[0]) in STABLE_INODES
        identity = struct.pack("<QQQQ", stamp[0], stamp[1], stamp[3], stamp[4]) if stable else b""  # ctime too
        rows.append(FileRow(_relative(key, root), _digest(parsed, size), _digest(key.encode()), _digest(version),
                            _digest(identity)))  # fmt: skip
    return rows


def host_key() -> bytes:
    """This host, as processes that see the same files under the same inodes share it: boot, hostname and mount
    namespace (containers on one host with copies of their own differ)."""
    parts = [socket.gethostname().encode()]
    for read in (lambda: Path("/proc/sys/kernel/random/boot_id").read_bytes(),
                 lambda: os.readlink("/proc/self/ns/mnt").encode()):  # fmt: skip
        try:
            parts.append(read())
        except OSError:
            parts.append(b"")
    return _digest(*parts)


def agree_on_inputs(group: Any, log: InputLog | None, root: str, *, failed: bool = False) -> None:
    """Compare the files this rank's load read (``log``) with every other rank of ``group``'s (a torch.distributed
    process group; None: the default one) and raise one line on every rank when two disagree, or when a rank
    failed (``failed``: this one, which raises its own error after taking part, so the others never wait on it).
    Waits as long as the group's own timeout allows: ranks' loads can end minutes apart."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return
    comm = _comm_device(group, torch.device("cpu"))
    rows = [] if log is None or failed else file_rows(log, root)
    head = torch.tensor([len(rows), int(failed), *struct.unpack("<q", host_key())], dtype=torch.int64).to(comm)
    heads = _all_gather(head, group)
    counts, fails, hosts = zip(*(h.tolist() for h in heads), strict=True)
    if failed:
        return
    if any(fails):
        rank = _global(group, [fails.index(1)])[0]
        raise ShardloadError(f"rank {rank} failed to load this model (its own error says why); nothing was returned",
                             file=root)  # fmt: skip
    width = max(counts) * ROW.size
    if not width:
        return
    mine = bytearray(width)
    for i, row in enumerate(rows):
        ROW.pack_into(mine, i * ROW.size, row.key, row.content, row.path, row.version, row.identity)
    tables = _all_gather(torch.frombuffer(mine, dtype=torch.uint8).to(comm), group)
    decoded = [_decode(bytes(t.cpu().numpy()), n) for t, n in zip(tables, counts, strict=True)]
    problem = first_disagreement(decoded, hosts, {row.key: row.name for row in rows})
    if problem is not None:
        (a, b), name, detail = problem
        ranks = _global(group, [a, b])
        raise ShardloadError(
            f"ranks {ranks[0]} and {ranks[1]} read different versions of {name} ({detail}): the checkpoint changed "
            "between their loads; nothing was returned: load again once nothing writes to it",
            file=root,
        )


def _all_gather(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``tensor``, waiting as the group's own timeout allows; a failure is one line."""
    import torch.distributed as dist

    out = [tensor.new_empty(tensor.shape) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(out, tensor, group=group)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise ShardloadError(f"checkpoint agreement: another rank of the group died or failed while the ranks "
                             f"compared the files they read ({first})") from None  # fmt: skip
    return out


def _decode(raw: bytes, count: int) -> list[tuple[bytes, ...]]:
    return [ROW.unpack_from(raw, i * ROW.size) for i in range(count)]


def first_disagreement(
    tables: list[list[tuple[bytes, ...]]], hosts: Iterable[int], names: dict[bytes, str]
) -> tuple[tuple[int, int], str, str] | None:
    """The first two ranks (group ranks) that read one file differently, the file's name (``names``: this rank's,
    by key; else "a file of the model") and how; None when every file two ranks read agrees. Versions are compared
    between ranks that read one address, identities between ranks of one host that read one path (their own copies
    may have other times, a mirror other ETags)."""
    hosts = list(hosts)
    first: dict[bytes, list[tuple[int, bytes, bytes, bytes, bytes]]] = {}
    for rank, table in enumerate(tables):
        for key, content, path, version, identity in table:
            seen = first.setdefault(key, [])
            name = names.get(key, "a file of the model")
            for other, content0, path0, version0, identity0 in seen:
                if content != content0:
                    return (other, rank), name, "its header or size differs"
                if path == path0 and version != version0:
                    return (other, rank), name, "another version of the object answered"
                if hosts[other] == hosts[rank] and path == path0 and identity != identity0:
                    return (other, rank), name, "on one host, another inode or time: replaced, rewritten or touched"
            seen.append((rank, content, path, version, identity))
    return None


@contextmanager
def same_checkpoint(group: Any, model: str | os.PathLike[str]) -> Iterator[None]:
    """Load ``model`` inside this block on every rank of ``group`` (a torch.distributed process group; None: the
    default one): at its end the ranks compare the files they read (:func:`agree_on_inputs`), and a rank whose load
    failed still takes part, so that the others raise at once instead of waiting, then raises its own error. The
    block holds no other collective of the group (a load with ``group=``, a barrier): a rank that fails before it
    would meet the others' collective with this one.

    Example::

        with same_checkpoint(group, "llama-dir"):
            state = shardload.load_rank("llama-dir", rank, world)
    """
    where = str(model)
    with input_log.recording() as log:
        log.agreeing = True
        try:
            yield
        except BaseException:
            try:
                agree_on_inputs(group, log, where, failed=True)
            except ShardloadError:
                pass  # the group failed too: this rank's own error is the one to tell
            raise
        agree_on_inputs(group, log, where)
