#!/usr/bin/env python
"""How the way a file came into the page cache changes every later warm load of it, side by side in one run.

A warm load copies out of the page cache. Linux keeps a file's cached pages in folios: a read with readahead (a
sequential ``read``, ``cat``, a download) fills it with large folios, while exact reads (``POSIX_FADV_RANDOM``,
``WILLNEED`` of ranges: what shardload's planned cold reads do to fetch only a rank's pages) fill it one 4 KiB
folio per page. Copying out of 4 KiB folios costs more per byte, whichever loader copies. So a warm figure
depends on what filled the cache: each loader's warm load in ``benchmarks/vllm_load.py`` follows its own cold
load.

On the ~1 GiB Llama-shaped float16 checkpoint of ``benchmarks/checkpoints.py``, for each way of filling the cache
(from a cold page cache, each in a fresh process, the ways interleaved round by round):

- ``sequential``: the whole file read in 16 MiB ``read`` calls (readahead on), as ``cat`` would;
- ``exact``: 2 MiB ranges requested up front with ``WILLNEED`` on a file opened ``POSIX_FADV_RANDOM``, then read
  by 8 threads with ``preadv`` (the pattern of a planned cold read of every byte);
- ``load_rank``: ``shardload.load_rank(model, 0, 1)`` from a cold cache (every byte, through shardload's own cold
  path);
- ``mapped``: one copy out of a fresh mapping of the file (how safetensors' and vLLM's default loaders read);

it then times, with every page cached: first ``load_rank(model, 3, 8)`` once (row 6's load: the process's first
load, into fresh memory), then, best of ``--repeats`` each, one copy of the whole file out of a fresh mapping into
resident memory (torch's copy, all cores) and ``preadv`` of the whole file in 64 MiB reads into resident memory
(one thread). It also prints the bytes each fill fetched from storage (``/proc/self/io``), which shows the
eviction took. Ratios are against ``sequential``.

Run: ``PYTHONPATH=$PWD python benchmarks/page_cache.py [--work DIR] [--repeats 3] [--rounds 3]``.
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
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoints import MODEL_FILE, drop, ensure_checkpoint, fresh_pages_per_allocation, read_io, warm_page_cache

WAYS = ("sequential", "exact", "load_rank", "mapped")
FIGURES = ("fill", "load_rank 3 of 8", "mmap copy", "preadv")
CHUNK = 2 << 20
THREADS = 8


def fill(model: Path, way: str) -> object:
    """Bring ``model``'s (evicted) file into the page cache ``way``; returns what the way made, to free later."""
    import torch

    path = model / MODEL_FILE
    made: object = None
    if way == "sequential":
        warm_page_cache(path)
    elif way == "exact":
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            for at in range(0, size, CHUNK):
                os.posix_fadvise(fd, at, CHUNK, os.POSIX_FADV_WILLNEED)
            offsets = iter(range(0, size, CHUNK))
            lock = threading.Lock()
            failed: list[BaseException] = []

            def reader() -> None:
                buf = bytearray(CHUNK)
                try:
                    while True:
                        with lock:
                            at = next(offsets, None)
                        if at is None:
                            return
                        if os.preadv(fd, [buf], at) != min(CHUNK, size - at):
                            raise OSError(f"short read at {at}")
                except BaseException as err:  # re-raised on the calling thread
                    failed.append(err)

            threads = [threading.Thread(target=reader) for _ in range(THREADS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if failed:
                raise failed[0]
        finally:
            os.close(fd)
    elif way == "load_rank":
        import shardload

        made = shardload.load_rank(model, 0, 1)
    elif way == "mapped":
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            src = torch.frombuffer(m, dtype=torch.uint8)  # holds no export of the mapping: delete it before close
            made = torch.empty_like(src).copy_(src)
            del src
    else:
        raise SystemExit(f"page_cache.py: unknown way {way!r}")
    return made


def warm_figures(model: Path, repeats: int) -> dict[str, float]:
    """Seconds of the warm copies, every page of ``model`` cached: ``load_rank`` once (this process's first load),
    the two whole-file copies best of ``repeats``."""
    import torch

    import shardload

    path = model / MODEL_FILE
    size = path.stat().st_size
    gc.collect()
    started = time.perf_counter()
    state = shardload.load_rank(model, 3, 8)
    figures = {"load_rank 3 of 8": time.perf_counter() - started}
    del state
    out = torch.ones(size, dtype=torch.uint8)  # resident: the copies below fault in no destination page
    view = memoryview(out.numpy())
    best = {name: float("inf") for name in FIGURES[2:]}
    for _ in range(repeats):
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            src = torch.frombuffer(m, dtype=torch.uint8)  # holds no export of the mapping: delete it before close
            started = time.perf_counter()
            out.copy_(src)
            best["mmap copy"] = min(best["mmap copy"], time.perf_counter() - started)
            del src
        fd = os.open(path, os.O_RDONLY)
        try:
            started = time.perf_counter()
            for at in range(0, size, 64 << 20):
                os.preadv(fd, [view[at : at + (64 << 20)]], at)
            best["preadv"] = min(best["preadv"], time.perf_counter() - started)
        finally:
            os.close(fd)
    return figures | best


def child(model: str, way: str, repeats: int) -> None:
    """One way in this fresh process: fill the cache, then time the warm copies; print a JSON line."""
    import torch  # noqa: F401  (imported before the clock, as every way needs it)

    import shardload

    # glibc's mmap threshold fixed at 128 KiB: the warm load's tensors get fresh pages whatever the fill freed (a
    # dynamic threshold would let them reuse heap pages a way's buffers or tensors faulted in)
    if not fresh_pages_per_allocation():
        raise SystemExit("page_cache.py: mallopt(M_MMAP_THRESHOLD) failed")
    shardload.plan_model(model, 8)  # imports and planning, not timed
    drop(Path(model) / MODEL_FILE)
    gc.collect()
    before, started = read_io(), time.perf_counter()
    made = fill(Path(model), way)
    figures = {"fill": time.perf_counter() - started, "fetched": read_io() - before}
    del made
    figures |= warm_figures(Path(model), repeats)
    print(json.dumps(figures))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/shardload-bench"))
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="warm copies per fill; the best is shown")
    parser.add_argument("--rounds", type=int, default=3, help="fills per way (interleaved); the median is shown")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return 0
    model = args.work / "model"
    ensure_checkpoint(model, args.size_gib, 8)
    size = (model / MODEL_FILE).stat().st_size
    load_start = os.getloadavg()[0]
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", str(model), way, str(args.repeats)],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if proc.returncode:
                raise SystemExit(f"page_cache.py: {way} failed:\n{proc.stderr.strip()}")
            runs[way].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    median = {way: {k: statistics.median(r[k] for r in runs[way]) for k in (*FIGURES, "fetched")} for way in WAYS}
    print(
        f"{size / 2**30:.2f} GiB file; the page cache filled four ways from cold, then warm copies out of it "
        f"(load_rank once, the copies best of {args.repeats}); medians of {args.rounds} fresh processes per way; "
        f"{os.cpu_count()} CPUs"
    )
    print(
        "| filled by | MiB from storage | "
        + " | ".join(f"{k} s" for k in FIGURES)
        + " | "
        + " | ".join(f"{k} vs sequential" for k in FIGURES[1:])
        + " |"
    )
    print("|---" * (2 * len(FIGURES) + 1) + "|")
    for way in WAYS:
        cells = [f"{median[way][k]:.3f}" for k in FIGURES]
        ratios = [f"{median[way][k] / median['sequential'][k]:.2f}x" for k in FIGURES[1:]]
        print(f"| `{way}` | {median[way]['fetched'] / 2**20:.0f} | " + " | ".join(cells + ratios) + " |")
    print(f"load average (1 min) at the start {load_start:.2f}, at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
