"""Run vLLM (a subprocess of the tests): greedy tokens and their logprobs for fixed prompts, as JSON.

Usage: python run_vllm.py JOBS.json
JOBS.json is a list of {"model", "load_format", "tp", "pp"?, "ep"?, "out", "extra"?, "save"?, "flip_before_fill"?};
the jobs share one world size (tp x pp) and run one after another in this process, which pays vLLM's import once.
A job that fails writes {"error": "..."} to its "out" and the next job still runs. A job with "save" then writes the
loaded model with vLLM's own ``ShardedStateLoader.save_model`` (``sharded_state`` rank files) into that directory;
such jobs keep the linear layers' weights in vLLM's state (:func:`keep_linear_weights`, in this process and in each
worker vLLM spawns, which imports this module first). A file with an "ep" job patches vLLM's CPU MoE the same way
(:func:`local_expert_ids`), for every job in it, so that expert-parallel generation runs at all. A tp=1 job with
"flip_before_fill" rewrites that file between shardload's load and its fill of vLLM's parameters
(:func:`flip_before_fill`).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from typing import Any

PROMPTS = [[1, 5, 9, 42, 7], [3, 17, 100, 4], [2, 2, 60, 33, 81, 12]]
TOKENS = 8


def flip_before_fill(path: str) -> Any:
    """Patch shardload's vLLM loader (in this process: a tp=1 job) so that every tensor byte of ``path`` is flipped in
    place after its load returned and before it fills vLLM's parameters, as a writer between the two would; returns
    the undo."""
    from shardload.integrations.vllm import loader

    original = loader.copy_into

    def copy_into(*args: Any, **kwargs: Any) -> Any:
        with open(path, "r+b") as f:
            header = int.from_bytes(f.read(8), "little")
            f.seek(8 + header)
            body = bytes(b ^ 0x5A for b in f.read())
            f.seek(8 + header)
            f.write(body)
        return original(*args, **kwargs)

    loader.copy_into = copy_into
    return lambda: setattr(loader, "copy_into", original)


def run_job(job: dict) -> dict:
    """Load one model in vLLM and return greedy tokens with their logprobs."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    undo = flip_before_fill(job["flip_before_fill"]) if job.get("flip_before_fill") else None
    try:
        llm = LLM(
            model=job["model"],
            load_format=job["load_format"],
            tensor_parallel_size=job["tp"],
            pipeline_parallel_size=job.get("pp", 1),
            enable_expert_parallel=job.get("ep", False),
            enforce_eager=True,
            dtype=job.get("dtype", "float32"),
            max_model_len=64,
            max_num_seqs=4,
            model_loader_extra_config=job.get("extra", {}),
            skip_tokenizer_init=True,
            seed=0,
            distributed_executor_backend=os.environ.get("RUN_VLLM_BACKEND"),
        )
    finally:
        if undo is not None:
            undo()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, logprobs=1, detokenize=False)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
        result = []
        for o in outputs:
            c = o.outputs[0]
            logprobs = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
            result.append({"tokens": list(c.token_ids), "logprobs": logprobs})
        if job.get("save"):
            os.makedirs(job["save"], exist_ok=True)
            llm.llm_engine.engine_core.save_sharded_state(job["save"])
        return {"outputs": result}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def keep_linear_weights() -> None:
    """Keep each linear layer's weight in vLLM's state, as vLLM on a GPU does: on the CPU vLLM packs it for oneDNN
    and replaces it with an empty tensor (``dispatch_cpu_unquantized_gemm(remove_weight=True)``), so its own
    ``save_model`` would write no linear weight at all. Patched before any model is built."""
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm

    def keep(layer: object, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    utils.dispatch_cpu_unquantized_gemm = keep


def local_expert_ids() -> None:
    """Test-only fix of vLLM 0.32's CPU MoE under expert parallelism, so that an ``ep`` job can generate at all:
    ``CPUUnquantizedExperts.apply`` takes the ``expert_map`` but hands the router's global expert ids to
    ``cpu_fused_moe``, which indexes the rank's local experts with them (a worker segfaults,
    ``csrc/cpu/cpu_fused_moe.cpp:242``). The patched ``apply`` maps each id through ``expert_map`` first; an expert
    another rank holds gets local id 0 and weight 0, so it adds exactly nothing here and its own rank adds its share
    in the all-reduce that follows. It changes no parameter and runs for every loader alike."""
    import torch
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    apply = CPUUnquantizedExperts.apply

    def apply_local(self: CPUUnquantizedExperts, **kwargs: Any) -> None:
        expert_map = kwargs.pop("expert_map")
        if expert_map is not None:
            if kwargs["apply_router_weight_on_input"]:  # weights already applied: a zero weight would not mask
                raise NotImplementedError("run_vllm.py: local_expert_ids with apply_router_weight_on_input")
            local = expert_map[kwargs["topk_ids"]]  # -1 where another rank holds the expert
            kwargs["topk_weights"] = torch.where(local >= 0, kwargs["topk_weights"], 0)
            kwargs["topk_ids"] = local.clamp(min=0).to(kwargs["topk_ids"].dtype)
        apply(self, expert_map=None, **kwargs)

    CPUUnquantizedExperts.apply = apply_local


KEEP_WEIGHTS = "RUN_VLLM_KEEP_LINEAR_WEIGHTS"
LOCAL_EXPERT_IDS = "RUN_VLLM_LOCAL_EXPERT_IDS"
if __name__ != "__main__":  # a worker process spawned by vLLM (it imports this module first)
    if os.environ.get(KEEP_WEIGHTS) == "1":
        keep_linear_weights()
    if os.environ.get(LOCAL_EXPERT_IDS) == "1":
        local_expert_ids()


def main() -> None:
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    worlds = {job["tp"] * job.get("pp", 1) for job in jobs}
    if len(worlds) != 1:
        raise SystemExit("run_vllm.py: jobs in one file must share a world size (tensor x pipeline parallel)")
    world = worlds.pop()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: one spawn less
    if world > 1:
        cpus = os.cpu_count() or 1
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % cpus) for i in range(world)))
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    launched = os.environ.get("RUN_VLLM_BACKEND") == "external_launcher"  # torchrun's groups stay up between jobs
    if any(job.get("save") for job in jobs):
        os.environ[KEEP_WEIGHTS] = "1"  # the workers vLLM spawns import this module: they patch on import
        keep_linear_weights()
    if any(job.get("ep") for job in jobs):
        os.environ[LOCAL_EXPERT_IDS] = "1"
        local_expert_ids()
    for job in jobs:
        try:
            result = run_job(job)
        except Exception as exc:  # the test reads the message
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        if not launched:
            cleanup_dist_env_and_memory()
        if os.environ.get("RANK", "0") == "0":
            with open(job["out"], "w") as f:
                json.dump(result, f)
        print(f"run_vllm: {job['load_format']} world={world} {job['model']} -> {job['out']}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # vLLM's shutdown waits seconds for worker processes; every result is written


if __name__ == "__main__":
    main()
