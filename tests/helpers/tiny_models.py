"""Tiny transformers models (hidden 64, 2 layers, fp32) with random weights, saved as HF checkpoints; the
reference forward of a dense state dict (``dense_logits``).

Every parameter is redrawn at random after construction (HF's init leaves biases at zero and norms
at one, which would hide a misplaced bias or norm).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}

# name -> (transformers config class, model class, config overrides, save_pretrained keyword arguments)
KINDS: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 4}, {}),
    "qwen2": (
        "Qwen2Config", "Qwen2ForCausalLM",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}, {},
    ),
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM", {"num_attention_heads": 8, "num_key_value_heads": 2}, {}),
    "phi3": (
        "Phi3Config", "Phi3ForCausalLM",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0, "eos_token_id": 2}, {},
    ),
    "mixtral": (
        "MixtralConfig", "MixtralForCausalLM",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}, {},
    ),
    "mixtral_stacked": (
        "MixtralConfig", "MixtralForCausalLM",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
        {"save_original_format": False},
    ),
    "bert": ("BertConfig", "BertModel", {"num_attention_heads": 4}, {}),
}  # fmt: skip


def build(kind: str, directory: Path, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Build the ``kind`` model with random weights, save it to ``directory`` and return it in eval mode."""
    import transformers

    config_cls, model_cls, extra, save_kwargs = KINDS[kind]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.lower():
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory, **save_kwargs)
    return model


def dense_logits(config: dict[str, Any], state: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Logits of the transformers causal LM that ``config`` (config.json's dict) describes, holding ``state``."""
    import transformers

    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config")}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **kwargs)
    hf_config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    with torch.no_grad():
        return model(input_ids=ids).logits
