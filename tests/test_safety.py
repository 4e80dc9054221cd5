"""A shard_info file is data, never code: names that would run code if imported, looked up or evaluated
go through validate, load and convert (API and CLI), each with arguments that would create a marker
file; the marker never appears. A static scan keeps pickle, eval and dynamic imports out of the tree.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import shardload
from helpers.checkpoints import random_array, write_model
from shardload.cli.main import main
from shardload.errors import ShardloadError

ROOT = Path(__file__).resolve().parent.parent


def attacks(marker: Path, victim: Path) -> list[tuple[str, list[Any]]]:
    """(function name, extra args): each would touch ``marker`` (or delete ``victim``) if it ever ran."""
    m = str(marker)
    code = f"open({m!r}, 'w').close()"
    return [
        ("os.system", [f"touch {m}"]),
        ("posix.system", [f"touch {m}"]),
        ("builtins.eval", [code]),
        ("builtins.exec", [code]),
        ("eval", [code]),
        ("builtins.open", [m, "w"]),
        ("io.open", [m, "w"]),
        ("pathlib.Path.touch", [m]),
        ("subprocess.run", [["touch", m]]),
        ("subprocess.Popen", [["touch", m]]),
        ("subprocess.check_call", [f"touch {m}"]),
        ("__import__", ["os"]),
        (f"__import__('os').system('touch {m}')", []),
        ("importlib.import_module", ["antigravity"]),
        ("os.remove", [str(victim)]),
        ("shutil.rmtree", [str(victim.parent)]),
        ("shardload.engine.convert.shutil.copyfile", ["/etc/hostname", m]),
        ("shardload.engine.load.os.system", [f"touch {m}"]),
        ("shardload.sources.checkpoint.os.system", [f"touch {m}"]),
        ("shardload.planning.registry._REGISTRY", []),
        ("shardload.planning.registry.register", ["x"]),
        ("shard_funcs.register", ["x"]),
        ("shard_funcs.shard_dim.__globals__", []),
        ("shard_funcs.shard_dim.__code__", []),
        ("__builtins__", []),
        ("__builtins__.eval", [code]),
        ("__class__", []),
        ("__init__", [m]),
        ("__reduce__", []),
        ("__subclasses__", []),
        ("().__class__.__base__.__subclasses__", []),
        ("torch.load", [m]),
        ("numpy.save", [m, [1]]),
    ]


@pytest.fixture()
def setup(tmp_path: Path) -> tuple[Path, Path, Path]:
    x = random_array(np.random.default_rng(1), (8, 4), "float32")
    model = write_model(tmp_path / "model", {"w": x})
    victim = tmp_path / "victim" / "keep.txt"
    victim.parent.mkdir()
    victim.write_text("still here")
    return model, tmp_path / "pwned", victim


def info_with(func: str, args: list[Any]) -> dict[str, Any]:
    return {"version": 1, "params": {"w": [[func, [None, None], *args]]}}


Route = Callable[[Path, Path, Path], None]


def via_validate_api(model: Path, info: Path, out: Path) -> None:
    problems = shardload.validate(info, model=model, num_shards=2)
    assert problems and all("unknown function" in str(p) for p in problems)
    problems = shardload.validate(info, num_shards=2)  # without a checkpoint too
    assert problems and all("unknown function" in str(p) for p in problems)


def via_validate_cli(model: Path, info: Path, out: Path) -> None:
    result = CliRunner().invoke(main, ["validate", str(info), "--model", str(model), "-n", "2"])
    assert result.exit_code == 1 and "unknown function" in result.stdout


def via_load_rank(model: Path, info: Path, out: Path) -> None:
    with pytest.raises(ShardloadError, match="unknown function"):
        shardload.load_rank(model, 0, 2, shard_info=info)


def via_load(model: Path, info: Path, out: Path) -> None:
    with pytest.raises(ShardloadError, match="unknown function"):
        shardload.load(model, 2, devices=["cpu", "cpu"], shard_info=json.loads(info.read_text()))


def via_convert_api(model: Path, info: Path, out: Path) -> None:
    with pytest.raises(ShardloadError, match="unknown function"):
        shardload.convert(model, 2, out, shard_info=info)


def via_convert_cli(model: Path, info: Path, out: Path) -> None:
    result = CliRunner().invoke(main, ["convert", str(model), "-n", "2", "-o", str(out), "--shard-info", str(info)])
    assert result.exit_code == 1 and "unknown function" in result.stderr


ROUTES: list[Route] = [via_validate_api, via_validate_cli, via_load_rank, via_load, via_convert_api, via_convert_cli]


@pytest.mark.parametrize("route", ROUTES, ids=[r.__name__ for r in ROUTES])
def test_function_names_never_run(setup: tuple[Path, Path, Path], route: Route) -> None:
    model, marker, victim = setup
    for func, args in attacks(marker, victim):
        info = model.parent / "attack.json"
        info.write_text(json.dumps(info_with(func, args)))
        route(model, info, model.parent / "out")
        assert not marker.exists(), f"{func} ran through {route.__name__}"
        assert victim.read_text() == "still here", f"{func} ran through {route.__name__}"
        assert not (model.parent / "out").exists()


def test_code_in_expressions_keys_and_other_fields_never_runs(setup: tuple[Path, Path, Path]) -> None:
    model, marker, _ = setup
    code = f"__import__('os').system('touch {marker}')"
    documents = [
        {"version": 1, "params": {"w": [["shard_funcs.shard_dim", [None, None], code, "num_shards"]]}},
        {"version": 1, "params": {"w": [["shard_funcs.shard_dim", [None, None], 0, code]]}},
        {"version": 1, "params": {"w": [["shard_funcs.shard_dim", [[code, 4, 4], None], 0, "num_shards"]]}},
        {"version": 1, "params": {"w": [["shard_funcs.shard_dim", [None, code], 0, "num_shards"]]}},
        {"version": 1, "params": {code: [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]]}},
        {"version": 1, "$schema": f"file://{marker}", "description": code, "params": {"w": []}, "num_shards": code},
        {"w": [["shard_funcs.replicate", [[2, 8, 4], "float32"], "(lambda: exec('1'))()"]]},
    ]
    for doc in documents:
        info = model.parent / "attack.json"
        info.write_text(json.dumps(doc))
        with pytest.raises(ShardloadError):
            shardload.load_rank(model, 0, 2, shard_info=info)
        with pytest.raises(ShardloadError):
            shardload.convert(model, 2, model.parent / "out", shard_info=info)
        result = CliRunner().invoke(main, ["validate", str(info), "--model", str(model)])
        assert result.exit_code == 1
        assert not marker.exists()


def test_code_in_the_checkpoint_header_is_data(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    x = random_array(np.random.default_rng(2), (4, 4), "float32")
    model = write_model(tmp_path / "m", {f"__import__('os').system('touch {marker}')": x})
    name = next(iter(shardload.load_rank(model, 0, 1, shard_info={"version": 1, "params": {}})))
    assert name.startswith("__import__") and not marker.exists()


FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve", "runpy", "pydoc"}
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_METHODS = {"import_module", "__import__", "eval", "exec", "locate"}


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            if any(n and n.split(".")[0] in FORBIDDEN_MODULES for n in names):
                found.append(f"{where}: imports {names}")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if (name in FORBIDDEN_BUILTINS and isinstance(func, ast.Name)) or (
            name in FORBIDDEN_METHODS and isinstance(func, ast.Attribute)
        ):
            found.append(f"{where}: calls {name}")
        if isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name):
            if func.value.id == "torch" and not any(
                k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in node.keywords
            ):
                found.append(f"{where}: torch.load without weights_only=True")
        if any(k.arg == "allow_pickle" for k in node.keywords):
            found.append(f"{where}: allow_pickle")
        if name == "getattr" and node.args:
            on_self = isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
            literal = len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
            if not (on_self or literal):
                found.append(f"{where}: getattr with a computed name")
    return found


# The two dynamic imports: --plugin MODULE, a name typed on the command line, and an installed package's entry point
# (its own entry_points.txt in site-packages, never a file beside a model: sources/plugins.installed_paths).
ALLOWED = {
    "shardload/cli/plugins.py": ["calls import_module"],
    "shardload/sources/plugins.py": ["calls import_module", "getattr with a computed name"],
}


def test_no_pickle_eval_or_dynamic_lookup_in_the_library() -> None:
    files = sorted((ROOT / "shardload").rglob("*.py")) + sorted((ROOT / "shard_funcs").rglob("*.py"))
    assert files
    problems = []
    for f in files:
        allowed = ALLOWED.get(str(f.relative_to(ROOT)), [])
        found = _problems(f)
        assert [p.split(": ", 1)[1] for p in found if p.split(": ", 1)[1] in allowed] == allowed or not allowed
        problems += [p for p in found if p.split(": ", 1)[1] not in allowed]
    assert problems == []


def test_the_scan_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = ROOT / "shardload" / "_scan_probe.py"
    probe = "import pickle\ntorch.load(f)\ngetattr(mod, name)\neval(s)\nimportlib.import_module(s)\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: probe)
    assert len(_problems(bad)) == 5
