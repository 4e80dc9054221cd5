#!/usr/bin/env python
"""One node's tensor-parallel load, rank by rank: every loader in fresh processes, cold and warm, to a GPU or the CPU.

On a random ~``--size-gib`` float16 Llama-shaped checkpoint (``benchmarks/checkpoints.py``), for each N of ``--tp``:

- modes: ``turn`` (the ranks one after another, each a fresh process started after the files it reads were dropped
  from the page cache with ``posix_fadvise(DONTNEED)``), ``together`` (all N ranks as N processes at once after one
  drop; on one GPU they all target ``cuda:0``, else rank r targets ``cuda:r``), ``warm`` (fresh processes one after
  another, the files cached).
- loaders: ``default`` (vLLM's default pattern: each tensor read whole with safetensors' ``safe_open``, the rank's
  boxes cut out on the CPU and copied to the device), ``shardload`` (``load_rank(model, rank, N, device=dev)``),
  ``presharded`` (safetensors ``load_file(rank file, device=dev)`` of ``shardload.convert``'s output for N), and the
  peers that import: ``instanttensor`` (``safe_open(...).tensors()``, CUDA only), ``fastsafetensors``
  (``SafeTensorsFileLoader``, nogds) and ``safetensors`` (``load_file`` of the whole model). A peer loads every
  tensor whole onto the device and cuts the rank's boxes there.

A cell's processes all start at once; each imports, plans and (on CUDA) creates its context, says it is ready and
waits to be told to go (after the drop; in turn and warm one rank at a time: the imports overlap, the loads do not).
Its wall time runs from just before the load call to after ``torch.cuda.synchronize`` (CPU: after one element of
every page of the result was read), the first load in the process. It prints one JSON line: wall seconds, CPU seconds
of all its threads (``getrusage``) and bytes fetched from storage (``/proc/self/io`` read_bytes) over the load, and
for shardload the bytes its readers moved. A cell's wall time is the sum over its ranks (``turn``, ``warm``) or from
the first start to the last end (``together``); the table gives medians of ``--repeats`` and ratios to ``default``,
the ranks' bytes delivered per second of it, and CPU seconds per GB delivered.
In the first round every loader's result is compared with shardload's CPU result (``torch.equal``).

The floors come first: the file's cold sequential read speed (after a drop, 16 MiB reads), a parallel cold read
(threads ``pread``-ing 16 MiB stripes), pinned and pageable host-to-device copies (CUDA only), and one thread's
``memcpy``. With ``--device cpu`` the "device" is the CPU: the copies are CPU copies and the H2D floors are skipped;
``--stand-in`` then sends shardload's loads through the GPU's data path (spans read into staging buffers, one upload
each, cut on the "device"), and a line per rank gives that path's spans (and how many were packed), the bytes it
read from the file, copied into staging and uploaded per byte delivered, its uploads and device cuts (printed on
CUDA too).

Run: ``PYTHONPATH=$PWD python benchmarks/gpu_node.py [--device cuda|cpu] [--size-gib 2] [--tp 2 8]
[--modes turn together warm] [--loaders default shardload ...] [--ranks K] [--work DIR] [--repeats 1]
[--stand-in] [--stripes on|off]``. In ``together`` every child gets ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` as torchrun
sets them, so shardload's ranks stripe their cold reads (``--stripes off``: ``ReadOptions(local_ranks=None)``, each
rank alone).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib.util
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoints import MODEL_FILE, drop, ensure_checkpoint, fresh_pages_per_allocation, read_io, warm_page_cache

HERE = Path(__file__).resolve()
MODES = ("turn", "together", "warm")
LOADERS = ("default", "shardload", "presharded", "instanttensor", "fastsafetensors", "safetensors")
PEERS = ("instanttensor", "fastsafetensors", "safetensors")
STAND_IN = "SHARDLOAD_BENCH_STAND_IN"
"""Set to 1 (``--stand-in``): shardload's loads on the CPU take the GPU's data path, the CPU as its "device"."""
CHUNK = 16 << 20
GIB = 1 << 30
CHILD_TIMEOUT_S = 120  # one hung loader costs its cell, not the run


# --- the child: one rank, one loader, one fresh process --------------------------------------------------------


def cut(full: Any, param: Any, rank: int, device: Any = None) -> Any:
    """Rank ``rank``'s tensor out of the whole ``full``, box by box into fresh memory on ``device`` (default: where
    ``full`` is)."""
    import torch

    pieces = param.pieces(rank)
    if pieces is None:
        raise SystemExit(f"{param.name}: a compute step needs the whole tensor; no boxes to cut")
    dest = torch.empty(param.shape, dtype=full.dtype, device=full.device if device is None else device)
    for pc in pieces:
        box = dest[tuple(slice(a, b) for a, b in pc.dst)]
        box.copy_(full[tuple(slice(a, b) for a, b in pc.src)].reshape(box.shape))
    return dest


def load(loader: str, model: Path, rank_file: Path, plan: Any, rank: int, n: int, dev: Any) -> dict[str, Any]:
    """Rank ``rank`` of ``n`` onto ``dev`` the way ``loader`` does it."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    import shardload

    path = str(model / MODEL_FILE)
    params = plan.params
    if loader == "shardload":
        off = os.environ.get("GPU_NODE_STRIPES") == "off"  # --stripes off: each rank alone, its own bytes
        return shardload.load_rank(model, rank, n, device=dev,
                                   read_options=shardload.ReadOptions(local_ranks=None) if off else None)  # fmt: skip
    if loader == "presharded":
        return load_file(str(rank_file), device=str(dev))
    if loader == "default":  # vLLM: the whole tensor on the CPU, narrowed there, copied into the parameter
        with safe_open(path, framework="pt") as f:
            return {name: cut(f.get_tensor(name), p, rank, dev) for name, p in params.items()}
    if loader == "instanttensor":
        import instanttensor

        with instanttensor.safe_open(path, framework="pt", device=dev) as f:
            return {name: cut(t, params[name], rank) for name, t in f.tensors()}
    if loader == "fastsafetensors":
        from fastsafetensors import SafeTensorsFileLoader

        files = SafeTensorsFileLoader(None, str(dev), nogds=True)
        try:
            files.add_filenames({0: [path]})
            buf = files.copy_files_to_device()
            try:
                return {name: cut(buf.get_tensor(name), p, rank) for name, p in params.items()}
            finally:
                buf.close()
        finally:
            files.close()
    if loader == "safetensors":
        whole = load_file(path, device=str(dev))
        return {name: cut(whole.pop(name), p, rank) for name, p in params.items()}
    raise SystemExit(f"unknown loader {loader!r}")


def cpu_seconds() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def child(loader: str, model: str, rank_file: str, rank: str, num_shards: str, device: str, check: str) -> None:
    """Load one rank when told to go; print one JSON line."""
    import safetensors.torch  # noqa: F401  (every import before the clock starts)
    import torch

    import shardload
    import shardload.planning.runs  # what loading imports lazily: not timed
    from shardload.sources.reader import count_reads

    if loader in PEERS and loader != "safetensors":
        importlib.import_module(loader)
    r, n = int(rank), int(num_shards)
    out: dict[str, Any] = {"loader": loader, "rank": r}
    plan = shardload.plan_model(model, n)  # not timed: the same for every loader (vLLM's plan is its model code)
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", r % torch.cuda.device_count())
        torch.empty(1, device=dev)  # the context: not timed
        torch.cuda.synchronize(dev)
    fresh_pages_per_allocation()
    gc.collect()
    print("ready", flush=True)
    sys.stdin.readline()  # the parent drops the page cache (cold modes), then says go
    try:  # the device path's tally (absent from a tree older than it)
        from shardload.engine.paths.device import count_device
    except ImportError:
        count_device = contextlib.nullcontext
    if os.environ.get(STAND_IN) == "1":  # the GPU's data path with the CPU as its "device"
        import shardload.engine.run as run
        from shardload.engine import paths

        run.data_path_for = lambda devices, **kw: paths.data_path_for(devices, **{**kw, "staged": True})
    io0, cpu0, start = read_io(), cpu_seconds(), time.time()
    t0 = time.perf_counter()
    try:
        with count_reads() as seen, count_device() as device_moved:
            state = load(loader, Path(model), Path(rank_file), plan, r, n, dev)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            else:  # one element of every page: a mapping's lazy pages count too
                for t in state.values():
                    flat = t.reshape(-1)
                    float(flat[:: max(1, 4096 // t.element_size())].float().sum())
    except Exception as err:  # a loader that fails is a cell that says so, not a lost run
        print(json.dumps({**out, "error": f"{type(err).__name__}: {err}"[:300]}), flush=True)
        return
    out.update(wall=time.perf_counter() - t0, start=start, end=time.time(), cpu=cpu_seconds() - cpu0)
    out.update(read_bytes=read_io() - io0, own=plan.rank_nbytes(r), moved=seen.moved, counted=seen.bytes,
               warmed=getattr(seen, "warmed", 0))  # fmt: skip
    out["delivered"] = sum(t.numel() * t.element_size() for t in state.values())
    if device_moved is not None and device_moved.spans:
        # a baseline tree's tally lacks the packed spans' counts: its spans staged every byte they read
        out["device"] = {k: getattr(device_moved, k, None) for k in ("spans", "packed", "read_bytes", "staged_bytes",
                                                                     "uploads", "upload_bytes", "cuts")}  # fmt: skip
    if check == "1":
        ref = shardload.load_rank(model, r, n)
        bad = sorted(set(ref) ^ set(state))
        bad += [k for k in ref if k in state and not torch.equal(state[k].cpu(), ref[k])]
        out.update(compared=len(ref), mismatch=bad[:5], mismatches=len(bad))
    print(json.dumps(out), flush=True)


# --- the parent ----------------------------------------------------------------------------------------------


def launch(loader: str, model: Path, rank_file: Path, rank: int, n: int, device: str, check: bool,
           together: bool = False, stripes: str = "on") -> Any:  # fmt: skip
    """One child; ``together``: as a launcher starts a host's ranks (torchrun's ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``,
    which shardload stripes its cold reads by unless ``stripes`` is ``"off"``)."""
    cmd = [sys.executable, str(HERE), "--child", loader, str(model), str(rank_file), str(rank), str(n), device,
           str(int(check))]  # fmt: skip
    env = {**os.environ, "GPU_NODE_STRIPES": stripes}
    if together:
        env.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n))
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    proc.err = err  # type: ignore[attr-defined]
    return proc


def ready_line(proc: Any) -> bool:
    """Wait for the child's "ready" (False if it ended first); a library's own output before it is skipped."""
    while line := proc.stdout.readline():
        if line.strip() == "ready":
            return True
    return False


def collect(proc: Any, loader: str, rank: int) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"loader": loader, "rank": rank, "error": f"no result in {CHILD_TIMEOUT_S} s (killed)"}
    lines = out.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        proc.err.seek(0)
        tail = (proc.err.read().strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return {"loader": loader, "rank": rank, "error": tail[:300]}


def run_cell(mode: str, loader: str, model: Path, tp_dir: Path, n: int, ranks: list[int], device: str,
             check: bool, stripes: str = "on") -> list[dict[str, Any]]:  # fmt: skip
    """One cell: the ranks in fresh processes, loading one after another or all at once."""
    files = {r: tp_dir / f"rank-{r:05d}-of-{n:05d}.safetensors" for r in range(n)}
    reads = list(files.values()) if loader == "presharded" else [model / MODEL_FILE]
    if mode == "warm":
        for f in reads:
            warm_page_cache(f)
    together = mode == "together"
    # Every process of the cell starts at once and waits at "ready": the imports overlap, the loads never do.
    procs = {r: launch(loader, model, files[r], r, n, device, check, together, stripes)
             for r in (range(n) if together else ranks)}  # fmt: skip
    ready = {r: ready_line(p) for r, p in procs.items()}
    results = []
    for group in [list(procs)] if together else [[r] for r in procs]:
        if mode != "warm":
            for f in reads:
                drop(f)
        for r in group:
            if ready[r]:
                procs[r].stdin.write("go\n")
                procs[r].stdin.flush()
        results += [collect(procs[r], loader, r) for r in group]
    return results


def summarize(mode: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A cell's figures from its ranks' lines."""
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"error": errors[0]}
    wall = max(r["end"] for r in runs) - min(r["start"] for r in runs) if mode == "together" else None
    return {"wall": wall if wall is not None else sum(r["wall"] for r in runs),
            **{k: sum(r[k] for r in runs) for k in ("cpu", "read_bytes", "own")}}  # fmt: skip


def floors(path: Path, device: str) -> list[str]:
    """The machine's bounds: cold reads of ``path``, host-to-device copies, memcpy."""
    import numpy as np
    import torch

    size = path.stat().st_size
    lines = []
    drop(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(CHUNK)
        while fh.readinto(buf):
            pass
    lines.append(f"cold sequential read ({CHUNK >> 20} MiB reads): {size / (time.perf_counter() - t0) / 1e9:.2f} GB/s")
    threads = min(8, os.cpu_count() or 1)
    drop(path)
    fd = os.open(path, os.O_RDONLY)

    def stripe(k: int) -> None:
        mine = bytearray(CHUNK)
        for off in range(k * CHUNK, size, threads * CHUNK):
            os.preadv(fd, [mine], off)

    workers = [threading.Thread(target=stripe, args=(k,)) for k in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t0
    os.close(fd)
    lines.append(f"cold parallel read ({threads} threads, {CHUNK >> 20} MiB stripes): {size / seconds / 1e9:.2f} GB/s")
    nbytes = 256 << 20
    if device.startswith("cuda"):
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        for kind, pinned in (("pinned", True), ("pageable", False)):
            src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
            best = math.inf
            for _ in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=pinned)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            lines.append(f"{kind} host-to-device copy ({nbytes >> 20} MiB, best of 3): {nbytes / best / 1e9:.2f} GB/s")
            del src
        del dst
        torch.cuda.empty_cache()
    else:
        lines.append("host-to-device copies: skipped (--device cpu)")
    src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    best = math.inf
    for _ in range(4):
        t0 = time.perf_counter()
        ctypes.memmove(dst.ctypes.data, src.ctypes.data, nbytes)
        best = min(best, time.perf_counter() - t0)
    lines.append(
        f"memcpy, one thread ({nbytes >> 20} MiB, pages faulted in, best of 3): {nbytes / best / 1e9:.2f} GB/s"
    )
    return lines


def presharded(model: Path, work: Path, n: int) -> Path:
    """``shardload.convert``'s output for ``n`` ranks under ``work`` (written again when older than the checkpoint)."""
    import shardload

    tp_dir = work / f"tp{n}"
    manifest = tp_dir / "shard_manifest.json"
    if not manifest.is_file() or manifest.stat().st_mtime < (model / MODEL_FILE).stat().st_mtime:
        shardload.convert(model, n, tp_dir, overwrite=True)
        os.sync()  # no dirty pages: a drop must be able to evict the rank files
    return tp_dir


def spread(n: int, k: int | None) -> list[int]:
    """``k`` ranks of ``n`` spread evenly, first and last included (all of them without ``k``)."""
    if k is None or k >= n:
        return list(range(n))
    return sorted({round(i * (n - 1) / max(1, k - 1)) for i in range(k)})


def ratio(x: float, base: float | None) -> str:
    return f"{x / base:.2f}x" if base else ""


def row(n: int, mode: str, loader: str, ranks: list[int], reps: list[dict[str, Any]], first: list[dict[str, Any]],
        base: dict[str, float] | None) -> str:  # fmt: skip
    """One line of the table: medians over the repeats, ratios to ``base`` (the default loader's medians)."""
    which = "all" if mode == "together" or len(ranks) == n else ",".join(map(str, ranks))
    errors = [c["error"] for c in reps if "error" in c]
    if errors:
        return f"| {n} | {mode} | {loader} | {which} | error: {errors[0]} | | | | | | | | |"
    med = {k: statistics.median(c[k] for c in reps) for k in reps[0]}
    compared = [r.get("mismatches") for r in first]
    checked = "" if compared[0] is None else ("MISMATCH" if any(compared) else "equal")
    wall, cpu = (ratio(med[k], base and base[k]) for k in ("wall", "cpu"))
    gb = med["own"] / 1e9  # the ranks' bytes delivered
    return (
        f"| {n} | {mode} | {loader} | {which} | {med['wall']:.3f} | {wall} | {gb / med['wall']:.2f} "
        f"| {med['cpu']:.2f} | {cpu} | {med['cpu'] / gb:.2f} "
        f"| {med['read_bytes'] / GIB:.3f} | {med['read_bytes'] / med['own']:.2f} | {checked} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda or cpu (default cuda)")
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--loaders", nargs="+", choices=LOADERS, default=list(LOADERS))
    parser.add_argument("--ranks", type=int, help="turn and warm measure this many ranks, spread (default all)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/shardload-gpu-node"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--prepare", action="store_true", help="write the checkpoint and the rank files, then stop")
    parser.add_argument(
        "--stand-in",
        action="store_true",
        help="with --device cpu: shardload takes the GPU's data path (spans, uploads, cuts) on the CPU",
    )
    parser.add_argument("--stripes", choices=("on", "off"), default="on",
                        help="together: shardload's ranks stripe cold reads by LOCAL_RANK/LOCAL_WORLD_SIZE (off: "
                        "local_ranks=None, each rank alone)")  # fmt: skip
    parser.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stand_in:
        os.environ[STAND_IN] = "1"  # the children inherit it
    if args.child:
        child(*args.child)
        return 0
    import torch

    import shardload

    if args.device.startswith("cuda") and not torch.cuda.is_available() and not args.prepare:
        raise SystemExit("gpu_node.py: --device cuda, and torch sees no CUDA GPU (use --device cpu)")
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    loaders = []
    for name in args.loaders:
        if name in PEERS and importlib.util.find_spec(name) is None:
            print(f"loader {name}: skipped (not importable)")
        elif name == "instanttensor" and device == "cpu":
            print("loader instanttensor: skipped (CUDA only)")
        else:
            loaders.append(name)
    model = args.work / "llama"
    ensure_checkpoint(model, args.size_gib, math.lcm(*args.tp))
    path = model / MODEL_FILE
    if args.prepare:
        for n in args.tp:
            presharded(model, args.work, n)
        print(f"prepared {path} and its rank files for N = {' '.join(map(str, args.tp))}")
        return 0
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    print(f"checkpoint {path.stat().st_size / GIB:.2f} GiB; device {device} ({gpu}); torch {torch.__version__}; "
          f"{os.cpu_count()} CPUs; shardload from {Path(shardload.__file__).parent}")  # fmt: skip
    for line in floors(path, device):
        print(line)
    check_mode = next(m for m in ("warm", "turn", "together") if m in args.modes)
    firsts: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    print()
    print("| N | mode | loader | ranks | wall s | vs default | GB/s delivered | CPU s | vs default | CPU s / GB "
          "| read GiB | read / own | checked |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for n in args.tp:
        tp_dir = presharded(model, args.work, n)
        ranks = spread(n, args.ranks)
        for mode in args.modes:
            base = None
            for loader in loaders:
                reps = []
                for rep in range(args.repeats):
                    runs = run_cell(mode, loader, model, tp_dir, n, ranks, device, rep == 0 and mode == check_mode,
                                    args.stripes)  # fmt: skip
                    firsts.setdefault((n, mode, loader), runs)
                    reps.append(summarize(mode, runs))
                if loader == "default" and all("error" not in c for c in reps):
                    base = {k: statistics.median(c[k] for c in reps) for k in reps[0]}
                print(row(n, mode, loader, ranks, reps, firsts[(n, mode, loader)], base), flush=True)
    print()
    for (n, mode, loader), runs in firsts.items():
        if loader == "shardload" and all("error" not in r for r in runs):
            per = ", ".join(f"rank {r['rank']} {r['moved'] / r['delivered']:.3f}" for r in runs)
            print(f"shardload on {device}, N = {n}, {mode}: host bytes its readers moved per byte delivered: {per}")
            for r in runs:
                if "device" in r:
                    d = r["device"]
                    staged = d["read_bytes"] if d["staged_bytes"] is None else d["staged_bytes"]
                    print(f"  rank {r['rank']}: device path: {d['spans']} spans ({d['packed'] or 0} packed); per "
                          f"byte delivered {d['read_bytes'] / r['delivered']:.3f} read from the file (the "
                          f"kernel's copies), {staged / r['delivered']:.3f} of it into staging (gaps to a sink), "
                          f"{d['upload_bytes'] / r['delivered']:.3f} uploaded; {d['uploads']} uploads, "
                          f"{d['cuts']} device cuts")  # fmt: skip
            warmed = sum(r.get("warmed", 0) for r in runs)
            if warmed:
                print(f"shardload on {device}, N = {n}, {mode}: {warmed / GIB:.3f} GiB read in stripes to warm the "
                      f"page cache (all ranks)")  # fmt: skip
    mismatches = [(key, r) for key, runs in firsts.items() for r in runs if r.get("mismatches")]
    for (n, _mode, loader), r in mismatches:
        print(f"MISMATCH: {loader} rank {r['rank']} of {n}: {r['mismatches']} of {r['compared']} tensors differ from "
              f"shardload's CPU result, e.g. {r['mismatch']}")  # fmt: skip
    load1, load5, load15 = os.getloadavg()
    print(f"load average (1, 5, 15 min): {load1:.2f} {load5:.2f} {load15:.2f} on {os.cpu_count()} CPUs")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
