#!/usr/bin/env python
"""Cold reads planned as I/O (issue 30, first bullet; issue 27's cold time target), side by side in one run.

On the ~1 GiB Llama-shaped float16 checkpoint of ``benchmarks/checkpoints.py``, rank 3 of 8, each figure from a
fresh process after ``posix_fadvise(DONTNEED)`` of the file, the kinds interleaved round by round, medians of
``--repeats``:

- ``seq``: the whole file read sequentially in 16 MiB reads: the cold sequential speed of this run.
- ``plan``: ``load_rank`` with the default ``ReadOptions`` (planned reads, 5% budget over the page floor).
- ``plan-unbounded``: ``ReadOptions(max_waste=inf)``: every gap the I/O model says is cheaper to read is read.
- ``verify``: ``load_rank(verify=True)`` with the default options (the checking reader's planned tile reads).
- ``pages``: the rank's page floor itself (every page holding a byte of it, touching pages merged into ranges,
  ranges cut at 2 MiB), every range requested up front (``WILLNEED``, as planned loads do) and read with
  ``preadv`` by ``PAGE_THREADS`` threads into throwaway buffers, nothing copied out: a reference for what this
  device takes for exactly those bytes in that pattern (a loader may still beat it by merging short gaps into
  fewer requests within its budget). Where the floor is many short ranges (a column split's pages), the device
  is bound by requests, not bytes, and this is slower than the page floor over the sequential speed.

Rows: bytes from storage (``/proc/self/io`` read_bytes) against the page floor (the pages holding the rank's bytes;
target <= 1.05x); seconds against the storage floor (bytes moved / the sequential speed; target <= 1.2x); the
reader count (bytes delivered vs the rank's bytes; target 1.00x) and the bytes the readers say they moved against
what the kernel read; verify against plan (target <= 1.15x). CPU seconds of all threads beside the wall times.

Run: ``PYTHONPATH=$PWD python benchmarks/cold_io.py [--work DIR] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoints import MODEL_FILE, covering_chunks, drop, ensure_checkpoint, read_io

RANK, N = 3, 8
KINDS = ("seq", "plan", "plan-unbounded", "verify", "pages")
PAGE_THREADS = 16
"""Threads reading the page floor in the ``pages`` kind (more than this no longer raised 4 KiB reads per second on
the development VM's disk: about 62,000 at 8 threads, 69,000 at 16, 63,000 at 32)."""


def child(model: str, kind: str) -> None:
    """One cold figure in this fresh process: seconds, CPU seconds, bytes from storage, bytes used and moved."""
    import shardload
    import shardload.planning.runs
    from shardload.sources.reader import count_reads

    shardload.plan_model(model, N)  # not timed: imports and planning are the same for every kind
    path = Path(model) / MODEL_FILE
    ranges = floor_ranges(Path(model)) if kind == "pages" else []  # not timed either
    drop(path)
    gc.collect()  # the full collection torch's import owes falls here, not inside the clock of one kind
    before = read_io()
    c0, t0 = time.process_time(), time.perf_counter()
    used = moved = 0
    if kind == "pages":
        read_ranges(path, ranges)
    elif kind == "seq":
        buf = bytearray(16 << 20)
        fd = os.open(path, os.O_RDONLY)
        at = 0
        while got := os.preadv(fd, [buf], at):
            at += got
        os.close(fd)
    else:
        options = shardload.ReadOptions(max_waste=float("inf") if kind == "plan-unbounded" else 0.05)
        with count_reads() as seen:
            shardload.load_rank(model, RANK, N, verify=kind == "verify", read_options=options)
        used, moved = seen.bytes, seen.moved
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps({"seconds": elapsed, "cpu": cpu, "read_bytes": read_io() - before, "used": used, "moved": moved}))


def read_ranges(path: Path, ranges: list[tuple[int, int]]) -> None:
    """Read byte ranges ``[a, b)`` (at most 2 MiB each) of ``path``: readahead off, every range requested up front
    (``WILLNEED``), then each read into a thread's buffer by ``PAGE_THREADS`` threads."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for a, b in ranges:
            os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_WILLNEED)
        local = threading.local()

        def work(part: list[tuple[int, int]]) -> None:
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = bytearray(2 << 20)
            view = memoryview(buf)
            for a, b in part:
                if os.preadv(fd, [view[: b - a]], a) != b - a:
                    raise SystemExit(f"cold_io.py: short read of bytes {a}-{b} of {path}")

        with ThreadPoolExecutor(PAGE_THREADS) as pool:
            list(pool.map(work, [ranges[i :: PAGE_THREADS * 4] for i in range(PAGE_THREADS * 4)]))
    finally:
        os.close(fd)


def floor_ranges(model: Path) -> list[tuple[int, int]]:
    """The rank's page floor as byte ranges: touching pages merged, each range cut into pieces of at most 2 MiB."""
    pages = sorted(rank_pages(model)[1])
    out: list[tuple[int, int]] = []
    for page in pages:
        if out and out[-1][1] == page * mmap.PAGESIZE and out[-1][1] - out[-1][0] < (2 << 20):
            out[-1] = (out[-1][0], (page + 1) * mmap.PAGESIZE)
        else:
            out.append((page * mmap.PAGESIZE, (page + 1) * mmap.PAGESIZE))
    return out


def page_floor(model: Path) -> tuple[int, int]:
    """The rank's bytes, and the bytes of the file pages holding them."""
    own, pages = rank_pages(model)
    return own, len(pages) * mmap.PAGESIZE


def rank_pages(model: Path) -> tuple[int, set[int]]:
    """The rank's bytes, and the indices of the file pages holding them."""
    import shardload

    return covering_chunks(shardload.plan_model(model, N), RANK, mmap.PAGESIZE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/shardload-bench"))
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", nargs=2)
    parser.add_argument("--kinds", default=",".join(KINDS), help="a comma-separated subset of " + ", ".join(KINDS))
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0
    model = args.work / "llama"
    ensure_checkpoint(model, args.size_gib, N)
    if not (model / "shardload.hashes").exists():
        from shardload.engine.hashing import hash_model

        hash_model(model)
    own, floor = page_floor(model)
    size = (model / MODEL_FILE).stat().st_size
    loads = [os.getloadavg()[0]]
    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    if not {"seq", "plan"} <= set(kinds):
        parser.error("--kinds needs seq and plan (the floors and the base of the verify ratio)")
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for kind in kinds:
            cmd = [sys.executable, __file__, "--child", str(model), kind]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[kind].append(json.loads(out.strip().splitlines()[-1]))
        loads.append(os.getloadavg()[0])
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    speed = size / med["seq"]["seconds"]
    mib = 2**20
    print(
        f"checkpoint {size / 2**30:.2f} GiB, rank {RANK} of {N}: {own / mib:.1f} MiB used, page floor "
        f"{floor / mib:.1f} MiB; cold sequential {speed / 1e9:.2f} GB/s (CPU {med['seq']['cpu']:.3f} s); "
        f"load average {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} cores, medians of {args.repeats}"
    )
    print(f"{'figure':<52}{'value':>11}{'floor':>11}{'ratio':>8}{'target':>9}")

    def row(figure: str, value: float, base: float, target: str, unit: str = "") -> None:
        scale = mib if unit == "MiB" else 1
        print(f"{figure:<52}{value / scale:>11.3f}{base / scale:>11.3f}{value / base:>8.2f}{target:>9}")

    for kind in [k for k in kinds if k not in ("seq", "pages")]:
        m = med[kind]
        row(f"{kind}: MiB from storage vs page floor", m["read_bytes"], floor, "<=1.05" if kind == "plan" else "",
            "MiB")  # fmt: skip
        row(f"{kind}: seconds vs storage floor (moved / seq)", m["seconds"], m["read_bytes"] / speed,
            "<=1.20" if kind != "verify" else "")  # fmt: skip
        row(f"{kind}: CPU seconds vs seq read's CPU", m["cpu"], max(med["seq"]["cpu"], 1e-3), "(info)")
        if kind != "verify":
            row(f"{kind}: reader count, MiB used vs rank's bytes", m["used"], own, "1.00", "MiB")
            row(f"{kind}: readers' MiB moved vs kernel's read_bytes", m["moved"], m["read_bytes"], "(info)", "MiB")
    if "pages" in med:
        m = med["pages"]
        print(f"pages: the page floor in {len(floor_ranges(model))} reads of at most 2 MiB, {PAGE_THREADS} threads")
        row("pages: MiB from storage vs page floor", m["read_bytes"], floor, "(info)", "MiB")
        row("pages: seconds vs storage floor (moved / seq)", m["seconds"], m["read_bytes"] / speed, "(info)")
        row("plan: seconds vs the page floor read raw (pages)", med["plan"]["seconds"], m["seconds"], "(info)")
    if "verify" in med:
        row("verify vs plan, seconds (cold)", med["verify"]["seconds"], med["plan"]["seconds"], "<=1.15")
        row("verify vs plan, CPU seconds (cold)", med["verify"]["cpu"], med["plan"]["cpu"], "(info)")
    for kind in kinds:
        print(f"{kind}: seconds {[round(r['seconds'], 3) for r in runs[kind]]}, "
              f"CPU {[round(r['cpu'], 3) for r in runs[kind]]}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
