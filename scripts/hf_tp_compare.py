"""shardload against transformers' own tensor parallelism, for every model type with a TP plan.

For each model type the installed transformers gives a ``base_model_tp_plan``: build a tiny random model
from its config class (sizes shrunk generically), save it, then under ``torchrun --nproc_per_node 2``
(gloo, CPU) load it with ``from_pretrained(dir, tp_plan="auto")`` and with shardload's ``load_rank`` of
the same rank (planned from the model directory: ``plan --style hf``), and compare every local tensor
(``DTensor.to_local()``) element for element; a tied weight (``lm_head`` tied to the embeddings) is
compared with the tensor it is tied to. All types run in one launch (a crash relaunches the rest).

    python scripts/hf_tp_compare.py                       # every type, the table and counts
    python scripts/hf_tp_compare.py --types llama,gemma   # some types
    python scripts/hf_tp_compare.py --json results.json   # also write the results
    python scripts/hf_tp_compare.py --types 'llama#swap'  # control: each rank against the other's shard

Outcomes: ``equal``; ``differs`` (which tensors, and why when known); ``transformers fails``
(from_pretrained raised); ``shardload fails``; ``not instantiable`` (no tiny model from the config class).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

RANKS = 2
MAX_PARAMS = 50_000_000

# config attribute -> tiny value, set where the config class has the attribute
TINY: dict[str, Any] = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "intermediate_size": 128, "ffn_hidden_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "moe_ffn_hidden_size": 32, "dense_intermediate_size": 128, "ffn_dim": 128, "expert_ffn_hidden_size": 32,
    "zero_expert_num": 2,
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "num_key_value_heads": 2, "num_kv_heads": 2,
    "head_dim": 16, "attention_head_dim": 16, "vocab_size": 256, "max_position_embeddings": 128,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_k": 2, "top_k": 2, "moe_topk": 2, "n_shared_experts": 1, "num_shared_experts": 1,
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 16, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "sliding_window": 32, "num_global_key_value_heads": 2, "global_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1, "ssm_state_size": 16,
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 256, "laurel_rank": 8,
    "altup_num_inputs": 2, "num_kv_shared_layers": 0, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
SUB_CONFIGS = ("text_config", "decoder", "encoder")


def split_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"llama@vocab_size=257"`` -> ``("llama", {"vocab_size": 257})``: a model type and config overrides
    (flags after ``#``: ``swap``, the control that compares each rank with the other rank's shard; ``orig``, saved
    in the checkpoint's original format, one tensor per expert, which transformers stacks when loading)."""
    model_type, *overrides = spec.split("#")[0].split("@")
    return model_type, {k: json.loads(v) for k, _, v in (o.partition("=") for o in overrides)}


def tiny_config(spec: str) -> Any:
    """A config of ``spec``'s model type with every size attribute it has shrunk, then ``spec``'s overrides.

    Per-layer lists are cut to the layer count keeping one layer of each kind (attention and linear/mamba
    layers), a per-modality list of sizes shrinks element-wise, ``mrope_section`` follows the head size, and a
    config that refuses grouped-query attention is retried with as many KV heads as query heads.
    """
    from transformers import CONFIG_MAPPING

    model_type, overrides = split_spec(spec)
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    values = default.to_dict()
    layer_key = next((k for k in ("num_hidden_layers", "num_layers", "n_layer") if k in values), None)
    layers = values.get(layer_key) if layer_key else None
    kwargs: dict[str, Any] = {}
    for key, tiny in TINY.items():
        if key not in values:
            continue
        old = values[key]
        if (old == 0 or old is False) and key not in ("pad_token_id", "bos_token_id", "eos_token_id"):
            continue  # a feature the model has off (no RoPE part, no dense layers): keep it off
        per_item = isinstance(old, list) and old and isinstance(old[0], int) and len(old) != layers
        kwargs[key] = [tiny] * len(old) if per_item else tiny
    kinds = 2
    for key, value in values.items():
        if isinstance(value, list) and layers and len(value) == layers and key not in kwargs:
            kinds = max(kinds, len({json.dumps(v) for v in value}))
    for key, value in values.items():
        if key in kwargs or key in SUB_CONFIGS or not isinstance(value, list) or not layers:
            continue
        if len(value) == layers:
            seen: dict[str, int] = {}
            for i, v in enumerate(value):
                seen.setdefault(json.dumps(v), i)  # the first layer of each kind
            firsts = sorted(seen.values())
            picked = sorted(firsts + [i for i in range(len(value)) if i not in firsts][: kinds - len(firsts)])
            kwargs[key] = [value[i] for i in picked]
        elif key.endswith(("_layers", "layers_idx", "layer_idx", "layer_ids")):
            kwargs[key] = [i for i in value if isinstance(i, int) and i < kinds]
    if layer_key:
        kwargs[layer_key] = kinds
    for key in TINY:
        if isinstance(values.get(key), list) and layers and len(values[key]) == layers:
            kwargs[key] = [TINY[key]] * kinds  # one size per layer
    head_dim = kwargs.get("head_dim", 16)
    rope = values.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list) and len(rope["mrope_section"]) == 3:
        half = head_dim // 2
        kwargs["rope_parameters"] = {**rope, "mrope_section": [half - 2 * (half // 4), half // 4, half // 4]}
    if "mamba_d_head" in kwargs and "mamba_expand" in values:
        kwargs["mamba_d_head"] = values["mamba_expand"] * kwargs["hidden_size"] // kwargs.get("mamba_n_heads", 4)
    kwargs["tie_word_embeddings"] = model_type in TIED
    kwargs.update(overrides)
    try:
        config = cls(**kwargs)
    except Exception:
        if "num_key_value_heads" not in kwargs:
            raise
        config = cls(**{**kwargs, "num_key_value_heads": kwargs.get("num_attention_heads", 4)})
    config._attn_implementation = "eager"
    return config


TIED = {"gemma", "qwen2", "starcoder2"}  # saved with tied embeddings (lm_head not stored)


def build(spec: str, out: Path, entry: dict[str, Any]) -> str | None:
    """Save a tiny random model of ``spec`` (a model type, maybe with overrides) to ``out``; None when done, else
    why it cannot be built."""
    import torch

    model_type, _ = split_spec(spec)
    try:
        config = tiny_config(spec)
        model_cls = _model_class(model_type)
        if model_cls is None:
            return "no model class"
        with torch.device("meta"):  # count first: a size the shrinking missed must not allocate gigabytes
            count = sum(p.numel() for p in model_cls(config).parameters())
        if count > MAX_PARAMS:
            return f"{count} parameters after shrinking (a size attribute it does not know)"
        torch.manual_seed(0)
        model = model_cls(config).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.is_floating_point():
                    base = 1.0 if "norm" in name.lower() else 0.0
                    param.copy_(base + 0.1 * torch.randn_like(param))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            model.save_pretrained(out, save_original_format="#orig" in spec)
    except Exception as err:  # any failure of a config class or model to build tiny: reported, not raised
        return _one_line(err)
    return None


def _one_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return (text[0] if text else type(err).__name__)[:160]


# --- under torchrun -------------------------------------------------------------------------------


def compare_rank(model_dir: Path, rank: int, entry: dict[str, Any], swap: bool = False) -> dict[str, Any]:
    """This rank: transformers' local tensors against shardload's load_rank, tensor by tensor (``swap``: against
    the other rank's, a control that must differ)."""
    import torch

    import shardload
    from shardload.models.generated import generate

    try:
        model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
        model_cls = _model_class(model_type)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            model = model_cls.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
        theirs = {k: (v.to_local() if hasattr(v, "to_local") else v).detach() for k, v in model.state_dict().items()}
    except Exception as err:  # transformers' failure is an outcome of the comparison
        return {"outcome": "transformers fails", "why": _one_line(err)}
    try:
        # plain padding (to a multiple of N) splits a vocabulary where torch.chunk does, zero rows past the end
        plan = generate(model_dir, style="hf", check_up_to=0, vocab_padding="plain")
        ours = shardload.load_rank(model_dir, RANKS - 1 - rank if swap else rank, RANKS, shard_info=plan.document)
    except Exception as err:
        return {"outcome": "shardload fails", "why": _one_line(err), "vocab": _vocab_note(model_dir)}
    tied = {k: v for k, v in entry.get("tied", {}).items()}
    differs, compared, padded, departed = {}, 0, [], []
    for name, tensor in theirs.items():
        mine = ours.get(name)
        if mine is None and name in tied:
            mine = ours.get(tied[name])
        if mine is None:
            mine = _stacked(name, ours)
        for model_part, stored_part in _RENAMES:
            if mine is None:
                mine = ours.get(name.replace(model_part, stored_part))
        if mine is None:
            if name.endswith(("inv_freq", "position_ids")) or not tensor.is_floating_point():
                continue  # buffers transformers computes, not stored weights
            differs[name] = "not loaded by shardload"
            continue
        compared += 1
        if tuple(mine.shape) != tuple(tensor.shape):
            if _zero_padded(mine, tensor):
                padded.append(name)
                continue
            differs[name] = f"shape {list(mine.shape)} vs transformers {list(tensor.shape)}"
        elif not torch.equal(mine, tensor.to(mine.dtype)):
            fused = _fused_local(model_dir, name, rank) if name.endswith(_FUSED_SUFFIXES) else None
            if fused is not None and torch.equal(mine, fused):
                departed.append(name)  # transformers splits it plainly and gathers the output: docs/model-plans.md
                continue
            differs[name] = "values differ"
    for name in ours.keys() - theirs.keys() - set(tied.values()):
        if any(name.replace(stored, model) in theirs for model, stored in _RENAMES):
            continue  # compared under transformers' name above
        if ".experts." in name and any(name.endswith(f".{p}.weight") for p in _EXPERT_PARTS):
            continue  # one expert's tensor: compared inside transformers' stacked tensor above
        differs[name] = "not in transformers' model"
    return {"outcome": "differs" if differs else "equal", "differs": differs, "compared": compared, "padded": padded,
            "departed": departed}  # fmt: skip


_FUSED_SUFFIXES = (".qkv_proj.weight", ".qkv_proj.bias", ".gate_up_proj.weight", ".gate_up_proj.bias")


def _fused_local(model_dir: Path, name: str, rank: int) -> Any:
    """Where shardload departs from transformers on a fused tensor whose output transformers gathers: rank
    ``rank``'s part of every piece (its q, k and v heads; its part of gate and of up), computed from the stored
    tensor and config.json alone (None where the KV heads do not split evenly)."""
    import torch
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    full = None
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            if name in f.keys():
                full = f.get_tensor(name)
    if full is None:
        return None
    if ".gate_up_proj." in name:
        pieces = list(full.chunk(2, 0))
    else:
        heads = config["num_attention_heads"]
        kv = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        if kv % RANKS:
            return None
        pieces = list(full.split([heads * head_dim, kv * head_dim, kv * head_dim], 0))
    return torch.cat([p.chunk(RANKS, 0)[rank] for p in pieces], 0)


# transformers' conversions of MoE checkpoints stored one tensor per expert (conversion_mapping.py's "mixtral" and
# "qwen2_moe" patterns): stacked name -> the per-expert names it is made of, gate and up concatenated
_PER_EXPERT = {
    "experts.gate_up_proj": [("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight"),
                             ("experts.{e}.w1.weight", "experts.{e}.w3.weight")],
    "experts.down_proj": [("experts.{e}.down_proj.weight",), ("experts.{e}.w2.weight",)],
}  # fmt: skip


# transformers' renames of stored names (conversion_mapping.py): (name in the model, name in the checkpoint)
_RENAMES = [
    (".mlp.", ".block_sparse_moe."),  # mixtral pattern
    (".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"),  # exaone_moe
    (".mlp.gate.moe_statics.", ".mlp.moe_statics."),  # ernie4_5_moe
]
_EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _stacked(name: str, ours: dict[str, Any]) -> Any:
    """transformers' stacked expert tensor ``name`` built from shardload's per-expert tensors of this rank (each
    expert's gate and up concatenated, as transformers concatenates them), or None."""
    import torch

    for suffix, layouts in _PER_EXPERT.items():
        if not name.endswith(suffix):
            continue
        head = name[: -len(suffix)]
        for prefix in {head, head.replace(".mlp.", ".block_sparse_moe.")}:
            for parts in layouts:
                experts = []
                while all(prefix + p.format(e=len(experts)) in ours for p in parts):
                    experts.append(torch.cat([ours[prefix + p.format(e=len(experts))] for p in parts]))
                if experts:
                    return torch.stack(experts)
    return None


def _zero_padded(mine: Any, theirs: Any) -> bool:
    """Whether ``mine`` is ``theirs`` followed by zeros on one dim (a vocab padded to a multiple of N)."""
    import torch

    if mine.dim() != theirs.dim():
        return False
    dims = [d for d in range(mine.dim()) if mine.shape[d] != theirs.shape[d]]
    if len(dims) != 1 or mine.shape[dims[0]] < theirs.shape[dims[0]]:
        return False
    head = mine.narrow(dims[0], 0, theirs.shape[dims[0]])
    tail = mine.narrow(dims[0], theirs.shape[dims[0]], mine.shape[dims[0]] - theirs.shape[dims[0]])
    return torch.equal(head, theirs.to(mine.dtype)) and not tail.any()


def _model_class(model_type: str) -> Any:
    """The class a tiny ``model_type`` model is built and loaded with: the one the table names (sub-configs are in
    no auto mapping, so not AutoModel)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto

    config_cls = CONFIG_MAPPING[model_type]
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING, modeling_auto.MODEL_MAPPING):
        try:
            return mapping[config_cls]
        except (KeyError, ValueError, ImportError, AttributeError):
            pass  # not in this mapping, or a name the mapping lists that the package does not export
    gen = importlib.util.spec_from_file_location("gen_hf_tp_plans", Path(__file__).with_name("gen_hf_tp_plans.py"))
    module = importlib.util.module_from_spec(gen)
    gen.loader.exec_module(module)
    return module.sub_config_model_class(config_cls)


def _vocab_note(model_dir: Path) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config.get("vocab_size")
    return f"vocab {vocab} not divisible by {RANKS}" if isinstance(vocab, int) and vocab % RANKS else ""


def child(work: Path, types: list[str], results: Path, swap: bool = False) -> None:
    """Run under torchrun: every type in turn, both ranks in step; rank 0 appends one JSON line per type."""
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    entries = json.loads((work / "entries.json").read_text())
    for model_type in types:
        dist.barrier()
        try:
            swapped = swap or "#swap" in model_type
            got = compare_rank(work / _dir_name(model_type), rank, entries[model_type], swapped)
        except Exception:
            got = {"outcome": "shardload fails", "why": traceback.format_exc().strip().splitlines()[-1][:160]}
        everyone: list[Any] = [None] * RANKS
        dist.all_gather_object(everyone, got)
        if rank == 0:
            with results.open("a") as f:
                f.write(json.dumps({"type": model_type, "ranks": everyone}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


# --- GQA: N above the KV heads ----------------------------------------------------------------------

IDS_SEED = 1


def gqa_child(model_dir: Path, out: Path) -> None:
    """Under torchrun: transformers' TP forward of ``model_dir`` against its unsharded forward; rank 0 writes what
    happened (the error, or the largest logit difference) and each rank's k_proj shape."""
    import torch
    import torch.distributed as dist
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(IDS_SEED))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(input_ids=ids).logits
        model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
        k_proj = model.model.layers[0].self_attn.k_proj.weight
        result: dict[str, Any] = {"k_proj": list((k_proj.to_local() if hasattr(k_proj, "to_local") else k_proj).shape)}
        try:
            got = model(input_ids=ids).logits
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            result["max_abs_diff"] = float((got - want).abs().max())
        except Exception as err:  # transformers' failure is the finding
            result["error"] = _one_line(err)
    everyone: list[Any] = [None] * RANKS
    dist.all_gather_object(everyone, result)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(everyone))
    dist.destroy_process_group()


def gqa_proof(work: Path) -> dict[str, Any]:
    """An MQA Llama (4 query heads, 1 KV head) on 2 ranks: transformers splits the one KV head in halves;
    shardload gives both ranks the whole head, and a tensor-parallel forward over its shards
    (tests/helpers/tp_reference.py) matches the unsharded logits."""
    import torch
    import transformers

    import shardload
    from shardload.models.generated import generate

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from helpers import tp_reference

    model_dir = work / "gqa_llama"
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256, max_position_embeddings=64,
        num_attention_heads=4, num_key_value_heads=1,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(param))
    model.save_pretrained(model_dir)
    out = work / "gqa.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS)]
    subprocess.run([*cmd, __file__, "--gqa-child", str(model_dir), str(out)], capture_output=True, env=dict(
        os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))  # fmt: skip
    theirs = json.loads(out.read_text()) if out.exists() else [{"error": "the launch crashed"}]
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(IDS_SEED))
    plan = generate(model_dir, style="hf", check_up_to=0).document
    shards = [shardload.load_rank(model_dir, r, RANKS, shard_info=plan) for r in range(RANKS)]
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = tp_reference.decoder_logits(json.loads((model_dir / "config.json").read_text()), shards, ids)
    return {
        "transformers": theirs,
        "shardload": {
            "k_proj": [list(s["model.layers.0.self_attn.k_proj.weight"].shape) for s in shards],
            "max_abs_diff": float((got - want).abs().max()),
        },
    }


# --- the parent -----------------------------------------------------------------------------------


def summarize(model_type: str, ranks: list[dict[str, Any]], entry: dict[str, Any]) -> dict[str, Any]:
    """One row: the outcome over both ranks, with the differing tensors and their reasons."""
    outcomes = [r["outcome"] for r in ranks]
    for bad in ("transformers fails", "shardload fails"):
        if bad in outcomes:
            why = next(r for r in ranks if r["outcome"] == bad)
            return {"type": model_type, "outcome": bad, "why": why.get("why", ""), "vocab": why.get("vocab", "")}
    differs: dict[str, str] = {}
    for r, got in enumerate(ranks):
        for name, why in got.get("differs", {}).items():
            differs.setdefault(name, f"rank {r}: {why}")
    row = {"type": model_type, "outcome": "differs" if differs else "equal", "differs": differs}
    row["compared"] = sum(r.get("compared", 0) for r in ranks)
    row["padded"] = sorted({n for r in ranks for n in r.get("padded", [])})
    row["departed"] = sorted({n for r in ranks for n in r.get("departed", [])})
    return row


STALL_S = 180


def _launch(cmd: list[str], env: dict[str, str], results: Path) -> tuple[int, str]:
    """Run one torchrun launch; kill it when no type finished for STALL_S seconds. (exit status, last words)"""
    import signal
    import time

    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        last, size = time.monotonic(), -1
        while proc.poll() is None:
            time.sleep(1)
            now = results.stat().st_size if results.exists() else 0
            if now != size:
                last, size = time.monotonic(), now
            elif time.monotonic() - last > STALL_S:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return 1, f"no progress for {STALL_S} s (killed)"
        log.seek(0)
        lines = [line for line in log.read().strip().splitlines() if "Error" in line or "error" in line]
        return proc.returncode, (lines[-1][:120] if lines else f"exit status {proc.returncode}")


def _dir_name(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in spec)


def run(types: list[str] | None, work: Path, log: Any = sys.stderr, swap: bool = False) -> list[dict[str, Any]]:
    """Build every type's tiny model, compare in one torchrun launch (relaunched past a crash); one row per type."""
    from transformers import CONFIG_MAPPING
    from transformers import logging as hf_logging

    from shardload.models.hf_tp_tables import installed_entry

    hf_logging.set_verbosity_error()
    wanted = types or [t for t in sorted(CONFIG_MAPPING.keys()) if installed_entry(t) is not None]
    entries = {t: e for t in wanted if (e := installed_entry(split_spec(t)[0])) is not None}
    rows: dict[str, dict[str, Any]] = {}
    for model_type in wanted:
        if model_type not in entries:
            rows[model_type] = {"type": model_type, "outcome": "no TP plan"}
            continue
        why = build(model_type, work / _dir_name(model_type), entries[model_type])
        if why is not None:
            rows[model_type] = {"type": model_type, "outcome": "not instantiable", "why": why}
    (work / "entries.json").write_text(json.dumps(entries))
    pending = [t for t in entries if t not in rows]
    print(f"{len(pending)} tiny models built; comparing under torchrun x{RANKS}", file=log, flush=True)
    results = work / "results.jsonl"
    while pending:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS)]
        cmd += [__file__, "--child", str(work), ",".join(pending), str(results), "swap" if swap else "same"]
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
        returncode, tail = _launch(cmd, env, results)
        seen = set()
        if results.exists():
            for line in results.read_text().splitlines():
                got = json.loads(line)
                seen.add(got["type"])
                if got["type"] not in rows:
                    rows[got["type"]] = summarize(got["type"], got["ranks"], entries[got["type"]])
        rest = [t for t in pending if t not in seen]
        if rest and returncode:
            rows[rest[0]] = {"type": rest[0], "outcome": "transformers fails", "why": f"the launch ended: {tail}"}
            rest = rest[1:]
        elif rest:
            raise SystemExit(f"hf_tp_compare: the launch ended without results for {rest[:3]}")
        pending = rest
    return [rows[t] for t in wanted if t in rows]


def explain(row: dict[str, Any], config: dict[str, Any] | None) -> str:
    """The table's last column: why a type differs or fails, when the reason is known."""
    if row.get("vocab"):
        return f"{row['vocab']}; shardload: {row.get('why', '')}"
    if row["outcome"] == "differs":
        names = sorted(row["differs"])
        vocab = (config or {}).get("vocab_size")
        if isinstance(vocab, int) and vocab % RANKS:
            return f"vocab {vocab} not divisible by {RANKS}: " + ", ".join(names[:3])
        return "; ".join(f"{n} ({row['differs'][n]})" for n in names[:3]) + (
            f" (+{len(names) - 3} more)" if len(names) > 3 else ""
        )
    if row.get("padded"):
        return f"vocab padded with zeros past transformers' rows: {', '.join(row['padded'][:2])}"
    return row.get("why", "") or row.get("vocab", "")


def table(rows: list[dict[str, Any]], work: Path | None = None) -> str:
    """The printed table: model type, outcome, detail; then the counts per outcome."""
    lines = [f"{'model type':<40} {'outcome':<20} detail", "-" * 100]
    counts: dict[str, int] = {}
    for row in rows:
        config = None
        path = None if work is None else work / _dir_name(row["type"]) / "config.json"
        if path is not None and path.exists():
            config = json.loads(path.read_text())
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
        lines.append(f"{row['type']:<40} {row['outcome']:<20} {explain(row, config)}")
    lines.append("-" * 100)
    lines.append(", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + f" (of {len(rows)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--gqa-child":
        gqa_child(Path(sys.argv[2]), Path(sys.argv[3]))
        return 0
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]), sys.argv[3].split(","), Path(sys.argv[4]), sys.argv[5] == "swap")
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", help="comma-separated model types (default: every one with a TP plan)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--keep", type=Path, help="build the models here and keep them")
    parser.add_argument("--gqa", action="store_true", help="only the GQA proof (N above the KV heads)")
    parser.add_argument("--swap-ranks", action="store_true", help="control: compare each rank with the other's shard")
    args = parser.parse_args(argv)
    types = args.types.split(",") if args.types else None
    with contextlib.ExitStack() as stack:
        work = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hf_tp_compare-")))
        work.mkdir(parents=True, exist_ok=True)
        (work / "results.jsonl").unlink(missing_ok=True)
        if args.gqa:
            proof = gqa_proof(work)
            print(json.dumps(proof, indent=1))
            if args.json:
                args.json.write_text(json.dumps(proof, indent=1) + "\n")
            return 0
        rows = run(types, work, swap=args.swap_ranks)
        print(table(rows, work))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
