"""Run vLLM (a subprocess of the tests): greedy tokens and their logprobs for fixed prompts, as JSON.

Usage: python run_vllm.py JOBS.json
JOBS.json is a list of {"model", "load_format", "tp", "pp"?, "ep"?, "out", "extra"?, "save"?}; the jobs share one
world size (tp x pp) and run one after another in this process, which pays vLLM's import once.
A job that fails writes {"error": "..."} to its "out" and the next job still runs. A job with "save" then writes the
loaded model with vLLM's own ``ShardedStateLoader.save_model`` (``sharded_state`` rank files) into that directory;
such jobs keep the linear layers' weights in vLLM's state (:func:`keep_linear_weights`, in this process and in each
worker vLLM spawns, which imports this module first).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

PROMPTS = [[1, 5, 9, 42, 7], [3, 17, 100, 4], [2, 2, 60, 33, 81, 12]]
TOKENS = 8


def run_job(job: dict) -> dict:
    """Load one model in vLLM and return greedy tokens with their logprobs."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

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


KEEP_WEIGHTS = "RUN_VLLM_KEEP_LINEAR_WEIGHTS"
if os.environ.get(KEEP_WEIGHTS) == "1" and __name__ != "__main__":  # a worker process spawned by vLLM
    keep_linear_weights()


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
