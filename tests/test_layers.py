"""The package's layering: the import-linter contracts in pyproject.toml hold, and no module import cycle exists."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")
pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("shardload", "shard_funcs")


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run import-linter on the tree at ``cwd`` (its own pyproject.toml, its own packages first on the path)."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run(
        [sys.executable, "-c", code, "--no-cache"],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )


def test_layer_contracts_are_kept() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    """The control: plant one upward import (sources -> engine) in a copy of the tree; the contract must fail."""
    for name in (*PACKAGES, "pyproject.toml", "shard_info.schema.json"):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, tmp_path / name)
    planted = tmp_path / "shardload" / "sources" / "dtypes.py"
    planted.write_text(
        planted.read_text()
        + textwrap.dedent(
            """

            def _upward():
                from ..engine.load import load  # noqa: F401  (planted by the test: must break the contract)
            """
        )
    )
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "shardload.sources.dtypes -> shardload.engine.load" in result.stdout


def _cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each a cycle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.find_modules_directly_imported_by(node) & modules):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles() -> None:
    """No two modules import each other, directly or through others (function-level imports included).

    A package's ``__init__`` re-exporting its children is not an edge back up; only the root package does that.
    """
    sys.setrecursionlimit(10_000)
    graph = grimp.build_graph(*PACKAGES)
    modules = {m for m in graph.modules if m not in PACKAGES}
    assert _cycles(graph, modules) == []
