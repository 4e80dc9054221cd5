"""Vocabulary padding: a vocabulary N does not divide gets zero rows (embeddings and LM heads alike).

Pure: placements and tensor headers in, padded placements and a note for the user out. The rules are
:data:`shardload.models.choices.VOCAB_PADDING`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..errors import PlanError
from .choices import DEFAULT_VOCAB_PADDING, VOCAB_PADDING
from .placement import Placement, TensorHeader

__all__ = ["LM_HEADS", "pad_vocab", "padding_hint", "padding_note"]

LM_HEADS = ("lm_head", "embed_out", "output", "lm_head.decoder", "cls.predictions.decoder", "cls.predictions")
"""Modules that project onto the vocabulary (HF ``lm_head``, GPT-NeoX ``embed_out``, GGUF ``output``, BERT/RoBERTa
masked-LM heads); their weight and bias split along the vocabulary like the embedding."""


def _vocab_rows(name: str, placement: Placement, tensors: Mapping[str, TensorHeader]) -> int | None:
    """The vocabulary size when ``placement`` splits a vocabulary (an embedding, or an LM head along its rows)."""
    info = tensors.get(name)
    if info is None or placement.dim is None or placement.segmented:
        return None
    shape = tuple(info.shape)
    dim = placement.dim % len(shape) if shape else 0
    if placement.style == "vocab" and dim == 0:
        return shape[0]
    module, _, param = name.rpartition(".")
    top = module.split(".", 1)[-1] if module.startswith(("model.", "transformer.")) else module
    head = (param in ("weight", "bias") and top in LM_HEADS) or name in ("cls.predictions.bias", "lm_head.bias")
    if placement.style == "column" and head and dim == 0:
        return shape[0]
    return None


def pad_vocab(
    placements: Mapping[str, Placement], tensors: Mapping[str, TensorHeader], rule: str = DEFAULT_VOCAB_PADDING
) -> tuple[dict[str, Placement], int | None]:
    """``placements`` with every vocabulary split (embeddings, LM head weight and bias) padded by ``rule`` (a key of
    :data:`VOCAB_PADDING`) where N does not divide it, and the vocabulary size (None: none is split)."""
    if rule not in VOCAB_PADDING:
        raise PlanError(f"vocab padding must be one of {', '.join(VOCAB_PADDING)}, got {rule!r}")
    out = dict(placements)
    vocab = None
    for name, placement in placements.items():
        rows = _vocab_rows(name, placement, tensors)
        if rows is None:
            continue
        vocab = max(vocab or 0, rows)
        if VOCAB_PADDING[rule] is not None:
            out[name] = replace(placement, pad_to=VOCAB_PADDING[rule])
    return out, vocab


def padding_hint(problems: Sequence[str], rule: str) -> str:
    """A pointer to ``--vocab-padding plain`` when a vocabulary split is among ``problems``."""
    if rule == "plain" or not any("pad_dim" in p or "embed" in p or "lm_head" in p for p in problems):
        return ""
    return "; --vocab-padding plain pads a vocabulary to a multiple of N"


def padding_note(
    document: Mapping[str, Any], tensors: Mapping[str, TensorHeader], supported: Sequence[int], vocab: int | None,
    rule: str,
) -> str:  # fmt: skip
    """One sentence recording the padded vocabulary size for each N it is padded for ("" when none is)."""
    padded = [name for name, steps in document["params"].items() if steps and steps[0][0] == "shard_funcs.pad_dim"]
    if not padded or vocab is None:
        return ""
    multiple = VOCAB_PADDING[rule]

    def size(n: int) -> int:  # shard_funcs.pad_dim's rule, for an N the plan was checked for
        m = n if multiple == "num_shards" else int(multiple or 1)
        return vocab if vocab % n == 0 else -(-vocab // m) * m

    sizes = [(n, size(n)) for n in supported]
    listed = ", ".join(f"{size} rows for N={n}" for n, size in sizes if size != vocab) or "no N listed pads"
    return (
        f"Vocabulary of {vocab} rows ({', '.join(padded)}) padded with zero rows where N does not divide it "
        f"({rule} rule: {listed}); a server masks the logits of rows >= {vocab}."
    )
