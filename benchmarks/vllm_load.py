#!/usr/bin/env python
"""vLLM weight loading at tensor_parallel_size 2, 4 and 8: vLLM's default loader, ``load_format="shardload"``,
``sharded_state`` on ``shardload convert --layout vllm`` output, and ``shardload`` with
``model_loader_extra_config={"read_options": {"max_waste": "inf"}}`` (``shardload-unbounded``), measured side by side
in one run.

Usage (in the vLLM virtualenv, ``.ci/vllm-venv DIR``, from the repository root)::

    PYTHONPATH=$PWD DIR/bin/python benchmarks/vllm_load.py [--tp 2 4 8] [--size-gib 1.0] [--repeats 2] [--keep DIR]
        [--formats auto shardload sharded_state shardload-unbounded] [--launcher serial|per-rank|torchrun]

On a random ~``--size-gib`` bfloat16 Llama-shaped checkpoint (one safetensors file, GQA, untied head), every rank
of every tensor-parallel size N is built as a vLLM worker builds it (vLLM's config, its distributed state,
``initialize_model``) and loaded with each format, one process at a time. ``--launcher serial`` (the default): one
process per format and N, in which vLLM's tensor-parallel group (in a world of one) poses as each rank in turn
(loading runs no collective); each rank gets a fresh model (fresh pages: glibc's mmap threshold is fixed), and one
unmeasured load comes first so that no rank pays first-call imports the others do not. ``--launcher per-rank``: a
fresh process per rank, nothing shared (slower to run). ``--launcher torchrun``: the N ranks together under
``torchrun``, with vLLM's real groups (gloo and its shared-memory communicator), loading in turn.

Each load starts from a cold page cache: the checkpoint's pages are evicted (``posix_fadvise(DONTNEED)``) and
``mincore`` shows how many stayed (reported; 0 when eviction took). Storage bytes are ``/proc/self/io``
``read_bytes`` of the loading process over the cold load: what the kernel fetched from the block device for that
process alone (its reads, its page faults, readahead), in whole pages; the machine's block-device counters would
also count every other process. Bytes used are the rank's own bytes (its slices and the replicated tensors, from
shardload's plan), and for ``shardload`` its reader count; the page floor is the bytes of the file pages holding
them. The storage floor is the bytes a load moved over the cold sequential read speed of the same file measured
in the same run (16 MiB reads after eviction, before each format's loads; the best of the run). Then the load
runs again with the whole file cached (warm). Per format and N it prints the slowest rank's cold and warm time
(each rank its best of ``--repeats``) with CPU seconds beside them, every ratio, issue 30's table and its
targets, and the load average. It exits 1 if a target is missed (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FORMATS = ("auto", "shardload", "sharded_state", "shardload-unbounded")
VARIANTS = {"shardload-unbounded": ("shardload", {"read_options": {"max_waste": "inf"}})}
"""Formats that are ``load_format="shardload"`` with a ``model_loader_extra_config``: ``shardload-unbounded`` merges
every gap its I/O model says is cheaper to read than to skip, with no byte budget over the page floor."""
LAUNCHERS = {
    "serial": "one process per format and N, its ranks built and loaded in turn after one unmeasured load",
    "per-rank": "a fresh process per rank, one at a time",
    "torchrun": "the N ranks together under torchrun, loading in turn",
}
MODEL_FILE = "model.safetensors"
COLD_TARGET = {2: 0.6, 4: 0.5, 8: 0.4}
"""Issue 30: ``shardload``'s cold load at most this many times the default loader's, by tensor-parallel size."""
FLOOR_TARGET, WARM_TARGET, PAGE_SLACK = 1.2, 0.8, 1.05
SEQUENTIAL_READ = 16 << 20
M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


@dataclass
class RankRun:
    """One rank's loads with one format: cold and warm, wall and CPU seconds, and the bytes it moved and asked for."""

    fmt: str
    tp: int
    rank: int
    cold_s: float
    cold_cpu_s: float
    warm_s: float
    warm_cpu_s: float
    read_bytes: int
    rchar: int
    counted: int
    resident_after_evict: int


@dataclass
class Need:
    """What a rank must read of the source file: its bytes, and the bytes of the file pages holding them."""

    used: int
    pages: int


def make_model(out: Path, size_gib: float) -> None:
    """A random bfloat16 Llama with ~``size_gib`` GiB of weights (layers scaled to fit), config.json included."""
    import torch
    from safetensors.torch import save_file

    hidden, inter, vocab, heads, kv = 2048, 5632, 32000, 16, 4
    head_dim = hidden // heads
    per_layer = hidden * hidden * 2 + 2 * hidden * kv * head_dim + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((size_gib * 2**30 / 2 - 2 * vocab * hidden) / per_layer))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "lm_head.weight": rand(vocab, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors |= {
            f"{p}.self_attn.q_proj.weight": rand(hidden, hidden),
            f"{p}.self_attn.k_proj.weight": rand(kv * head_dim, hidden),
            f"{p}.self_attn.v_proj.weight": rand(kv * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": rand(hidden, hidden),
            f"{p}.mlp.gate_proj.weight": rand(inter, hidden),
            f"{p}.mlp.up_proj.weight": rand(inter, hidden),
            f"{p}.mlp.down_proj.weight": rand(hidden, inter),
            f"{p}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
    out.mkdir(parents=True)
    save_file(tensors, str(out / MODEL_FILE), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))


def needs(model: Path, num_shards: int) -> list[Need]:
    """Per rank: the bytes of the source file it must read (its runs; a tensor a compute step needs whole counts
    whole) and the bytes of the file pages holding them (a page shared with another rank's bytes is read whole)."""
    from checkpoints import covering_chunks

    from shardload.models.plan_source import plan_shard_info
    from shardload.planning.plan import build_plan
    from shardload.sources.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(model)
    plan = build_plan(plan_shard_info(checkpoint, None)[0], checkpoint, num_shards)
    out = []
    for rank in range(num_shards):
        used, pages = covering_chunks(plan, rank, mmap.PAGESIZE)
        out.append(Need(used=used, pages=len(pages) * mmap.PAGESIZE))
    return out


def evict(directory: Path) -> None:
    """Drop every file of ``directory`` from the page cache, so the next read of it comes from storage."""
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def resident_bytes(directory: Path) -> int:
    """Bytes of ``directory``'s files in the page cache (``mincore``), to show an eviction took."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    total = 0
    for path in directory.iterdir():
        size = path.stat().st_size if path.is_file() else 0
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
                total += sum(b & 1 for b in vec) * mmap.PAGESIZE
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


def warm(path: Path) -> None:
    """Read the whole file once, so the next load finds every page cached."""
    with open(path, "rb", buffering=0) as f:
        while f.read(SEQUENTIAL_READ):
            pass


def sequential_read_speed(path: Path) -> float:
    """Bytes per second of one cold sequential read of ``path`` (16 MiB reads after evicting it)."""
    evict(path.parent)
    buf = bytearray(SEQUENTIAL_READ)
    total, started = 0, time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while n := os.readv(fd, [buf]):
            total += n
    finally:
        os.close(fd)
    return total / (time.perf_counter() - started)


def proc_io() -> dict[str, int]:
    """This process's I/O counters (all its threads)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


@dataclass
class Built:
    """vLLM's model for one rank, with its config and the format's loader."""

    model: Any
    config: Any
    loader: Any


def engine_config(model_dir: str, load_format: str, tp: int, in_turn: bool = False) -> Any:
    """vLLM's config for loading ``model_dir`` with ``load_format`` at tensor_parallel_size ``tp`` (``in_turn``: the
    ranks of a real group load one after another, so they cannot compare the files they read at the end)."""
    from vllm.engine.arg_utils import EngineArgs

    load_format, extra = VARIANTS.get(load_format, (load_format, {}))
    if in_turn and load_format == "shardload":
        extra = {**extra, "compare_ranks": False}
    args = EngineArgs(model=model_dir, load_format=load_format, tensor_parallel_size=tp, dtype="bfloat16",
                      enforce_eager=True, max_model_len=64, skip_tokenizer_init=True,
                      model_loader_extra_config=extra,
                      distributed_executor_backend="external_launcher")  # fmt: skip
    return args.create_engine_config()


def build(config: Any) -> Built:
    """vLLM's model for the current tensor-parallel rank, built as a worker builds it (no weights loaded)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype), torch.device("cpu"):
        model = initialize_model(vllm_config=config, model_config=config.model_config)
    return Built(model, config, get_model_loader(config.load_config))


def measure(built: Built, model_dir: Path, load_format: str, tp: int, rank: int) -> RankRun:
    """The format's ``load_weights`` from a cold page cache, then from a warm one."""
    import gc

    from vllm.config import set_current_vllm_config

    from shardload.sources.reader import count_reads

    with set_current_vllm_config(built.config):
        evict(model_dir)
        resident = resident_bytes(model_dir)
        with count_reads() as seen:
            before, wall, cpu = proc_io(), time.perf_counter(), time.process_time()
            built.loader.load_weights(built.model, built.config.model_config)
            cold, cold_cpu, after = time.perf_counter() - wall, time.process_time() - cpu, proc_io()
        for path in model_dir.iterdir():
            if path.suffix == ".safetensors":
                warm(path)
        wall, cpu = time.perf_counter(), time.process_time()
        built.loader.load_weights(built.model, built.config.model_config)
        warm_s, warm_cpu = time.perf_counter() - wall, time.process_time() - cpu
    gc.collect()  # a loader's file mapping can outlive load_weights until collected; mapped pages resist eviction
    return RankRun(fmt=load_format, tp=tp, rank=rank, cold_s=cold, cold_cpu_s=cold_cpu, warm_s=warm_s,
                   warm_cpu_s=warm_cpu, read_bytes=after["read_bytes"] - before["read_bytes"],
                   rchar=after["rchar"] - before["rchar"], counted=seen.bytes,
                   resident_after_evict=resident)  # fmt: skip


@contextmanager
def tp_rank(tp: int, rank: int) -> Iterator[None]:
    """vLLM's tensor-parallel group, in this one-process world, reporting size ``tp`` and rank ``rank``."""
    import copy

    from vllm.distributed import parallel_state

    real = parallel_state._TP
    posed = copy.copy(real)
    posed.world_size, posed.rank_in_group, posed.ranks = tp, rank, list(range(tp))
    parallel_state._TP = posed
    try:
        yield
    finally:
        parallel_state._TP = real


def fresh_pages_per_allocation() -> None:
    """Fix glibc's mmap threshold at 128 KiB, so each rank's model gets fresh pages as in a fresh process (the
    dynamic threshold would let a later rank reuse heap memory an earlier rank's model faulted in)."""
    libc = ctypes.CDLL(None)
    if not libc.mallopt(M_MMAP_THRESHOLD, 128 << 10):
        raise SystemExit("vllm_load.py: mallopt(M_MMAP_THRESHOLD) failed")


def rank_child(load_format: str, model: str, tp: int, ranks: Sequence[int], warm_up: bool) -> None:
    """Ranks ``ranks`` of ``tp`` in this process, one after another (``--launcher serial`` and ``per-rank``): vLLM's
    distributed state for a world of one, its tensor-parallel group posing as each rank in turn, the rank's model
    built and measured, then freed. ``warm_up``: one unmeasured load first, so no rank pays the first call's
    imports that the others would not."""
    import gc

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank, parallel_state
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    if len(ranks) > 1:
        fresh_pages_per_allocation()
    init = Path(tempfile.gettempdir()) / f"shardload-vllm-bench-{uuid.uuid4().hex}"
    results = []
    try:
        with set_current_vllm_config(VllmConfig()):
            parallel_state.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{init}", backend="gloo"
            )
            parallel_state.initialize_model_parallel(1, 1)
        for rank in ([ranks[0]] if warm_up else []) + list(ranks):
            with tp_rank(tp, rank):
                if get_tensor_model_parallel_rank() != rank:
                    raise SystemExit(f"vllm_load.py: vLLM's tensor-parallel group did not take rank {rank} of {tp}")
                built = build(engine_config(model, load_format, tp))  # a config per model: it names its layers
                if warm_up:
                    with set_current_vllm_config(built.config):
                        built.loader.load_weights(built.model, built.config.model_config)
                    warm_up = False
                else:
                    results.append(asdict(measure(built, Path(model), load_format, tp, rank)))
                del built
                gc.collect()
    finally:
        init.unlink(missing_ok=True)
    print("RESULT " + json.dumps(results), flush=True)
    sys.stderr.flush()
    os._exit(0)  # vLLM's teardown of its groups adds seconds and nothing measured


def torchrun_child(load_format: str, model: str) -> None:
    """One torchrun process (``--launcher torchrun``): vLLM's real groups, the ranks loading in turn."""
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = engine_config(model, load_format, world, in_turn=True)
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, distributed_init_method="env://",
                                     backend="gloo")  # fmt: skip
        initialize_model_parallel(world, 1)
    built = build(config)
    result: dict[str, Any] = {}
    for turn in range(world):
        dist.barrier()
        if turn == rank:
            result = asdict(measure(built, Path(model), load_format, world, rank))
    dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    sys.stderr.flush()
    os._exit(0)


def _results(proc: subprocess.CompletedProcess[str], what: str) -> list[RankRun]:
    """The RankRuns a child printed, or the run stopped with its output's tail."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"vllm_load.py: {what} exited {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return [RankRun(**r) for r in json.loads(lines[-1].removeprefix("RESULT "))]


def child_env() -> dict[str, str]:
    """The environment vLLM's CPU workers expect: a KV cache size, and a shared-memory ident unique to this launch
    (vLLM's CPU worker sets ``VLLM_DIST_IDENT`` itself; a process that builds the model as a worker does must set
    it, and two launches sharing one find each other's segments: ``create shm ... errno 17``)."""
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_DIST_IDENT=f"shardload-bench-{uuid.uuid4().hex}")


def run_child(load_format: str, model: Path, tp: int, ranks: Sequence[int], warm_up: bool) -> list[RankRun]:
    """Ranks ``ranks`` in one fresh process, one after another."""
    which = ",".join(map(str, ranks))
    proc = subprocess.run(
        [sys.executable, __file__, "--child", load_format, str(model), str(tp), which, str(int(warm_up))],
        capture_output=True, text=True, env=child_env(), timeout=1800, check=False,
    )  # fmt: skip
    return _results(proc, f"{load_format} tp={tp} ranks {which}")


def run_torchrun(load_format: str, model: Path, tp: int) -> list[RankRun]:
    """The ``tp`` ranks together under torchrun, loading in turn; their shared-memory segments removed after."""
    env = child_env()
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // tp))
    torchrun = Path(sys.executable).parent / "torchrun"
    try:
        proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", str(tp), __file__,
                               "--torchrun-child", load_format, str(model)],
                              capture_output=True, text=True, env=env, timeout=1200, check=False)  # fmt: skip
    finally:
        for path in glob.glob(f"/dev/shm/*{env['VLLM_DIST_IDENT']}*"):  # left by os._exit; the ident is this run's
            Path(path).unlink(missing_ok=True)
    return _results(proc, f"torchrun {load_format} tp={tp}")


@dataclass
class Summary:
    """One format at one N: the slowest rank's best times, and the worst rank's ratio of each kind."""

    cold_s: float
    cold_cpu_s: float
    warm_s: float
    warm_cpu_s: float
    read_max: int
    x_needed: float
    x_pages: float
    x_floor: float
    rchar_max: int
    counted: tuple[float, float]
    resident: int


def summarize(runs: Sequence[RankRun], need: Sequence[Need], speed: float) -> Summary:
    """Each rank's best cold run (its bytes with it) and best warm run, then the slowest or worst over ranks."""
    ranks = sorted({r.rank for r in runs})
    cold = [min((r for r in runs if r.rank == k), key=lambda r: r.cold_s) for k in ranks]
    warm_runs = [min((r for r in runs if r.rank == k), key=lambda r: r.warm_s) for k in ranks]
    slow, slow_warm = max(cold, key=lambda r: r.cold_s), max(warm_runs, key=lambda r: r.warm_s)
    counted = [r.counted / need[r.rank].used for r in cold]
    return Summary(
        cold_s=slow.cold_s, cold_cpu_s=slow.cold_cpu_s, warm_s=slow_warm.warm_s, warm_cpu_s=slow_warm.warm_cpu_s,
        read_max=max(r.read_bytes for r in cold), x_needed=max(r.read_bytes / need[r.rank].used for r in cold),
        x_pages=max(r.read_bytes / need[r.rank].pages for r in cold),
        x_floor=max(r.cold_s / (r.read_bytes / speed) if r.read_bytes else float("inf") for r in cold),
        rchar_max=max(r.rchar for r in cold), counted=(min(counted), max(counted)),
        resident=max(r.resident_after_evict for r in runs),
    )  # fmt: skip


def mib(n: float) -> str:
    """Bytes as whole MiB, for the tables."""
    return f"{n / 2**20:.0f} MiB"


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table, as docs/benchmarks.md takes it."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def report(summaries: dict[tuple[str, int], Summary], need: dict[int, list[Need]], formats: Sequence[str]) -> bool:
    """Print the per-format table and issue 30's ratio table with its targets; True when every target is met."""
    head = [
        "TP",
        "format",
        "cold (slowest rank)",
        "CPU",
        "x default",
        "warm",
        "CPU",
        "x default",
        "storage per rank (max)",
        "x needed",
        "x page floor",
        "x storage floor",
        "read() per rank (max)",
    ]
    rows, issue, checks = [], [], []
    for tp in sorted(need):
        base = summaries.get(("auto", tp))
        for fmt in formats:
            s = summaries[(fmt, tp)]
            rows.append([str(tp), f"`{fmt}`", f"{s.cold_s:.3f} s", f"{s.cold_cpu_s:.3f} s",
                         f"{s.cold_s / base.cold_s:.2f}x" if base else "-", f"{s.warm_s:.3f} s",
                         f"{s.warm_cpu_s:.3f} s", f"{s.warm_s / base.warm_s:.2f}x" if base else "-",
                         mib(s.read_max), f"{s.x_needed:.2f}x",
                    f"{s.x_pages:.2f}x" if fmt != "sharded_state" else "-", f"{s.x_floor:.2f}x",
                         mib(s.rchar_max)])  # fmt: skip
        sl, st = summaries.get(("shardload", tp)), summaries.get(("sharded_state", tp))
        if sl is None:
            continue
        cold = sl.cold_s / base.cold_s if base else None
        warm_x = sl.warm_s / base.warm_s if base else None
        issue.append([str(tp), "1.00x" if base else "-", f"{cold:.2f}x" if cold is not None else "-",
                      f"{st.cold_s / base.cold_s:.2f}x" if st and base else "-", f"{sl.x_needed:.2f}x",
                      f"{sl.x_pages:.2f}x", f"{sl.x_floor:.2f}x", f"{warm_x:.2f}x" if warm_x is not None else "-",
                      f"{sl.counted[1]:.3f}x"])  # fmt: skip
        target = COLD_TARGET.get(tp)
        if cold is not None and target is not None:
            checks.append((f"TP={tp} cold <= {target}x default", cold <= target))
        if warm_x is not None:
            checks.append((f"TP={tp} warm <= {WARM_TARGET}x default", warm_x <= WARM_TARGET))
        checks.append((f"TP={tp} cold <= {FLOOR_TARGET}x storage floor", sl.x_floor <= FLOOR_TARGET))
        checks.append((f"TP={tp} reader count 1.00x", round(sl.counted[0], 3) == round(sl.counted[1], 3) == 1.0))
        checks.append((f"TP={tp} storage <= page floor + 5%", sl.x_pages <= PAGE_SLACK))
    print(table(head, rows))
    if issue:
        print()
        print(table(["TP", "default `auto` cold", "`shardload` cold", "`sharded_state` (our convert) cold",
                     "`shardload` storage bytes vs needed", "vs page floor", "cold vs storage floor",
                     "`shardload` warm vs default", "reader count vs needed"], issue))  # fmt: skip
    if checks:
        print("\ntargets (issue 30): " + "; ".join(f"{what}: {'met' if ok else 'MISSED'}" for what, ok in checks))
    return all(ok for _, ok in checks)


def main(argv: Sequence[str] | None = None) -> int:
    """Build (or reuse) the checkpoints, measure every rank of every N and format, print the tables."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8], help="tensor-parallel sizes (default 2 4 8)")
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2, help="runs per rank; each rank keeps its best")
    parser.add_argument(
        "--formats",
        nargs="+",
        choices=FORMATS,
        default=list(FORMATS),
        help="default: all; shardload-unbounded is load_format shardload with read_options max_waste inf",
    )
    parser.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="serial",
        help="serial: one process per format and N, its ranks in turn; per-rank: a fresh process per rank; "
        "torchrun: the N ranks together",
    )
    parser.add_argument("--keep", type=Path, help="build (or reuse) the checkpoints here instead of a temp dir")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--torchrun-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        fmt, model, tp, ranks, warm_up = args.child
        rank_child(fmt, model, int(tp), [int(r) for r in ranks.split(",")], warm_up == "1")
    if args.torchrun_child:
        torchrun_child(*args.torchrun_child)
    if args.repeats < 1 or any(tp < 1 for tp in args.tp):
        parser.error("--repeats and --tp take positive numbers")
    from importlib.metadata import version

    from shardload.integrations.vllm.writer import convert_vllm

    load_start = os.getloadavg()
    root = args.keep or Path(tempfile.mkdtemp(prefix="shardload-vllm-bench-"))
    model = root / "llama"
    dirs = {(fmt, tp): model if fmt != "sharded_state" else root / f"llama-vllm-tp{tp}" for fmt in args.formats
            for tp in args.tp}  # fmt: skip
    try:
        if not model.exists():
            make_model(model, args.size_gib)
        for (fmt, tp), path in dirs.items():
            if fmt == "sharded_state" and not path.exists():
                convert_vllm(model, tp, path)
        need = {tp: needs(model, tp) for tp in args.tp}
        runs: list[RankRun] = []
        speeds: list[float] = []
        started = time.perf_counter()
        for _ in range(args.repeats):
            for tp in args.tp:
                for fmt in args.formats:
                    speeds.append(sequential_read_speed(model / MODEL_FILE))  # beside every format's loads
                    if args.launcher == "torchrun":
                        runs += run_torchrun(fmt, dirs[(fmt, tp)], tp)
                    elif args.launcher == "serial":
                        runs += run_child(fmt, dirs[(fmt, tp)], tp, range(tp), warm_up=True)
                    else:
                        for rank in range(tp):
                            runs += run_child(fmt, dirs[(fmt, tp)], tp, [rank], warm_up=False)
        elapsed = time.perf_counter() - started
        speed = max(speeds)
        size = (model / MODEL_FILE).stat().st_size
        launched = LAUNCHERS[args.launcher]
        print(f"vLLM load_weights, {size / 2**30:.2f} GiB bfloat16 Llama, vllm {version('vllm-cpu')}, "
              f"{launched}; each rank from a cold page cache, best of {args.repeats} per rank\n")  # fmt: skip
        summaries = {(fmt, tp): summarize([r for r in runs if (r.fmt, r.tp) == (fmt, tp)], need[tp], speed)
                     for fmt in args.formats for tp in args.tp}  # fmt: skip
        ok = report(summaries, need, args.formats)
        print(
            f"\ncold sequential read of {MODEL_FILE} (16 MiB reads after eviction): best {speed / 1e9:.2f} GB/s "
            f"(all: {', '.join(f'{s / 1e9:.2f}' for s in speeds)}); storage floor = bytes moved / that speed"
        )
        for tp in args.tp:
            print(
                f"TP={tp} per rank: needed {mib(min(n.used for n in need[tp]))}..{mib(max(n.used for n in need[tp]))}"
                f", page floor {mib(min(n.pages for n in need[tp]))}..{mib(max(n.pages for n in need[tp]))}"
            )
        resident = max(s.resident for s in summaries.values())
        print(f"pages still cached after eviction (mincore, worst run): {mib(resident)}; storage: /proc/self/io "
              "read_bytes of the rank's process over its cold load; read(): rchar (a mapping's page faults are not "
              "in it); CPU: that process's CPU seconds over the load")  # fmt: skip
        load_end = os.getloadavg()
        print(f"load average at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, at end "
              f"{load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f} ({os.cpu_count()} cores); measuring took "
              f"{elapsed:.0f} s")  # fmt: skip
        return 0 if ok else 1
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
