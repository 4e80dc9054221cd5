"""Test modules do not import each other: what two of them share lives in ``tests/helpers/`` (fixtures in
conftest.py, which pytest loads itself and nothing imports)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
SUITES = (TESTS, ROOT / "tests_vllm")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """The top-level names of the absolute imports in ``path``, with their line numbers (nested imports too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def python_files() -> list[Path]:
    """Every Python file of the test suites, the benchmarks and the scripts."""
    return sorted(p for d in (*SUITES, ROOT / "benchmarks", ROOT / "scripts") for p in d.rglob("*.py"))


def test_no_module_imports_a_test_module_or_conftest() -> None:
    test_modules = {p.stem for d in SUITES for p in d.rglob("test_*.py")} | {"conftest"}
    bad = [
        f"{path.relative_to(ROOT)}:{line}: imports {name}"
        for path in python_files()
        for line, name in imported_modules(path)
        if name in test_modules
    ]
    assert bad == [], "move what is shared to tests/helpers/ (fixtures: conftest.py):\n" + "\n".join(bad)


def test_shared_test_code_lives_in_helpers() -> None:
    """A module of tests/ that others import sits in tests/helpers/ (not beside the test modules), imported as such."""
    beside = {p.stem for p in TESTS.glob("*.py") if not p.stem.startswith("test_") and p.stem != "conftest"}
    beside |= {p.stem for p in (TESTS / "helpers").glob("*.py")} - {"__init__"}  # by bare name: a sys.path hack
    bad = [
        f"{path.relative_to(ROOT)}:{line}: imports {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, name in imported_modules(path)
        if name in beside
    ]
    assert bad == [], "move these modules to tests/helpers/ and import them as helpers.NAME:\n" + "\n".join(bad)


def test_the_checks_see_an_import_of_a_test_module(tmp_path: Path) -> None:
    """The parser finds plain, from- and nested imports, and passes over relative ones."""
    module = tmp_path / "test_planted.py"
    module.write_text(
        "import test_load\nfrom conftest import write_model\nfrom . import sibling\n\n"
        "def f():\n    from test_hub import put\n    import helpers.s3\n"
    )
    assert imported_modules(module) == [(1, "test_load"), (2, "conftest"), (6, "test_hub"), (7, "helpers")]
