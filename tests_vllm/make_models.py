"""Tiny random checkpoints saved by transformers, for the vLLM tests (run in the vLLM virtualenv).

Usage: python make_models.py OUT_DIR [NAME ...]   (all models when no NAME is given)
Weights are drawn from a fixed seed with a large enough spread that greedy tokens depend on every layer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

COMMON = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128)  # fmt: skip
"""head_dim 64: vLLM's CPU attention needs at least 32."""


def _save(model, out: Path) -> None:
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(out)


def llama(out: Path) -> None:
    """Llama with grouped-query attention: 4 query heads, 2 KV heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _save(LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **COMMON)), out)


def llama_kv1(out: Path) -> None:
    """One KV head: fewer than N=2, so vLLM replicates it on both ranks. Its vocabulary (251) is one N=2 does not
    divide: the plan pads it to 256 (vLLM's rule), 128 rows per rank, the last 5 zeros."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _save(LlamaForCausalLM(LlamaConfig(num_key_value_heads=1, **dict(COMMON, vocab_size=251))), out)


def qwen2(out: Path) -> None:
    """Qwen2: biases on q/k/v, tied embeddings, and a vocabulary (250) that is not a multiple of 64."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **dict(COMMON, vocab_size=250))
    _save(Qwen2ForCausalLM(cfg), out)


def qwen2_head(out: Path) -> None:
    """Qwen2 whose config ties the head to the embeddings over a checkpoint that stores another lm_head.weight (as
    quantizing and fine-tuning tools leave one): vLLM unties them and serves the stored head."""
    import torch
    from safetensors.torch import load_file, save_file

    qwen2(out)
    state = load_file(str(out / "model.safetensors"))
    state["lm_head.weight"] = torch.flip(state["model.embed_tokens.weight"], [0]).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def mixtral(out: Path) -> None:
    """Mixtral: 4 experts, 2 per token, which vLLM stacks into one fused MoE parameter per layer."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **COMMON)
    _save(MixtralForCausalLM(cfg), out)


def w8a8(out: Path) -> None:
    """The Llama above with every linear layer quantized to compressed-tensors W8A8 int8 (per-channel weights)."""
    import torch
    from safetensors.torch import load_file, save_file

    llama(out)
    tensors = load_file(out / "model.safetensors")
    quantized = {}
    for name, t in tensors.items():
        if name.endswith("proj.weight"):
            scale = t.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
            quantized[name] = torch.round(t / scale).clamp(-128, 127).to(torch.int8)
            quantized[name.removesuffix("weight") + "weight_scale"] = scale.to(torch.float32)
        else:
            quantized[name] = t
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                      "dynamic": True},
            }
        },
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))


def w8a8_kv(out: Path) -> None:
    """The W8A8 Llama above with a quantized KV cache: one FP8 scale per attention layer for its keys and one for its
    values (``self_attn.k_scale``, ``v_scale``: compressed-tensors' ``kv_cache_scheme``, strategy ``tensor``)."""
    import torch
    from safetensors.torch import load_file, save_file

    w8a8(out)
    tensors = load_file(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    for layer in range(config["num_hidden_layers"]):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.02 + layer / 100)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([0.03 + layer / 100])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "symmetric": True,
                                                         "strategy": "tensor", "dynamic": False}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))


MOE = dict(moe_intermediate_size=128, num_experts_per_tok=2)
"""Four experts of 128 rows (TP=4 splits each into 32; EP=4 gives each rank one)."""


def _causal(config_cls: str, model_cls: str, out: Path, stacked: bool = False, **kwargs: object) -> None:
    import torch
    import transformers

    config = getattr(transformers, config_cls)(**{**COMMON, **kwargs})
    model = getattr(transformers, model_cls)(config)
    if not stacked:
        _save(model, out)
        return
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(out, save_original_format=False)


def deepseek_v2(out: Path) -> None:
    """DeepSeek-V2-Lite-style: MLA without a q LoRA, two shared experts, the first layer dense. Latent 512 + rope 64:
    the one size vLLM's CPU MLA kernel runs."""
    _causal("DeepseekV2Config", "DeepseekV2ForCausalLM", out, num_key_value_heads=4, q_lora_rank=None,
            kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=4,
            n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
            **MOE)  # fmt: skip


def deepseek_v3(out: Path) -> None:
    """DeepSeek-V3-style: MLA with a q LoRA, one shared expert, grouped routing (vLLM's loader wants noaux_tc)."""
    _causal("DeepseekV3Config", "DeepseekV3ForCausalLM", out, num_key_value_heads=4, q_lora_rank=96,
            kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=4,
            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, topk_method="noaux_tc",
            **MOE)  # fmt: skip


def qwen3_moe(out: Path) -> None:
    """Qwen3-MoE: q/k norms, four experts, no shared expert."""
    _causal("Qwen3MoeConfig", "Qwen3MoeForCausalLM", out, num_key_value_heads=2, head_dim=64, num_experts=4, **MOE)


def qwen2_moe(out: Path) -> None:
    """Qwen2-MoE: qkv biases, four experts and a gated shared expert."""
    _causal("Qwen2MoeConfig", "Qwen2MoeForCausalLM", out, num_key_value_heads=2, num_experts=4,
            shared_expert_intermediate_size=256, **MOE)  # fmt: skip


def qwen3_moe_stacked(out: Path) -> None:
    """The Qwen3-MoE above with its experts stored stacked (transformers' ``save_original_format=False``)."""
    _causal("Qwen3MoeConfig", "Qwen3MoeForCausalLM", out, stacked=True,
            num_key_value_heads=2, head_dim=64, num_experts=4, **MOE)  # fmt: skip


def olmoe(out: Path) -> None:
    """OLMoE: q/k norms over the whole projection, four experts."""
    _causal("OlmoeConfig", "OlmoeForCausalLM", out, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
            intermediate_size=128)  # fmt: skip


def gemma2(out: Path) -> None:
    """Gemma 2: tied embeddings, sliding and global layers, soft-capped logits."""
    _causal("Gemma2Config", "Gemma2ForCausalLM", out, num_key_value_heads=2, head_dim=64, sliding_window=16)


def gemma3(out: Path) -> None:
    """Gemma 3 (text): tied embeddings, q/k norms, sliding and global layers."""
    _causal("Gemma3TextConfig", "Gemma3ForCausalLM", out, num_key_value_heads=2, head_dim=64, sliding_window=16)


def phi3(out: Path) -> None:
    """Phi-3: q, k and v stored fused (qkv_proj), gate and up fused (gate_up_proj)."""
    _causal("Phi3Config", "Phi3ForCausalLM", out, num_key_value_heads=2, pad_token_id=0)


def gpt_oss(out: Path) -> None:
    """GPT-OSS-style: attention sinks, biased experts stored stacked and interleaved."""
    _causal("GptOssConfig", "GptOssForCausalLM", out, num_key_value_heads=2, head_dim=64, num_local_experts=4,
            num_experts_per_tok=2, intermediate_size=128, sliding_window=16)  # fmt: skip


def qwen3(out: Path) -> None:
    """Qwen3 (dense): q/k norms per head."""
    _causal("Qwen3Config", "Qwen3ForCausalLM", out, num_key_value_heads=2, head_dim=64)


def mistral(out: Path) -> None:
    """Mistral: vLLM's own MistralForCausalLM."""
    _causal("MistralConfig", "MistralForCausalLM", out, num_key_value_heads=2)


def granite(out: Path) -> None:
    """Granite: Llama's names with embedding, residual, attention and logit multipliers."""
    _causal("GraniteConfig", "GraniteForCausalLM", out, num_key_value_heads=2, embedding_multiplier=2.0,
            residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0)  # fmt: skip


def gemma(out: Path) -> None:
    """Gemma (1): tied embeddings."""
    _causal("GemmaConfig", "GemmaForCausalLM", out, num_key_value_heads=2, head_dim=64)


def glm4(out: Path) -> None:
    """GLM-4: gate and up stored fused (gate_up_proj), served by vLLM's own Glm4ForCausalLM."""
    _causal("Glm4Config", "Glm4ForCausalLM", out, num_key_value_heads=2, head_dim=64, pad_token_id=0)


def cohere(out: Path) -> None:
    """Cohere (Command R): tied embeddings, no lm_head in vLLM's model."""
    _causal("CohereConfig", "CohereForCausalLM", out, num_key_value_heads=2, use_qk_norm=False)


def glm(out: Path) -> None:
    """GLM (v1): gate_up_proj stored fused; vLLM 0.32 serves it through its Transformers backend, which splits the
    fused tensor plainly (load_format="shardload" filled it part by part: wrong rows at TP >= 2)."""
    _causal("GlmConfig", "GlmForCausalLM", out, num_key_value_heads=2, head_dim=64, pad_token_id=0)


def bloom(out: Path) -> None:
    """Bloom, whose vLLM load_weights reorders the fused query_key_value rows, with a shard_info replicating every
    tensor (no plan source knows Bloom)."""
    _causal("BloomConfig", "BloomForCausalLM", out, n_head=4, n_layer=2)
    (out / "shard_info.json").write_text(json.dumps({"version": 1, "num_shards": None, "params": {}}))


def w4a16(out: Path) -> None:
    """The GQA Llama with every linear layer quantized to compressed-tensors W4A16 (int4 packed 8 to an int32,
    symmetric, groups of 32 columns), the format vLLM's CPU build serves through its WNA16 kernels."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    llama(out)
    tensors = load_file(out / "model.safetensors")
    quantized = {}
    for name, t in tensors.items():
        if not name.endswith("proj.weight"):
            quantized[name] = t
            continue
        prefix = name.removesuffix(".weight")
        g = t.reshape(t.shape[0], t.shape[1] // 32, 32)
        scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args)
        packed = compressor.compress({"weight": t, "weight_scale": scale}, scheme)
        quantized |= {f"{prefix}.{k}": v.contiguous() for k, v in packed.items()}
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                     "ignore": ["lm_head"], "config_groups": groups}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))


def gptq(out: Path) -> None:
    """The GQA Llama with every linear layer quantized to GPTQ int4 (symmetric, groups of 32, no act-order):
    ``qweight`` [in/8, out] and ``qzeros`` [groups, out/8] packed 8 to an int32, ``scales`` [groups, out]."""
    import torch
    from safetensors.torch import load_file, save_file

    llama(out)
    tensors = load_file(out / "model.safetensors")
    quantized, group = {}, 32
    for name, t in tensors.items():
        if not name.endswith("proj.weight"):
            quantized[name] = t
            continue
        prefix, w = name.removesuffix(".weight"), t.T.contiguous()  # [in, out]
        rows, cols = w.shape
        g = w.reshape(rows // group, group, cols)
        scale = (g.abs().amax(1) / 7).clamp(min=1e-8)
        q = (torch.round(g / scale[:, None, :]).clamp(-8, 7) + 8).to(torch.int64).reshape(rows, cols)
        qweight = torch.zeros(rows // 8, cols, dtype=torch.int64)
        qzeros = torch.zeros(rows // group, cols // 8, dtype=torch.int64)
        for i in range(8):
            qweight |= q[i::8] << (4 * i)
            qzeros |= 7 << (4 * i)  # zero point 8, stored minus one (GPTQ's convention)
        quantized[f"{prefix}.qweight"] = qweight.to(torch.uint32).view(torch.int32)
        quantized[f"{prefix}.qzeros"] = qzeros.to(torch.uint32).view(torch.int32)
        quantized[f"{prefix}.scales"] = scale.to(torch.float16)
        quantized[f"{prefix}.g_idx"] = torch.arange(rows, dtype=torch.int32) // group
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                     "sym": True}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ's order_map: nibble i of a packed int32 holds output column ``AWQ_ORDER[i]`` of its run of eight."""


def awq_pack(q: torch.Tensor) -> torch.Tensor:
    """4-bit values ``q`` [rows, cols] (0..15) packed 8 to an int32 along the columns in AWQ's order: ``[rows,
    cols / 8]`` (a reimplementation of AutoAWQ's packing, checked against vLLM's unpacking in :func:`awq`)."""
    import torch

    runs = q.to(torch.int64).reshape(q.shape[0], -1, 8)
    packed = torch.zeros(runs.shape[:2], dtype=torch.int64)
    for nibble, column in enumerate(AWQ_ORDER):
        packed |= runs[:, :, column] << (4 * nibble)
    return packed.to(torch.uint32).view(torch.int32)


def awq(out: Path) -> None:
    """The GQA Llama with every linear layer quantized to AWQ int4 (GEMM version: asymmetric, groups of 32):
    ``qweight`` [in, out/8] and ``qzeros`` [groups, out/8] packed 8 to an int32 along the columns in AWQ's order,
    ``scales`` [groups, out] float16."""
    import torch
    from safetensors.torch import load_file, save_file

    llama(out)
    quantized, group = {}, 32
    for name, t in load_file(out / "model.safetensors").items():
        if not name.endswith("proj.weight"):
            quantized[name] = t
            continue
        prefix, w = name.removesuffix(".weight"), t.T.contiguous()  # [in, out]
        g = w.reshape(w.shape[0] // group, group, w.shape[1])
        low, high = g.amin(1), g.amax(1)
        scale = ((high - low).clamp(min=1e-5) / 15).to(torch.float16)
        zero = torch.round(-low / scale.float()).clamp(0, 15)
        q = (torch.round(g / scale.float()[:, None, :]) + zero[:, None, :]).clamp(0, 15).reshape(w.shape)
        quantized[f"{prefix}.qweight"], quantized[f"{prefix}.qzeros"] = awq_pack(q), awq_pack(zero)
        quantized[f"{prefix}.scales"] = scale
        _check_awq(quantized[f"{prefix}.qweight"], q)
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                     "version": "gemm"}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _check_awq(packed: torch.Tensor, q: torch.Tensor) -> None:
    """vLLM's own AWQ unpacking (its reverse order, as ``_convert_awq_to_standard_format`` applies it) gives ``q``
    back from :func:`awq_pack`'s ``packed``."""
    import torch
    from vllm.model_executor.layers.quantization.auto_awq import _REVERSE_AWQ_PACK_ORDER

    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    unpacked = ((packed.unsqueeze(-1) >> shifts) & 0xF)[:, :, _REVERSE_AWQ_PACK_ORDER].reshape(q.shape)
    assert torch.equal(unpacked, q.to(torch.int32)), "AWQ packing differs from vLLM's unpacking"


FP8_BLOCK = 128
"""The FP8 block size: weights quantized per 128x128 block, as DeepSeek-V3 and Qwen3-FP8 checkpoints are."""


def fp8_block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight float8_e4m3fn, weight_scale_inv float32 [ceil(out/128), ceil(in/128)])`` for a 2-D weight: each
    128x128 block (the last ones cut short) divided by its absolute maximum over 448, the e4m3 maximum, so that
    ``weight * weight_scale_inv`` per block gives it back (the layout of ``quant_method: fp8`` with
    ``weight_block_size``; the arithmetic of vLLM's ``per_block_cast_to_fp8``, which checks it in :func:`fp8`)."""
    import torch

    rows, cols = w.shape
    b = FP8_BLOCK
    padded = torch.zeros(-(-rows // b) * b, -(-cols // b) * b, dtype=w.dtype)
    padded[:rows, :cols] = w
    blocks = padded.view(-1, b, padded.shape[1] // b, b)
    scale = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4) / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks * (1.0 / scale)).to(torch.float8_e4m3fn).view_as(padded)[:rows, :cols].contiguous()
    return q, scale.view(blocks.shape[0], blocks.shape[2]).contiguous()


def fp8(out: Path) -> None:
    """A Llama with every linear layer FP8 block-quantized (``quant_method: fp8``, ``weight_block_size`` [128,
    128]): ``weight`` float8_e4m3fn and ``weight_scale_inv`` float32, the rest bfloat16. Heads of 128 and 4 KV
    heads so that every rank of TP=4 holds whole 128-row blocks (vLLM requires it); one layer keeps it small."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**dict(COMMON, hidden_size=1024, intermediate_size=2048, num_hidden_layers=1,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=128))  # fmt: skip
    _save(LlamaForCausalLM(config).to(torch.bfloat16), out)
    quantized = {}
    for name, t in load_file(out / "model.safetensors").items():
        if not name.endswith("proj.weight"):
            quantized[name] = t
            continue
        q, scale = fp8_block_quantize(t)
        quantized[name], quantized[f"{name}_scale_inv"] = q, scale
        _check_fp8_block(t)
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _check_fp8_block(t: torch.Tensor) -> None:
    """:func:`fp8_block_quantize` gives vLLM's own ``per_block_cast_to_fp8``'s bytes, on ``t`` and on a weight whose
    sides are not multiples of 128."""
    import torch
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    for w in (t, t[:200, :300].contiguous()):
        ours, theirs = fp8_block_quantize(w), per_block_cast_to_fp8(w)
        for a, b in zip(ours, theirs, strict=True):
            assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (a.shape, b.shape)


def phi3_fp8(out: Path) -> None:
    """Phi-3 with every linear layer FP8 per tensor (``quant_method: fp8``, static activations), as
    nm-testing/Phi-3-mini-128k-instruct-FP8 is: ``qkv_proj`` and ``gate_up_proj`` stored fused, each with one
    ``weight_scale`` and one ``input_scale`` (``[]``) that vLLM copies into each of its parts' slots."""
    import torch
    from safetensors.torch import load_file, save_file

    phi3(out)
    tensors = load_file(out / "model.safetensors")
    quantized = {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if not name.endswith("proj.weight"):
            quantized[name] = t
            continue
        scale = t.abs().amax().float().clamp(min=1e-8) / torch.finfo(torch.float8_e4m3fn).max
        stem = name.removesuffix("weight")
        quantized[name] = (t.float() / scale).to(torch.float8_e4m3fn)
        quantized[stem + "weight_scale"] = scale.reshape(())
        quantized[stem + "input_scale"] = torch.tensor(0.01 + i / 1000, dtype=torch.float32)
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static", "fmt": "e4m3"}
    (out / "config.json").write_text(json.dumps(config, indent=2))


MODELS = {"llama": llama, "llama_kv1": llama_kv1, "qwen2": qwen2, "mixtral": mixtral, "w8a8": w8a8, "w4a16": w4a16,
          "gptq": gptq}  # fmt: skip
FAMILIES = {"llama": llama, "llama_kv1": llama_kv1, "mixtral": mixtral, "deepseek_v2": deepseek_v2,
            "deepseek_v3": deepseek_v3, "qwen3_moe": qwen3_moe, "qwen2_moe": qwen2_moe, "olmoe": olmoe,
            "gemma2": gemma2, "gemma3": gemma3, "phi3": phi3, "gpt_oss": gpt_oss,
            "qwen3_moe_stacked": qwen3_moe_stacked, "qwen3": qwen3, "mistral": mistral, "granite": granite,
            "gemma": gemma, "glm4": glm4, "cohere": cohere, "glm": glm, "bloom": bloom}  # fmt: skip
QUANTIZED = {"w4a16": w4a16, "gptq": gptq, "fp8": fp8, "awq": awq, "phi3_fp8": phi3_fp8}
"""Quantized models the parameter comparison covers too (Llamas, and Phi-3 FP8 per tensor)."""
"""The families the parameter comparison covers (test_vllm_params.py)."""


def main() -> None:
    out = Path(sys.argv[1])
    for name in sys.argv[2:] or list(MODELS):
        {**MODELS, **FAMILIES, **QUANTIZED}[name](out / name)
        print(f"make_models: {out / name}", flush=True)


if __name__ == "__main__":
    main()
