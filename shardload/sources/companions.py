"""The files beside the weights that travel with them into an output: an allow-list of companions (model
config, generation config, tokenizer, chat templates, processor configs, README and license), each a regular
file inside the model directory. Nothing else is ever copied: no other weight format (.bin, .pt, .msgpack,
.gguf, .h5), no unrelated file that happens to sit beside a single-file input."""

from __future__ import annotations

import fnmatch
from pathlib import Path

from .checkpoint import resolve_inside
from .objects import ObjectPath

COMPANION_NAMES = frozenset({
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
    "chat_template.json", "chat_template.jinja",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
    "feature_extractor_config.json", "image_processor_config.json",
    "README.md", "LICENSE", "LICENSE.md", "LICENSE.txt", "NOTICE", "NOTICE.txt", "USE_POLICY.md",
})  # fmt: skip
"""Companion files by exact name."""
COMPANION_PATTERNS = ("tokenizer*.model", "*.tiktoken", "chat_template*.jinja", "LICENSE-*", "LICENSE_*")
"""Companion files by pattern (sentencepiece and tiktoken vocabularies, named chat templates, extra licenses)."""


def is_companion(name: str) -> bool:
    """Whether a top-level file of this name travels with the weights."""
    return name in COMPANION_NAMES or any(fnmatch.fnmatchcase(name, p) for p in COMPANION_PATTERNS)


def companion_files(root: Path, skip: frozenset[str] | set[str] = frozenset()) -> list[Path]:
    """The companions in ``root`` (sorted, except the names in ``skip``), each checked to be a regular file that
    resolves inside the model directory (a symlink elsewhere is a ``CheckpointError``, never followed)."""
    if isinstance(root, ObjectPath):  # a model in object storage: its objects directly under the prefix
        return [root / name for name in sorted(root.children()) if name not in skip and is_companion(name)]
    found = []
    for entry in sorted(root.iterdir()):
        if entry.name in skip or not is_companion(entry.name):
            continue
        found.append(resolve_inside(root, entry.name, entry))
    return found
