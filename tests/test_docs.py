"""The docs run: every ```python block of README.md and docs/ executes, and the MkDocs site builds strictly.

A page's blocks run in order in one namespace, in a fresh working directory holding ``example-model/``
(the built-in example). A block preceded by ``<!-- docs-test: skip: REASON -->`` is skipped with that reason.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardload.cli.example import write_example

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_SKIP = re.compile(r"<!--\s*docs-test:\s*skip:\s*(.+?)\s*-->\s*$")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """Every ```python block of a page: (line number, code, skip reason or None)."""
    blocks = []
    for match in _FENCE.finditer(text):
        if match.group(1) != "python":
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _SKIP.search(before)
        line = text.count("\n", 0, match.start()) + 1
        blocks.append((line, match.group(2), skip.group(1) if skip else None))
    return blocks


def test_pages_are_found() -> None:
    """The collector sees the pages and their blocks (a broken pattern would make every other test vacuous)."""
    assert len(PAGES) > 5
    assert sum(len(python_blocks(p.read_text())) for p in PAGES) >= 8
    sample = "x\n<!-- docs-test: skip: needs a GPU -->\n```python\nboom()\n```\n```python\nok = 1\n```\n"
    assert python_blocks(sample) == [(3, "boom()\n", "needs a GPU"), (6, "ok = 1\n", None)]


@pytest.fixture(scope="module")
def example_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_example(tmp_path_factory.mktemp("docs-example") / "example-model")


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text())], ids=lambda p: p.name)
def test_python_blocks_run(page: Path, example_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(example_source, tmp_path / "example-model")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    skipped = []
    for line, code, skip in python_blocks(page.read_text()):
        if skip:
            skipped.append(f"line {line}: {skip}")
            continue
        try:
            exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)  # the docs' own code
        except Exception as err:
            pytest.fail(f"{page.relative_to(ROOT)}, block at line {line}: {type(err).__name__}: {err}")
    if skipped and len(skipped) == len(python_blocks(page.read_text())):
        pytest.skip("; ".join(skipped))


def test_readme_links_exist() -> None:
    """Relative links in the README point at files of the repository."""
    text = (ROOT / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)#]+)\)", text) if "://" not in t]
    assert targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert missing == []


def test_mkdocs_build_is_strict_clean(tmp_path: Path) -> None:
    """The docs build with no warning: a broken link or anchor fails it (``-q`` hid the warnings from ``--strict``,
    so four dead anchors passed)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()
