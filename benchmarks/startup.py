"""Start-up of a model planned from transformers' TP table: commands from a fresh interpreter, and planning inside
``load_rank`` of a 1 GiB model; each against a baseline measured side by side in the same run.

Usage:
    python benchmarks/startup.py [--work DIR] [--rounds 5] [--size-gib 1.0] [--only commands,load_rank]
    python benchmarks/startup.py --only load_rank --python VENV/bin/python --preimport vllm   # in a vLLM worker

``commands``: ``shardload inspect MODEL -n 8`` of tiny models without shard_info.json (a Gemma 2, planned by its
built-in preset; a Gemma and a Gemma 3, planned from transformers' table), the same Gemma with its model type taken
out of the table (the fallback that imports transformers: what every such command paid before the table came
first), beside ``python -c pass`` and ``python -c "import shardload"``. Each command runs in a fresh process,
rounds interleaved, best of ``--rounds``; wall and CPU (user + system of the child) in seconds, with Python's
bytecode cache (as an installed package has it) and without it (``PYTHONDONTWRITEBYTECODE=1``, every module
compiled at each start).

``load_rank``: a ~1 GiB float16 Gemma-shaped checkpoint without shard_info.json; per fresh process (imports of
shardload and torch done first, not timed), the planning ``load_rank`` does (the config and headers planned in
memory from the table, ``build_plan`` for N=8), then ``load_rank(rank=3, num_shards=8)`` whole from a warm page
cache; beside the same with a shard_info.json in the model directory and with the table lacking the type. The
child runs ``gc.collect()`` after its imports: otherwise the first full collection of torch's objects (70-90 ms of
CPU, owed by the imports) lands in whichever phase allocates first. With ``--python`` and ``--preimport vllm`` the
children run in vLLM's virtualenv after importing vLLM, as a worker's loader plans
(``integrations/vllm/loader.py``: ``plan_shard_info`` then ``build_plan``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHARDLOAD = [sys.executable, str(ROOT / "cli.py")]
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256}
TINY |= {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8, "max_position_embeddings": 64}
KINDS = {"gemma2": "gemma2", "gemma": "gemma", "gemma3": "gemma3_text"}

# runs the command line with ``model_type`` taken out of the shipped table: planning falls back to transformers
WITHOUT_TYPE = """
import sys
from shardload.models import hf_tp_tables
drop, table = sys.argv.pop(1), hf_tp_tables.shipped_table()
dropped = {**table, "models": {k: v for k, v in table["models"].items() if k != drop}}
hf_tp_tables.shipped_table = lambda: dropped
from shardload.cli.main import main
sys.argv[0] = "shardload"
main()
"""


@dataclass
class Timing:
    """Best wall and CPU seconds of a command over the rounds."""

    wall: float = float("inf")
    cpu: float = float("inf")

    def add(self, wall: float, cpu: float) -> None:
        """Keep the best of this round and the earlier ones."""
        self.wall, self.cpu = min(self.wall, wall), min(self.cpu, cpu)


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one child process; it must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr[-500:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def write_tiny(directory: Path, model_type: str) -> Path:
    """A tiny random checkpoint of ``model_type`` (config.json + model.safetensors), written once by transformers."""
    if (directory / "config.json").exists():
        return directory
    import torch
    import transformers

    config_cls = transformers.CONFIG_MAPPING[model_type]
    model_cls = transformers.AutoModelForCausalLM._model_mapping[config_cls]
    torch.manual_seed(0)
    model_cls(config_cls(**TINY)).save_pretrained(directory)
    return directory


def commands(work: Path, rounds: int) -> None:
    """The command table: wall and CPU of each command, with and without a bytecode cache."""
    models = {kind: write_tiny(work / f"tiny-{kind}", model_type) for kind, model_type in KINDS.items()}
    rows: dict[str, list[str]] = {
        "python -c pass": [sys.executable, "-c", "pass"],
        'python -c "import shardload"': [sys.executable, "-c", "import shardload"],
        "inspect -n 8, tiny gemma2 (preset)": [*SHARDLOAD, "inspect", str(models["gemma2"]), "-n", "8"],
        "inspect -n 8, tiny gemma (table)": [*SHARDLOAD, "inspect", str(models["gemma"]), "-n", "8"],
        "inspect -n 8, tiny gemma3_text (table)": [*SHARDLOAD, "inspect", str(models["gemma3"]), "-n", "8"],
        "inspect -n 8, tiny gemma, not in the table (imports transformers)": [
            sys.executable, "-c", WITHOUT_TYPE, "gemma", "inspect", str(models["gemma"]), "-n", "8",
        ],
    }  # fmt: skip
    base = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as cache:
        envs = {
            "cached": {**base, "PYTHONPYCACHEPREFIX": cache, "PYTHONDONTWRITEBYTECODE": ""},
            "no .pyc": {**base, "PYTHONDONTWRITEBYTECODE": "1"},
        }
        for argv in rows.values():  # write the bytecode cache, warm the page cache
            timed(argv, envs["cached"])
        best = {(row, env): Timing() for row in rows for env in envs}
        for _ in range(rounds):
            for row, argv in rows.items():
                for env_name, env in envs.items():
                    best[row, env_name].add(*timed(argv, env))
    print(f"\nstart-up, best of {rounds} interleaved rounds, load average {load_average()}")
    print("| command | wall s | CPU s | wall / `python -c pass` | wall s, no .pyc | CPU s, no .pyc |")
    print("|---|---|---|---|---|---|")
    floor = best["python -c pass", "cached"].wall
    for row in rows:
        c, n = best[row, "cached"], best[row, "no .pyc"]
        print(f"| {row} | {c.wall:.3f} | {c.cpu:.3f} | {c.wall / floor:.1f}x | {n.wall:.3f} | {n.cpu:.3f} |")


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as uptime prints them."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


# --- planning inside load_rank ----------------------------------------------------------------


def write_gemma(model_dir: Path, size_gib: float) -> Path:
    """A random float16 Gemma-shaped checkpoint of about ``size_gib`` GiB (separate q/k/v and gate/up, tied
    embeddings), config.json and no shard_info.json; written once."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import checkpoints

    dims = checkpoints.choose_config(int(size_gib * 2**30), 8)
    config = {
        "model_type": "gemma", "architectures": ["GemmaForCausalLM"], "torch_dtype": "float16",
        "tie_word_embeddings": True, "head_dim": checkpoints.HEAD_DIM,
        **{k: dims[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")},
        **{k: dims[k] for k in ("num_attention_heads", "num_key_value_heads", "max_position_embeddings")},
    }  # fmt: skip
    if (model_dir / "config.json").exists() and json.loads((model_dir / "config.json").read_text()) == config:
        return model_dir
    h, inter, head = config["hidden_size"], config["intermediate_size"], checkpoints.HEAD_DIM
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    per_layer = 2 * (2 * h + 2 * q * h + 2 * kv * h + 3 * inter * h)
    config["num_hidden_layers"] = max(1, round((size_gib * 2**30 - 2 * (config["vocab_size"] + 1) * h) / per_layer))
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config["vocab_size"], h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        specs += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h))]
        specs += [(p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q))]
        specs += [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h))]
        specs += [(p + "mlp.down_proj.weight", (h, inter))]
    specs.append(("model.norm.weight", (h,)))
    model_dir.mkdir(parents=True, exist_ok=True)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in specs:
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(0)
    with open(model_dir / checkpoints.MODEL_FILE, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for _name, shape in specs:
            fh.write(checkpoints.random_f16(rng, shape, norm=len(shape) == 1).data)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return model_dir


# one fresh process: imports first (not timed), then planning as load_rank does it, then load_rank whole
CHILD = """
import importlib, json, sys, time
for name in sys.argv[3:]:
    importlib.import_module(name)  # what the host process has imported already (vllm: a vLLM worker)
import gc, torch, shardload
from shardload.models import hf_tp_tables
from shardload.models.plan_source import shard_info_for
from shardload.planning.plan import build_plan
from shardload.sources.checkpoint import open_checkpoint
gc.collect()  # the full collection the imports owe (torch's objects: 70-90 ms) falls here, not in a timed phase
model, drop = sys.argv[1], sys.argv[2]
if drop:
    table = hf_tp_tables.shipped_table()
    dropped = {**table, "models": {k: v for k, v in table["models"].items() if k != drop}}
    hf_tp_tables.shipped_table = lambda: dropped
clock = lambda: (time.perf_counter(), time.thread_time())
t0 = clock()
checkpoint = open_checkpoint(model)
t1 = clock()
info = shard_info_for(checkpoint, None)
t2 = clock()
plan = build_plan(info, checkpoint, 8)
t3 = clock()
state = shardload.load_rank(model, rank=3, num_shards=8)
t4 = clock()
assert len(state) == len(plan.params)
spans = {"header": (t0, t1), "shard_info": (t1, t2), "build_plan": (t2, t3), "planning": (t0, t3)}
spans["load_rank"] = (t3, t4)
print(json.dumps({k: [b[0] - a[0], b[1] - a[1]] for k, (a, b) in spans.items()}))
"""


def load_rank_rows(work: Path, size_gib: float, rounds: int, python: str, preimport: list[str]) -> None:
    """Planning inside load_rank: from the table, from a shard_info.json beside the weights, from transformers;
    each child runs ``python`` and imports ``preimport`` first (untimed)."""
    model = write_gemma(work / "gemma-1gib", size_gib)
    with_file = work / "gemma-1gib-with-file"
    with_file.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        if not (with_file / name).exists():
            os.link(model / name, with_file / name)  # a hard link: shardload refuses files outside the directory
    cache = work / "pycache"  # a bytecode cache, as an installed package has
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONPYCACHEPREFIX": str(cache), "PYTHONDONTWRITEBYTECODE": ""}
    if not (with_file / "shard_info.json").exists():
        subprocess.run([*SHARDLOAD, "plan", str(with_file)], env=env, check=True, capture_output=True)
    rows = {
        "shard_info.json beside the weights": (with_file, ""),
        "planned in memory from the table": (model, ""),
        "planned in memory, gemma not in the table (imports transformers)": (model, "gemma"),
    }
    size = (model / "model.safetensors").stat().st_size
    best: dict[str, dict[str, list[float]]] = {row: {} for row in rows}
    for round_ in range(rounds + 1):  # round 0 writes the bytecode cache and warms the page cache: not counted
        for row, (path, drop) in rows.items():
            argv = [python, "-c", CHILD, str(path), drop, *preimport]
            done = subprocess.run(argv, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{row}: exit {done.returncode}: {done.stderr[-1000:]}")
            for key, (wall, cpu) in json.loads(done.stdout.splitlines()[-1]).items():
                if round_ == 0:
                    continue
                old = best[row].get(key, [float("inf")] * 2)
                best[row][key] = [min(old[0], wall), min(old[1], cpu)]
    print(
        f"\nload_rank(rank=3, num_shards=8) of a {size / 2**30:.2f} GiB float16 gemma, warm page cache, fresh "
        f"process each ({python}{', after importing ' + ', '.join(preimport) if preimport else ''}), best of "
        f"{rounds}, load average {load_average()}; ms wall (thread CPU)"
    )
    print("| shard_info from | header | shard_info | build_plan | planning | load_rank whole | planning / load_rank |")
    print("|---|---|---|---|---|---|---|")
    for row, spans in best.items():
        cells = [f"{spans[k][0] * 1e3:.1f} ({spans[k][1] * 1e3:.1f})" for k in
                 ("header", "shard_info", "build_plan", "planning", "load_rank")]  # fmt: skip
        print(f"| {row} | {' | '.join(cells)} | {spans['planning'][0] / spans['load_rank'][0]:.2f} |")


def main() -> None:
    """Build the models once under --work, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None, help="keep the models here (default: a temporary dir)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--only", default="commands,load_rank")
    parser.add_argument("--python", default=sys.executable, help="load_rank rows: the interpreter of each child")
    parser.add_argument("--preimport", default="", help="load_rank rows: modules each child imports first (vllm)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="shardload-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))
    try:
        if "commands" in only:
            commands(work, args.rounds)
        if "load_rank" in only:
            preimport = [m for m in args.preimport.split(",") if m]
            load_rank_rows(work, args.size_gib, args.rounds, args.python, preimport)
    finally:
        if args.work is None:
            shutil.rmtree(work)


if __name__ == "__main__":
    main()
