#!/usr/bin/env python
"""A fresh process's first load and the loads after it, side by side: shardload's ways against the default pattern.

What a server pays is its process's first load; this times it apart from the steady state. Each variant runs in a
fresh process (the page cache warm, every import and, on CUDA, the context made before the clock), which loads the
same rank ``--loads`` times and prints the wall and CPU seconds of each (to after ``torch.cuda.synchronize``):

- ``default``: vLLM's default pattern (``gpu_node.py``'s: every tensor read whole, the rank's boxes cut on the CPU);
- ``auto``: ``load_rank`` as it ships (its first load also compared with a CPU load of the rank, ``torch.equal``);
- ``spans``: the device path's spans for every parameter (``SPAN_OVER_READ`` set to infinity);
- ``map``: ``ReadOptions(strategy="map")``, every parameter copied out of the mapping into the staging buffers.

Run: ``PYTHONPATH=$PWD python benchmarks/first_load.py [--device cuda|cpu] [--stand-in] [--size-gib 1]
[--ranks 0/8 0/2] [--variants default auto spans map] [--loads 3] [--work DIR]``. With ``--device cpu --stand-in``
shardload's variants take the GPU's data path with the CPU as its device. The checkpoint is
``benchmarks/checkpoints.py``'s (``DIR/llama``, shared with ``gpu_node.py --work DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from checkpoints import MODEL_FILE, ensure_checkpoint, warm_page_cache  # noqa: E402

VARIANTS = ("default", "auto", "spans", "map")


def child(model: str, rank: int, n: int, device: str, variant: str, loads: int, stand_in: bool) -> None:
    """Load rank ``rank`` of ``n`` ``loads`` times the ``variant`` way; print one JSON line."""
    import safetensors.torch  # noqa: F401  (every import before the clock starts)
    import torch
    from gpu_node import cpu_seconds, load

    import shardload
    import shardload.engine.paths.device as device_path
    import shardload.planning.runs

    plan = shardload.plan_model(model, n)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.empty(1, device=dev)  # the context: not timed
        torch.cuda.synchronize(dev)
    if stand_in:
        import shardload.engine.run as run
        from shardload.engine import paths

        run.data_path_for = lambda devices, **kw: paths.data_path_for(devices, **{**kw, "staged": True})
    if variant == "spans":
        device_path.SPAN_OVER_READ = float("inf")
    options = shardload.ReadOptions(strategy="map") if variant == "map" else None
    out: dict[str, Any] = {"variant": variant, "rank": rank, "n": n, "wall": [], "cpu": []}
    for k in range(loads):
        c0, t0 = cpu_seconds(), time.perf_counter()
        if variant == "default":
            state = load("default", Path(model), Path(model), plan, rank, n, dev)
        else:
            state = shardload.load_rank(model, rank, n, device=dev, read_options=options)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        out["wall"].append(round(time.perf_counter() - t0, 4))
        out["cpu"].append(round(cpu_seconds() - c0, 3))
        if k == 0 and variant != "default":
            ref = shardload.load_rank(model, rank, n)
            bad = [name for name in ref if name not in state or not torch.equal(state[name].cpu(), ref[name])]
            out["equal"] = not bad and set(ref) == set(state)
        del state
    print(json.dumps(out), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--stand-in", action="store_true", help="with --device cpu: the GPU's data path")
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--ranks", nargs="+", default=["0/8", "0/2"], help="RANK/N of each row")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/shardload-first-load"))
    args = parser.parse_args()
    cells = [tuple(int(x) for x in r.split("/")) for r in args.ranks]
    model = args.work / "llama"
    ensure_checkpoint(model, args.size_gib, max(n for _, n in cells))
    warm_page_cache(model / MODEL_FILE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")])}
    print(f"checkpoint {(model / MODEL_FILE).stat().st_size / (1 << 30):.2f} GiB; device {args.device}"
          f"{' (stand-in)' if args.stand_in else ''}; {os.cpu_count()} CPUs; each row a fresh process")  # fmt: skip
    print(f"\n| rank | variant | {' | '.join(f'load {k + 1} s' for k in range(args.loads))} | CPU s, first | equal |")
    print(f"|---|---|{'---|' * args.loads}---|---|")
    failed = False
    for rank, n in cells:
        for variant in args.variants:
            cmd = [sys.executable, __file__, "--child", str(model), str(rank), str(n), args.device, variant,
                   str(args.loads), str(int(args.stand_in))]  # fmt: skip
            got = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/", timeout=600)
            line = got.stdout.strip().splitlines()[-1] if got.returncode == 0 and got.stdout.strip() else ""
            if not line:
                print(f"| {rank}/{n} | {variant} | failed: {got.stderr.strip()[-200:]} |")
                failed = True
                continue
            row = json.loads(line)
            equal = {True: "equal", False: "MISMATCH"}.get(row.get("equal"), "")
            failed |= equal == "MISMATCH"
            walls = " | ".join(f"{w:.4f}" for w in row["wall"])
            print(f"| {rank}/{n} | {variant} | {walls} | {row['cpu'][0]:.3f} | {equal} |", flush=True)
    print(f"\nload average (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        a = sys.argv[2:]
        child(a[0], int(a[1]), int(a[2]), a[3], a[4], int(a[5]), a[6] == "1")
    else:
        sys.exit(main())
