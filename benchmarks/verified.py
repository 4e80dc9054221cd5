"""Verified loading against plain loading, side by side in one run (issue 27's targets): a ~1 GiB Llama-shaped
float16 checkpoint, rank 3 of 8, each figure from fresh processes (median of ``--repeats``, plain and verify
alternating), warm and cold.

- bytes: warm, the tensor bytes the readers copy (``count_reads``); cold, ``/proc/self/io`` read_bytes after the
  file's pages were dropped (``POSIX_FADV_DONTNEED``). Target: verify <= 1.10x plain.
- seconds: the load itself (imports and planning excluded, as in run.py's row 6). Target: verify <= 1.15x plain.
  CPU seconds of all threads beside it: steadier than wall time on a shared machine.
- ``shardload hash`` throughput against ``cat FILE > /dev/null``, both cold. Target: >= 0.8x.
- record size against 0.1% of the checkpoint + 16 KiB.
- the hashes alone: the bytes a warm verified load hashed, in as many pieces, hashed from memory in a fresh
  process by one thread and by as many threads as a load reads with; and the least a warm verified load could
  take on this machine given them, were they fitted perfectly into the CPU time the plain load leaves idle:
  max(plain seconds, (plain CPU seconds + the hashes' smaller CPU seconds) / cores). A bound, not a target: the
  rest of verify's cost is above it.
- what file-linear 64 KiB leaves would read for the same rank (computed from the rank's byte runs), the layout the
  tiled record replaces.

Run: ``PYTHONPATH=$PWD python benchmarks/verified.py [--work DIR] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoints import MODEL_FILE, covering_chunks, drop, ensure_checkpoint, read_io

RANK, N = 3, 8


def child(model: str, verify: str, cold: str) -> None:
    """One load of rank 3 of 8 in this fresh process: seconds, bytes read from storage, bytes copied."""
    import shardload
    import shardload.planning.runs
    from shardload.sources.reader import count_reads

    shardload.plan_model(model, N)  # not timed: planning is the same either way
    path = Path(model) / MODEL_FILE
    if cold == "cold":
        drop(path)
    else:
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    gc.collect()  # the full collection torch's import owes falls here, not inside the clock of one side
    before = read_io()
    c0, t0 = time.process_time(), time.perf_counter()
    with count_reads() as seen:
        state = shardload.load_rank(model, RANK, N, verify=verify == "verify")
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    held = sum(t.numel() * t.element_size() for t in state.values())
    print(json.dumps({"seconds": elapsed, "cpu": cpu, "read_bytes": read_io() - before, "counted": seen.bytes,
                      "held": held, "checked": seen.checked, "tiles": seen.tiles}))  # fmt: skip


def hash_child(nbytes: str, tiles: str) -> None:
    """The checks alone, in this fresh process: ``tiles`` pieces of ``nbytes`` in all, already in memory, hashed
    with the record's hash by one thread, then by as many threads as a load reads with."""
    import threading

    import numpy as np

    from shardload.engine.read_strategy import READ_THREADS
    from shardload.format.hash_record import default_hash, hasher

    total, count = int(nbytes), int(tiles)
    piece = -(-total // count)
    data = np.random.default_rng(0).integers(0, 256, size=piece * count, dtype=np.uint8)
    digest = hasher(default_hash())

    def work(first: int, step: int) -> None:
        for k in range(first, count, step):
            digest(data[k * piece : (k + 1) * piece]).digest()

    work(0, 1)  # warm the code and the buffer's pages; not timed
    out = {}
    for n in (1, READ_THREADS):
        threads = [threading.Thread(target=work, args=(t, n)) for t in range(n)]
        c0, t0 = time.process_time(), time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out[f"seconds{n}"], out[f"cpu{n}"] = time.perf_counter() - t0, time.process_time() - c0
    out["threads"] = READ_THREADS
    print(json.dumps(out))


def measure(model: Path, cold: bool, repeats: int) -> dict[str, dict[str, float]]:
    """Medians of ``repeats`` fresh processes per mode, plain and verify alternating (a load change on a shared
    machine then hits both alike)."""
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "verify": []}
    for _ in range(repeats):
        for mode, out in runs.items():
            cmd = [sys.executable, __file__, "--child", str(model), mode, "cold" if cold else "warm"]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            out.append(json.loads(done.strip().splitlines()[-1]))
    return {mode: {key: statistics.median(r[key] for r in out) for key in out[0]} for mode, out in runs.items()}


def hash_alone(checked: dict[str, float], repeats: int) -> dict[str, float]:
    """Medians of ``repeats`` fresh processes hashing what a warm verified load hashed, and nothing else."""
    cmd = [sys.executable, __file__, "--hash-child", str(int(checked["checked"])), str(int(checked["tiles"]))]
    runs = [json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
            for _ in range(repeats)]  # fmt: skip
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def linear_leaf_bytes(model: Path, leaf: int = 64 << 10) -> tuple[int, int]:
    """Bytes rank 3 of 8 needs, and the bytes of the file-linear ``leaf``-byte chunks covering them."""
    import shardload

    own, chunks = covering_chunks(shardload.plan_model(model, N), RANK, leaf)
    return own, len(chunks) * leaf


def hash_vs_cat(model: Path) -> tuple[float, float]:
    """Seconds of ``cat FILE > /dev/null`` and of ``shardload hash``, each from a cold cache."""
    path = model / MODEL_FILE
    drop(path)
    t0 = time.perf_counter()
    subprocess.run(f"cat {path} > /dev/null", shell=True, check=True)
    cat = time.perf_counter() - t0
    drop(path)
    code = "import sys, time; from shardload.engine.hashing import hash_model; t = time.perf_counter(); " \
           "hash_model(sys.argv[1]); print(time.perf_counter() - t)"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(model)], check=True, capture_output=True, text=True)
    return cat, float(out.stdout.strip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/shardload-bench"))
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", nargs=3)
    parser.add_argument("--hash-child", nargs=2)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0
    if args.hash_child:
        hash_child(*args.hash_child)
        return 0
    model = args.work / "llama"
    ensure_checkpoint(model, args.size_gib, N)
    from shardload.engine.hashing import hash_model

    result = hash_model(model)
    size = (model / MODEL_FILE).stat().st_size
    cat, hashed = hash_vs_cat(model)
    own, linear = linear_leaf_bytes(model)
    print(f"checkpoint {size / 2**30:.2f} GiB, rank {RANK} of {N} needs {own / 2**20:.1f} MiB; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")  # fmt: skip
    print(f"{'figure':<34}{'plain':>12}{'verify':>12}{'ratio':>8}{'target':>9}")
    for cold in (False, True):
        both = measure(model, cold, args.repeats)
        plain, checked = both["plain"], both["verify"]
        state = "cold" if cold else "warm"
        key = "read_bytes" if cold else "counted"
        what = "bytes from storage" if cold else "bytes copied by readers"
        ratio = checked[key] / max(1, plain[key])
        print(f"{f'{what} ({state}), MiB':<34}{plain[key] / 2**20:>12.1f}{checked[key] / 2**20:>12.1f}"
              f"{ratio:>8.2f}{'<=1.10':>9}")  # fmt: skip
        ratio = checked["seconds"] / plain["seconds"]
        print(f"{f'seconds ({state})':<34}{plain['seconds']:>12.3f}{checked['seconds']:>12.3f}{ratio:>8.2f}"
              f"{'<=1.15':>9}")  # fmt: skip
        ratio = checked["cpu"] / plain["cpu"]
        print(f"{f'CPU seconds, all threads ({state})':<34}{plain['cpu']:>12.3f}{checked['cpu']:>12.3f}{ratio:>8.2f}"
              f"{'(info)':>9}")  # fmt: skip
        if not cold:
            hashes = hash_alone(checked, args.repeats)
            print(f"{'MiB used vs hashed (warm)':<34}{plain['counted'] / 2**20:>12.1f}"
                  f"{checked['checked'] / 2**20:>12.1f}{checked['checked'] / plain['counted']:>8.2f}"
                  f"{'(info)':>9}")  # fmt: skip
            threads = int(hashes["threads"])
            for n in (1, threads):
                label = f"hashes alone, {n} thread{'s' if n > 1 else ''}: s, CPU s"
                print(f"{label:<34}{hashes[f'seconds{n}']:>12.3f}{hashes[f'cpu{n}']:>12.3f}{'':>8}{'(info)':>9}")
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            least = min(hashes["cpu1"], hashes[f"cpu{threads}"])
            bound = max(plain["seconds"], (plain["cpu"] + least) / cores)
            print(f"{'seconds: plain vs least with hashes':<34}{plain['seconds']:>12.3f}{bound:>12.3f}"
                  f"{bound / plain['seconds']:>8.2f}{'(bound)':>9}")  # fmt: skip
    print(f"{'hash vs cat (cold), GB/s':<34}{size / cat / 1e9:>12.2f}{size / hashed / 1e9:>12.2f}"
          f"{cat / hashed:>8.2f}{'>=0.80':>9}")  # fmt: skip
    limit = size // 1000 + (16 << 10)
    print(f"{'record bytes vs 0.1% + 16 KiB':<34}{limit:>12}{result.record_bytes:>12}"
          f"{result.record_bytes / limit:>8.2f}{'<=1.00':>9}")  # fmt: skip
    print(f"{'file-linear 64 KiB leaves, MiB':<34}{own / 2**20:>12.1f}{linear / 2**20:>12.1f}{linear / own:>8.2f}"
          f"{'(info)':>9}")  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
