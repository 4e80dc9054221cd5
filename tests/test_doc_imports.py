"""The docs teach the public API: every ``from shardload... import`` in README.md and docs/ imports from the package
root (a name in ``shardload.__all__``), or is a deep import listed below with the reason the docs may teach it."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path

import shardload

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

DEEP_IMPORTS_ALLOWED: dict[str, tuple[frozenset[str], str]] = {
    "shardload.planning.registry": (frozenset({"lookup", "unregister"}), "the step registry (extending.md)"),
    "shardload.models.families": (
        frozenset({"family_for", "llama_named", "register_family"}),
        "the model-family registry (extending.md)",
    ),
    "shardload.sources.formats": (frozenset({"source_format"}), "the checkpoint-format table (extending.md)"),
    "shardload.models.generated": (
        frozenset({"generate", "model_placements", "shard_info_document"}),
        "`shardload plan`'s pipeline shown layer by layer (model-plans.md, extending.md)",
    ),
    "shardload.models.stored_layouts": (
        frozenset({"logical_tensors", "companion_steps", "read_quantization_config"}),
        "quantized companions planned layer by layer (model-plans.md, quantized.md)",
    ),
    "shardload.sources.checkpoint": (frozenset({"read_config"}), "a model's config as planning reads it"),
    "shardload.integrations.fill": (frozenset({"Target", "copy_into"}), "the server-neutral fill code (extending.md)"),
    "shardload.engine.paths": (
        frozenset({"DevicePath", "HostPath", "MappedPath", "data_path_for"}),
        "the data-path seam (extending.md)",
    ),
    "shardload.integrations.api": (
        frozenset({"same_checkpoint"}),
        "the integration API a server's own loader uses (servers.md, extending.md)",
    ),
}
"""Deep imports the docs may teach: module -> (names, why). Anything else a user needs is exported by the root."""

_FROM = re.compile(r"^\s*from\s+(shardload(?:\.\w+)*)\s+import\s+([\w ,]+)", re.M)
_IMPORT = re.compile(r"^\s*import\s+(shardload\.[\w.]+)", re.M)


@dataclass(frozen=True)
class DocImport:
    """One import of shardload a page shows: where, from which module, which name (``*``: the module itself)."""

    where: str
    module: str
    name: str


def doc_imports(text: str, page: str) -> list[DocImport]:
    """Every ``from shardload... import`` and ``import shardload.x`` in ``text``."""
    found = []
    for match in _FROM.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        for name in match.group(2).split(","):
            if name.strip():
                found.append(DocImport(f"{page}:{line}", match.group(1), name.strip().split()[0]))
    for match in _IMPORT.finditer(text):
        found.append(DocImport(f"{page}:{text.count(chr(10), 0, match.start()) + 1}", match.group(1), "*"))
    return found


def problems(imports: list[DocImport]) -> list[str]:
    """One line per import the docs may not teach."""
    bad = []
    for i in imports:
        if i.module == "shardload":
            if i.name not in shardload.__all__:
                bad.append(f"{i.where}: from shardload import {i.name}: not in shardload.__all__")
        elif i.name not in DEEP_IMPORTS_ALLOWED.get(i.module, (frozenset(),))[0]:
            bad.append(
                f"{i.where}: from {i.module} import {i.name}: a deep import; export it from shardload/__init__.py "
                "and import it from the root, or list it in DEEP_IMPORTS_ALLOWED with the reason"
            )
    return bad


def all_imports() -> list[DocImport]:
    return [i for page in PAGES for i in doc_imports(page.read_text(), str(page.relative_to(ROOT)))]


def test_docs_import_only_the_root_or_allowed_deep_names() -> None:
    assert problems(all_imports()) == []


def test_the_check_sees_imports_and_refuses_a_deep_one() -> None:
    """The scanner finds the docs' imports (else the test above would pass vacuously) and flags a private one."""
    seen = {(i.module, i.name) for i in all_imports()}
    assert ("shardload.models.generated", "generate") in seen and len(seen) >= 10
    planted = doc_imports("x\n```python\nfrom shardload.engine.transfer import Transfer, JOB_BYTES\n```\n", "p.md")
    assert [p.split(": a deep")[0] for p in problems(planted)] == [
        "p.md:3: from shardload.engine.transfer import Transfer",
        "p.md:3: from shardload.engine.transfer import JOB_BYTES",
    ]
    assert problems(doc_imports("import shardload.engine.load\nfrom shardload import nope\n", "q.md")) == [
        "q.md:2: from shardload import nope: not in shardload.__all__",
        "q.md:1: from shardload.engine.load import *: a deep import; export it from shardload/__init__.py and "
        "import it from the root, or list it in DEEP_IMPORTS_ALLOWED with the reason",
    ]


def test_the_allow_list_is_used_and_importable() -> None:
    """Each allowed deep import still appears in the docs (a stale entry would allow it again silently) and exists."""
    seen = {(i.module, i.name) for i in all_imports()}
    for module, (names, _) in DEEP_IMPORTS_ALLOWED.items():
        for name in names:
            assert (module, name) in seen, f"DEEP_IMPORTS_ALLOWED lists {module}.{name}, which no page imports now"
            assert hasattr(importlib.import_module(module), name), f"{module} has no {name}"
