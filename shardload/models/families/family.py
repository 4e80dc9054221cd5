"""One model family's entry: its model types, the roles of its tensor names and their GGUF names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ...errors import PlanError

ROLES = (
    "vocab", "lm_head", "q", "k", "v", "qkv", "o", "column", "row", "heads_column", "heads_row", "gate_up",
    "expert_column", "expert_row", "stacked_gate_up", "stacked_column", "stacked_row", "stacked_transposed_column",
)  # fmt: skip
"""How a module with that role is split (:func:`shardload.models.presets.role_placement` gives each one meaning)."""


@dataclass(frozen=True)
class Family:
    """A family of architectures that share tensor names: the model types (config.json's ``model_type``) it
    covers, its module-path suffixes -> roles (``*`` matches a layer or expert index), llama.cpp's GGUF names ->
    roles (None: not read from GGUF), and GGUF ``general.architecture`` names -> model type where they differ.
    What a server's model of a family fuses and names is its integration's (``shardload.integrations``)."""

    name: str
    model_types: tuple[str, ...]
    roles: Mapping[str, str]
    gguf_roles: Mapping[str, str] | None = None
    gguf_architectures: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model_types:
            raise PlanError(f"model family {self.name!r} names no model type")
        stray = sorted(set(self.gguf_architectures.values()) - set(self.model_types))
        if stray:
            raise PlanError(f"model family {self.name!r}: GGUF architectures name model types it lacks: {stray}")
        for table in (self.roles, self.gguf_roles or {}):
            unknown = sorted({role for role in table.values() if role not in ROLES})
            if unknown:
                raise PlanError(f"model family {self.name!r}: unknown role(s) {unknown} (known: {', '.join(ROLES)})")
