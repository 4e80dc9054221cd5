"""BERT's tensor names, shared by RoBERTa and XLM-RoBERTa (encoders with masked-LM heads)."""

from __future__ import annotations

from .family import Family

ROLES: dict[str, str] = {
    "embeddings.word_embeddings": "vocab",
    "attention.self.query": "q",
    "attention.self.key": "k",
    "attention.self.value": "v",
    "attention.output.dense": "o",
    "intermediate.dense": "column",
    "output.dense": "row",
    "cls.predictions.decoder": "lm_head",
    "cls.predictions.bias": "lm_head",
    "lm_head.decoder": "lm_head",
    "lm_head.bias": "lm_head",
}
"""Module path suffixes -> role."""

BERT = Family("bert", ("bert", "roberta", "xlm-roberta"), ROLES)
