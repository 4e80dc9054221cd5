"""How one rank decides, per file and parameter, which way it gets its bytes: strided copies out of a read-only
mapping, or ``preadv`` of its exact runs (docs/reading.md), with the cold-storage hints that make either way fetch
only the rank's pages. :class:`ReadOptions` is the caller's say in it: a forced way, and how many reader threads.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..errors import ShardloadError, short_repr
from ..sources.objects import COST_FIELDS, ObjectCost, parse_fields
from ..sources.read_plan import MAX_WASTE, IoModel
from ..sources.reader import PAGE, probes
from .host_group import ALONE, LocalRanks, LocalRanksOption, announce, as_local_ranks, local_ranks, rank_threads

if TYPE_CHECKING:
    import numpy as np

    from ..planning.plan import ParamPlan
    from ..planning.runs import Runs
    from ..sources.reader import FileMaps, RunReader
    from .read_schedule import StructureKey, StructureRuns

READ_THREADS = rank_threads(ALONE)
"""Reader threads of a rank alone on its host by default: page-cache copies scale with cores until memory bandwidth
is the bound (the cores this process may run on: a container or ``taskset`` may allow fewer than the machine has).
Ranks loading together on a host share its cores (:func:`~.host_group.rank_threads`)."""
RESIDENT_ENOUGH = 0.9
"""``auto`` treats a parameter's bytes as cached when at least this fraction of the pages holding them is (sampled
with ``mincore``); otherwise it fetches exactly those pages from storage."""
STAGED_MAP_RUN = 256 << 10
"""A GPU rank copies out of a mapping (when cached) only if its runs average under this many bytes; longer runs
are read with ``preadv`` into the pinned buffers (measured on an H100 host: whole tensors 0.053 s by ``preadv``
against 0.079 s through the mapping, column slices 0.050 s against 0.305 s)."""
CACHED_READ_RUN = 1 << 20
"""A CPU rank reads cached runs averaging at least this many bytes with ``preadv`` (the kernel's copy out of the
page cache) instead of copying them out of a mapping: no file pages to fault in and tear down, which on a server's
model loaded again into its parameters was as much CPU as the copy itself (docs/benchmarks.md, "After this round's
warm-path changes"; fresh destinations measured the same either way). Shorter runs (column slices) stay mapped:
``preadv`` would pay a call per row."""

IO_DEPTH = 8
"""Planned cold reads a single rank keeps in flight by default (threads blocked on storage use no CPU)."""

Strategy = Literal["auto", "map", "read", "plan", "view"]
STRATEGIES: tuple[Strategy, ...] = ("auto", "map", "read", "plan", "view")


@dataclass(frozen=True)
class ReadOptions:
    """How a load reads: ``strategy`` picks a single rank's way (``"auto"``: per parameter, from its runs and the
    page cache; ``"map"``: always copy out of a mapping; ``"read"``: always ``preadv`` the exact runs; ``"plan"``:
    always the planned reads of cold storage; ``"view"``: a CPU rank's tensor that is one contiguous stretch of
    its file comes back as a view of a private mapping, no copy, the rest as ``"auto"``), ``threads`` the reader
    threads (None: the reader's own number, else the rank's share of the host's cores: :data:`READ_THREADS` alone;
    0: read in the calling thread). ``local_ranks`` is this process's place among the ranks loading together on its
    host (``"auto"``: from ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``; None or ``"off"``: alone; ``(index, count)``):
    together, each reads a stripe of the local files into the page cache (:mod:`~.host_stripes`). Cold reads
    are planned with ``io_model`` (None: measured once per file system), merging gaps within ``max_waste`` (a
    fraction of the page floor), ``io_depth`` of them in flight (0: by the reader threads). ``object_cost`` is what
    a request to an object store costs, which decides its ranged GETs (an
    :class:`~shardload.sources.objects.ObjectCost`; ``"measure"``: timed once per store; None:
    ``SHARDLOAD_S3_COST``, else the default)."""

    strategy: Strategy = "auto"
    threads: int | None = None
    io_model: IoModel | None = None
    max_waste: float = MAX_WASTE
    io_depth: int = IO_DEPTH
    object_cost: ObjectCost | Literal["measure"] | None = None
    local_ranks: LocalRanksOption = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_ranks", as_local_ranks(self.local_ranks))
        if self.strategy not in STRATEGIES:
            raise ShardloadError(f"read strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.threads is not None and (type(self.threads) is not int or self.threads < 0):
            raise ShardloadError(f"reader threads must be None or an int >= 0, got {self.threads!r}")
        if self.io_model is not None and not isinstance(self.io_model, IoModel):
            raise ShardloadError(f"io_model must be None or an IoModel, got {self.io_model!r}")
        if type(self.max_waste) not in (int, float) or not self.max_waste >= 0:
            raise ShardloadError(f"max_waste must be a number >= 0, got {self.max_waste!r}")
        if type(self.io_depth) is not int or self.io_depth < 0:
            raise ShardloadError(f"io_depth must be an int >= 0, got {self.io_depth!r}")
        cost = self.object_cost
        if not (cost is None or isinstance(cost, ObjectCost) or (isinstance(cost, str) and cost == "measure")):
            raise ShardloadError(f'object_cost must be an ObjectCost, "measure" or None, got {cost!r}')

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str = "read_options") -> ReadOptions:
        """The options a JSON mapping names (a server's config, e.g. its loader's extra config): keys
        ``strategy``, ``threads``, ``max_waste`` (a number or ``"inf"``), ``io_depth``, ``io_model`` (``{"request_s":
        S, "bandwidth": B}`` or ``"request_s=S,bandwidth=B"``), ``object_cost`` (as ``SHARDLOAD_S3_COST``, or a
        mapping of its fields) and ``local_ranks`` (``"auto"``, ``"off"``, null or ``[index, count]``). An unknown
        key or a bad value raises one line naming ``where`` and the key."""
        if not isinstance(config, Mapping):
            raise ShardloadError(f"expected a mapping of read options, got {short_repr(config)}", param=where)
        unknown = sorted(str(k) for k in set(config) - set(_CONFIG_KEYS))
        if unknown:
            raise ShardloadError(f"unknown key(s) {unknown}; accepted: {list(_CONFIG_KEYS)}", param=where)
        values: dict[str, Any] = {}
        for key, value in config.items():
            try:
                values[key] = _CONFIG_KEYS[key](value)
            except (ShardloadError, ValueError, TypeError, OverflowError) as err:
                reason = err.reason if isinstance(err, ShardloadError) else str(err)
                raise ShardloadError(reason, param=f"{where}.{key}") from None
        try:
            return cls(**values)
        except ShardloadError as err:
            raise ShardloadError(err.reason, param=where) from None

    def threads_for(self, reader: RunReader) -> int:
        """The reader threads of a load through ``reader`` (an object store asks for its own number; a local reader's
        default is the rank's share of its host's cores, announced once with the rank's place on the host)."""
        if self.threads is not None:
            return self.threads
        if reader.threads:
            return reader.threads
        local = local_ranks(self.local_ranks)
        threads = rank_threads(local)
        announce(local, threads)
        return threads


def _waste(value: Any) -> float:
    if isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        return math.inf
    if type(value) not in (int, float):
        raise ShardloadError(f'expected a number >= 0 or "inf", got {short_repr(value)}')
    return float(value)


def _count(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ShardloadError(f"expected an integer >= 0, got {short_repr(value)}")
    return value


def _threads(value: Any) -> int | None:
    return None if value is None else _count(value)  # null: the reader's own number, as threads=None


def _local_ranks(value: Any) -> LocalRanks | str | None:
    if isinstance(value, list):
        value = tuple(value)  # JSON's [index, count]
    return as_local_ranks(value)


def _strategy(value: Any) -> Strategy:
    if value not in STRATEGIES:
        raise ShardloadError(f"expected one of {', '.join(STRATEGIES)}, got {short_repr(value)}")
    return value  # type: ignore[no-any-return]


def _io_model(value: Any) -> IoModel | None:
    if value is None:
        return None
    kinds = {"request_s": float, "bandwidth": float}
    fields = parse_fields(value, kinds) if isinstance(value, str) else value
    if not isinstance(fields, Mapping) or set(fields) != set(kinds):
        raise ShardloadError(f"expected request_s and bandwidth, as a mapping or request_s=S,bandwidth=B, got "
                             f"{short_repr(value)}")  # fmt: skip
    try:
        return IoModel(**fields)
    except ValueError as err:
        raise ShardloadError(str(err)) from None


def _object_cost(value: Any) -> ObjectCost | Literal["measure"] | None:
    if value is None or isinstance(value, ObjectCost):
        return value
    if isinstance(value, str):
        return ObjectCost.parse(value)  # as SHARDLOAD_S3_COST takes it
    if not (isinstance(value, Mapping) and set(COST_FIELDS) >= set(value) >= {"latency", "bandwidth"}):
        raise ShardloadError(f"expected exact, merged, measure or a mapping with latency and bandwidth (and "
                             f"concurrency, request_bytes), got {short_repr(value)}")  # fmt: skip
    return ObjectCost(**value)  # which names a field of the wrong type or range


_CONFIG_KEYS: dict[str, Callable[[Any], Any]] = {
    "strategy": _strategy,
    "threads": _threads,
    "max_waste": _waste,
    "io_depth": _count,
    "io_model": _io_model,
    "object_cost": _object_cost,
    "local_ranks": _local_ranks,
}
"""The keys :meth:`ReadOptions.from_config` takes, each with the function that reads its JSON value."""


class Way(enum.Enum):
    """How one rank gets one parameter's bytes."""

    MAP = "map"
    """Strided copies out of a read-only mapping of the file."""
    READ = "read"
    """``preadv`` of the exact runs (through the read schedule)."""
    PLAN = "plan"
    """Planned reads of cold storage: the runs' pages, merged across cheap gaps, read whole (``sources/read_plan``)."""


@dataclass(frozen=True)
class RunSpans:
    """Where one rank's bytes of a parameter structure lie, offsets relative to the stored tensor: what ``auto``
    asks the page cache about, and the ranges its cold-storage hints name."""

    starts: np.ndarray
    """Run starts, sorted."""
    ends: np.ndarray
    """Run ends (exclusive), in the same order."""
    mean_run: float
    """Average run length in bytes: long runs are read, short ones copied out of the mapping."""
    probes: list[int]
    """Offsets of the pages to ask ``mincore`` about."""
    end: int
    """End of the last run."""

    @classmethod
    def of(cls, runs: Runs) -> RunSpans:
        """The spans of ``runs`` (at least one, sorted by file offset)."""
        starts, ends = runs.src, runs.src + runs.length
        return cls(starts, ends, float(runs.length.mean()), probes(starts, ends), int(ends.max()))


class ReadStrategy:
    """A single rank's choice of :class:`Way` per parameter, under ``options.strategy``. What a parameter structure
    alone decides is kept per structure; ``auto`` then asks the page cache about each parameter whose runs it
    could read either way, and gives the reader the cold-storage hints for the way it chose."""

    def __init__(self, options: ReadOptions, reader: RunReader, filemaps: FileMaps, runs: StructureRuns) -> None:
        self.strategy = options.strategy
        self.reader = reader
        self.filemaps = filemaps
        self.runs = runs
        self.known: dict[StructureKey, Way | RunSpans] = {}
        """Per structure: its way, or (``auto``) the spans to decide each parameter by."""

    def way(self, plan: ParamPlan, rank: int, key: StructureKey, *, direct: bool) -> Way:
        """How ``rank`` gets ``plan``'s bytes (``key``: the plan's structure; ``direct``: into a CPU tensor, not
        through staging buffers)."""
        if not plan.remap or plan.rank_nbytes == 0 or plan.source.dtype != plan.dtype:
            return Way.READ
        known = self.known.get(key)
        if known is None:
            known = self.known[key] = self._by_structure(plan, rank, key)
        if isinstance(known, Way):
            return Way.READ if known is Way.PLAN and not direct else known  # planned reads fill CPU tensors only
        return self._by_page_cache(plan, known, direct)

    def _by_structure(self, plan: ParamPlan, rank: int, key: StructureKey) -> Way | RunSpans:
        """The way every parameter of ``plan``'s structure takes, or (``auto``) the spans to ask about."""
        from ..planning.runs import MANY_RUNS, run_count

        if run_count(plan, [rank]) > MANY_RUNS:
            return Way.MAP  # too many runs to list: always copied out of the mapping, whatever the strategy
        if self.strategy == "read":
            return Way.READ
        runs = self.runs.get(plan, [rank], key)
        if runs is None or not len(runs):
            return Way.READ
        if self.strategy == "map":
            return Way.MAP
        if self.strategy == "plan":
            return Way.PLAN
        return RunSpans.of(runs)

    def _by_page_cache(self, plan: ParamPlan, spans: RunSpans, direct: bool) -> Way:
        """``auto`` for one parameter: copy short cached runs out of the mapping (and short runs from cold
        storage, their pages requested first); read long cached runs with ``preadv`` (:data:`CACHED_READ_RUN`), long
        runs from cold storage as planned I/O, and on a GPU long runs whatever the cache.

        Planned I/O may read through short gaps within ``ReadOptions.max_waste`` of the page floor (counted as
        moved, not used).
        """
        file, at = plan.source.file, plan.source.offset
        if self.filemaps.warm(file):  # the whole file is cached: no probe per parameter
            resident: float | None = 1.0
        else:
            resident = self.filemaps.cached(file, [at + x for x in spans.probes], at + spans.end)
        if not direct and spans.mean_run >= STAGED_MAP_RUN:
            # long runs reach the pinned buffers faster by preadv than through a mapping
            if resident is not None and resident < RESIDENT_ENOUGH:
                self.reader.no_readahead(file)  # cold: exactly the runs, their pages requested now
                self.reader.prefetch(file, (at + spans.starts).tolist(), (at + spans.ends).tolist())
            return Way.READ
        if resident is None:
            return Way.READ
        if direct and resident >= RESIDENT_ENOUGH and spans.mean_run >= CACHED_READ_RUN:
            return Way.READ  # long cached runs: the kernel's copy, no mapping to fault in and tear down
        if resident < RESIDENT_ENOUGH:  # cold: the pages holding the rank's bytes, read as planned I/O
            if direct:
                return Way.PLAN
            starts, ends = at + spans.starts, at + spans.ends
            # a staged rank's short runs: request the pages they touch (merged into ranges), copy as they arrive
            self.filemaps.no_readahead(file, int(starts.min()), int(ends.max()))
            self.reader.prefetch(file, *page_ranges(starts, ends))
        return Way.MAP


def page_ranges(starts: np.ndarray, ends: np.ndarray) -> tuple[list[int], list[int]]:
    """The byte ranges of whole pages that runs ``[starts[i], ends[i])`` (sorted) touch, adjacent pages merged."""
    first = (starts // PAGE).tolist()
    last = ((ends - 1) // PAGE).tolist()
    lo: list[int] = []
    hi: list[int] = []
    for a, b in zip(first, last, strict=True):
        if hi and a <= hi[-1]:
            hi[-1] = max(hi[-1], b + 1)
        else:
            lo.append(a)
            hi.append(b + 1)
    return [x * PAGE for x in lo], [x * PAGE for x in hi]
