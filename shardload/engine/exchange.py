"""Loading one rank's shard with the reading shared across a torch.distributed group (``load_rank(share_reads=)``).

The ranks first exchange their (stage, tp rank) and a digest of their plan (a rank that planned another
checkpoint or shard_info is refused before any byte moves), then compare fingerprints of their copies of the files
(:mod:`~shardload.engine.fingerprint`: ranks whose headers agree but whose bytes differ, two fine-tunes of one
base, are refused too); then each computes the same :class:`~shardload.planning.group_reads.GroupReads`. Per round
every rank reads one chunk of the bytes the group needs (each stored byte read by exactly one rank), copies out what
each member needs, and one ``all_to_all_single`` delivers it; the rank copies what it received into its tensors. A
thread reads round ``k + 1``'s chunk while round ``k`` is exchanged. Every collective is waited on with
:data:`EXCHANGE_TIMEOUT`, so a rank that dies or hangs makes the others fail with one line instead of waiting
forever.
"""

from __future__ import annotations

import datetime
import hashlib
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from ..errors import ShardloadError
from ..format import input_log
from ..planning.group_reads import GroupReads, choose_chunk, file_bases, slot_needs, strided
from ..sources.dtypes import to_torch
from ..sources.reader import PAGE
from . import fingerprint as fp
from .steps import run_steps
from .transfer import fill_padding

if TYPE_CHECKING:
    import torch

    from ..planning.group_reads import StridedCopies
    from ..planning.plan import ParamPlan
    from ..sources.reader import RunReader

EXCHANGE_BYTES = 256 << 20
"""Bytes of exchange buffers per rank, at most: two chunk buffers (one being read, one being sent) plus a send
and a receive buffer of up to one chunk per member, so a group of ``G`` ranks reads chunks of at most
``EXCHANGE_BYTES / (2 G + 2)`` bytes (25.6 MiB for 4 ranks, 1.9 MiB for 64; smaller for a small model, see
:data:`MIN_ROUNDS`). The rank's own tensors come on top."""
MIN_ROUNDS = 8
"""Chunks are made small enough for at least this many rounds (down to :data:`MIN_CHUNK`): the last round's exchange
is the one no read overlaps, so on a small model smaller chunks finish sooner."""
MIN_CHUNK = 1 << 20
"""Chunks are at least this many bytes (unless the memory bound says less): every round costs a collective."""
EXCHANGE_TIMEOUT = 300.0
"""Seconds a rank waits for one collective of the exchange before it fails with a :class:`ShardloadError` (a rank
that died is usually noticed at once: its connections close). A round waits for the slowest rank's read of one
chunk, so this only has to exceed that (and the planning of the slowest rank, for the first collective)."""


_JOINED: ContextVar[bool] = ContextVar("shardload_exchange_joined", default=False)
"""Whether this rank's load has come to the group's first collective (:func:`load_shared`)."""
_FAILED_ROW = -1
"""The slot a rank whose load failed before the exchange sends in the first collective."""


@contextmanager
def failing_together(group: Any, device: Any, where: str) -> Iterator[None]:
    """A load with ``group`` (None: none): a failure of this rank before it comes to the group's exchange (its model,
    its plan or its record) is told the others in the exchange's first collective, so that they fail at once with it
    rather than wait out :data:`EXCHANGE_TIMEOUT`; then it is raised here."""
    if group is None or group is False:
        yield
        return
    token = _JOINED.set(False)
    try:
        yield
    except Exception:
        if not _JOINED.get():
            _tell_failure(group, device, where)
        raise
    finally:
        _JOINED.reset(token)


def _tell_failure(group: Any, device: Any, where: str) -> None:
    """Come to the exchange's first collective as a rank that failed (what goes wrong here is dropped: this rank's
    own error is the one raised); ``device`` as the caller gave it (the CPU where it names none)."""
    import torch
    import torch.distributed as dist

    try:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank(None if group is True else group) < 0:
            return
        group = None if group is True else group
        try:
            device = device if isinstance(device, torch.device) else torch.device(device)
        except Exception:
            device = torch.device("cpu")
        comm = _comm_device(group, device)
        mine = torch.full((2 + hashlib.sha256().digest_size,), _FAILED_ROW, dtype=torch.int64, device=comm)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        _wait(dist.all_gather(rows, mine, group=group, async_op=True), comm, "while the ranks compared their plans",
              where)  # fmt: skip
    except Exception:
        pass


def load_shared(
    slot_params: Callable[[tuple[int, int]], tuple[Sequence[ParamPlan], int]],
    digest: bytes,
    slot: tuple[int, int],
    device: torch.device,
    reader: RunReader,
    group: Any = None,
    progress: Callable[[int, int], None] | None = None,
    where: str = "",
    check: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's tensors, the reading shared with the ranks of ``group`` (None: the default process group), each
    of which calls this with its own ``slot`` (stage, tp rank); ``check`` (what the peers sent, against the
    integrity record) runs on them before the ranks agree, so that its failure fails every rank.

    ``slot_params(slot)`` gives the parameter plans a slot builds and the rank of those plans it takes (the same on
    every rank, computed without I/O beyond headers); ``digest`` hashes what this rank planned, so that ranks
    that planned differently are refused before any byte moves.
    """
    import torch
    import torch.distributed as dist

    log = input_log.current()
    if log is not None and log.agreeing:  # every rank refuses here, before any collective: none waits on another
        raise ShardloadError("a load with group= inside same_checkpoint: its ranks already compare what they read "
                             "(fingerprints); load without same_checkpoint", file=where)  # fmt: skip
    size, me = dist.get_world_size(group), dist.get_rank(group)
    comm = _comm_device(group, device)
    most = max(PAGE, EXCHANGE_BYTES // (2 * size + 2) // PAGE * PAGE)
    settings = (size, most, MIN_ROUNDS, MIN_CHUNK, fp.SAMPLES_PER_FILE, fp.SAMPLE_BYTES)
    digest = hashlib.sha256(digest + repr(settings).encode()).digest()
    mine = torch.tensor([slot[0], slot[1], *digest], dtype=torch.int64, device=comm)
    rows = [torch.empty_like(mine) for _ in range(size)]
    _JOINED.set(True)  # from here on, a failure of this rank is told the others by the exchange itself
    _wait(dist.all_gather(rows, mine, group=group, async_op=True), comm, "while the ranks compared their plans", where)
    table = [row.tolist() for row in rows]
    gone = [i for i, row in enumerate(table) if row[0] == _FAILED_ROW]
    if gone:
        raise ShardloadError(f"shared reads: rank {_global(group, gone)[0]} failed before the group's reads began "
                             "(its own error says why); nothing was returned", file=where)  # fmt: skip
    for i, row in enumerate(table):
        if row[2:] != table[0][2:]:
            ranks = _global(group, [0, i])
            raise ShardloadError(
                f"rank {ranks[1]} planned a different checkpoint, shard_info or mesh than rank {ranks[0]} (their plan "
                "digests differ): every rank sharing reads must load the same model the same way",
                file=where,
            )
    members = [(int(row[0]), int(row[1])) for row in table]
    keys = sorted(set(members))
    failed: BaseException | None = None
    try:  # headers only: a rank that fails here (a rank file its copy lacks) tells the others at the next collective
        plans = {key: slot_params(key) for key in keys}
        bases = file_bases([p for key in keys for p in plans[key][0]])
        needs = {key: slot_needs(plans[key][0], plans[key][1], bases) for key in keys}
        schedule = GroupReads.build(members, needs, most)
        chunk = choose_chunk(schedule.union.total, size, most, MIN_ROUNDS, MIN_CHUNK)
        schedule = schedule.with_chunk(chunk)
    except Exception as err:
        failed = err
    _agree_no_failure(failed, group, comm, where, "planned the group's reads")
    if size > 1:
        samples = fp.plan_samples(p.source for key in keys for p in plans[key][0])
        _agree_on_content(samples, reader, group, comm, where)
    own = needs[slot]
    taken = plans[slot][1]  # the rank of the slot's plans this rank takes
    pin = comm.type == "cuda"
    dests: list[torch.Tensor] = []
    try:  # the rank's tensors and chunk buffers (a device out of memory on one rank): told before the first round
        for p, whole in zip(own.params, own.whole, strict=True):
            if whole:  # the stored tensor, gathered on the CPU; the steps run once its last byte is in
                dests.append(torch.empty(p.source.shape, dtype=to_torch(p.source.dtype)))
            else:
                dests.append(torch.empty(p.shape, dtype=to_torch(p.dtype), device=device))
                fill_padding(p, taken, dests[-1])  # zeros no stored byte maps to (a padded vocabulary)
        buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
    except Exception as err:
        failed = err
    _agree_no_failure(failed, group, comm, where, "made its tensors and buffers")
    flat = [t.reshape(-1).view(torch.uint8) for t in dests]
    result: dict[str, torch.Tensor] = {p.name: t for p, t in zip(own.params, dests, strict=True)}
    last = schedule.last_round(slot)
    finish: list[list[int]] = [[] for _ in range(schedule.rounds + 1)]  # compute-step parameters done after round
    for k, r in enumerate(last):
        if own.whole[k]:
            finish[r + 1].append(k)

    def complete(done: list[int]) -> None:
        for k in done:
            p = own.params[k]
            part = run_steps(p, dests[k])[taken]
            result[p.name] = part.to(device, copy=True, memory_format=torch.contiguous_format)
            dests[k] = flat[k] = torch.empty(0, dtype=torch.uint8)  # the whole stored tensor is no longer needed

    unpack = schedule.unpack(slot)
    send_host = torch.empty(0, dtype=torch.uint8, pin_memory=pin)
    recv = torch.empty(0, dtype=torch.uint8, device=comm)

    def read(k: int) -> None:
        for path, runs in schedule.reads(k, me, bases):
            reader.read_runs(path, runs.src, runs.length, runs.buf, runs.dst, [buffers[k % 2]])

    # A rank whose own work fails (a read, a step) keeps exchanging, its buffers unread, so that no rank waits on it;
    # the agreement after the last round then fails every rank, and none returns what it received.
    try:
        complete(finish[0])
    except Exception as err:
        failed = err
    with ThreadPoolExecutor(1, thread_name_prefix="shardload-exchange") as pool:
        pending: Future[None] | None = pool.submit(read, 0) if schedule.rounds and failed is None else None
        for k in range(schedule.rounds):
            sizes, pack = schedule.pack(k, me)
            total = sum(sizes)
            if send_host.numel() < total:
                send_host = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
            if failed is None:
                try:
                    assert pending is not None
                    pending.result()
                    pending = pool.submit(read, k + 1) if k + 1 < schedule.rounds else None
                    _copy(buffers[k % 2], strided(pack), [send_host])
                except Exception as err:
                    failed, pending = err, None
            send = send_host[:total].to(comm) if pin else send_host[:total]
            splits = schedule.splits(k, slot)
            if recv.numel() < sum(splits):
                recv = torch.empty(sum(splits), dtype=torch.uint8, device=comm)
            got = recv[: sum(splits)]
            work = dist.all_to_all_single(got, send, splits, sizes, group=group, async_op=True)
            _wait(work, comm, f"in exchange round {k + 1} of {schedule.rounds}", where)
            if failed is None:
                try:
                    _copy(got, strided(unpack[k]), flat)
                    complete(finish[k + 1])
                except Exception as err:
                    failed = err
            if progress is not None and failed is None:
                try:
                    progress(k + 1, schedule.rounds)
                except Exception as err:  # the caller's callback: its failure is this rank's, told at the end
                    failed = err
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if check is not None and failed is None:
        try:
            check(result)
        except Exception as err:
            failed = err
    _agree_unchanged(bases, group, comm, where, failed)
    return result


_FAILED, _CHANGED = 1, 2
"""What a rank tells the others after the last round: its own work failed, or a file it read changed."""


def _agree_unchanged(
    files: Iterable[Any], group: Any, comm: torch.device, where: str, failed: BaseException | None = None
) -> None:
    """After the last round: this rank's work did not fail (``failed``), and every file it planned from is still the
    one whose header it parsed. When either is not so on any rank, every rank fails, since the others received
    bytes from it."""
    state = 0 if failed is None else _FAILED
    if failed is None:
        try:
            input_log.check_unchanged(files, input_log.current())
        except ShardloadError as err:
            failed, state = err, _CHANGED
    states = _gather_flags(state, group, comm, where, "while the ranks checked their files")
    if failed is not None:
        raise failed
    for i, flag in enumerate(states):
        if flag:
            rank = _global(group, [i])[0]
            if flag == _CHANGED:
                raise ShardloadError(f"shared reads: rank {rank} read a file that changed during the exchange (its own "
                                     "error names it); nothing was returned", file=where)  # fmt: skip
            raise ShardloadError(f"shared reads: rank {rank} failed during the exchange (its own error says why); "
                                 "nothing was returned", file=where)  # fmt: skip


def _agree_no_failure(failed: BaseException | None, group: Any, comm: torch.device, where: str, done: str) -> None:
    """Every rank tells whether it failed while it ``done`` (``"planned the group's reads"``); a rank that did
    raises its own error, the others one line."""
    states = _gather_flags(_FAILED if failed is not None else 0, group, comm, where, f"after the ranks {done}")
    if failed is not None:
        raise failed
    flagged = [i for i, flag in enumerate(states) if flag]
    if flagged:
        raise ShardloadError(f"shared reads: rank {_global(group, flagged[:1])[0]} failed while it {done} (its own "
                             "error says why); nothing was exchanged", file=where)  # fmt: skip


def _gather_flags(state: int, group: Any, comm: torch.device, where: str, what: str) -> list[int]:
    """Every rank's ``state`` (this rank's alone in a group of one)."""
    import torch
    import torch.distributed as dist

    if dist.get_world_size(group) == 1:
        return [state]
    flag = torch.tensor([state], dtype=torch.int64).to(comm)
    flags = [torch.empty_like(flag) for _ in range(dist.get_world_size(group))]
    _wait(dist.all_gather(flags, flag, group=group, async_op=True), comm, what, where)
    return [int(f.item()) for f in flags]


def _agree_on_content(samples: fp.SamplePlan, reader: RunReader, group: Any, comm: torch.device, where: str) -> None:
    """Fingerprint this rank's copy of every file the group reads and compare it with the group's first rank's;
    when a rank's copy differs, or a rank could not read its own, every rank fails with one line before any byte
    is exchanged."""
    import torch
    import torch.distributed as dist

    failed: Exception | None = None
    try:
        mine = fp.fingerprint(samples, reader)
    except Exception as err:  # still take part, so that the others fail at once rather than time out
        failed, mine = err, []
    raw = fp.encode(mine) if failed is None else bytes(len(samples.files) * fp.row_bytes())
    table = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(comm) if raw else torch.empty(0, dtype=torch.uint8)
    if table.numel():
        work = dist.broadcast(table, src=_global(group, [0])[0], group=group, async_op=True)
        _wait(work, comm, "while the ranks compared their files' fingerprints", where)
    diff = None
    if failed is None and dist.get_rank(group) > 0:
        try:
            diff = fp.first_difference(mine, fp.decode(bytes(table.cpu().numpy())))
        except Exception as err:  # told as this rank's failure, as an unreadable copy is
            failed = err
    if failed is not None:
        verdict = fp.Difference(-1, fp.UNREADABLE)
    else:
        verdict = diff or fp.Difference(-1, 0)
    row = torch.tensor([verdict.file, verdict.kind, verdict.slot], dtype=torch.int64).to(comm)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    _wait(dist.all_gather(rows, row, group=group, async_op=True), comm, "while the ranks compared their files", where)
    verdicts = [fp.Difference(*r.tolist()) for r in rows]
    unreadable = [i for i, v in enumerate(verdicts) if v.kind == fp.UNREADABLE]
    if failed is not None:
        raise failed
    if unreadable:
        raise ShardloadError(
            f"shared reads refused: rank {_global(group, unreadable[:1])[0]} could not fingerprint its copy of the "
            "checkpoint (its own error says why: a file it cannot read, or bytes its integrity record refuses); "
            "nothing was exchanged",
            file=where,
        )
    for i, v in enumerate(verdicts):
        if v.kind != 0:
            rank, reference = _global(group, [i, 0])
            if not fp.well_formed(samples, v):
                raise ShardloadError(
                    f"shared reads refused: rank {rank} reported a difference this rank cannot place ({v}): do all "
                    "ranks run the same shardload?",
                    file=where,
                )
            raise fp.describe(samples, v, rank, reference)


def _copy(src: torch.Tensor, copies: StridedCopies, dests: Sequence[torch.Tensor]) -> None:
    """Apply strided copies from the byte tensor ``src`` into the byte tensors ``dests``."""
    import torch

    rows = zip(
        copies.src.tolist(), copies.src_step.tolist(), copies.dst.tolist(), copies.dst_step.tolist(),
        copies.buf.tolist(), copies.length.tolist(), copies.count.tolist(), strict=True,
    )  # fmt: skip
    for s, s_step, d, d_step, b, n, count in rows:
        out = dests[b]
        if count == 1:
            out[d : d + n].copy_(src[s : s + n])
            continue
        a = torch.as_strided(src, (count, n), (s_step, 1), src.storage_offset() + s)
        z = torch.as_strided(out, (count, n), (d_step, 1), out.storage_offset() + d)
        z.copy_(a)


def _comm_device(group: Any, device: torch.device) -> torch.device:
    """Where the exchange's tensors live: the rank's CUDA device under NCCL, else the CPU (gloo)."""
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend:
        return torch.device("cpu")
    if device.type == "cuda":
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    if "gloo" in backend:  # a CPU load on a mixed group: gloo carries CPU tensors
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*")


def _wait(work: Any, comm: torch.device, what: str, where: str = "") -> None:
    """Wait for one collective, at most :data:`EXCHANGE_TIMEOUT` seconds; any failure is one ShardloadError line
    (located at ``where``, the model)."""
    timeout = EXCHANGE_TIMEOUT
    try:
        if comm.type == "cuda":  # NCCL work completes on the device: poll it, so a dead peer cannot hang us
            deadline = time.monotonic() + timeout
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError
                time.sleep(0.001)
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout))
    except (RuntimeError, TimeoutError) as err:
        reason = _SOURCE_PREFIX.sub("", str(err).strip().splitlines()[0] if str(err).strip() else "")
        if isinstance(err, TimeoutError) or "timed out" in reason.lower():
            raise ShardloadError(
                f"shared reads: no answer from the group within {timeout:g} s {what}: "
                "another rank died, hangs or is not calling load_rank(group=...)",
                file=where or None,
            ) from None
        reason = reason.split(". ")[0][:160]
        raise ShardloadError(
            f"shared reads: the exchange failed {what}: another rank of the group died or failed ({reason})",
            file=where or None,
        ) from None


def _global(group: Any, ranks: list[int]) -> list[int]:
    """Global ranks of group ranks ``ranks``."""
    import torch.distributed as dist

    if group is None:
        return ranks
    return [dist.get_global_rank(group, r) for r in ranks]
