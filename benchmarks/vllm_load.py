#!/usr/bin/env python
"""vLLM weight loading at tensor_parallel_size=2: vLLM's default loader, ``load_format="shardload"``, and
``sharded_state`` on ``shardload convert --layout vllm`` output, measured side by side in one run.

Usage (in the vLLM virtualenv, ``.ci/vllm-venv DIR``)::

    DIR/bin/python benchmarks/vllm_load.py [--size-gib 1.0] [--repeats 2] [--keep DIR]

On a random ~``--size-gib`` bfloat16 Llama-shaped checkpoint (one safetensors file, GQA, untied head), each
format runs under ``torchrun --nproc_per_node 2``: each process builds vLLM's model for its tensor-parallel
rank exactly as a vLLM worker does (vLLM's config, its parallel groups, ``initialize_model``) and calls the
format's ``load_weights``. The ranks load one after the other, each from a cold page cache (the checkpoint's
pages are evicted with ``posix_fadvise(DONTNEED)`` first), so ``/proc/self/io`` ``read_bytes`` counts what that
worker alone read from storage, then once more from the warm cache. Reported per format: the slower rank's cold
and warm load times (best of ``--repeats`` interleaved rounds), and each rank's bytes read from storage (and by
``read()``/``preadv()``: ``rchar``; and by shardload's own reader count) against its own shard plus the
replicated tensors (the bytes it must read). Targets: ``shardload`` reads at most 1.05x of that on every rank
(its reader count), and loads in at most 0.5x the default loader's time (cold). It prints one table and exits 1
if a target is missed (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FORMATS = ("auto", "shardload", "sharded_state")


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
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))


def needed_bytes(model: Path, num_shards: int) -> int:
    """The bytes a rank must read: its own slice of every split tensor plus every replicated tensor."""
    from shardload.models.plan_source import plan_shard_info
    from shardload.planning.plan import build_plan
    from shardload.sources.checkpoint import open_checkpoint
    from shardload.sources.dtypes import itemsize

    checkpoint = open_checkpoint(model)
    plan = build_plan(plan_shard_info(checkpoint, None)[0], checkpoint, num_shards)
    total = 0
    for param in plan.params.values():
        count = itemsize(param.dtype)
        for n in param.shape:
            count *= n
        total += count
    return total


def _evict(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def child(load_format: str, model: str) -> None:
    """One torchrun process: vLLM's model for this rank, then the format's load_weights, ranks in turn."""
    import torch
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.plugins import load_general_plugins
    from vllm.utils.torch_utils import set_default_torch_dtype

    from shardload.sources.reader import count_reads

    load_general_plugins()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    args = EngineArgs(model=model, load_format=load_format, tensor_parallel_size=world, dtype="bfloat16",
                      enforce_eager=True, max_model_len=64, skip_tokenizer_init=True,
                      distributed_executor_backend="external_launcher")  # fmt: skip
    config = args.create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, distributed_init_method="env://",
                                     backend="gloo")  # fmt: skip
        initialize_model_parallel(world, 1)
        loader = get_model_loader(config.load_config)
        with set_default_torch_dtype(config.model_config.dtype), torch.device("cpu"):
            vmodel = initialize_model(vllm_config=config, model_config=config.model_config)
        result: dict[str, Any] = {}
        for turn in range(world):
            dist.barrier()
            if turn == rank:
                _evict(Path(model))
                with count_reads() as seen:
                    before, started = _io(), time.perf_counter()
                    loader.load_weights(vmodel, config.model_config)
                    after, cold = _io(), time.perf_counter() - started
                started = time.perf_counter()
                loader.load_weights(vmodel, config.model_config)  # again: the checkpoint's pages now cached
                result = {"rank": rank, "seconds": cold, "warm": time.perf_counter() - started,
                          "read_bytes": after["read_bytes"] - before["read_bytes"],
                          "rchar": after["rchar"] - before["rchar"], "counted": seen.bytes}  # fmt: skip
        dist.barrier()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    sys.stdout.flush()
    os._exit(0)


def run_format(load_format: str, model: Path) -> list[dict[str, Any]]:
    torchrun = Path(sys.executable).parent / "torchrun"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // 2)))
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "2", __file__, "--child", load_format, str(model)],
                          capture_output=True, text=True, env=env, timeout=1200, check=False)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(
            f"{load_format}: torchrun exited {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="build (or reuse) the checkpoints here instead of a temp dir")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    from shardload.engine.vllm_layout import convert_vllm

    root = args.keep or Path(tempfile.mkdtemp(prefix="shardload-vllm-bench-"))
    model, state = root / "llama", root / "llama-vllm-tp2"
    try:
        if not model.exists():
            make_model(model, args.size_gib)
        if not state.exists():
            convert_vllm(model, 2, state)
        dirs = {"auto": model, "shardload": model, "sharded_state": state}
        best: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.repeats):
            for fmt in FORMATS:
                ranks = run_format(fmt, dirs[fmt])
                if fmt not in best or max(r["seconds"] for r in ranks) < max(r["seconds"] for r in best[fmt]):
                    best[fmt] = ranks
        need = [needed_bytes(model, 2)] * 2
        size = (model / "model.safetensors").stat().st_size
        base = max(r["seconds"] for r in best["auto"])
        print(f"vLLM load_weights, tensor_parallel_size=2, {size / 2**30:.2f} GiB bfloat16 Llama, cold page cache "
              f"per rank, best of {args.repeats}\n")  # fmt: skip
        warm_base = max(r["warm"] for r in best["auto"])
        head = ["format", "cold load", "x default", "warm load", "x default"]
        head += [f"rank {r} {what}" for r in range(2) for what in ("storage read", "x needed", "read()")]
        rows = []
        for fmt in FORMATS:
            slow, warm = max(r["seconds"] for r in best[fmt]), max(r["warm"] for r in best[fmt])
            cells = [fmt, f"{slow:.2f} s", f"{slow / base:.2f}x", f"{warm:.2f} s", f"{warm / warm_base:.2f}x"]
            for r in best[fmt]:
                cells += [f"{r['read_bytes'] / 2**20:.0f} MiB", f"{r['read_bytes'] / need[r['rank']]:.3f}x",
                          f"{r['rchar'] / 2**20:.0f} MiB"]  # fmt: skip
            rows.append(cells)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        print("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        print(
            f"\nneeded per rank (own shard + replicated): {need[0] / 2**20:.0f} MiB, {need[1] / 2**20:.0f} MiB; "
            "storage read: /proc/self/io read_bytes from a cold page cache (whole pages, readahead included); "
            "read(): rchar, the bytes read() and preadv() returned (a file mapping's page faults are not in it)"
        )
        shard = best["shardload"]
        counted = ", ".join(f"rank {r['rank']} {r['counted'] / 2**20:.0f} MiB ({r['counted'] / need[r['rank']]:.3f}x)"
                            for r in shard)  # fmt: skip
        print(f"shardload's reader count (every tensor byte it read or copied from a mapping): {counted}")
        ok_bytes = all(r["counted"] <= 1.05 * need[r["rank"]] for r in shard)
        ok_time = max(r["seconds"] for r in shard) <= 0.5 * base
        print(
            f"targets: shardload reads <= 1.05x needed on every rank: {'met' if ok_bytes else 'MISSED'}; "
            f"loads in <= 0.5x the default loader's time: {'met' if ok_time else 'MISSED'}"
        )
        if not (ok_bytes and ok_time):
            sys.exit(1)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
