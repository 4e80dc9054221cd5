#!/usr/bin/env python
"""Loading from the shards only (docs/reshard.md): a directory converted for N_old, loaded for N_new.

Usage::

    python benchmarks/reshard.py [--size-gib 0.25] [--old 2,8] [--new 1,4,8] [--repeats 3] [--keep DIR]

On the ~``--size-gib`` float16 Llama-shaped checkpoint of ``benchmarks/checkpoints.py`` (fused GQA qkv, gate_up,
8 KV heads), converted for each N_old, page cache warm: for each N_new, every rank loaded with
``load_rank(OUT, r, N_new)``. Bytes read per rank (shardload's reader count) against the rank's own bytes
(target <= 1.05x), and time for all N_new ranks against ``load_rank(MODEL, r, N_new)`` from the original checkpoint
(shown), in one process, best of ``--repeats``. Then ``convert OUT -n N_new`` against ``convert MODEL -n N_new``
(shown). Prints one markdown table; exits 1 if a byte ratio misses its target.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import ensure_checkpoint

import shardload
from shardload.sources.reader import count_reads

TARGET = 1.05


def best(fn: Callable[[], object], repeats: int) -> float:
    """The best wall time of ``repeats`` calls of ``fn`` (after one untimed call, which warms the cache)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def ranks_of(model: Path, n: int) -> None:
    for r in range(n):
        shardload.load_rank(model, r, n)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size-gib", type=float, default=0.25)
    parser.add_argument("--old", default="2,8")
    parser.add_argument("--new", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="work directory to keep and reuse (default: a temporary one)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="shardload-reshard-"))
    model = work / "model"
    ensure_checkpoint(model, args.size_gib, 8)
    rows, missed = [], False
    for n_old in (int(x) for x in args.old.split(",")):
        out = work / f"tp{n_old}"
        if not out.exists():
            shardload.convert(model, n_old, out)
        for n_new in (int(x) for x in args.new.split(",")):
            ratio = 0.0
            for r in range(n_new):
                with count_reads() as seen:
                    state = shardload.load_rank(out, r, n_new)
                own = sum(t.numel() * t.element_size() for t in state.values())
                ratio = max(ratio, seen.bytes / own)
            missed |= ratio > TARGET
            t_shards = best(lambda out=out, n=n_new: ranks_of(out, n), args.repeats)
            t_model = best(lambda n=n_new: ranks_of(model, n), args.repeats)
            dest = work / "convert-out"
            c_shards = best(lambda s=out, n=n_new, d=dest: shardload.convert(s, n, d, overwrite=True), args.repeats)
            c_model = best(lambda n=n_new, d=dest: shardload.convert(model, n, d, overwrite=True), args.repeats)
            shutil.rmtree(dest, ignore_errors=True)
            rows.append(
                f"| {n_old} | {n_new} | {ratio:.3f}x | {t_shards:.3f} s | {t_model:.3f} s | {t_shards / t_model:.2f}x "
                f"| {c_shards:.3f} s | {c_model:.3f} s | {c_shards / c_model:.2f}x |"
            )
    size = sum(f.stat().st_size for f in model.glob("*.safetensors")) / (1 << 30)
    print(f"checkpoint: {size:.2f} GiB float16, warm page cache, best of {args.repeats}")
    print()
    print(
        "| N_old | N_new | bytes read / own (max over ranks; target <= 1.05x) | load_rank x N_new from shards "
        "| from the original | ratio | convert from shards | from the original | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
