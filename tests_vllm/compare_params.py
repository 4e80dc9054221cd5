"""Compare vLLM's parameters after a load format's load with its default loader's, bit for bit (a test subprocess).

Usage: python compare_params.py JOBS.json OUT.json
JOBS.json is a list of {"case", "model", "tp", "ep"?, "dtype"?, "formats": {format: model dir}, "controls"?:
bool}. Every rank of a TP group is built in this one process, one after another: vLLM's tensor-parallel group is
replaced by one of the job's size and rank (no collectives run while a model is built and loaded), so no worker is
started and no token is generated. Each model's parameters are filled with a marker (NaN, or 0x5A bytes) before
its load, so a parameter a loader skips cannot compare equal. OUT.json maps "case/format/tp/rank" to {"status":
"equal" | "differs" | "error", "detail"}; with "controls", two loads that must differ are recorded too: rank r
loaded with the next rank's shard ("swapped"), and one loaded parameter set back to the marker ("unfilled").
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@dataclass
class Built:
    """A vLLM model built for one rank, with the config its loader needs."""

    model: Any
    config: Any


def _init_once() -> None:
    """vLLM's distributed state for one process (world size 1, gloo); the TP group is swapped per job later."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    path = tempfile.mktemp(prefix="shardload-vllm-dist-")
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{path}", backend="gloo"
        )
        parallel_state.initialize_model_parallel(1, 1)


@contextmanager
def as_rank(tp: int, rank: int) -> Iterator[None]:
    """Make vLLM's tensor-parallel group report size ``tp`` and rank ``rank`` in this process."""
    from vllm.distributed import parallel_state

    real = parallel_state._TP
    fake = copy.copy(real)
    fake.world_size, fake.rank_in_group, fake.ranks = tp, rank, list(range(tp))
    parallel_state._TP = fake
    try:
        yield
    finally:
        parallel_state._TP = real


@contextmanager
def no_fp8_kernel() -> Iterator[None]:
    """Let vLLM build FP8 linear layers on a CPU without AMX: its kernel choice (made after the parameters are
    created, used only by a forward pass) is replaced by a stub; the parameters and their weight loaders are vLLM's."""
    from vllm.model_executor.layers.quantization import fp8

    real = fp8.init_fp8_linear_kernel
    fp8.init_fp8_linear_kernel = lambda **kwargs: None
    try:
        yield
    finally:
        fp8.init_fp8_linear_kernel = real


def build(
    model_dir: str, load_format: str, tp: int, ep: bool, dtype: str = "float32", extra: dict[str, Any] | None = None
) -> Built:
    """vLLM's model for the current (faked) rank, every parameter holding the marker (an FP8 model's linear layers
    without a kernel: see :func:`no_fp8_kernel`); ``extra``: the loader's ``model_loader_extra_config``."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    args = EngineArgs(model=model_dir, load_format=load_format, tensor_parallel_size=tp, enable_expert_parallel=ep,
                      dtype=dtype, enforce_eager=True, max_model_len=64, skip_tokenizer_init=True,
                      distributed_executor_backend="mp", model_loader_extra_config=extra or {})  # fmt: skip
    config = args.create_engine_config()
    with (
        set_current_vllm_config(config),
        set_default_torch_dtype(config.model_config.dtype),
        torch.device("cpu"),
        no_fp8_kernel(),
    ):
        model = initialize_model(vllm_config=config, model_config=config.model_config)
    for param in model.parameters():
        mark(param.data)
    return Built(model, config)


def mark(data: Any) -> None:
    """Fill ``data`` with the marker: NaN for floats, 0x5A in every byte otherwise."""
    import torch

    if data.dtype.is_floating_point:
        data.fill_(float("nan"))
    elif data.numel():
        data.view(-1).view(torch.uint8).fill_(0x5A)


def load(built: Built, load_format: str) -> None:
    """Run ``load_format``'s ``load_weights`` on ``built`` (the default loader's, shardload's or sharded_state's)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    with set_current_vllm_config(built.config):
        get_model_loader(built.config.load_config).load_weights(built.model, built.config.model_config)


def state(model: Any) -> dict[str, Any]:
    """Every parameter's bytes (a copy), by name."""
    import torch

    return {n: p.data.detach().clone().contiguous().view(-1).view(torch.uint8) for n, p in model.named_parameters()}


def compare(expected: dict[str, Any], model: Any, defaulted: frozenset[str] = frozenset()) -> tuple[str, str]:
    """``("equal", "")`` when every parameter's bytes are the default loader's, else the first difference;
    ``defaulted``: KV-cache scales the default loader left for vLLM to set after loading (not compared)."""
    import torch

    got = dict(model.named_parameters())
    if set(got) != set(expected):
        return "differs", f"parameter names differ: {sorted(set(got) ^ set(expected))[:4]}"
    for name, want in expected.items():
        if name in defaulted:
            continue
        have = got[name].data.contiguous().view(-1).view(torch.uint8)
        if have.shape != want.shape or not torch.equal(have, want):
            return "differs", f"{name}: bytes differ ({list(got[name].shape)})"
    return "equal", ""


def unfilled(model: Any) -> list[str]:
    """Parameters the default loader itself left at the marker (a comparison cannot vouch for those)."""
    import torch

    out = []
    for name, p in model.named_parameters():
        data = p.data
        if data.numel() and data.dtype.is_floating_point and bool(torch.isnan(data).all()):
            out.append(name)
    return out


def run_job(job: dict[str, Any], results: dict[str, Any]) -> None:
    """Every rank of one job: the default loader, then each format, compared; the controls when asked."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from shardload.sources.reader import count_reads

    tp, ep, dtype = job["tp"], bool(job.get("ep")), job.get("dtype", "float32")
    extras = job.get("extra", {})  # "shardload@name" -> model_loader_extra_config: the format before the "@"
    for rank in range(tp):
        with as_rank(tp, rank):
            assert get_tensor_model_parallel_rank() == rank
            key = f"{job['case']}/%s/{tp}/{rank}"
            try:
                base = build(job["model"], "auto", tp, ep, dtype)
                load(base, "auto")
                expected = state(base.model)
                from shardload.integrations.vllm.names import OPTIONAL_SUFFIXES

                blank = unfilled(base.model)
                defaulted = frozenset(n for n in blank if n.endswith(OPTIONAL_SUFFIXES))  # vLLM sets them later
                blank = [n for n in blank if n not in defaulted]
                del base
            except Exception as exc:
                traceback.print_exc()
                for fmt in job["formats"]:
                    results[key % fmt] = {"status": "error", "detail": f"default loader: {type(exc).__name__}: {exc}"}
                continue
            for fmt, model_dir in job["formats"].items():
                try:
                    built = build(model_dir, fmt.split("@")[0], tp, ep, dtype, extras.get(fmt))
                    with count_reads() as seen:
                        load(built, fmt)
                    status, detail = compare(expected, built.model, defaulted)
                    if blank:
                        detail += f" (default loader left {blank[:3]} unfilled)"
                    own = sum(p.numel() * p.element_size() for p in built.model.parameters())
                    results[key % fmt] = {"status": status, "detail": detail, "read": seen.bytes, "own": own,
                                          "moved": seen.moved}  # fmt: skip
                    if job.get("controls") and "@" not in fmt:
                        mark(next(p for p in built.model.parameters() if p.numel()).data)
                        status, detail = compare(expected, built.model, defaulted)
                        results[key % f"{fmt}+unfilled"] = {"status": status, "detail": detail}
                    del built
                except Exception as exc:
                    traceback.print_exc()
                    results[key % fmt] = {"status": "error", "detail": f"{type(exc).__name__}: {exc}".strip()}
                if job.get("controls") and tp > 1 and "@" not in fmt:
                    with as_rank(tp, (rank + 1) % tp):
                        try:
                            other = build(model_dir, fmt, tp, ep, dtype)  # the controls: plain formats only
                            load(other, fmt)
                            status, detail = compare(expected, other.model, defaulted)
                        except Exception as exc:
                            status, detail = "error", f"{type(exc).__name__}: {exc}"
                        results[key % f"{fmt}+swapped"] = {"status": status, "detail": detail}


def main() -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    _init_once()
    results: dict[str, Any] = {}
    for job in jobs:
        run_job(job, results)
        print(f"compare_params: {job['case']} tp={job['tp']} ep={bool(job.get('ep'))} done", flush=True)
        with open(sys.argv[2], "w") as f:
            json.dump(results, f, indent=1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
