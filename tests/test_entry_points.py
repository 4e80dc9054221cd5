"""The package's own ``shardload.*`` entry points: what pyproject.toml declares loads and registers, the command line's
``convert --layout`` choices come from the registered targets, and ``engine``/``models`` name no server."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from click.testing import CliRunner

from shardload.cli.main import main
from shardload.engine.convert_targets import LayoutTarget, layout_for_manifest, layout_names, layouts, register_layout
from shardload.errors import ShardloadError
from shardload.sources.manifest import VLLM_MANIFEST_FORMAT
from shardload.sources.source_types import WholeTensors, open_source, split_formats

ROOT = Path(__file__).resolve().parent.parent


def declared(group: str) -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][group]


def load(value: str) -> None:
    module, _, attr = value.partition(":")
    getattr(importlib.import_module(module), attr)()


def test_the_vllm_layout_is_declared_and_registers_itself() -> None:
    """``shardload.layouts``' vllm entry registers ``--layout vllm``, which knows its outputs' manifests."""
    load(declared("shardload.layouts")["vllm"])
    target = layouts()["vllm"]
    assert target.expert_parallel and layout_names()[0] == "shardload" and "vllm" in layout_names()
    assert layout_for_manifest({"format": VLLM_MANIFEST_FORMAT}) is target
    assert layout_for_manifest({"format": "something else"}) is None


def test_the_vllm_split_format_is_declared_and_registers_itself(example_dir: Path) -> None:
    load(declared("shardload.split_formats")["vllm"])
    assert "vllm-sharded-state" in [f.name for f in split_formats()]
    assert type(open_source(example_dir)) is WholeTensors  # a plain checkpoint is no sharded_state directory


def test_convert_layout_choices_come_from_the_registry() -> None:
    result = CliRunner().invoke(main, ["convert", "--help"])
    assert result.exit_code == 0 and "[shardload|vllm]" in result.output
    result = CliRunner().invoke(main, ["convert", "m", "-n", "2", "-o", "out", "--layout", "nope"])
    assert result.exit_code == 2 and "'nope' is not one of 'shardload', 'vllm'" in result.output


def test_the_built_in_layout_cannot_be_replaced() -> None:
    target = LayoutTarget("shardload", convert=lambda *a, **k: [], served=lambda *a: "", mesh_refusal="")
    with pytest.raises(ShardloadError, match="is built in"):
        register_layout(target)


def test_engine_and_models_import_no_integration() -> None:
    """Importing the engine and the model layer brings in no server integration (they name none)."""
    code = (
        "import sys, shardload.engine.convert, shardload.engine.verify_dir, shardload.models.families;"
        "print(sorted(m for m in sys.modules if m.startswith('shardload.integrations')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_a_broken_entry_points_file_fails_every_load_naming_it(
    tmp_path: Path, example_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed package whose entry_points.txt does not parse is named in one line, by every load (not once, after
    which split formats would go missing), and a duplicate name or a [DEFAULT] section is read as importlib reads it."""
    import shardload
    from shardload.sources import plugins

    site = tmp_path / "site"
    (site / "bad_pkg-1.0.dist-info").mkdir(parents=True)
    (site / "bad_pkg-1.0.dist-info" / "entry_points.txt").write_text("[shardload.split_formats]\nno delimiter here\n")
    monkeypatch.setattr(plugins, "installed_paths", lambda: [str(site)])
    monkeypatch.setattr(plugins, "_DONE", set())
    for _ in range(2):
        with pytest.raises(ShardloadError, match=r"bad_pkg-1.0.dist-info/entry_points.txt: cannot be read as entry"):
            shardload.load_rank(example_dir, 0, 2)
    (site / "bad_pkg-1.0.dist-info" / "entry_points.txt").write_text(
        "[DEFAULT]\nleak = nowhere:x\n[shardload.split_formats]\nx = json:dumps\nx = json:loads\n"
    )
    assert plugins._entry_points("shardload.split_formats") == [("x", "json:loads")]


def test_a_pinned_root_is_read_as_a_file_holds_it() -> None:
    from shardload import Verify

    root = "AB" * 32
    assert Verify(root=root + "\n").root == root.lower()
    with pytest.raises(ShardloadError, match="must be 64 hex digits"):
        Verify(root="ab" * 31)


def _installed_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    """A site directory holding one installed package (module ``late_steps``: ``body``) whose ``shardload.steps``
    entry point is its ``register``, made the only one installed, every group's entry points not loaded yet."""
    from shardload.sources import plugins

    site = tmp_path / "site"
    dist = site / "late_steps-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "entry_points.txt").write_text("[shardload.steps]\nlate = late_steps:register\n")
    (site / "late_steps.py").write_text(body)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(plugins, "installed_paths", lambda: [str(site)])
    monkeypatch.setattr(plugins, "_DONE", set())
    monkeypatch.setattr(plugins, "_LOADED", set())
    monkeypatch.delitem(sys.modules, "late_steps", raising=False)
    return site


_LATE_STEP = """
import time

from shardload.planning import registry


def register():
    time.sleep(0.3)  # importing a package's steps takes a while; another thread looks a name up meanwhile
    registry.register("late.step", out=True)(lambda x, out: out.copy_(x))
"""


def test_a_step_from_an_entry_point_is_found_by_every_thread_looking_it_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads look up a step an installed package registers: both find it (the second waits for the entry
    points the first is loading; it is not told the name is unknown)."""
    import threading

    from shardload.planning import registry

    _installed_steps(tmp_path, monkeypatch, _LATE_STEP)
    found: list[object] = []

    def look() -> None:
        try:
            found.append(registry.lookup("late.step"))
        except Exception as err:
            found.append(err)

    threads = [threading.Thread(target=look) for _ in range(2)]
    threads[0].start()
    import time

    time.sleep(0.05)
    threads[1].start()
    for t in threads:
        t.join()
    registry.unregister("late.step")
    assert all(not isinstance(f, Exception) for f in found), found


def test_a_failing_entry_point_is_named_by_every_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed package whose steps fail to import: every lookup of a name not registered says so (the second
    does not claim the name is unknown, as if nothing were installed); once it imports, the name is found."""
    from shardload.errors import StepArgumentError
    from shardload.planning import registry

    site = _installed_steps(tmp_path, monkeypatch, "raise ImportError('its own dependency is missing')\n")
    for _ in range(2):
        with pytest.raises(StepArgumentError, match=r"late_steps:register.*its own dependency is missing"):
            registry.lookup("late.step")
    (site / "late_steps.py").write_text(_LATE_STEP.replace("time.sleep(0.3)", "pass"))
    sys.modules.pop("late_steps", None)
    importlib.invalidate_caches()
    try:
        assert registry.lookup("late.step") is not None
    finally:
        registry.unregister("late.step")


def test_a_retry_after_a_failing_entry_point_does_not_run_the_others_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One package's steps load, another's fail: the second lookup names the failing one again, not the first one's
    steps as registered twice."""
    from shardload.errors import StepArgumentError
    from shardload.planning import registry

    site = _installed_steps(
        tmp_path, monkeypatch, _LATE_STEP.replace("time.sleep(0.3)", "pass")
    )  # registers a new closure per call
    bad = site / "zbroken_steps-1.0.dist-info"
    bad.mkdir()
    (bad / "entry_points.txt").write_text("[shardload.steps]\nbroken = zbroken_steps:register\n")
    (site / "zbroken_steps.py").write_text("raise ImportError('broken on purpose')\n")
    monkeypatch.delitem(sys.modules, "zbroken_steps", raising=False)
    try:
        for _ in range(2):
            with pytest.raises(StepArgumentError, match=r"'broken' \(zbroken_steps:register\).*broken on purpose"):
                registry.lookup("other.step")
    finally:
        registry.unregister("late.step")


def test_a_plugin_whose_import_looks_a_step_up_does_not_hang_a_concurrent_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thread B imports a plugin module whose top level lists the steps (``names()``) while thread A's first lookup
    loads the entry points, which import that same module: both finish (no lock is held across a plugin's import,
    so neither waits for the other forever)."""
    import threading

    from shardload.planning import registry
    from shardload.sources import plugins

    body = (
        "import time\n\nfrom shardload.planning import registry\n\ntime.sleep(0.3)\nregistry.names()\n"
        "registry.register('late.step', out=True)(lambda x, out: out)\n\n\ndef register():\n    pass\n"
    )
    _installed_steps(tmp_path, monkeypatch, body)
    monkeypatch.setattr(plugins, "WAIT_S", 1.0)
    done: list[str] = []
    b = threading.Thread(target=lambda: (importlib.import_module("late_steps"), done.append("B")), daemon=True)
    b.start()
    import time

    time.sleep(0.1)
    a = threading.Thread(target=lambda: (registry.lookup("late.step"), done.append("A")), daemon=True)
    a.start()
    b.join(20)
    a.join(20)
    registry.unregister("late.step")
    assert sorted(done) == ["A", "B"]


def test_a_plugin_that_registers_then_fails_leaves_no_step_and_is_named_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry point registers a step, then fails: its step is withdrawn (a half-initialised package's step is not
    used) and every later lookup names the first failure, not 'already registered' from running it again."""
    from shardload.errors import StepArgumentError
    from shardload.planning import registry

    body = (
        "from shardload.planning import registry\n\n\ndef register():\n"
        "    registry.register('late.step', out=True)(lambda x, out: out)\n    raise RuntimeError('half way')\n"
    )
    _installed_steps(tmp_path, monkeypatch, body)
    try:
        for name in ("other.step", "late.step", "other.step"):
            with pytest.raises(StepArgumentError, match=r"'late' \(late_steps:register\).*RuntimeError: half way"):
                registry.lookup(name)
    finally:
        registry.unregister("late.step")


def test_sha256_to_a_layout_that_takes_none_is_a_usage_line(example_dir: Path, tmp_path: Path) -> None:
    """``--sha256`` goes to a layout that declares it takes it (vLLM's); any other is refused in one usage line,
    not a TypeError from its convert."""
    from shardload.engine import convert_targets

    calls: list[dict[str, object]] = []
    toy = LayoutTarget("toy", convert=lambda *a, **k: calls.append(k) or [], served=lambda *a: "", mesh_refusal="")
    register_layout(toy)
    try:
        result = CliRunner().invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(tmp_path / "o"),
                                           "--layout", "toy", "--sha256"])  # fmt: skip
        assert result.exit_code == 2 and "--layout toy takes no --sha256" in result.output, result.output
        assert calls == []
    finally:
        convert_targets._LAYOUTS.pop("toy", None)
    assert layouts()["vllm"].sha256


def test_the_package_ships_its_type_hints_and_data_files() -> None:
    """The wheel carries ``py.typed`` (without it, mypy and pyright ignore every public hint) and the JSON files the
    package reads at run time: each is in the tree and listed in pyproject's package-data."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for package, name in [("shardload", "py.typed"), ("shardload.format", "shard_info.schema.json"),
                          ("shardload.models", "hf_tp_plans.json")]:  # fmt: skip
        assert name in listed.get(package, []), (package, name)
        assert (root / package.replace(".", "/") / name).is_file(), (package, name)
