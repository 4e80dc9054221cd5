#!/usr/bin/env python
"""What the share_reads content check costs one rank: fingerprinting its copy of a ~1 GiB checkpoint file.

Usage::

    python benchmarks/fingerprint.py [--size-gib 1] [--repeats 5] [--keep DIR]

Writes (or reuses) the random Llama-shaped float16 checkpoint of ``benchmarks/checkpoints.py`` (one
``model.safetensors``), then times ``plan_samples`` + ``fingerprint`` on it (``shardload.engine.fingerprint``, what
each rank of a group runs before any exchange; the group's two small collectives come on top): warm (the
file in the page cache) and cold (the file's pages dropped first with ``posix_fadvise(DONTNEED)``). Shown: the
median and range of ``--repeats`` runs in ms, the bytes ``count_reads`` counts (the blocks asked for), and for the
cold runs the bytes the process read from storage (``read_bytes`` of ``/proc/self/io``: readahead included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from shardload.engine.fingerprint import SAMPLE_BYTES, SAMPLES_PER_FILE, fingerprint, plan_samples
from shardload.sources.checkpoint import open_checkpoint
from shardload.sources.reader import Reader, count_reads


def storage_bytes() -> int | None:
    """Bytes this process has read from storage so far (None where ``/proc/self/io`` is missing)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def drop_pages(path: Path) -> None:
    """Drop ``path``'s clean pages from the page cache (best effort)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_once(model: Path, cold: bool) -> tuple[float, int, int | None]:
    """One fingerprint of every file of ``model``: ms, bytes counted, bytes read from storage (cold only)."""
    checkpoint = open_checkpoint(model)
    files = sorted({t.file for t in checkpoint.tensors.values()})
    if cold:
        for f in files:
            drop_pages(f)
    before = storage_bytes()
    start = time.perf_counter()
    with count_reads() as seen, Reader() as reader:
        fingerprint(plan_samples(checkpoint.tensors.values()), reader)
    ms = (time.perf_counter() - start) * 1e3
    after = storage_bytes()
    return ms, seen.bytes, (after - before) if cold and before is not None and after is not None else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keep", type=Path, default=None, help="write the checkpoint here and keep it")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from checkpoints import MODEL_FILE, ensure_checkpoint

    with tempfile.TemporaryDirectory(prefix="shardload-fingerprint-") as tmp:
        model = args.keep or Path(tmp) / "model"
        ensure_checkpoint(model, args.size_gib, 2)
        size = (model / MODEL_FILE).stat().st_size
        tensors = len(open_checkpoint(model).tensors)
        run_once(model, cold=False)  # imports, first open
        print(f"\nfingerprint of one {size / (1 << 30):.2f} GiB file ({tensors} tensors), {SAMPLES_PER_FILE} blocks "
              f"of {SAMPLE_BYTES} bytes at most; median (min-max) of {args.repeats}")  # fmt: skip
        print("| page cache | ms | bytes counted (count_reads) | bytes read from storage |")
        print("|---|---|---|---|")
        for cold in (False, True):
            runs = [run_once(model, cold) for _ in range(args.repeats)]
            ms = [r[0] for r in runs]
            disk = [r[2] for r in runs if r[2] is not None]
            shown = f"{statistics.median(disk) / 1024:.0f} KiB" if disk else "-"
            print(f"| {'cold' if cold else 'warm'} | {statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f}) | "
                  f"{runs[0][1]} ({runs[0][1] / 1024:.0f} KiB, {runs[0][1] / size:.4%}) | {shown} |")  # fmt: skip
    print(f"load average: {', '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
