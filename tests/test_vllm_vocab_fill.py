"""``load_format="shardload"`` with a vocabulary N does not divide, without vLLM: the plan's padded rank slice
fills vLLM's padded vocabulary shard (stored rows, then zeros), read in place; a plan padded by another rule is
detected and read whole, then narrowed; a converted directory is taken when padded by vLLM's rule and refused
when split another way; ``convert --layout vllm`` writes the same rows as the plan.

vLLM's row ranges come from :func:`shardload.integrations.vllm.names.vocab_range` (vLLM's ``pad_vocab_size`` rule,
which ``tests_vllm/`` checks against vLLM's own ``VocabParallelEmbedding``); the parameters are plain tensors
of vLLM's per-rank shape. vLLM serving such a model through this path is proven in ``tests_vllm/``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import shardload
from shardload.cli.main import main
from shardload.errors import ShardloadError
from shardload.integrations.fill import FillReport, copy_into
from shardload.integrations.vllm.loader import _converted_vocab, _read_planned
from shardload.integrations.vllm.names import Target, vocab_range
from shardload.integrations.vllm.sharded_state import rank_path
from shardload.integrations.vllm.writer import convert_vllm
from shardload.models.plan_source import plan_shard_info
from shardload.sources.checkpoint import open_checkpoint

pytest.importorskip("transformers")
from helpers import tiny_models

VOCAB, N = 251, 2
HEADS = ("model.embed_tokens.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("vllm_vocab")
    built = tiny_models.build("llama", root / "llama", vocab_size=VOCAB)
    plain = root / "plain.shard_info.json"
    result = CliRunner().invoke(main, ["plan", str(root / "llama"), "-o", str(plain), "--vocab-padding", "plain"])
    assert result.exit_code == 0, result.output
    return root, {k: v.detach().clone() for k, v in built.state_dict().items()}


def _fill(
    model_dir: Path, shard_info: Path | None, rank: int, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], set[str], FillReport]:
    """What the loader's planned branch puts into vLLM's rank-``rank`` vocabulary parameters (NaN where nothing)."""
    checkpoint = open_checkpoint(model_dir)
    info, _ = plan_shard_info(checkpoint, shard_info)
    vocab = {}
    targets = {}
    for name in HEADS:
        start, stop, per_rank = vocab_range(VOCAB, rank, N)
        vocab[name] = (start, stop, VOCAB, per_rank)
        targets[name] = torch.nn.Parameter(torch.full((per_rank, 64), float("nan"), dtype=dtype), requires_grad=False)
    report = FillReport()

    def route(name: str) -> Target | None:
        return Target(name) if name in HEADS else None

    tensors, direct, narrow, routes = _read_planned(checkpoint, info, rank, N, route, targets, vocab, report)
    assert set(tensors) == set(HEADS)
    filled = copy_into(targets, tensors, routes, vocab, narrow, str(model_dir), direct, server="vLLM")
    assert filled == set(HEADS)
    return {k: v.data for k, v in targets.items()}, direct, report


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["in_place", "scratch"])
@pytest.mark.parametrize("rule", ["vllm", "plain"])
def test_padded_vocabulary_fills_vllms_shards(
    model: tuple[Path, dict[str, torch.Tensor]], rule: str, dtype: torch.dtype
) -> None:
    """float64 parameters (vLLM's dtype is not the checkpoint's) are read into scratch tensors, then copied."""
    root, state = model
    for rank in range(N):
        info = None if rule == "vllm" else root / "plain.shard_info.json"
        got, direct, report = _fill(root / "llama", info, rank, dtype)
        start, stop, per_rank = vocab_range(VOCAB, rank, N)
        assert per_rank == 128 and stop - start == (128 if rank == 0 else 123)
        for name in HEADS:
            want = torch.zeros(per_rank, 64, dtype=dtype)
            want[: stop - start] = state[name][start:stop].to(dtype)
            assert torch.equal(got[name], want), (rule, rank, name)
        if rule == "vllm":  # the plan's padding is vLLM's: read straight into the parameters, no note
            assert direct == (set(HEADS) if dtype == torch.float32 else set()) and report.notes == []
        else:  # plain pads 251 to 252, 126 rows per rank: not vLLM's rows, so read whole and narrowed
            assert direct == set() and len(report.notes) == 1
            assert "lm_head.weight, model.embed_tokens.weight: the plan's split is not vLLM's" in report.notes[0]


def test_layout_vllm_writes_the_plans_padded_rows(model: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """``convert --layout vllm`` (vLLM's rule, applied itself) and the plan's default padding agree row for row."""
    root, state = model
    convert_vllm(root / "llama", N, root / "vllm2")
    for rank in range(N):
        planned = shardload.load_rank(root / "llama", rank, N)
        written = load_file(str(rank_path(root / "vllm2", rank)))
        for name in HEADS:
            assert written[name].shape == (128, 64)
            assert torch.equal(written[name], planned[name]), (rank, name)
    last = torch.cat([state["lm_head.weight"][128:], torch.zeros(5, 64)])  # rank 1: rows 128..250, then 5 zeros
    assert torch.equal(written["lm_head.weight"], last)


def test_converted_directory_padded_by_vllms_rule_fills_and_another_split_is_refused(
    model: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    root, state = model
    shardload.convert(root / "llama", N, root / "conv-vllm")
    shardload.convert(root / "llama", N, root / "conv-plain", shard_info=root / "plain.shard_info.json")
    for rank in range(N):
        start, stop, per_rank = vocab_range(VOCAB, rank, N)
        vocab = {name: (start, stop, VOCAB, per_rank) for name in HEADS}
        routes = {name: Target(name) for name in HEADS}
        stored = shardload.load_rank(root / "conv-vllm", rank, N, mmap=True)
        stored = {k: v for k, v in stored.items() if k in HEADS}
        narrow = _converted_vocab(stored, routes, vocab, rank, "conv-vllm")
        assert narrow == set()
        targets = {n: torch.nn.Parameter(torch.full((per_rank, 64), float("nan")), requires_grad=False) for n in HEADS}
        assert copy_into(targets, stored, routes, vocab, narrow, "conv-vllm", server="vLLM") == set(HEADS)
        for name in HEADS:
            want = torch.zeros(per_rank, 64)
            want[: stop - start] = state[name][start:stop]
            assert torch.equal(targets[name].data, want), (rank, name)
        plain = shardload.load_rank(root / "conv-plain", rank, N)
        with pytest.raises(ShardloadError, match=r"splits the vocabulary into 126 rows per rank; vLLM's padded "
                           r"vocabulary needs 128 rows per rank") as err:  # fmt: skip
            _converted_vocab({k: plain[k] for k in HEADS}, routes, vocab, rank, "conv-plain")
        assert "\n" not in str(err.value)


def test_an_even_split_of_a_divisible_vocabulary_is_refused_with_advice_that_works() -> None:
    """The default plan splits 250 rows evenly at N=2 (125 per rank, docs/model-plans.md); vLLM wants 128: the
    refusal points at ``--layout vllm`` or the source, never at the default plan, which gives the same 125 again."""
    routes = {name: Target(name) for name in HEADS}
    for rank in range(2):
        start, stop, per_rank = vocab_range(250, rank, 2)
        vocab = {name: (start, stop, 250, per_rank) for name in HEADS}
        with pytest.raises(ShardloadError, match="125 rows per rank") as err:
            _converted_vocab({k: torch.zeros(125, 4) for k in HEADS}, routes, vocab, rank, "conv")
        assert "--layout vllm" in str(err.value) and "(the default)" not in str(err.value)


def test_per_tensor_scales_stored_without_a_shape_fill_fused_and_plain_parameters() -> None:
    """AutoFP8 and ModelOpt FP8 store per-tensor scales 0-d; vLLM holds one per fused part ([3] for qkv_proj) and
    [1] for an unfused layer, and reshapes a 0-d scale to [1]. torch.cat of 0-d parts raised a bare RuntimeError,
    and a 0-d scale into a [1] parameter was refused as a plan that splits it otherwise."""
    qkv = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    o = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    targets = {"l.qkv_proj.weight_scale": qkv, "l.o_proj.weight_scale": o}
    tensors = {f"l.{p}_proj.weight_scale": torch.tensor(float(i + 1)) for i, p in enumerate("qkvo")}
    routes = {f"l.{p}_proj.weight_scale": Target("l.qkv_proj.weight_scale", i, 3) for i, p in enumerate("qkv")}
    routes["l.o_proj.weight_scale"] = Target("l.o_proj.weight_scale")
    filled = copy_into(targets, tensors, routes, {}, set(), "model-dir", server="vLLM")
    assert filled == set(targets) and qkv.tolist() == [1.0, 2.0, 3.0] and o.tolist() == [4.0]


def test_expert_input_scales_stored_without_a_shape_fill_one_value_per_expert() -> None:
    """vLLM's static-activation FP8 MoE keeps w13_input_scale [E] (gate's and up's, which must agree), w2's [E] and
    w13_weight_scale [E, 2]; 0-d scales into [E] raised a bare IndexError."""
    e = 2
    vname = "model.layers.0.mlp.experts"
    params = {
        "w13_input_scale": torch.zeros(e),
        "w2_input_scale": torch.zeros(e),
        "w13_weight_scale": torch.zeros(e, 2),
    }
    targets = {f"{vname}.{k}": torch.nn.Parameter(v, requires_grad=False) for k, v in params.items()}
    tensors, routes = {}, {}
    for x in range(e):
        for part, proj in enumerate(("gate_proj", "up_proj")):
            tensors[f"{vname}.{x}.{proj}.input_scale"] = torch.tensor(3.0 + x)
            routes[f"{vname}.{x}.{proj}.input_scale"] = Target(f"{vname}.w13_input_scale", part, 2, x)
            tensors[f"{vname}.{x}.{proj}.weight_scale"] = torch.tensor(10.0 * x + part)
            routes[f"{vname}.{x}.{proj}.weight_scale"] = Target(f"{vname}.w13_weight_scale", part, 2, x)
        tensors[f"{vname}.{x}.down_proj.input_scale"] = torch.tensor(7.0 + x)
        routes[f"{vname}.{x}.down_proj.input_scale"] = Target(f"{vname}.w2_input_scale", 0, 1, x)
    assert copy_into(targets, tensors, routes, {}, set(), "model-dir", server="vLLM") == set(targets)
    assert targets[f"{vname}.w13_input_scale"].tolist() == [3.0, 4.0]
    assert targets[f"{vname}.w2_input_scale"].tolist() == [7.0, 8.0]
    assert targets[f"{vname}.w13_weight_scale"].tolist() == [[0.0, 1.0], [10.0, 11.0]]
    tensors[f"{vname}.1.up_proj.input_scale"] = torch.tensor(5.0)  # gate 4.0, up 5.0: vLLM keeps one
    with pytest.raises(ShardloadError, match=r"expert 1's parts store 4\.0 and 5\.0: they must be equal"):
        copy_into(targets, tensors, routes, {}, set(), "model-dir", server="vLLM")


@pytest.mark.parametrize("inputs", [128, 124])
def test_a_kept_weight_shape_is_checked_only_where_this_rank_reads_it(tmp_path: Path, inputs: int) -> None:
    """vLLM keeps a compressed-tensors weight_shape whole; its plan's check (a partly filled last word split across
    ranks) runs on the values this rank reads. A rank that routes none of them (another pipeline stage's, another
    expert-parallel rank's) raised a bare KeyError, for any model."""
    from safetensors.torch import save_file

    from shardload.models.plan_source import plan_shard_info
    from shardload.sources.checkpoint import open_checkpoint

    h, heads, kv, hd = 64, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    tensors = {"model.norm.weight": torch.rand(h).half()}
    for name, (o, k) in {"self_attn.q_proj": (heads * hd, h), "self_attn.k_proj": (kv * hd, h),
                         "self_attn.v_proj": (kv * hd, h), "self_attn.o_proj": (h, heads * hd),
                         "mlp.gate_proj": (inputs, h), "mlp.up_proj": (inputs, h),
                         "mlp.down_proj": (h, inputs)}.items():  # fmt: skip
        prefix = f"model.layers.0.{name}"
        tensors[f"{prefix}.weight_packed"] = torch.randint(
            0, 2**31 - 1, (o, -(-k // 8)), dtype=torch.int32, generator=g
        )
        tensors[f"{prefix}.weight_scale"] = torch.rand(o, 1, generator=g).half()
        tensors[f"{prefix}.weight_shape"] = torch.tensor([o, k], dtype=torch.int64)
    model = tmp_path / "model"
    model.mkdir()
    save_file(tensors, str(model / "model.safetensors"))
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}  # fmt: skip
    config = {"model_type": "llama", "hidden_size": h, "intermediate_size": inputs, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": hd, "num_hidden_layers": 1, "vocab_size": 128,
              "quantization_config": qc}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    checkpoint = open_checkpoint(model)
    info, _ = plan_shard_info(checkpoint, None)
    norm = torch.nn.Parameter(torch.zeros(h).half(), requires_grad=False)
    only_norm = {"model.norm.weight": norm}
    got, *_ = _read_planned(checkpoint, info, 0, 2, lambda n: Target(n) if n in only_norm else None, only_norm, {},
                            FillReport())  # fmt: skip
    assert set(got) == {"model.norm.weight"}
    shape = "model.layers.0.mlp.down_proj.weight_shape"
    with_shape = {**only_norm, shape: torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)}
    route = lambda n: Target(n) if n in with_shape else None  # noqa: E731
    if inputs % 16:  # 62 inputs a rank: the last of 16 words is half filled
        with pytest.raises(ShardloadError, match=r"down_proj\.weight_shape.*partly filled"):
            _read_planned(checkpoint, info, 0, 2, route, with_shape, {}, FillReport())
    else:
        got, *_ = _read_planned(checkpoint, info, 0, 2, route, with_shape, {}, FillReport())
        assert got[shape].tolist() == [h, inputs]  # vLLM's value: the stored one


def test_per_expert_scales_stored_without_a_shape_are_placed_then_filled(tmp_path: Path) -> None:
    """The loader places each stored tensor in its slot before copying; a 0-d scale of an expert stacked as [E]
    (vLLM's FP8 MoE w2_weight_scale, w2_input_scale) raised a bare IndexError there, so no such model loaded."""
    from safetensors.torch import save_file

    from shardload.integrations.fill import place_slots

    vname = "model.layers.0.mlp.experts.w2_weight_scale"
    names = [f"model.layers.0.mlp.experts.{e}.down_proj.weight_scale" for e in range(3)]
    save_file({n: torch.tensor(1.5 + e) for e, n in enumerate(names)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "shard_info.json").write_text(json.dumps({"version": 1, "params": {}}))
    plan = shardload.plan_model(tmp_path, 2)
    routes = {n: Target(vname, 0, 1, e) for e, n in enumerate(names)}
    targets = {vname: torch.nn.Parameter(torch.zeros(3), requires_grad=False)}
    slots = place_slots(plan, targets, routes, {}, set())
    tensors = {n: slots[n] if n in slots else torch.tensor(1.5 + e) for e, n in enumerate(names)}
    assert copy_into(targets, tensors, routes, {}, set(), "model-dir", set(slots), server="vLLM") == {vname}
    assert targets[vname].tolist() == [1.5, 2.5, 3.5]


@pytest.mark.parametrize("parts", [1, 2])
def test_a_missing_expert_is_named_alone(parts: int) -> None:
    """Of a stacked expert parameter, the line names the experts the checkpoint lacks; for one of one part (w2) it
    named every expert."""
    vname = "m.experts.w2_weight" if parts == 1 else "m.experts.w13_weight"
    targets = {vname: torch.nn.Parameter(torch.zeros(4, 2 * parts, 3), requires_grad=False)}
    tensors, routes = {}, {}
    for e in (0, 2, 3):
        for p in range(parts):
            tensors[f"m.experts.{e}.p{p}.weight"] = torch.ones(2, 3)
            routes[f"m.experts.{e}.p{p}.weight"] = Target(vname, p, parts, e)
    with pytest.raises(ShardloadError, match=r"expert\(s\) \[1\] of vLLM's stacked parameter"):
        copy_into(targets, tensors, routes, {}, set(), "model-dir", server="vLLM")
