"""The companion API (shardload.models.stored_layouts): format detection, the steps it writes, and its errors;
GGUF sources, also through ``shardload plan``."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import shardload
from helpers.quantized import rank_reference, save_gguf
from shardload.cli.main import main
from shardload.errors import CheckpointError, PlanError
from shardload.format.shard_info import ShardInfo
from shardload.models.generated import generate
from shardload.models.placement import Header, Placement, placement_from_steps
from shardload.models.stored_layouts import (
    companion_steps,
    detect_format,
    quantized_shard_info,
    read_quantization_config,
)


def _headers(**tensors: tuple[tuple[int, ...], str]) -> dict[str, Header]:
    return {name.replace("__", "."): Header(*v) for name, v in tensors.items()}


def _ct(prefix: str, out: int, inp: int, group: int = 32, asym: bool = False) -> dict[str, Header]:
    t = {
        f"{prefix}.weight_packed": Header((out, inp // 8), "int32"),
        f"{prefix}.weight_scale": Header((out, -(-inp // group)), "float16"),
        f"{prefix}.weight_shape": Header((2,), "int64"),
    }
    if asym:
        t[f"{prefix}.weight_zero_point"] = Header((out // 8, -(-inp // group)), "int32")
    return t


def column(name: str, segments: tuple[int, ...] = (), unit: int = 1, kv: tuple[bool, ...] = (), dim: int = 0):
    return Placement(name, "column", dim, segments, unit, kv)


def row(name: str, dim: int = 1) -> Placement:
    return Placement(name, "row", dim)


def test_detect_format_from_names_and_shapes() -> None:
    tensors = _headers(
        g__qweight=((8, 64), "int32"), g__qzeros=((2, 8), "int32"), g__scales=((2, 64), "float16"),
        w__qweight=((64, 8), "int32"), w__qzeros=((2, 8), "int32"), w__scales=((2, 64), "float16"),
        m__q_weight=((64, 8), "uint32"), m__q_scale=((64, 2), "float16"),
        f__weight=((64, 64), "float8_e4m3fn"), f__weight_scale=((1,), "float32"),
        d__weight=((64, 64), "float16"), d__bias=((64,), "float16"),
    ) | _ct("a", 64, 64)  # fmt: skip
    found = {p: detect_format(p, tensors) for p in "agwmfd"}
    assert found == {"a": "compressed-tensors", "g": "gptq", "w": "awq", "m": "mlc", "f": "scaled", "d": "dense"}
    assert detect_format("d.weight", tensors) == "dense"
    with pytest.raises(PlanError, match="no stored tensor of this weight"):
        detect_format("missing", tensors)
    # a bias is placed on its own: a stored tensor of no quantized layout gets steps for itself only
    assert set(companion_steps(column("d.weight"), tensors)) == {"d.weight"}
    assert companion_steps(column("d.bias"), tensors) == {
        "d.bias": [["shard_funcs.shard_dim", [["num_shards", "64 // num_shards"], "float16"], 0, "num_shards"]]
    }


def test_steps_are_n_agnostic_documents_that_validate() -> None:
    tensors = {**_ct("qkv", 192, 256, asym=True), **_ct("down", 256, 768, asym=True)}
    params = {
        **companion_steps(column("qkv.weight", (8, 2, 2), 16), tensors),
        **companion_steps(row("down.weight"), tensors),
    }
    # 16 rows per head packed 8 rows per int32 along out: the pack factor is 8
    assert params["qkv.weight_zero_point"] == [
        ["shard_funcs.shard_segments", [["num_shards", "24 // num_shards", 8], "int32"], 0, [8, 2, 2], [0, 0, 0],
         "num_shards", 16, 8]
    ]  # fmt: skip
    assert params["down.weight_scale"] == [
        ["shard_funcs.shard_groups", [["num_shards", 256, "24 // num_shards"], "float16"], 1, 32, "num_shards", 768]
    ]
    assert params["down.weight_shape"] == [
        ["shard_funcs.shard_shape", [["num_shards", 2], "int64"], 1, "num_shards", [], [], 1, 768]
    ]  # the packed length: an entry short of it (a partly filled last word) is refused
    info = ShardInfo.from_dict({"version": 1, "num_shards": None, "params": params})
    assert info.num_shards is None and set(info.params) == set(tensors)
    # replicated: every tensor listed with no steps
    replicated = Placement("qkv.weight", "replicated")
    assert companion_steps(replicated, tensors) == {name: [] for name in tensors if "qkv" in name}


def test_expert_weights_split_per_expert_or_inside_each() -> None:
    experts = _headers(e__weight_packed=((4, 64, 16), "int32"), e__weight_scale=((4, 64, 4), "bfloat16"),
                       e__weight_zero_point=((4, 8, 4), "int32"), e__weight_shape=((3,), "int64"))  # fmt: skip
    by_expert = companion_steps(Placement("e.weight", "expert", 0), experts)
    assert {n: s[0][2] for n, s in by_expert.items()} == dict.fromkeys(experts, 0)  # every tensor on dim 0
    inside = companion_steps(row("e.weight", 2), experts)
    assert inside["e.weight_packed"][0][:3] == ["shard_funcs.shard_packed", [["num_shards", 4, 64, "16 // num_shards"],
                                                                             "int32"], 2]  # fmt: skip
    assert inside["e.weight_zero_point"][0][0] == "shard_funcs.shard_groups"
    assert inside["e.weight_shape"][0][2] == 2
    by_out = companion_steps(column("e.weight", dim=1), experts)
    assert by_out["e.weight_zero_point"][0][:3] == ["shard_funcs.shard_packed", [["num_shards", 4, "8 // num_shards",
                                                                                  4], "int32"], 1]  # fmt: skip


def test_act_order_replicates_scales_on_row_splits() -> None:
    tensors = _headers(g__qweight=((96, 64), "int32"), g__qzeros=((24, 8), "int32"), g__scales=((24, 64), "float16"),
                       g__g_idx=((768,), "int32"))  # fmt: skip
    act = companion_steps(row("g.weight"), tensors, {"quant_method": "gptq", "bits": 4, "desc_act": True})
    assert act["g.scales"] == [] and act["g.qzeros"] == []
    assert act["g.g_idx"][0][0] == "shard_funcs.shard_dim" and act["g.qweight"][0][0] == "shard_funcs.shard_packed"
    plain = companion_steps(row("g.weight"), tensors, {"quant_method": "gptq", "bits": 4, "desc_act": False})
    assert plain["g.g_idx"] == [
        ["shard_funcs.shard_group_index", [["num_shards", "768 // num_shards"], "int32"], 24, "num_shards"]
    ]
    assert plain["g.scales"][0][0] == "shard_funcs.shard_groups"
    by_column = companion_steps(column("g.weight"), tensors, {"quant_method": "gptq", "desc_act": True})
    assert by_column["g.g_idx"] == [] and by_column["g.scales"][0][0] == "shard_funcs.shard_dim"


def test_layouts_that_cannot_follow_a_split_are_named() -> None:
    tensors = _ct("qkv", 60, 64, asym=False)
    with pytest.raises(PlanError) as err:
        companion_steps(row("qkv.weight"), {**tensors, "qkv.weight_scale": Header((60, 3), "float16")})
    assert str(err.value) == (
        "qkv.weight_scale: compressed-tensors layout: 3 entries along a dim of 64: "
        "cannot tell the group size (give the quantization_config)"
    )
    # FP8 blocks of 128 rows cannot separate fused segments of 64 rows
    fp8 = _headers(f__weight=((192, 256), "float8_e4m3fn"), f__weight_scale_inv=((2, 2), "float32"))
    with pytest.raises(PlanError, match=r"f.weight_scale_inv: fused segment 0 \(1 x 64 elements\)"):
        companion_steps(column("f.weight", (1, 1, 1), 64), fp8, {"weight_block_size": [128, 128]})
    with pytest.raises(PlanError, match="a tensor this planner does not know: weight_global_scale"):
        companion_steps(row("qkv.weight"), {**tensors, "qkv.weight_global_scale": Header((60,), "float32")})
    with pytest.raises(PlanError, match=r"^x.weight: gguf layout: no block size"):
        companion_steps(row("x.weight"), _headers(x__weight=((4, 2, 34), "uint8")), {"quant_method": "gguf"})
    with pytest.raises(PlanError, match=r"^qkv.weight: row split dim 2 is out of range for a 2-d weight"):
        companion_steps(row("qkv.weight", 2), tensors)
    with pytest.raises(ValueError, match="style must be one of"):
        Placement("w", "diagonal", 0)


def test_placement_from_steps_reads_the_example_plan(example_dir: Path) -> None:
    info = ShardInfo.load(example_dir / "shard_info.json")
    qkv = placement_from_steps("qkv", info.params["model.layers.0.self_attn.qkv_proj.weight"])
    assert (qkv.dim, qkv.segments, qkv.unit, qkv.kv) == (0, (16, 8, 8), 16, ())
    down = placement_from_steps("down", info.params["model.layers.0.mlp.down_proj.weight"])
    assert (down.style, down.dim) == ("row", 1)
    assert placement_from_steps("x", []).style == "replicated"
    gqa = placement_from_steps(
        "qkv", [["shard_funcs.shard_segments", [None, "float16"], 0, [8, 2, 2], [0, 1, 1], "num_shards", 16]]
    )
    assert gqa.kv == (False, True, True) and gqa.segments == (8, 2, 2) and gqa.unit == 16
    with pytest.raises(PlanError, match=r"^x: cannot carry steps.*only replicate, shard_dim"):
        placement_from_steps("x", [["myorg.scale_rows", [None, None], "num_shards"]])
    with pytest.raises(PlanError, match="different dims"):
        placement_from_steps("x", [["shard_funcs.reorder_segments", [None, None], 0, [2, 2], "num_shards"],
                                   ["shard_funcs.shard_dim", [None, None], 1, "num_shards"]])  # fmt: skip
    with pytest.raises(PlanError, match="names no tensor"):
        quantized_shard_info({"x.bias": []}, _headers(y__weight=((2, 2), "float16")))


def test_mlc_issue_3004_message_through_validate(tmp_path: Path) -> None:
    # down_proj with 16360 inputs in groups of 40: 409 groups, which no N > 1 can split
    rng = np.random.default_rng(0)
    tensors = {
        "model.layers.0.mlp.down_proj.q_weight": torch.from_numpy(rng.integers(0, 2**32, (8, 2045), dtype=np.uint32)),
        "model.layers.0.mlp.down_proj.q_scale": torch.rand(8, 409, dtype=torch.float32).half(),
    }
    (tmp_path / "m").mkdir()
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    qconfig = {"quant_method": "mlc", "bits": 4, "group_size": 40}
    shapes = {k: Header(tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in tensors.items()}
    params = companion_steps(row("model.layers.0.mlp.down_proj.weight"), shapes, qconfig)
    (tmp_path / "m" / "shard_info.json").write_text(json.dumps({"version": 1, "num_shards": None, "params": params}))
    done = CliRunner().invoke(main, ["validate", str(tmp_path / "m" / "shard_info.json"), "--model",
                                     str(tmp_path / "m"), "-n", "2"])  # fmt: skip
    assert done.exit_code == 1
    assert (
        "model.layers.0.mlp.down_proj.q_scale: step 1 (shard_funcs.shard_groups): 409 groups along dim 1 "
        "cannot be split across 2 ranks (group size 40): group 204 would straddle ranks 0 and 1"
    ) in done.output
    assert shardload.load(tmp_path / "m", 1, devices=["cpu"])[0].keys() == tensors.keys()


def _write_gguf(path: Path) -> dict[str, np.ndarray]:
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(6)
    data = {
        "blk.0.attn_q.weight": gguf.quants.quantize(rng.standard_normal((8, 64)).astype(np.float32),
                                                    gguf.GGMLQuantizationType.Q8_0),
        "blk.0.attn_norm.weight": rng.standard_normal(64).astype(np.float32),
        "token_embd.weight": rng.standard_normal((16, 64)).astype(np.float16),
    }  # fmt: skip
    q8 = gguf.GGMLQuantizationType.Q8_0
    save_gguf(path, {name: (value, q8 if name == "blk.0.attn_q.weight" else None) for name, value in data.items()})
    return data


def test_gguf_source_opens_plans_and_converts(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    data = _write_gguf(model / "tiny.gguf")
    (model / "tokenizer_config.json").write_text("{}")
    ckpt = shardload.sources.checkpoint.open_checkpoint(model)
    assert ckpt.kind == "gguf"
    assert {n: (t.shape, t.dtype) for n, t in ckpt.tensors.items()} == {
        "blk.0.attn_q.weight": ((8, 2, 34), "uint8"),
        "blk.0.attn_norm.weight": ((64,), "float32"),
        "token_embd.weight": ((16, 64), "float16"),  # numpy order: GGUF lists [64, 16]
    }
    qconfig = read_quantization_config(model / "tiny.gguf")
    assert qconfig is not None and qconfig["tensor_types"]["blk.0.attn_q.weight"]["type"] == "Q8_0"
    shapes = ckpt.tensors
    dense = {"blk.0.attn_q.weight": [["shard_funcs.shard_dim", [None, None], 1, "num_shards"]],
             "token_embd.weight": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]]}  # fmt: skip
    params = quantized_shard_info(dense, shapes, qconfig)
    assert params["blk.0.attn_q.weight"][0][:1] == ["shard_funcs.shard_groups"]
    (model / "shard_info.json").write_text(json.dumps({"version": 1, "num_shards": None, "params": params}))
    out = tmp_path / "tp2"
    shardload.convert(model, 2, out)
    assert not list(out.glob("*.gguf")) and (out / "tokenizer_config.json").exists()
    raw = data["blk.0.attn_q.weight"].reshape(8, 2, 34)
    for r in range(2):
        state = shardload.load_rank(out, r, 2)
        np.testing.assert_array_equal(state["blk.0.attn_q.weight"].numpy(), raw[:, r : r + 1])
        np.testing.assert_array_equal(state["token_embd.weight"].numpy(), data["token_embd.weight"][8 * r : 8 * r + 8])
        np.testing.assert_array_equal(state["blk.0.attn_norm.weight"].numpy(), data["blk.0.attn_norm.weight"])
    done = CliRunner().invoke(main, ["validate", str(model / "shard_info.json"), "--model", str(model), "-n", "4"])
    assert done.exit_code == 1 and "2 groups along dim 1 cannot be split across 4 ranks (group size 32)" in done.output


def test_bad_gguf_is_one_line_error(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 12)
    with pytest.raises(CheckpointError, match=r"bad\.gguf: not a readable GGUF file"):
        shardload.sources.checkpoint.open_checkpoint(bad)
    done = CliRunner().invoke(main, ["inspect", str(bad)])
    assert done.exit_code == 1 and done.output.count("\n") == 1 and "Traceback" not in done.output


def _write_gguf_llama(path: Path) -> dict[str, tuple[np.ndarray, Any]]:
    """A one-layer Llama as llama.cpp names it (Q8_0 and Q4_0 linear weights, plain embeddings and norms)."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(7)
    q8, q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0
    shapes = {
        "blk.0.attn_q.weight": ((128, 128), q8), "blk.0.attn_k.weight": ((64, 128), q8),
        "blk.0.attn_v.weight": ((64, 128), q4), "blk.0.attn_output.weight": ((128, 128), q8),
        "blk.0.ffn_gate.weight": ((256, 128), q4), "blk.0.ffn_up.weight": ((256, 128), q8),
        "blk.0.ffn_down.weight": ((128, 256), q8), "output.weight": ((96, 128), q8),
    }  # fmt: skip
    data: dict[str, tuple[np.ndarray, Any]] = {
        name: (gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), qtype), qtype)
        for name, (shape, qtype) in shapes.items()
    }
    data["token_embd.weight"] = (rng.standard_normal((96, 128)).astype(np.float16), None)
    for norm in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        data[norm] = ((1 + 0.1 * rng.standard_normal(128)).astype(np.float32), None)
    save_gguf(path, data, block_count=1, embedding_length=128, feed_forward_length=256, head_count=4, head_count_kv=2)
    return data


def test_plan_on_a_gguf_file(tmp_path: Path) -> None:
    """``shardload plan`` reads head counts from GGUF metadata, places llama.cpp's tensor names, and splits
    block-quantized weights on whole blocks and heads; each rank dequantizes to its part of the weight."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "llama.gguf"
    data = _write_gguf_llama(path)
    done = CliRunner().invoke(main, ["plan", str(path)])
    assert done.exit_code == 0, done.output
    assert "num_shards 1, 2, 4\n" in done.output and "note: 8 quantized weight(s) (gguf)" in done.output
    generated = generate(path)
    want = {
        "blk.0.attn_q.weight": ("column", 0, (4,), 32, (False,)),
        "blk.0.attn_k.weight": ("column", 0, (2,), 32, (True,)),
        "blk.0.attn_output.weight": ("row", 1, (4,), 32, (False,)),
        "blk.0.ffn_down.weight": ("row", 1, (), 1, ()),
        "token_embd.weight": ("vocab", 0, (), 1, ()),
        "output.weight": ("column", 0, (), 1, ()),
    }
    got = {n: (p.style, p.dim, p.segments, p.unit, p.kv) for n, p in generated.placements.items() if n in want}
    assert got == want
    assert generated.placements["output_norm.weight"].style == "replicated"
    for n in (1, 2, 4):
        shards = shardload.load(path, n, devices=["cpu"] * n)  # the plan written beside the file
        for name, (value, qtype) in data.items():
            placement = generated.placements[name]
            full = value if qtype is None else gguf.quants.dequantize(value, qtype)
            for r, shard in enumerate(shards):
                raw = shard[name].numpy()
                got_r = raw if qtype is None else gguf.quants.dequantize(raw.reshape(raw.shape[0], -1), qtype)
                want_r = full if placement.style == "replicated" else rank_reference(full, placement, n, r)
                np.testing.assert_array_equal(got_r, want_r, err_msg=f"{name} {r}/{n}")


def test_a_compressed_tensors_group_naming_the_layer_wins_over_a_class_target() -> None:
    """vLLM and compressed-tensors match a layer's name, then a regex, then a class ("Linear"); the first group whose
    targets matched was taken, so a class group listed first hid down_proj's own group size (refused at every N);
    up_proj, matched by a regex and by its name, takes its name's group."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    groups = {"group_0": {"targets": ["Linear"], "weights": {**weights, "group_size": 128}},
              "group_1": {"targets": ["re:.*down_proj$", "re:.*up_proj$"], "weights": {**weights, "group_size": 32}},
              "group_2": {"targets": ["model.up_proj"], "weights": {**weights, "group_size": 64}}}  # fmt: skip
    qconfig = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": groups}
    tensors = {
        **_ct("model.down_proj", 64, 256, 32),
        **_ct("model.up_proj", 64, 256, 64),
        **_ct("model.o", 64, 256, 128),
    }
    for prefix, group in (("model.down_proj", 32), ("model.up_proj", 64), ("model.o", 128)):
        steps = companion_steps(Placement(f"{prefix}.weight", "row", 1), tensors, qconfig)
        assert steps[f"{prefix}.weight_scale"][0][3] == group, (prefix, steps[f"{prefix}.weight_scale"])


def _write_f32_gguf(path: Path, arch: str, shapes: dict[str, tuple[int, ...]], split_max_tensors: int = 0) -> None:
    """A one-layer GGUF model of ``arch`` (64 wide, 4 heads, 2 KV heads) with float32 tensors of ``shapes``, in parts
    of ``split_max_tensors`` tensors where given."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_feed_forward_length(128)
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_family_whose_preset_knows_only_hugging_face_names_is_refused(tmp_path: Path) -> None:
    """A BERT GGUF (llama.cpp names): its preset's roles name Hugging Face tensors, none matched, and every tensor
    loaded whole on every rank at any N (plan wrote "params": {})."""
    path = tmp_path / "bert.gguf"
    _write_f32_gguf(path, "bert", {"token_embd.weight": (100, 64), "blk.0.attn_q.weight": (64, 64),
                                   "blk.0.attn_k.weight": (64, 64), "blk.0.attn_v.weight": (64, 64),
                                   "blk.0.attn_output.weight": (64, 64), "blk.0.ffn_up.weight": (128, 64),
                                   "blk.0.ffn_down.weight": (64, 128)})  # fmt: skip
    with pytest.raises(PlanError, match="model_type 'bert': the built-in preset knows its Hugging Face tensor names"):
        shardload.load_rank(path, 0, 2)
    done = CliRunner().invoke(main, ["plan", str(path), "-o", str(tmp_path / "si.json")])
    assert done.exit_code == 1 and "GGUF names" in done.output and not (tmp_path / "si.json").exists()


def test_a_split_gguf_model_needs_every_part(tmp_path: Path) -> None:
    """llama.cpp's split models (model-0000K-of-0000N.gguf, split.count in each): a part missing, or a part given
    alone, loaded the tensors that were there without a word."""
    model = tmp_path / "split"
    model.mkdir()
    shapes = {"token_embd.weight": (128, 64), "blk.0.attn_q.weight": (64, 64), "blk.0.attn_k.weight": (32, 64),
              "blk.0.attn_v.weight": (32, 64), "blk.0.attn_output.weight": (64, 64), "blk.0.ffn_up.weight": (128, 64),
              "blk.0.ffn_gate.weight": (128, 64), "blk.0.ffn_down.weight": (64, 128),
              "output_norm.weight": (64,)}  # fmt: skip
    _write_f32_gguf(model / "model.gguf", "llama", shapes, split_max_tensors=3)
    parts = sorted(model.glob("*.gguf"))
    assert len(parts) == 3
    assert len(shardload.load_rank(model, 1, 2)) == 9  # every part: the whole model
    with pytest.raises(
        CheckpointError, match=r"needs all its 3 parts.*here model-00001-of-00003\.gguf \(part 1 of 3\)"
    ):
        shardload.load_rank(parts[0], 0, 2)
    parts[1].rename(tmp_path / parts[1].name)
    with pytest.raises(
        CheckpointError, match=r"needs all its 3 parts, each once, and nothing else: here .*part 3 of 3\)"
    ):
        shardload.load_rank(model, 0, 2)


def test_a_gguf_header_is_parsed_once_per_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gguf's own reader decoded every tokenizer string, three times a load (24.6 s and 1.5 GB for a Llama 3
    tokenizer's 9 MB header); shardload's parser skips arrays and parses each file once."""
    import shardload.sources.gguf as gguf_source

    path = tmp_path / "llama.gguf"
    _write_gguf_llama(path)
    calls: list[Path] = []
    real = gguf_source.read_header
    monkeypatch.setattr(gguf_source, "read_header", lambda p: calls.append(p) or real(p))
    shardload.load_rank(path, 1, 2)
    assert calls == [path]
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file touched: parsed again
    shardload.load_rank(path, 1, 2)
    assert calls == [path, path]


def test_a_gguf_file_linked_from_outside_the_model_directory_is_refused(tmp_path: Path) -> None:
    """A directory's model.gguf that links out of it was read; the same link as model.safetensors is refused."""
    pytest.importorskip("gguf")
    outside = tmp_path / "outside"
    outside.mkdir()
    _write_gguf_llama(outside / "x.gguf")
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.gguf").symlink_to("../outside/x.gguf")
    with pytest.raises(CheckpointError, match="resolves outside the model directory"):
        shardload.load_rank(model, 0, 2)


@pytest.mark.parametrize("case", ["not-utf8-name", "alignment-48", "per-layer-kv-heads"])
def test_gguf_metadata_the_parser_meets(tmp_path: Path, case: str) -> None:
    """A metadata string no load uses that is not UTF-8 (gguf's reader loads it) loads; an alignment that is not a
    power of two (ggml pads with a mask: data at another offset) is refused; a head count given per layer is
    refused by the plan rather than left out (the default would be used)."""
    pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    rng = np.random.default_rng(1)
    data = {"token_embd.weight": (rng.standard_normal((64, 32)).astype(np.float32), None),
            "blk.0.attn_q.weight": (rng.standard_normal((32, 32)).astype(np.float32), None)}  # fmt: skip
    metadata: dict[str, Any] = {"block_count": 1, "embedding_length": 32, "head_count": 4, "name": "x"}
    metadata["head_count_kv"] = [2] if case == "per-layer-kv-heads" else 2
    if case == "alignment-48":
        metadata["custom_alignment"] = 64
    save_gguf(path, data, **metadata)
    raw = path.read_bytes()
    plain = {"version": 1, "params": {}}
    if case == "not-utf8-name":  # general.name "x" (type 8, length 1) becomes the byte 0xff
        name = b"general.name" + struct.pack("<IQ", 8, 1)
        path.write_bytes(raw.replace(name + b"x", name + b"\xff"))
        assert set(shardload.load_rank(path, 0, 1, shard_info=plain)) == set(data)
    elif case == "alignment-48":  # general.alignment 64 (type 4) becomes 48
        key = b"general.alignment" + struct.pack("<I", 4)
        path.write_bytes(raw.replace(key + struct.pack("<I", 64), key + struct.pack("<I", 48)))
        with pytest.raises(CheckpointError, match=r"general\.alignment must be a power of two"):
            shardload.load_rank(path, 0, 1, shard_info=plain)
    else:
        with pytest.raises(shardload.ShardloadError, match=r"attention\.head_count_kv holds one value per layer"):
            shardload.load_rank(path, 0, 2)


def test_gguf_types_whose_rows_are_interleaved_are_refused_whatever_gguf_knows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp's repacked ARM types (Q4_0_4_4 and kin, GGML types 31-33 and 36-38) store the blocks of 4 or 8
    rows interleaved. gguf 0.10 to 0.13 list them with Q4_0's block size, and shardload took them as plain row
    blocks: a row-parallel split loaded other values without a word. Only types whose data is whole rows of blocks
    one after another are read: the repacked ones are refused by type id, whatever the installed gguf lists."""
    import enum

    import gguf.constants

    from shardload.errors import CheckpointError
    from shardload.sources import gguf as gguf_source

    class OldTypes(enum.IntEnum):  # what an older gguf package lists, and a newer type of whole-row blocks
        Q4_0 = 2
        Q4_0_4_4 = 31
        NVFP4 = 40

    sizes = {OldTypes.Q4_0: (32, 18), OldTypes.Q4_0_4_4: (32, 18), OldTypes.NVFP4: (64, 36)}
    monkeypatch.setattr(gguf.constants, "GGMLQuantizationType", OldTypes)
    monkeypatch.setattr(gguf.constants, "GGML_QUANT_SIZES", sizes)
    for kind, shape in ((2, (16, 2, 18)), (40, (16, 1, 36))):
        plain = gguf_source._Entry("blk.0.ffn_down.weight", (64, 16), kind, 0)
        info, _ = gguf_source._tensor_info(tmp_path / "m.gguf", 1 << 20, 0, plain)
        assert info.shape == shape
    with pytest.raises(CheckpointError, match=r"type 31 is not one shardload splits: .*rows interleaved") as err:
        gguf_source._tensor_info(tmp_path / "m.gguf", 1 << 20, 0, gguf_source._Entry("blk.0.ffn_down.weight",
                                                                                     (64, 16), 31, 0))  # fmt: skip
    assert "\n" not in str(err.value) and "blk.0.ffn_down.weight" in str(err.value)
