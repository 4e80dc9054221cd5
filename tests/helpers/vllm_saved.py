"""A directory as vLLM's own ``ShardedStateLoader.save_model`` writes it, made without vLLM: the rank files of
``convert --layout vllm`` (the tensors vLLM's state holds, proven equal to vLLM's own loader in tests_vllm/),
rewritten by safetensors in vLLM's way (another tensor order, no shardload metadata), no manifest, and the model's
config.json copied beside them as the user does."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from shardload.integrations.vllm.writer import convert_vllm


def fake_vllm_save(model: Path, num_shards: int, out: Path, expert_parallel: bool = False) -> Path:
    """Write ``model`` into ``out`` as vLLM's ``save_model`` at TP=``num_shards`` would (with
    ``enable_expert_parallel`` when ``expert_parallel``); return ``out``."""
    staged = out.parent / f"{out.name}.staged"
    convert_vllm(model, num_shards, staged, expert_parallel=expert_parallel)
    out.mkdir()
    for r in range(num_shards):
        name = f"model-rank-{r}-part-0.safetensors"
        tensors = load_file(staged / name)
        save_file(dict(reversed(tensors.items())), out / name, metadata={"format": "pt"})
    shutil.rmtree(staged)
    shutil.copy(model / "config.json", out / "config.json")
    return out
