"""Proof for every quantized format: dequantize(shard r of the stored tensors) == shard r of dequantize(all of them).

Each format gets a model with three quantized modules, one per kind of split: column-parallel with
fused segments (gate_up-like), column-parallel with GQA (KV heads replicated once N exceeds them)
and row-parallel. Their steps come from :func:`shardload.models.stored_layouts.companion_steps`, the data is
random, and each rank's tensors are dequantized with the format's own reference
(compressed_tensors, gguf) or the one in ``helpers/quant_reference.py``, element for element, N = 1, 2,
3 (where the heads allow it), 4, 8. The module builders (``helpers/quantized.py``) also make the
synthetic quantized Llamas of test_quant_llama.py (``helpers/quant_llama.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import shardload
from helpers.quantized import (
    Builder,
    Dequant,
    Tensors,
    awq_module,
    fp8_module,
    gptq_module,
    local_tensors,
    mlc_module,
    rank_reference,
    save_gguf,
)
from shardload.models.placement import Header, Placement
from shardload.models.stored_layouts import companion_steps
from shardload.sources.checkpoint import open_checkpoint

ALL_N = (1, 2, 3, 4, 8)
GQA_N = (1, 2, 4, 8)  # 2 KV heads: N = 3 neither divides nor is a multiple of it
# the placements of the three modules (named per module by check_modules)
COLUMN = Placement("", "column", 0, (24, 24), 8)  # 384 rows: gate and up, 24 units of 8 each
GQA = Placement("", "column", 0, (8, 2, 2), 16, (False, True, True))  # 192 rows: 8 query heads, 2 KV heads
ROW = Placement("", "row", 1)


@dataclass
class Module:
    """One quantized module: its stored tensors (full names), its split, and how to dequantize a set of its tensors."""

    prefix: str
    split: Placement
    tensors: Tensors
    dequant: Dequant
    ns: tuple[int, ...] = ALL_N

    def local(self, state: Tensors) -> Tensors:
        return local_tensors(state, self.prefix)


def check_modules(model: Path, modules: list[Module], qconfig: dict[str, Any] | None) -> None:
    """Load ``model`` for each N with the modules' companion steps and compare every rank with the reference."""
    tensors = open_checkpoint(model).tensors
    for n in sorted({n for m in modules for n in m.ns}):
        active = [m for m in modules if n in m.ns]
        params: dict[str, Any] = {}
        for m in active:
            steps = companion_steps(replace(m.split, name=f"{m.prefix}.weight"), tensors, qconfig)
            assert set(steps) == set(m.tensors), "every stored tensor of the weight gets an entry"
            params.update(steps)
        shards = shardload.load(model, n, devices=["cpu"] * n, shard_info={"version": 1, "params": params})
        if torch.cuda.is_available():  # the same stored bits on the GPU (packed ints, uint8 blocks, float8)
            on_gpu = shardload.load(model, n, devices=["cuda:0"] * n, shard_info={"version": 1, "params": params})
            for cpu, gpu in zip(shards, on_gpu, strict=True):
                for k, t in cpu.items():
                    assert gpu[k].device.type == "cuda" and gpu[k].dtype == t.dtype, k
                    assert torch.equal(gpu[k].cpu().reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k
        for m in active:
            full = m.dequant(m.local(m.tensors))
            for r in range(n):
                got = m.dequant(m.local(shards[r]))
                np.testing.assert_array_equal(got, rank_reference(full, m.split, n, r), err_msg=f"{m.prefix} {r}/{n}")


def check_only_one_rank(
    model: Path, module: Module, qconfig: dict[str, Any] | None, refused: tuple[int, ...], reason: str
) -> None:
    """``module`` loads exactly at N = 1 and is refused at every N of ``refused`` with ``reason``."""
    check_modules(model, [module], qconfig)
    params = companion_steps(replace(module.split, name=f"{module.prefix}.weight"), open_checkpoint(model).tensors,
                             qconfig)  # fmt: skip
    for n in refused:
        with pytest.raises(shardload.ShardloadError, match=reason):
            shardload.load(model, n, devices=["cpu"] * n, shard_info={"version": 1, "params": params})


def save(model: Path, modules: list[Module]) -> Path:
    model.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for m in modules for k, v in m.tensors.items()}
    save_file(tensors, str(model / "model.safetensors"))
    return model


# --- 1. compressed-tensors pack-quantized -------------------------------------------------------

CT_SCHEMES = {
    "W4A16": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
    "W4A16_ASYM": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32},
    "W8A16": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
}


@pytest.mark.parametrize("scheme", list(CT_SCHEMES))
def test_compressed_tensors_pack_quantized(tmp_path: Path, scheme: str) -> None:
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**CT_SCHEMES[scheme])
    qscheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    torch.manual_seed(0)

    def module(prefix: str, split: Placement, shape: tuple[int, int], ns: tuple[int, ...]) -> Module:
        w = torch.randn(shape, dtype=torch.float16)
        group = args.group_size or shape[1]
        g = w.reshape(shape[0], shape[1] // group, group)
        scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), args)
        state = {"weight": w, "weight_scale": scale}
        if not args.symmetric:
            state["weight_zero_point"] = zero.to(torch.int8)
        packed = compressor.compress(state, qscheme)

        def dequant(local: Tensors) -> np.ndarray:
            weight = compressor.decompress(local, qscheme)["weight"]
            # decompression tolerates a too-large weight_shape, so check it holds this rank's logical shape
            assert local["weight_shape"].tolist() == list(weight.shape)
            return weight.float().numpy()

        return Module(prefix, split, {f"{prefix}.{k}": v for k, v in packed.items()}, dequant, ns)

    modules = [
        module("m.gate_up", COLUMN, (384, 256), ALL_N),
        module("m.qkv", GQA, (192, 256), GQA_N),
        module("m.down", ROW, (128, 768), ALL_N),
    ]
    suffixes = {k.rsplit(".", 1)[1] for m in modules for k in m.tensors}
    assert {"weight_packed", "weight_scale", "weight_shape"} <= suffixes
    assert ("weight_zero_point" in suffixes) == (not args.symmetric)
    qconfig = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": CT_SCHEMES[scheme]}},
        "version": ct.__version__,
    }
    check_modules(save(tmp_path / "model", modules), modules, qconfig)


@pytest.mark.parametrize(
    ("label", "shape", "weights", "split"),
    [
        ("in=60, a row split", (16, 60), {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}, ROW),
        ("out=28, zero points packed 8 to a word, a column split", (28, 64),
         {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32},
         Placement("", "column", 0)),
    ],
)  # fmt: skip
def test_compressed_tensors_partly_filled_last_word_is_never_split(
    tmp_path: Path, label: str, shape: tuple[int, int], weights: dict[str, Any], split: Placement
) -> None:
    """compressed-tensors packs ceil(size / 8) words: where the last is partly filled, no N > 1 splits on whole words
    (rank 1 got 4 padding values and lost 2 real ones): N = 1 loads exactly, every other N is refused."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**weights)
    qscheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=torch.float16)
    group = args.group_size or shape[1]
    g = w.reshape(shape[0], shape[1] // group, group)
    scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), args)
    state = {
        "weight": w,
        "weight_scale": scale,
        **({} if args.symmetric else {"weight_zero_point": zero.to(torch.int8)}),
    }
    tensors = {f"m.p.{k}": v for k, v in compressor.compress(state, qscheme).items()}
    words = tensors["m.p.weight_packed" if split.dim == 1 else "m.p.weight_zero_point"].shape[split.dim]
    assert words * 8 > shape[split.dim], "the last word is partly filled"

    def dequant(local: Tensors) -> np.ndarray:
        return compressor.decompress(local, qscheme)["weight"].float().numpy()

    module = Module("m.p", split, tensors, dequant, (1,))
    qconfig = {"quant_method": "compressed-tensors", "format": "pack-quantized",
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}  # fmt: skip
    check_only_one_rank(save(tmp_path / "model", [module]), module, qconfig, (2, 4), "partly filled")


def test_compressed_tensors_nvfp4_packs_two_values_to_a_byte(tmp_path: Path) -> None:
    """NVFP4 (``nvfp4-pack-quantized``) stores uint8 ``weight_packed`` [out, in/2] and float8 scales per 16 inputs:
    its pack factor was taken as an int32 word's 8, the input dim read as 4x too large, and the model refused."""
    gen = torch.Generator().manual_seed(9)

    def module(prefix: str, split: Placement, out: int, inp: int, ns: tuple[int, ...]) -> Module:
        tensors = {f"{prefix}.weight_packed": torch.randint(0, 256, (out, inp // 2), generator=gen, dtype=torch.uint8),
                   f"{prefix}.weight_scale": (torch.rand(out, inp // 16, generator=gen) + 0.5).to(torch.float8_e4m3fn),
                   f"{prefix}.weight_global_scale": torch.tensor([2.0]),
                   f"{prefix}.input_global_scale": torch.tensor([3.0])}  # fmt: skip

        def dequant(local: Tensors) -> np.ndarray:  # codes (low nibble first) times their group's scale
            packed = local["weight_packed"].numpy()
            codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1).astype(np.float32)
            scale = np.repeat(local["weight_scale"].float().numpy(), 16, axis=1)
            return codes * scale * float(local["weight_global_scale"][0])

        return Module(prefix, split, tensors, dequant, ns)

    modules = [module("m.gate_up", COLUMN, 384, 256, ALL_N), module("m.qkv", GQA, 192, 256, GQA_N),
               module("m.down", ROW, 128, 768, (1, 2, 3, 4, 6))]  # fmt: skip
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}
    qconfig = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
               "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                             "weights": weights}}}  # fmt: skip
    check_modules(save(tmp_path / "model", modules), modules, qconfig)


# --- 2. MLC-LLM group-quantized int4 ------------------------------------------------------------


def _modules(rng: np.random.Generator, build: Builder) -> list[Module]:
    """The three modules of a format's test: fused column, GQA column and row."""
    modules = []
    for prefix, split, (out, inp), ns in (
        ("m.gate_up", COLUMN, (384, 256), ALL_N),
        ("m.qkv", GQA, (192, 256), GQA_N),
        ("m.down", ROW, (128, 768), ALL_N),
    ):
        tensors, dequant = build(rng, prefix, out, inp)
        modules.append(Module(prefix, split, tensors, dequant, ns))
    return modules


def test_mlc_q4f16(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)

    modules = _modules(rng, mlc_module)
    check_modules(save(tmp_path / "model", modules), modules, {"quant_method": "mlc", "bits": 4, "group_size": 32})


# --- 3. GPTQ and AWQ ----------------------------------------------------------------------------


@pytest.mark.parametrize("desc_act", [True, False])
def test_gptq(tmp_path: Path, desc_act: bool) -> None:
    rng = np.random.default_rng(2)
    modules = _modules(rng, lambda rng, prefix, out, inp: gptq_module(rng, prefix, out, inp, desc_act=desc_act))
    qconfig = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": desc_act, "sym": False}
    check_modules(save(tmp_path / "model", modules), modules, qconfig)


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_one_group_per_channel_splits_at_every_n(tmp_path: Path, desc_act: bool) -> None:
    """group_size -1: one scale row for all inputs, g_idx all zeros; every rank keeps the one group (it was refused
    at every N > 1 without act-order)."""
    rng = np.random.default_rng(5)
    modules = []
    for prefix, split, (out, inp) in (("m.gate_up", COLUMN, (384, 256)), ("m.down", ROW, (128, 768))):
        tensors, dequant = gptq_module(rng, prefix, out, inp, group=inp, desc_act=desc_act)
        modules.append(Module(prefix, split, tensors, dequant, ALL_N))
    qconfig = {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": desc_act, "sym": False}
    check_modules(save(tmp_path / "model", modules), modules, qconfig)


def test_gptq_dynamic_overrides_set_a_modules_group_size(tmp_path: Path) -> None:
    """GPTQModel's ``dynamic``: the first pattern matching a module (``+:`` or bare) overrides its settings, as vLLM
    reads them; down_proj's own group size 32 was taken for the global 128 and the model refused at every N."""
    rng = np.random.default_rng(7)
    modules = []
    for prefix, split, (out, inp), group in (("model.layers.0.mlp.gate_up", COLUMN, (384, 256), 64),
                                             ("model.layers.0.mlp.down_proj", ROW, (128, 768), 32),
                                             ("model.layers.0.other", ROW, (128, 512), 128)):  # fmt: skip
        tensors, dequant = gptq_module(rng, prefix, out, inp, group=group)
        modules.append(Module(prefix, split, tensors, dequant, (1, 2, 4) if group > 32 else ALL_N))
    dynamic = {"-:.*self_attn.*": {}, r"+:.*down_proj.*": {"group_size": 32}, r".*mlp.*": {"group_size": 64}}
    qconfig = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False,
               "dynamic": dynamic}  # fmt: skip
    check_modules(save(tmp_path / "model", modules), modules, qconfig)


def test_gptq_g_idx_must_cover_the_packed_inputs(tmp_path: Path) -> None:
    """qweight packs 64 inputs; a g_idx of 60 (a partly filled last word) cannot be sliced beside it."""
    tensors, _ = gptq_module(np.random.default_rng(6), "m.down", 16, 64)
    tensors["m.down.g_idx"] = tensors["m.down.g_idx"][:60].clone()
    save(tmp_path / "model", [Module("m.down", ROW, tensors, lambda t: np.zeros(0))])
    qconfig = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False}
    with pytest.raises(shardload.ShardloadError, match=r"m\.down\.g_idx.*60 entries for 64 packed inputs"):
        companion_steps(replace(ROW, name="m.down.weight"), open_checkpoint(tmp_path / "model").tensors, qconfig)


def test_awq(tmp_path: Path) -> None:
    modules = _modules(np.random.default_rng(3), awq_module)
    qconfig = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}
    check_modules(save(tmp_path / "model", modules), modules, qconfig)


# --- 4. FP8 ------------------------------------------------------------------------------------


def test_fp8_tensor_channel_and_block_scales(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)

    def module(prefix: str, split: Placement, shape: tuple[int, int], kind: str, ns: tuple[int, ...]) -> Module:
        tensors, dequant = fp8_module(rng, prefix, *shape, kind=kind)
        return Module(prefix, split, tensors, dequant, ns)

    block_column = Placement("", "column", 0, (24, 24), 128)  # every rank's part is whole 128-row blocks
    block_gqa = Placement("", "column", 0, (8, 2, 2), 128, (False, True, True))  # head_dim 128 = one block
    modules = [
        module("t.gate_up", COLUMN, (384, 256), "tensor", ALL_N),
        module("t.down", ROW, (128, 768), "tensor", ALL_N),
        module("c.gate_up", COLUMN, (384, 256), "channel", ALL_N),
        module("c.qkv", GQA, (192, 256), "channel", GQA_N),
        module("c.down", ROW, (128, 768), "channel", ALL_N),
        module("b.gate_up", block_column, (6144, 256), "block", ALL_N),
        module("b.qkv", block_gqa, (1536, 256), "block", GQA_N),
        module("b.down", ROW, (128, 3072), "block", ALL_N),
        module("b.ragged", ROW, (200, 300), "block", (1,)),  # partial last blocks: only N = 1 works
    ]
    qconfig = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    check_modules(save(tmp_path / "model", modules), modules, qconfig)


@pytest.mark.parametrize(
    "qconfig",
    [None, {"quant_method": "fp8"}, {"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"}],
    ids=["no-config", "fp8-no-block-size", "modelopt-FP8_PB_WO"],
)
def test_fp8_block_scales_without_a_configured_block_are_128(tmp_path: Path, qconfig: dict[str, Any] | None) -> None:
    """[300, 256] with 3 x 2 scales is blocks of 128 rows (128, 128, 44): read as 100-row blocks, N = 3 loaded wrong
    scales into ranks 1 and 2. Without a configured block size the blocks are 128 x 128 where that gives the count
    (every FP8 block producer's, and what vLLM implies for ModelOpt's FP8_PB_WO), else the size that fills each
    exactly."""
    rng = np.random.default_rng(8)
    tensors, dequant = fp8_module(rng, "m.up", 300, 256, kind="block")
    column = Placement("", "column", 0)
    module = Module("m.up", column, tensors, dequant, (1,))
    check_only_one_rank(save(tmp_path / "model", [module]), module, qconfig, (2, 3), "group size 128")
    # 64 x 64 blocks of a [4096, 4096] weight: 128 gives 32, not 64; blocks of 64 fill them exactly
    headers = {"m.b.weight": Header((4096, 4096), "float8_e4m3fn"), "m.b.weight_scale_inv": Header((64, 64), "float32")}
    steps = companion_steps(replace(column, name="m.b.weight"), headers, qconfig)
    assert (
        steps["m.b.weight_scale_inv"][0][0] == "shard_funcs.shard_groups" and steps["m.b.weight_scale_inv"][0][3] == 64
    )


# --- 5. GGUF -----------------------------------------------------------------------------------

GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")
# byte offsets of the float16 scale fields in one block of the K-quant types (the rest is any bits)
K_QUANT_F16_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,)}


def gguf_blocks(rng: np.random.Generator, qtype: Any, rows: int, cols: int) -> np.ndarray:
    """Random quantized rows: gguf's own quantizer where it has one, else random blocks with sane scales."""
    import gguf

    name = qtype.name
    if name not in K_QUANT_F16_FIELDS:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
    for offset in K_QUANT_F16_FIELDS[name]:
        values = (rng.random((rows, cols // block)) * 0.1 + 0.01).astype(np.float16)
        raw[:, :, offset : offset + 2] = values.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def test_gguf_block_quantized(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    from shardload.sources.gguf import quantization_config

    rng = np.random.default_rng(5)
    path = tmp_path / "model.gguf"
    stored: dict[str, tuple[np.ndarray, Any]] = {}
    modules = []
    for type_name in GGUF_TYPES:
        qtype = gguf.GGMLQuantizationType[type_name]
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        for prefix, split, rows, cols, ns in (
            (f"blk.{type_name}.ffn_gate_up", COLUMN, 384, block, ALL_N),
            (f"blk.{type_name}.attn_qkv", GQA, 192, block, GQA_N),
            (f"blk.{type_name}.ffn_down", ROW, 16, 24 * block, ALL_N),
        ):
            data = gguf_blocks(rng, qtype, rows, cols)
            stored[f"{prefix}.weight"] = (data, qtype)

            def dequant(local: Tensors, qtype: Any = qtype) -> np.ndarray:
                raw = local["weight"].numpy()
                return gguf.quants.dequantize(raw.reshape(raw.shape[0], -1), qtype)

            modules.append(Module(prefix, split, {f"{prefix}.weight": torch.from_numpy(data)}, dequant, ns))
    save_gguf(path, stored)
    header = open_checkpoint(path).tensors["blk.Q4_K.ffn_down.weight"]
    assert (header.dtype, header.shape) == ("uint8", (16, 24, 144))  # [rows, blocks, bytes per block]
    check_modules(path, modules, quantization_config(path))
