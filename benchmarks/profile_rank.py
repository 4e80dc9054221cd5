"""Where the calling thread's time goes in one rank's load: a phase table (thread CPU ms, us per tensor).

Usage:
    python benchmarks/profile_rank.py MODEL [--rank 3] [--num-shards 8] [--mmap] [--runs 7]

Each run is a fresh process that imports everything a load imports (not timed), then times, one after another:
the header parse (``open_checkpoint``), the shard_info read and schema check, ``build_plan``, the executor's
set-up of every parameter with the reads held back (``Transfer(defer=True)``: no phase waits for a core or the
interpreter lock behind the reader threads), the reads, and freeing the result. The table shows the median over
``--runs`` processes, each started right after the model's files were read (a warm page cache). To compare with
another version, run it with ``PYTHONPATH`` pointing at that checkout.
``benchmarks/run.py --keep DIR --only rank`` builds a 1 GiB Llama-shaped checkpoint in ``DIR/model``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PHASES = [
    ("open_checkpoint: header parsed", "header"),
    ("shard_info.json read, schema-checked, parsed", "shard_info"),
    ("build_plan: steps resolved and checked", "plan"),
    ("executor set-up of every parameter", "setup"),
    ("reads and copies (this thread waits)", "reads"),
    ("freeing the result", "teardown"),
]


def child(model: str, rank: int, num_shards: int, mmap: bool) -> None:
    """One fresh process: print the phases' thread CPU seconds as a JSON line."""
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import shardload.engine.steps
    import shardload.planning.runs  # noqa: F401
    from shardload.engine.paths import data_path_for
    from shardload.engine.run import stages_of
    from shardload.engine.transfer import Transfer, reader_for_plan
    from shardload.models.plan_source import shard_info_for
    from shardload.planning.mesh import Mesh
    from shardload.planning.plan import build_plan
    from shardload.sources.checkpoint import open_checkpoint

    with contextlib.suppress(ImportError):
        import jsonschema_rs  # noqa: F401  (the schema check imports it on first use)

    gc.collect()  # the full collection torch's import owes (about 60 ms) would otherwise land in one phase
    marks = [time.thread_time()]
    checkpoint = open_checkpoint(model)
    marks.append(time.thread_time())
    info = shard_info_for(checkpoint, None)
    marks.append(time.thread_time())
    plan = build_plan(info, checkpoint, num_shards)
    stage = stages_of(plan, Mesh(tp=num_shards))[0]
    marks.append(time.thread_time())
    out = {}
    with reader_for_plan(stage.params.values()) as reader:
        transfer = Transfer(reader, path=data_path_for(["cpu"], mmap=mmap, one_rank=True), defer=True)
        for param in stage.params.values():
            out[param.name] = transfer.param(param, [rank], ["cpu"])[0]
        marks.append(time.thread_time())
        transfer.wait()
        transfer.close()
    marks.append(time.thread_time())
    del out
    marks.append(time.thread_time())
    print(json.dumps({"tensors": len(stage.params), "seconds": [b - a for a, b in itertools.pairwise(marks)]}))


def warm(model: Path) -> None:
    """Read the model's safetensors files once, so each run starts from a warm page cache (as row 6 does)."""
    files = [model] if model.is_file() else sorted(model.glob("*.safetensors"))
    buf = bytearray(16 << 20)
    for path in files:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def main(argv: list[str] | None = None) -> int:
    """Run ``--runs`` fresh processes and print the median of each phase."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("model")
    parser.add_argument("--rank", type=int, default=3)
    parser.add_argument("--num-shards", type=int, default=8)
    parser.add_argument("--mmap", action="store_true", help="load_rank(mmap=True)'s path")
    parser.add_argument("--runs", type=int, default=7, help="fresh processes; the median is shown (default 7)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.model, args.rank, args.num_shards, args.mmap)
        return 0
    cmd = [sys.executable, __file__, "--child", args.model, "--rank", str(args.rank), "--num-shards",
           str(args.num_shards)] + (["--mmap"] if args.mmap else [])  # fmt: skip
    results = []
    for _ in range(args.runs):
        warm(Path(args.model))
        run = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results.append(json.loads(run.stdout.splitlines()[-1]))
    tensors = results[0]["tensors"]
    print(f"load_rank(rank {args.rank} of {args.num_shards}{', mmap=True' if args.mmap else ''}): {tensors} tensors, "
          f"median of {args.runs} fresh processes, thread CPU time")  # fmt: skip
    for k, (label, _) in enumerate(PHASES):
        ms = 1e3 * statistics.median(r["seconds"][k] for r in results)
        print(f"  {label:48s} {ms:8.2f} ms  {1e3 * ms / max(1, tensors):8.1f} us/tensor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
