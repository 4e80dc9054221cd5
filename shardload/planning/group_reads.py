"""Reading once per process group: who of a group reads which stored bytes, and what every rank sends and receives.

Pure: every rank computes the same :class:`GroupReads` from the plan and the members' (stage, tp rank) slots,
without talking to the others. Three byte spaces:

- *file space*: the checkpoint's files laid end to end (in plan order, a one-byte gap between files), so a
  stored byte is one integer;
- *union space*: the bytes any member needs, packed end to end in file order (holes dropped), ``total`` bytes.
  It is cut into chunks of ``chunk`` bytes; round ``k`` holds chunks ``k G .. k G + G - 1`` of a group of ``G``
  members, chunk ``k G + i`` read from storage by member ``i`` (so each stored byte is read by exactly one rank,
  and reading is balanced to within a chunk);
- a member's *need space*: the bytes that member needs, packed in file order (a subsequence of the union).

In round ``k`` member ``i`` sends every member ``m`` the bytes of its chunk that ``m`` needs, in order; ``m``
receives them from members ``0 .. G-1`` in turn, which is the next stretch of its need space. So one
``all_to_all`` per round moves exactly the bytes each rank needs, and a rank maps what it received onto its
tensors with the runs of :meth:`GroupReads.unpack`, computed here once.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..sources.tensor_info import TensorInfo
from .plan import ModelPlan, ParamPlan
from .runs import Runs, param_runs


@dataclass(frozen=True)
class Intervals:
    """Sorted disjoint byte intervals ``[start[i], end[i])`` of a larger space, and where each lands when they are
    packed end to end (``at[i]``, ``total`` bytes in all)."""

    start: np.ndarray
    end: np.ndarray
    at: np.ndarray
    total: int

    @classmethod
    def merged(cls, src: np.ndarray, length: np.ndarray) -> Intervals:
        """The union of byte ranges ``[src[i], src[i] + length[i])`` (any order, overlaps allowed)."""
        keep = length > 0
        src, end = src[keep], (src + length)[keep]
        if not len(src):
            z = np.zeros(0, dtype=np.int64)
            return cls(z, z, z, 0)
        order = np.argsort(src, kind="stable")
        s, e = src[order], end[order]
        reach = np.maximum.accumulate(e)
        heads = np.flatnonzero(np.concatenate(([True], s[1:] > reach[:-1])))
        start, stop = s[heads], np.maximum.reduceat(e, heads)
        sizes = stop - start
        at = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        return cls(start.astype(np.int64), stop.astype(np.int64), at, int(sizes.sum()))

    def pack(self, x: np.ndarray) -> np.ndarray:
        """Packed positions of outer positions ``x``, each inside (or at the end of) an interval."""
        i = np.searchsorted(self.start, x, side="right") - 1
        return self.at[i] + (x - self.start[i])

    def count_before(self, x: np.ndarray) -> np.ndarray:
        """How many interval bytes lie before each outer position ``x`` (the packed position of ``x``, clamped)."""
        if not len(self.start):
            return np.zeros(len(x), dtype=np.int64)
        i = np.searchsorted(self.start, x, side="right") - 1
        inside = np.clip(x - self.start[np.maximum(i, 0)], 0, (self.end - self.start)[np.maximum(i, 0)])
        return np.where(i < 0, 0, self.at[np.maximum(i, 0)] + inside)

    def clip(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """The parts of the intervals inside outer range ``[lo, hi)``: their outer starts and lengths."""
        a = int(np.searchsorted(self.end, lo, side="right"))
        b = int(np.searchsorted(self.start, hi, side="left"))
        start = np.maximum(self.start[a:b], lo)
        end = np.minimum(self.end[a:b], hi)
        keep = end > start
        return start[keep], (end - start)[keep]

    def digest(self) -> bytes:
        """A hash of the intervals (equal on ranks that computed the same ones)."""
        return hashlib.sha256(self.start.tobytes() + self.end.tobytes()).digest()


@dataclass(frozen=True)
class Needs:
    """What one (stage, tp rank) slot builds: ``params`` in order, which of them are read whole (a compute step:
    the stored tensor is gathered, then the steps run), and the runs from file space into their buffers
    (``buf`` = index into ``params``; ``dst`` = byte in the rank tensor, or in the whole stored tensor)."""

    params: tuple[ParamPlan, ...]
    whole: tuple[bool, ...]
    runs: Runs


def file_bases(params: Iterable[ParamPlan]) -> dict[Path, int]:
    """Where each checkpoint file starts in file space: files in the order ``params`` first name them, each as
    long as its last tensor byte, one byte apart (so no interval ever spans two files)."""
    ends: dict[Path, int] = {}
    for p in params:
        ends[p.source.file] = max(ends.get(p.source.file, 0), p.source.offset + p.source.nbytes)
    bases, at = {}, 0
    for path, end in ends.items():
        bases[path] = at
        at += end + 1
    return bases


def slot_needs(params: Sequence[ParamPlan], tp: int, bases: dict[Path, int]) -> Needs:
    """The runs tp rank ``tp`` needs for ``params`` (a stage's parameters), in file space, sorted by offset."""
    parts: list[Runs] = []
    whole: list[bool] = []
    for k, p in enumerate(params):
        base = bases[p.source.file]
        runs = param_runs(p, [tp])
        whole.append(runs is None)
        if runs is None:  # a compute step (or too many runs to list): the whole stored tensor, then the steps
            n = p.source.nbytes
            one = np.array([base + p.source.offset], dtype=np.int64)
            runs = Runs(one, np.array([n], dtype=np.int64), np.array([k], dtype=np.int64), np.zeros(1, dtype=np.int64))
            parts.append(runs.take(runs.length > 0))
        else:
            parts.append(Runs(runs.src + base, runs.length, runs.buf * 0 + k, runs.dst))
    if not parts:
        z = np.zeros(0, dtype=np.int64)
        return Needs((), (), Runs(z, z, z, z))
    runs = Runs(
        np.concatenate([r.src for r in parts]),
        np.concatenate([r.length for r in parts]),
        np.concatenate([r.buf for r in parts]),
        np.concatenate([r.dst for r in parts]),
    )
    return Needs(tuple(params), tuple(whole), runs.take(np.argsort(runs.src, kind="stable")))


@dataclass(frozen=True)
class GroupReads:
    """The reading and exchange schedule of a group of ``len(members)`` ranks (see the module docstring).

    ``members[i]`` is member ``i``'s slot key; ``needs[key]`` what that slot builds. ``union`` holds the bytes any
    member needs (file space); ``own[key]`` a slot's need space as intervals of the union space.
    """

    members: tuple[tuple[int, int], ...]
    needs: dict[tuple[int, int], Needs]
    union: Intervals
    own: dict[tuple[int, int], Intervals]
    chunk: int

    @classmethod
    def build(cls, members: Sequence[tuple[int, int]], needs: dict[tuple[int, int], Needs], chunk: int) -> GroupReads:
        """Plan a group whose member ``i`` holds slot ``members[i]``, reading chunks of ``chunk`` bytes."""
        if chunk < 1:
            raise ValueError("chunk must be positive")
        keys = sorted(set(members))
        src = np.concatenate([needs[k].runs.src for k in keys] or [np.zeros(0, dtype=np.int64)])
        length = np.concatenate([needs[k].runs.length for k in keys] or [np.zeros(0, dtype=np.int64)])
        union = Intervals.merged(src, length)
        own = {}
        for k in keys:
            mine = Intervals.merged(needs[k].runs.src, needs[k].runs.length)
            start = union.pack(mine.start) if len(mine.start) else mine.start
            own[k] = Intervals(start, start + (mine.end - mine.start), mine.at, mine.total)
        return cls(tuple(members), {k: needs[k] for k in keys}, union, own, chunk)

    def with_chunk(self, chunk: int) -> GroupReads:
        """The same group reading chunks of ``chunk`` bytes."""
        if chunk < 1:
            raise ValueError("chunk must be positive")
        return GroupReads(self.members, self.needs, self.union, self.own, chunk)

    @property
    def size(self) -> int:
        """Members in the group."""
        return len(self.members)

    @property
    def rounds(self) -> int:
        """Exchange rounds: each member reads at most one chunk per round."""
        return -(-self.union.total // (self.chunk * self.size))

    def chunk_range(self, round_: int, member: int) -> tuple[int, int]:
        """The union-space range member ``member`` reads in round ``round_`` (empty past the end)."""
        c = round_ * self.size + member
        lo = min(c * self.chunk, self.union.total)
        return lo, min(lo + self.chunk, self.union.total)

    def reads(self, round_: int, member: int, bases: dict[Path, int]) -> list[tuple[Path, Runs]]:
        """What member ``member`` reads from storage in round ``round_``: per file, runs (file offset, length,
        buffer 0, byte of the chunk buffer), sorted by file offset."""
        lo, hi = self.chunk_range(round_, member)
        if hi <= lo:
            return []
        u = self.union
        a = int(np.searchsorted(u.at + (u.end - u.start), lo, side="right"))
        b = int(np.searchsorted(u.at, hi, side="left"))
        at = u.at[a:b]
        first = np.maximum(at, lo)
        last = np.minimum(at + (u.end[a:b] - u.start[a:b]), hi)
        src = u.start[a:b] + (first - at)
        length = last - first
        dst = first - lo
        starts = np.array(list(bases.values()), dtype=np.int64)
        paths = list(bases)
        file = np.searchsorted(starts, src, side="right") - 1
        out = []
        for f in np.unique(file).tolist():
            sel = file == f
            n = int(sel.sum())
            out.append((paths[f], Runs(src[sel] - starts[f], length[sel], np.zeros(n, dtype=np.int64), dst[sel])))
        return out

    def splits(self, round_: int, key: tuple[int, int]) -> list[int]:
        """Bytes slot ``key`` receives from each member in round ``round_`` (the output splits of its exchange)."""
        bounds = [self.chunk_range(round_, i)[0] for i in range(self.size)] + [self.chunk_range(round_, self.size)[0]]
        counts = self.own[key].count_before(np.array(bounds, dtype=np.int64))
        return np.diff(counts).tolist()

    def pack(self, round_: int, member: int) -> tuple[list[int], Runs]:
        """What member ``member`` sends in round ``round_``: bytes per receiver (the input splits), and runs
        copying them from its chunk buffer (``src``: byte of the chunk) into the send buffer (``dst``), receiver
        after receiver."""
        lo, hi = self.chunk_range(round_, member)
        sizes: list[int] = []
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        for key in self.members:
            start, length = self.own[key].clip(lo, hi)
            sizes.append(int(length.sum()))
            parts.append((start - lo, length))
        src = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
        length = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
        dst = np.concatenate(([0], np.cumsum(length)[:-1])).astype(np.int64) if len(length) else length
        return sizes, Runs(src, length, np.zeros(len(src), dtype=np.int64), dst)

    def receive_bounds(self, key: tuple[int, int]) -> list[int]:
        """Where each round's received bytes start in slot ``key``'s need space (``rounds + 1`` bounds)."""
        starts = [self.chunk_range(k, 0)[0] for k in range(self.rounds)] + [self.union.total]
        return self.own[key].count_before(np.array(starts, dtype=np.int64)).tolist()

    def unpack(self, key: tuple[int, int]) -> list[Runs]:
        """Per round, runs copying slot ``key``'s received bytes (``src``: byte of that round's receive buffer)
        into its buffers (``buf``, ``dst``): a slot's runs moved into its need space and cut at round bounds."""
        runs = self.needs[key].runs
        own = self.own[key]
        pos = own.pack(self.union.pack(runs.src)) if len(runs) else runs.src
        bounds = self.receive_bounds(key)
        return cut(Runs(pos, runs.length, runs.buf, runs.dst), bounds)

    def last_round(self, key: tuple[int, int]) -> list[int]:
        """Per parameter of slot ``key``, the round in which its last byte arrives (-1: it needs no bytes)."""
        needs = self.needs[key]
        runs = needs.runs
        last = np.full(len(needs.params), -1, dtype=np.int64)
        if len(runs):
            end = self.own[key].pack(self.union.pack(runs.src)) + runs.length - 1
            rnd = np.searchsorted(np.array(self.receive_bounds(key)[1:]), end, side="right")
            np.maximum.at(last, runs.buf, rnd)
        return last.tolist()

    def digest(self) -> bytes:
        """A hash of the whole schedule: equal on every rank that planned the same checkpoint, plan and group."""
        h = hashlib.sha256()
        h.update(repr((self.members, self.chunk, self.union.total)).encode())
        h.update(self.union.digest())
        for key in sorted(self.own):
            h.update(repr(key).encode() + self.own[key].digest())
        return h.digest()


def choose_chunk(total: int, size: int, most: int, rounds: int, least: int) -> int:
    """Chunk bytes for a group of ``size`` reading ``total`` bytes: at most ``most`` (the memory bound), small enough
    for at least ``rounds`` rounds (the last round's exchange is the part that no read overlaps), at least
    ``least`` (each round costs a collective's latency) unless ``most`` is smaller; a multiple of ``least``'s
    alignment (4 KiB)."""
    want = -(-total // (size * rounds))
    chunk = min(most, max(least, want))
    return max(4096, chunk // 4096 * 4096)


def cut(runs: Runs, bounds: Sequence[int]) -> list[Runs]:
    """Runs whose ``src`` is a position in a stream, cut at ``bounds`` (sorted, ``len(bounds) - 1`` parts); each
    part's ``src`` made relative to its start and sorted by it."""
    out = []
    order = np.argsort(runs.src, kind="stable")
    runs = runs.take(order)
    end = runs.src + runs.length
    for lo, hi in itertools.pairwise(bounds):
        a = int(np.searchsorted(end, lo, side="right"))
        b = int(np.searchsorted(runs.src, hi, side="left"))
        part = runs.take(slice(a, b))
        s = np.maximum(part.src, lo)
        e = np.minimum(part.src + part.length, hi)
        keep = e > s
        out.append(Runs(s[keep] - lo, (e - s)[keep], part.buf[keep], (part.dst + (s - part.src))[keep]))
    return out


def plan_digest(plan: ModelPlan, stages: Sequence[ModelPlan]) -> bytes:
    """A hash of what a rank planned before it knows the others: files, parameters, steps and stages. Ranks that
    load different checkpoints or shard_infos get different digests."""
    h = hashlib.sha256(repr((plan.num_shards, len(stages))).encode())
    root = str(plan.checkpoint.root) if plan.checkpoint is not None else ""
    for p in plan.params.values():
        s = p.source
        file = str(s.file)  # relative to the model's root: nodes may hold the same model at other paths
        file = file[len(root) :] if root and file.startswith(root) else file
        steps = tuple((st.name, repr(st.args), st.out_shape, st.out_dtype) for st in p.steps)
        h.update(repr((p.name, file, s.offset, s.nbytes, s.shape, s.dtype, s.decode, steps, p.shape)).encode())
    for k, stage in enumerate(stages):
        h.update(repr((k, tuple(stage.params))).encode())
    return h.digest()


def whole_tensors(infos: Iterable[TensorInfo]) -> list[ParamPlan]:
    """Plans that read stored tensors whole, as they are (a converted directory's rank file): rank 0 of 1 each."""
    return [ParamPlan(t.name, t, (), 1, t.shape, t.logical_dtype) for t in infos]


@dataclass(frozen=True)
class StridedCopies:
    """Strided copies that apply many runs at once: copy ``k`` moves ``count[k]`` rows of ``length[k]`` bytes from
    byte ``src[k] + i * src_step[k]`` to byte ``dst[k] + i * dst_step[k]`` of buffer ``buf[k]``."""

    src: np.ndarray
    src_step: np.ndarray
    dst: np.ndarray
    dst_step: np.ndarray
    buf: np.ndarray
    length: np.ndarray
    count: np.ndarray

    def __len__(self) -> int:
        return len(self.src)


def strided(runs: Runs) -> StridedCopies:
    """Group consecutive runs of one buffer and one length whose source and destination advance by fixed steps
    (the rows of a column slice) into one strided copy each; any other run is a copy of its own."""
    n = len(runs)
    first: list[int] = []
    count: list[int] = []
    if n > 1:
        ds, dd = np.diff(runs.src), np.diff(runs.dst)
        ok = (runs.buf[1:] == runs.buf[:-1]) & (runs.length[1:] == runs.length[:-1]) & (ds >= 0) & (dd > 0)
        # pair p (runs p and p + 1) may share a copy: same buffer and length, steps forward (a strided view)
        cont = ok.copy()
        cont[1:] &= ok[:-1] & (ds[1:] == ds[:-1]) & (dd[1:] == dd[:-1])  # pair p continues pair p - 1's steps
        starts = np.flatnonzero(ok & ~np.concatenate(([False], cont[1:])))
        stops = np.flatnonzero(~cont[1:]) + 1  # pairs that start no continuation: a chain ends before them
        ends = np.searchsorted(stops, starts, side="right")
        stops = np.concatenate((stops, [n - 1]))  # past the last pair
        last = stops[ends] - 1
        taken = -1
        for p, q in zip(starts.tolist(), last.tolist(), strict=True):  # one per chain of equal steps: few
            if p <= taken:
                p += 1  # its first run closed the previous chain
            for r in range(taken + 1, p):
                first.append(r)
                count.append(1)
            first.append(p)
            count.append(q + 2 - p)
            taken = q + 1
        for r in range(taken + 1, n):
            first.append(r)
            count.append(1)
    elif n == 1:
        first, count = [0], [1]
    f = np.array(first, dtype=np.int64)
    c = np.array(count, dtype=np.int64)
    nxt = np.minimum(f + 1, max(n - 1, 0))
    src_step = np.where(c > 1, runs.src[nxt] - runs.src[f], 0) if n else f
    dst_step = np.where(c > 1, runs.dst[nxt] - runs.dst[f], 0) if n else f
    return StridedCopies(runs.src[f], src_step, runs.dst[f], dst_step, runs.buf[f], runs.length[f], c)
