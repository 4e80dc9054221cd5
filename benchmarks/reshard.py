#!/usr/bin/env python
"""Loading from the shards only (docs/reshard.md): a directory converted for N_old, loaded for N_new.

Usage::

    python benchmarks/reshard.py [--size-gib 0.25] [--old 2,8] [--new 1,4,8] [--repeats 3] [--keep DIR]
                                 [--only shards|vllm-saved]

On the ~``--size-gib`` float16 Llama-shaped checkpoint of ``benchmarks/checkpoints.py`` (fused GQA qkv, gate_up,
8 KV heads), converted for each N_old, page cache warm: for each N_new, every rank loaded with
``load_rank(OUT, r, N_new)``. Bytes read per rank (shardload's reader count) against the rank's own bytes
(target <= 1.05x), and time for all N_new ranks against ``load_rank(MODEL, r, N_new)`` from the original checkpoint
(shown), in one process, best of ``--repeats``. Then ``convert OUT -n N_new`` against ``convert MODEL -n N_new``
(shown). Prints one markdown table; exits 1 if a byte ratio misses its target.

A second table: a Llama-named checkpoint of the same size and shapes (q, k, v and gate, up stored apart, as vLLM
reads them) saved as vLLM's ``save_model`` writes it at each N_old (the ``convert --layout vllm`` rank files and
config.json, no manifest), converted with ``convert SAVED -n N_new --layout vllm``: bytes read (the content checks
included) against the bytes of the rank tensors written, and wall and CPU time (best of ``--repeats``) against
``convert --layout vllm`` from this shardload's own ``sharded_state`` directory (its manifest) and from the
original, side by side in one process.
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


def best_wall_cpu(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """The best wall time and the best CPU time (this process, all threads) of ``repeats`` calls of ``fn``, after
    one untimed call."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return min(walls), min(cpus)


def ranks_of(model: Path, n: int) -> None:
    for r in range(n):
        shardload.load_rank(model, r, n)


def llama_checkpoint(model: Path, out: Path) -> None:
    """``model`` (fused qkv and gate_up) rewritten under Llama's names, q/k/v and gate/up apart (what vLLM reads)."""
    import json

    from safetensors.torch import load_file, save_file

    if (out / "model.safetensors").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    heads, kv, hidden = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
    q, k = heads * hidden // heads, kv * hidden // heads
    tensors = {}
    for path in sorted(model.glob("*.safetensors")):
        for name, t in load_file(path).items():
            if name.endswith("qkv_proj.weight"):
                base = name.removesuffix("qkv_proj.weight")
                for part, rows in zip(("q_proj", "k_proj", "v_proj"), t.split([q, k, k]), strict=True):
                    tensors[f"{base}{part}.weight"] = rows.contiguous()
            elif name.endswith("gate_up_proj.weight"):
                base = name.removesuffix("gate_up_proj.weight")
                for part, rows in zip(("gate_proj", "up_proj"), t.chunk(2), strict=True):
                    tensors[f"{base}{part}.weight"] = rows.contiguous()
            else:
                tensors[name] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
            "vocab_size", "max_position_embeddings", "rms_norm_eps")  # fmt: skip
    llama = {k: config[k] for k in keep if k in config} | {"model_type": "llama", "torch_dtype": "float16",
                                                           "architectures": ["LlamaForCausalLM"]}  # fmt: skip
    (out / "config.json").write_text(json.dumps(llama, indent=2))


def vllm_saved_rows(model: Path, work: Path, olds: list[int], news: list[int], repeats: int) -> tuple[list[str], bool]:
    """The second table's rows (and whether a byte ratio missed its target)."""
    from shardload.integrations.vllm.writer import convert_vllm
    from shardload.sources.safetensors_header import read_header

    llama = work / "llama"
    llama_checkpoint(model, llama)
    rows, missed = [], False
    for n_old in olds:
        own_dir, saved = work / f"llama-vllm{n_old}", work / f"llama-saved{n_old}"
        if not own_dir.exists():
            convert_vllm(llama, n_old, own_dir)
        if not saved.exists():
            saved.mkdir()
            for r in range(n_old):
                (saved / f"model-rank-{r}-part-0.safetensors").hardlink_to(
                    own_dir / f"model-rank-{r}-part-0.safetensors"
                )
            shutil.copy(llama / "config.json", saved / "config.json")
        for n_new in news:
            dest = work / "vllm-out"
            with count_reads() as seen:
                convert_vllm(saved, n_new, dest, overwrite=True)
            written = sum(t.nbytes for p in dest.glob("model-rank-*.safetensors") for t in read_header(p).values())
            ratio = seen.bytes / written
            missed |= ratio > TARGET
            t = {
                key: best_wall_cpu(lambda d=dest, n=n_new, s=src: convert_vllm(s, n, d, overwrite=True), repeats)
                for key, src in (("saved", saved), ("own", own_dir), ("model", llama))
            }
            shutil.rmtree(dest, ignore_errors=True)
            cells = " | ".join(f"{t[k][0]:.3f} s ({t[k][1]:.3f} s CPU)" for k in ("saved", "own", "model"))
            rows.append(
                f"| {n_old} | {n_new} | {ratio:.3f}x | {cells} | {t['saved'][0] / t['own'][0]:.2f}x "
                f"({t['saved'][1] / t['own'][1]:.2f}x CPU) | {t['saved'][0] / t['model'][0]:.2f}x "
                f"({t['saved'][1] / t['model'][1]:.2f}x CPU) |"
            )
    return rows, missed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size-gib", type=float, default=0.25)
    parser.add_argument("--old", default="2,8")
    parser.add_argument("--new", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="work directory to keep and reuse (default: a temporary one)")
    parser.add_argument("--only", choices=["shards", "vllm-saved"], help="run one of the two tables")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="shardload-reshard-"))
    model = work / "model"
    ensure_checkpoint(model, args.size_gib, 8)
    rows, missed = [], False
    olds, news = [int(x) for x in args.old.split(",")], [int(x) for x in args.new.split(",")]
    for n_old in olds if args.only != "vllm-saved" else []:
        out = work / f"tp{n_old}"
        if not out.exists():
            shardload.convert(model, n_old, out)
        for n_new in news:
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
    if rows:
        print()
        print(
            "| N_old | N_new | bytes read / own (max over ranks; target <= 1.05x) | load_rank x N_new from shards "
            "| from the original | ratio | convert from shards | from the original | ratio |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))
    if args.only != "shards":
        saved_rows, saved_missed = vllm_saved_rows(model, work, olds, news, args.repeats)
        missed |= saved_missed
        print()
        print(
            "| N_old (vLLM save) | N_new | bytes read / rank bytes written (target <= 1.05x) "
            "| convert --layout vllm from the save | from shardload's sharded_state | from the original "
            "| save / shardload's | save / original |"
        )
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(saved_rows))
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
