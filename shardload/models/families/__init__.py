"""The model families shardload plans from config.json without transformers' TP tables: one entry per family.

A family that keeps Llama's tensor names is one line here (:func:`~.llama.llama_named`); a family with its own
names is one module beside this one (its roles, like :mod:`.bert`) and its entry. :func:`register_family` adds
one at run time (a plugin, a test).
"""

from __future__ import annotations

from ...errors import PlanError
from .bert import BERT
from .deepseek import DEEPSEEK
from .family import ROLES, Family
from .gpt_oss import GPT_OSS
from .llama import llama_named

__all__ = [
    "FAMILIES",
    "ROLES",
    "Family",
    "family_for",
    "gguf_model_type",
    "llama_named",
    "model_types",
    "register_family",
]

FAMILIES: list[Family] = [
    llama_named("llama", "llama"),
    llama_named("mistral", "mistral"),
    llama_named("qwen2", "qwen2"),
    llama_named("qwen3", "qwen3"),
    llama_named("phi3", "phi3", gguf_overrides={"ffn_up": "gate_up"}),  # Phi-3 stores gate and up fused
    llama_named("mixtral", "mixtral"),
    llama_named("gemma2", "gemma2"),
    llama_named("qwen2_moe", "qwen2_moe", gguf_architectures={"qwen2moe": "qwen2_moe"}),
    llama_named("qwen3_moe", "qwen3_moe", gguf_architectures={"qwen3moe": "qwen3_moe"}),
    DEEPSEEK,
    GPT_OSS,
    BERT,
]
"""Every known family, in the order error messages list their model types."""


def family_for(model_type: object) -> Family | None:
    """The family whose entry names config.json's ``model_type`` (None: no family does)."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def gguf_model_type(architecture: str) -> str:
    """The model type of a GGUF file's ``general.architecture`` (itself unless a family names it otherwise)."""
    return next((f.gguf_architectures[architecture] for f in FAMILIES if architecture in f.gguf_architectures),
                architecture)  # fmt: skip


def model_types() -> tuple[str, ...]:
    """Every model type some family covers."""
    return tuple(t for f in FAMILIES for t in f.model_types)


def register_family(family: Family) -> Family:
    """Add ``family`` to :data:`FAMILIES`; a model type another family already covers is refused."""
    taken = sorted(set(family.model_types) & set(model_types()))
    if taken:
        raise PlanError(f"model family {family.name!r}: model type(s) {taken} already belong to a family")
    FAMILIES.append(family)
    return family
