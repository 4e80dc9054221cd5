#!/usr/bin/env python
"""Read once per group: ``load_rank(share_reads=True)`` against every rank reading for itself, side by side.

Usage::

    python benchmarks/shared_reads.py [--size-gib 0.25] [--mb-per-s 200] [--repeats 3] [--warmup 1] [--keep DIR]

Four processes under ``torchrun`` (gloo, CPU) load a random Llama-shaped float16 checkpoint as a dp=2 x tp=2 mesh,
from a store throttled to a fixed bandwidth shared by every reader. The throttle is a token bucket kept in a
file under a file lock (``flock``), wrapped around shardload's reader by this script only (``ThrottledReader``,
plugged in where the engine picks readers: ``reader_for`` in ``shardload.engine.routes`` and ``.transfer``): before
a read of ``n`` bytes a process books the next
``n / bandwidth`` seconds of the shared link and sleeps until its booking ends, then reads (from the page cache).
So the four processes together never read faster than ``--mb-per-s``, as through a throttling proxy in front of
an object store. Both ways read exact runs with ``preadv`` (share_reads always does; each rank for itself with
``ReadOptions(strategy="read")``), so every byte passes the throttle.

Measured: time until every rank holds its shard (the slowest rank, from a common start after a barrier), and the
bytes the group read from the store (``count_reads`` summed over the ranks). Targets: time ratio <= 0.6x; shared
bytes = the checkpoint's tensor bytes (1.00x) plus the blocks each rank samples to fingerprint its copy.
``--mb-per-s 0`` reads the page cache unthrottled (time shown, no target: the exchange's cost where storage is
not the bound). Times are the best of ``--repeats`` rounds after ``--warmup`` untimed ones, the two ways
interleaved. The load average is printed too: the machine may be shared.
Exits 1 if a target is missed (it is a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shardload.sources.reader import Reader

MESH = "dp=2,tp=2"
RANKS = 4
TARGET = 0.6


class ThrottledReader(Reader):
    """shardload's reader behind a link of ``rate`` bytes/s shared by every process using the bucket ``path``."""

    def __init__(self, path: str, rate: float) -> None:
        super().__init__()
        self.path = path
        self.rate = rate

    def _book(self, nbytes: int) -> float:
        """Book the link for ``nbytes`` after every earlier booking; return when the booking ends."""
        with open(self.path, "r+b") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                (free,) = struct.unpack("d", fh.read(8))
                start = max(time.monotonic(), free)
                end = start + nbytes / self.rate
                fh.seek(0)
                fh.write(struct.pack("d", end))
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
        return end

    def read_runs(self, path: Any, src: Any, length: Any, buf: Any, dst: Any, buffers: Any, **kw: Any) -> None:
        end = self._book(int(length.sum()))
        delay = end - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        super().read_runs(path, src, length, buf, dst, buffers, **kw)


def reset(bucket: str) -> None:
    """An idle link: no booking pending."""
    with open(bucket, "wb") as fh:
        fh.write(struct.pack("d", 0.0))


def worker(model: str, bucket: str, rate: float, repeats: int, warmup: int) -> None:
    """One rank: load both ways, interleaved; rank 0 prints the best times and the bytes read as one JSON line."""
    import torch
    import torch.distributed as dist

    import shardload
    import shardload.engine.routes as load
    import shardload.engine.transfer as transfer
    from shardload.sources.reader import count_reads

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    exact = shardload.ReadOptions(strategy="read")  # every byte through the (throttled) reader, never a mapping
    if rate > 0:
        throttled = lambda path=None, cost=None: ThrottledReader(bucket, rate)  # noqa: E731
        load.reader_for = transfer.reader_for = throttled  # type: ignore[assignment]  (paths, and plans' files)
    best: dict[str, float] = {}
    nbytes: dict[str, int] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for rep in range(warmup + repeats):
        for mode in ("plain", "shared") if rep % 2 else ("shared", "plain"):
            states.pop(mode, None)
            dist.barrier()
            if rank == 0:
                reset(bucket)
            dist.barrier()
            start = time.monotonic()
            with count_reads() as seen:
                if mode == "shared":
                    state = shardload.load_rank(model, mesh=MESH, group=True)
                else:
                    state = shardload.load_rank(model, mesh=MESH, read_options=exact)
            took = torch.tensor([time.monotonic() - start], dtype=torch.float64)
            read = torch.tensor([seen.bytes], dtype=torch.int64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            dist.all_reduce(read)
            states[mode] = state
            if rep >= warmup:
                best[mode] = min(best.get(mode, float("inf")), float(took))
            nbytes[mode] = int(read)
    same = states["plain"].keys() == states["shared"].keys() and all(
        torch.equal(t.reshape(-1).view(torch.uint8), states["shared"][k].reshape(-1).view(torch.uint8))
        for k, t in states["plain"].items()
    )
    flag = torch.tensor([int(same)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if rank == 0:
        print("RESULT " + json.dumps({"best": best, "bytes": nbytes, "same": bool(flag)}), flush=True)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=0.25)
    parser.add_argument("--mb-per-s", type=float, default=200.0,
                        help="the store's bandwidth, shared (1 MB = 1e6 B); 0: no throttle")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--keep", type=Path, help="keep the checkpoint in this directory (reused when unchanged)")
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "BUCKET", "RATE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], float(args.worker[2]), args.repeats, args.warmup)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from checkpoints import ensure_checkpoint

    from shardload.engine.fingerprint import plan_samples
    from shardload.sources.checkpoint import open_checkpoint

    with tempfile.TemporaryDirectory(prefix="shardload-shared-") as tmp:
        model = args.keep or Path(tmp) / "model"
        ensure_checkpoint(model, args.size_gib, 2)
        stored = sum(t.nbytes for t in open_checkpoint(model).tensors.values())
        sampled = RANKS * plan_samples(open_checkpoint(model).tensors.values()).nbytes  # each rank's fingerprint
        bucket = str(Path(tmp) / "bucket")
        reset(bucket)
        rate = args.mb_per_s * 1e6
        load_before = os.getloadavg()
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
                   __file__, "--worker", str(model), bucket, str(rate),
                   "--repeats", str(args.repeats), "--warmup", str(args.warmup)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        load_after = os.getloadavg()
    if done.returncode != 0:
        print(done.stdout[-4000:] + done.stderr[-4000:], file=sys.stderr)
        return 1
    result = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    plain, shared = result["best"]["plain"], result["best"]["shared"]
    read_plain, read_shared = result["bytes"]["plain"], result["bytes"]["shared"]
    ratio = shared / plain
    rows = [
        ("time until every rank holds its shard (s)", f"{plain:.2f}", f"{shared:.2f}", f"{ratio:.2f}x",
         f"<= {TARGET}x" if args.mb_per_s > 0 else "(shown)", ratio <= TARGET or args.mb_per_s <= 0),
        ("bytes read from the store by the group (MB)", f"{read_plain / 1e6:.0f}", f"{read_shared / 1e6:.0f}",
         f"{read_shared / read_plain:.2f}x", f"shared = checkpoint ({stored / 1e6:.0f} MB) + fingerprints "
         f"({sampled / 1e6:.1f} MB): {read_shared / stored:.3f}x", read_shared == stored + sampled),
    ]  # fmt: skip
    store = (f"store throttled to {args.mb_per_s:g} MB/s shared by all readers (token bucket in a file lock around "
             "the reader)" if args.mb_per_s > 0 else "no throttle (a warm page cache)")  # fmt: skip
    print(f"\nshared reads: {MESH} ({RANKS} processes, gloo, CPU), {stored / 1e6:.0f} MB float16 checkpoint, "
          f"{store}; best of {args.repeats} after {args.warmup} warm-up")  # fmt: skip
    print("| measure | every rank reads for itself | share_reads=True | ratio | target | met |")
    print("|---|---|---|---|---|---|")
    for name, a, b, r, target, ok in rows:
        print(f"| {name} | {a} | {b} | {r} | {target} | {'yes' if ok else 'NO'} |")
    print(f"shards identical both ways: {'yes' if result['same'] else 'NO'}")
    print("load average (1, 5, 15 min): before " + ", ".join(f"{x:.1f}" for x in load_before)
          + "; after " + ", ".join(f"{x:.1f}" for x in load_after) + f" ({os.cpu_count()} cores)")  # fmt: skip
    return 0 if all(row[-1] for row in rows) and result["same"] else 1


if __name__ == "__main__":
    sys.exit(main())
