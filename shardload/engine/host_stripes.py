"""Cooperative stripe reads: the ranks loading together on one host (:mod:`.host_group`) read each byte of the
files from storage once, in large sequential reads, instead of N interleaved streams of each rank's own pages.

Local rank ``i`` of ``count`` reads stripe ``i`` of each cold local file's tensor-data region (the bytes the host's
ranks need of it together: with every rank of the tensor-parallel group on the host, all of them) on a background
thread, :data:`STRIPE_READ` bytes a ``preadv`` into one reused scratch buffer. A buffered read returns only once its
pages are in the page cache, so the stripe is cached when the thread is done, and the only memory it costs is the
scratch buffer and the page cache the ranks' own reads use anyway (``posix_fadvise(WILLNEED)`` would also warm
the cache, without a copy, but gives no sign of when the pages are in, and the kernel may drop the advice).

The rank plans meanwhile, then waits for its stripe (:meth:`HostStripes.wait`), and for the stripes of the ranks
beside it while the file's pages keep arriving, before its own reads start. Those then take the way the page cache
says (:mod:`.read_strategy`): normally the warm path (copies out of a mapping, ``preadv`` of exact runs), with no
cold-storage hints. Reading its own bytes beside the stripes, as planned cold reads, would request the peers'
stripes' pages ahead of them, page by page, which are the interleaved streams this replaces; where a peer's stripe
is late, the per-parameter probes find its pages cold and the rank reads just its own of them, as planned reads.

The stripe only warms the cache: every byte a rank returns is read by its own load. It is skipped where it cannot
help or would read bytes nobody needs: a rank alone, files in object storage, files already cached, a load that
reads only some tensors or a pipeline stage, one verifying every byte, the ``plan`` and ``view`` strategies, and
files larger together than :data:`MEMORY_SHARE` of the memory available.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..sources.reader import PAGE, FileMaps, count_warmed
from ..sources.source_types import Source, remote
from .host_group import LocalRanks, cgroup_least, local_ranks

if TYPE_CHECKING:
    from ..planning.mesh import Mesh
    from ..sources.checkpoint import Checkpoint
    from .load_options import LoadOptions

log = logging.getLogger("shardload.host")

STRIPE_READ = 16 << 20
"""Bytes per stripe read: large enough that a request's cost is its bytes (``benchmarks/gpu_node.py`` measures the
cold sequential floor in 16 MiB reads)."""
COLD_BELOW = 0.9
"""A file is striped when fewer than this fraction of :data:`COLD_PROBES` pages over its data region are cached."""
COLD_PROBES = 64
MEMORY_SHARE = 0.5
"""Files striped together take at most this fraction of the memory available (:func:`memory_available`: the
host's, or a container's limit): the ranks' own reads come after the stripes, so what would not stay cached until
then is left to them."""
MEMINFO = Path("/proc/meminfo")
"""Where the host's available memory is read (tests point it elsewhere; the cgroups: ``host_group.CGROUP_ROOT``)."""
SETTLE_PROBES = 1024
"""Pages over a file's data region asked about while the peers' stripes arrive."""
SETTLE_STALL_S = 0.25
"""After its stripe, a rank waits for the peers' stripes while a probed page arrived within this many seconds."""
SETTLE_POLL_S = 0.005


@dataclass(frozen=True)
class ByteRange:
    """Bytes ``[start, end)`` of a file."""

    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return max(0, self.end - self.start)


@dataclass(frozen=True)
class FileStripe:
    """One file's data region (what the host's ranks need of it) and this rank's stripe of it."""

    path: Path
    region: ByteRange
    mine: ByteRange


def stripe_of(region: ByteRange, index: int, count: int) -> ByteRange:
    """Stripe ``index`` of ``count`` of ``region``: the ``count`` stripes tile it in order, every boundary between
    two of them on a page boundary (a page is read by one rank); a stripe may be empty."""
    first = region.start // PAGE
    pages = -(-region.end // PAGE) - first

    def edge(k: int) -> int:
        if k in (0, count):
            return region.start if k == 0 else region.end
        return min(region.end, max(region.start, (first + pages * k // count) * PAGE))

    return ByteRange(edge(index), edge(index + 1))


def data_regions(checkpoint: Checkpoint) -> dict[Path, ByteRange]:
    """Each local file's tensor-data region: from its first tensor byte to its last."""
    regions: dict[Path, ByteRange] = {}
    for info in checkpoint.tensors.values():
        if not info.nbytes:
            continue
        old = regions.get(info.file)
        start, end = info.offset, info.offset + info.nbytes
        regions[info.file] = ByteRange(start, end) if old is None else ByteRange(min(old.start, start),
                                                                                 max(old.end, end))  # fmt: skip
    return regions


class HostStripes:
    """This rank's stripes of a load's files, read on a background thread from ``with`` on; :meth:`wait` is the
    gate before the rank's own reads, and leaving the block stops the thread (between reads) and joins it."""

    def __init__(self, stripes: Sequence[FileStripe] = (), local: LocalRanks | None = None) -> None:
        self.stripes = list(stripes)
        self.local = local
        self.read = 0
        """Bytes the stripe thread read."""
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        """What stopped the thread other than the end of its stripes or a read error (re-raised by :meth:`wait`)."""
        self.thread: threading.Thread | None = None

    def __enter__(self) -> HostStripes:
        if self.stripes:
            # joined on leaving the block; not a daemon (one stopped inside a read at interpreter exit would abort)
            self.thread = threading.Thread(target=self._run, name="shardload-stripe")
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the stripe thread after its current read, and wait for it."""
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()

    def wait(self) -> None:
        """Wait for this rank's stripes, then for the peers' while their pages keep arriving (see the module)."""
        if self.thread is None:
            return
        started = time.perf_counter()
        self.thread.join()
        if self.error is not None:
            raise self.error
        own = time.perf_counter() - started
        self._settle()
        assert self.local is not None
        log.debug("shardload: local rank %d of %d read its stripes (%.1f MiB of %d files); waited %.3f s for them, "
                  "%.3f s more for the peers'", self.local.index, self.local.count, self.read / (1 << 20),
                  len(self.stripes), own, time.perf_counter() - started - own)  # fmt: skip

    def _run(self) -> None:
        try:
            scratch = memoryview(bytearray(min(STRIPE_READ, max(s.mine.nbytes for s in self.stripes))))
            for stripe in self.stripes:
                if not self._read(stripe, scratch):
                    return
        except OSError as err:  # unreadable or cut short: the rank's own reads of these bytes say so, in a line
            log.debug("shardload: stripe read stopped: %s", err)
        except BaseException as err:  # a bug: wait() raises it
            self.error = err

    def _read(self, stripe: FileStripe, scratch: memoryview) -> bool:
        """Read ``stripe.mine`` of its file into the page cache; False once stopped or at an early end of file."""
        if not stripe.mine.nbytes:
            return True
        fd = os.open(stripe.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, stripe.mine.start, stripe.mine.nbytes, os.POSIX_FADV_SEQUENTIAL)
            at, end = stripe.mine.start, stripe.mine.end
            while at < end:
                if self.stopped.is_set():
                    return False
                got = os.preadv(fd, [scratch[: min(len(scratch), end - at)]], at)
                if got == 0:
                    return False  # cut short: the rank's own reads say so
                at += got
                self.read += got
                count_warmed(got)
        finally:
            os.close(fd)
        return True

    def _settle(self) -> None:
        """Wait while the peers' stripes arrive: until every probed page of every region is cached, or none has
        arrived for :data:`SETTLE_STALL_S`, once for the whole load (a rank whose peers do not load waits that long
        once, not once per file)."""
        maps = FileMaps()
        try:
            probes = [(stripe, spread(stripe.region, SETTLE_PROBES)) for stripe in self.stripes]
            best, since = -1.0, time.perf_counter()
            while probes and not self.stopped.is_set():
                cached = [maps.cached(stripe.path, offsets, stripe.region.end) for stripe, offsets in probes]
                probes = [p for p, c in zip(probes, cached, strict=True) if c is not None and c < 1.0]
                if not probes:
                    break
                now = time.perf_counter()
                seen = sum(c for c in cached if c is not None)
                if seen > best:
                    best, since = seen, now
                elif now - since >= SETTLE_STALL_S:
                    break
                time.sleep(SETTLE_POLL_S)
        finally:
            maps.release()


def spread(region: ByteRange, count: int) -> list[int]:
    """At most ``count`` offsets spread evenly over ``region``, one per page at most."""
    pages = max(1, region.nbytes // PAGE)
    k = min(count, pages)
    return [region.start + i * region.nbytes // k for i in range(k)] if region.nbytes else []


def host_stripes(source: Source, mesh: Mesh, ranks: Sequence[int], options: LoadOptions) -> HostStripes:
    """The stripes this rank reads for a load of ``ranks`` (one) out of ``source``, none where striping does not
    apply (see the module)."""
    read = options.read_options
    if (
        len(ranks) != 1
        or mesh.pp != 1
        or options.group is not None
        or options.mmap
        or options.verify
        or (options.into is not None and options.into.params is not None)
        or (read is not None and read.strategy == "plan")
        or remote(source)  # an object store: its reader cannot map (reader.can_map), nothing to cache
    ):
        return HostStripes()
    option = "auto" if read is None else read.local_ranks
    local = local_ranks(option)
    if local.alone:
        return HostStripes()
    if option == "auto" and local.count != mesh.tp:
        # the host's ranks are not the tensor-parallel group (tensor parallelism across hosts, several groups on one
        # host, data-parallel ranks): striping the whole file would read bytes no rank here needs
        log.info(
            "shardload: no stripes: %d local ranks (%s) are not this load's %d tensor-parallel ranks (give "
            "ReadOptions(local_ranks=(index, count)) to stripe anyway)",
            local.count,
            local.source,
            mesh.tp,
        )
        return HostStripes()
    cold = {path: region for path, region in data_regions(source.checkpoint).items() if _cold(path, region)}
    total = sum(r.nbytes for r in cold.values())
    available = memory_available()
    if available is not None and total > MEMORY_SHARE * available:
        log.debug("shardload: no stripes: %.1f GiB of cold files, %.1f GiB of memory available", total / (1 << 30),
                  available / (1 << 30))  # fmt: skip
        return HostStripes()
    stripes = [FileStripe(path, region, stripe_of(region, local.index, local.count)) for path, region in cold.items()]
    if stripes:
        log.info("shardload: local rank %d of %d (%s): reads its stripe of %d cold file(s), %.1f GiB in all, for the "
                 "host's ranks", local.index, local.count, local.source, len(stripes), total / (1 << 30))  # fmt: skip
    return HostStripes(stripes, local)


def _cold(path: Path, region: ByteRange) -> bool:
    """Whether too little of ``region`` of the local file ``path`` is cached (``mincore`` of sampled pages)."""
    maps = FileMaps()
    try:
        cached = maps.cached(path, spread(region, COLD_PROBES), region.end)
    finally:
        maps.release()
    return cached is not None and cached < COLD_BELOW


def memory_available() -> int | None:
    """Bytes this process may still fill with page cache: the host's ``MemAvailable``, or less where a cgroup
    memory limit (v2, or v1's memory controller) on its group or a parent group leaves less (the limit less what the
    group holds beyond its droppable file pages). None where the host's figure cannot be read (not Linux)."""
    host = _meminfo_available()
    if host is None:
        return None
    limit = cgroup_least("memory", _cgroup_headroom)
    return host if limit is None else max(0, min(host, int(limit)))


def _meminfo_available() -> int | None:
    """``MemAvailable`` in bytes (Linux), else None."""
    try:
        with open(MEMINFO) as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


V1_UNLIMITED = 1 << 62
"""A cgroup v1 ``memory.limit_in_bytes`` at least this large is no limit (v1 writes the page counter's maximum)."""
MEMORY_FILES = {2: ("memory.max", "memory.current", "file"),
                1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")}  # fmt: skip
"""Per cgroup version: the memory limit's file, the usage's, and the ``memory.stat`` key of the page cache the
kernel drops first (v1's ``total_cache``: the group's and its children's)."""


def _cgroup_headroom(group: Path, version: int) -> int | None:
    """What ``group``'s memory limit leaves: the limit less the usage plus its page cache (:data:`MEMORY_FILES`);
    None without a limit (v2's ``max``, v1's :data:`V1_UNLIMITED`) or where the files cannot be read."""
    limit_file, usage_file, cache_key = MEMORY_FILES[version]
    try:
        most = (group / limit_file).read_text().strip()
        if most == "max" or (version == 1 and int(most) >= V1_UNLIMITED):
            return None
        current = int((group / usage_file).read_text().strip())
        cache = 0
        for line in (group / "memory.stat").read_text().splitlines():
            if line.startswith(cache_key + " "):
                cache = int(line.split()[1])
                break
        return int(most) - (current - cache)
    except (OSError, ValueError, IndexError):
        return None
