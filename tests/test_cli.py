"""The shardload command line: click's test runner for every command, plus the installed executable."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import shardload
from shardload.cli.main import main


@pytest.fixture()
def runner() -> CliRunner:
    return CliRunner()


def test_validate_valid_file(runner: CliRunner, example_dir: Path) -> None:
    result = runner.invoke(main, ["validate", str(example_dir / "shard_info.json"), "--model", str(example_dir)])
    assert result.exit_code == 0, result.output
    assert "valid for num_shards 1, 2, 4, 8" in result.output


def test_validate_reports_each_problem_on_one_line(runner: CliRunner, example_dir: Path, tmp_path: Path) -> None:
    info = json.loads((example_dir / "shard_info.json").read_text())
    params = info["params"]
    params["model.layers.0.mlp.down_proj.weight"][0][0] = "os.system"
    params["model.layers.1.self_attn.o_proj.weight"][0][1][1] = "float32"
    params["model.layers.9.mlp.down_proj.weight"] = params["model.layers.1.mlp.down_proj.weight"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(info))
    result = runner.invoke(main, ["validate", str(bad), "--model", str(example_dir), "-n", "2", "-n", "16"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert (
        f"{bad}: model.layers.0.mlp.down_proj.weight: step 1 (os.system): unknown function 'os.system' "
        "(not registered; --plugin MODULE registers your own)" in lines
    )
    assert any(
        "model.layers.1.self_attn.o_proj.weight: step 1 (shard_funcs.shard_dim): declared dtype float32" in ln
        for ln in lines
    )
    assert any("model.layers.9.mlp.down_proj.weight: names no parameter" in ln for ln in lines)
    assert any(
        "qkv_proj.weight: step 1 (shard_funcs.reorder_segments)" in ln and ln.endswith("[num_shards=16]")
        for ln in lines
    )
    assert all(ln.startswith(f"{bad}: ") for ln in lines)
    assert "Traceback" not in result.output


def test_validate_json_report(runner: CliRunner, example_dir: Path) -> None:
    result = runner.invoke(main, ["validate", str(example_dir / "shard_info.json"), "--model", str(example_dir),
                                  "-n", "4", "-n", "3", "--json"])  # fmt: skip
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["valid"] is False and report["num_shards_checked"] == [4, 3] and report["valid_for"] == [4]
    assert report["problems"] and all(p["num_shards"] == [3] for p in report["problems"])
    assert {"file", "param", "step", "function", "reason", "message"} <= set(report["problems"][0])


def test_validate_without_model_never_passes_an_n_a_load_refuses(runner: CliRunner, example_dir: Path,
                                                                  tmp_path: Path) -> None:  # fmt: skip
    """``validate FILE -n 16`` without ``--model`` said "valid for num_shards 16" of the example's file, whose load
    at 16 is refused (a KV head would be cut). The example's file records the N it plans for, so that N fails; a
    file recording none says its pass covers its declarations only, in text and JSON."""
    info = example_dir / "shard_info.json"
    done = runner.invoke(main, ["validate", str(info), "-n", "16"])
    assert done.exit_code == 1 and "num_shards=16 is not among the N this file records" in done.output, done.output
    with pytest.raises(shardload.ShardloadError, match="a head would be cut"):
        shardload.load_rank(example_dir, 0, 16)
    assert runner.invoke(main, ["validate", str(info), "-n", "8"]).exit_code == 0
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({k: v for k, v in json.loads(info.read_text()).items() if k != "description"}))
    done = runner.invoke(main, ["validate", str(bare), "-n", "16"])
    assert done.exit_code == 0 and "declarations only" in done.output and "--model" in done.output, done.output
    report = json.loads(runner.invoke(main, ["validate", str(bare), "-n", "16", "--json"]).output)
    assert report["checked_against"] == "declarations"
    report = json.loads(runner.invoke(main, ["validate", str(info), "--model", str(example_dir), "--json"]).output)
    assert report["checked_against"] == "model"


def test_validate_without_model_and_malformed_file(runner: CliRunner, tmp_path: Path) -> None:
    seed = tmp_path / "seed.json"
    seed.write_text(json.dumps({"x_0": [["shard_funcs.shard_dim", [[2, 64, 64], "float16"], 1, 2]]}))
    ok = runner.invoke(main, ["validate", str(seed)])
    assert ok.exit_code == 0 and "valid for num_shards 2" in ok.output
    broken = tmp_path / "broken.json"
    broken.write_text('{"x": [["f", [[1], "float16"]],')
    result = runner.invoke(main, ["validate", str(broken)])
    assert result.exit_code == 1
    assert result.output.strip().startswith(f"{broken}: not valid JSON")
    assert len(result.output.strip().splitlines()) == 1


def test_usage_errors_exit_2(runner: CliRunner, example_dir: Path) -> None:
    assert runner.invoke(main, ["validate"]).exit_code == 2
    assert runner.invoke(main, ["validate", "x.json", "-n", "0"]).exit_code == 2
    assert runner.invoke(main, ["convert", str(example_dir), "-o", "x"]).exit_code == 2
    assert runner.invoke(main, ["frobnicate"]).exit_code == 2


def test_inspect_table_and_json(runner: CliRunner, example_dir: Path) -> None:
    result = runner.invoke(main, ["inspect", str(example_dir), "-n", "4"])
    assert result.exit_code == 0, result.output
    row = next(ln for ln in result.output.splitlines() if ln.startswith("model.layers.0.self_attn.qkv_proj.weight"))
    assert "[512, 256]" in row and "reorder_segments > shard_dim" in row and "[128, 256]" in row
    assert "replicated bytes per rank: 2.5 KiB (2560)" in result.output
    as_json = json.loads(runner.invoke(main, ["inspect", str(example_dir), "-n", "4", "--json"]).output)
    plan = shardload.plan_model(example_dir, 4)
    assert as_json["totals"]["bytes_per_rank"] == [plan.rank_nbytes(0)] * 4
    assert len(as_json["rows"]) == len(plan.params)
    bad = runner.invoke(main, ["inspect", str(example_dir), "-n", "3"])
    assert bad.exit_code == 1 and bad.output.startswith("error: ") and "not divisible" in bad.output


def test_convert_command(runner: CliRunner, example_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(main, ["convert", str(example_dir), "--num-shards", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "rank-00001-of-00002.safetensors" in result.output
    manifest = json.loads((out / "shard_manifest.json").read_text())
    assert [f["path"] for f in manifest["files"][:2]] == [
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    ]
    again = runner.invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(out)])
    assert again.exit_code == 1 and "output directory exists" in again.output
    quiet = runner.invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(out), "--overwrite", "-q"])
    assert quiet.exit_code == 0 and quiet.output == ""
    missing = runner.invoke(main, ["convert", str(tmp_path / "nope"), "-n", "2", "-o", str(tmp_path / "o2")])
    assert missing.exit_code == 1 and "no such file or directory" in missing.output


def test_example_command(runner: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "ex"
    assert runner.invoke(main, ["example", str(out)]).exit_code == 0
    assert (out / "shard_info.json").exists() and (out / "model.safetensors").exists()
    assert runner.invoke(main, ["example", str(out)]).exit_code == 1
    assert runner.invoke(main, ["example", str(out), "--overwrite", "--multi-file"]).exit_code == 0
    assert (out / "model.safetensors.index.json").exists()


def _installed_command() -> str:
    found = shutil.which("shardload", path=str(Path(sys.executable).parent)) or shutil.which("shardload")
    if found is None:
        pytest.fail("the shardload command is not installed (pip install -e .)")
    return found


def test_installed_command_end_to_end(tmp_path: Path) -> None:
    exe = _installed_command()
    model, out = tmp_path / "model", tmp_path / "out"
    subprocess.run([exe, "example", str(model)], check=True, capture_output=True, text=True)
    done = subprocess.run([exe, "convert", str(model), "--num-shards", "8", "-o", str(out)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "rank-00007-of-00008.safetensors" in done.stdout
    assert done.stderr == "", "no progress bar when stderr is not a terminal"
    direct = shardload.load_rank(model, 5, 8)
    converted = shardload.load_rank(out, 5, 8, verify=True)
    assert direct.keys() == converted.keys()
    assert all(torch.equal(direct[k], converted[k]) for k in direct)
    bad = subprocess.run(
        [exe, "convert", str(model), "-n", "3", "-o", str(tmp_path / "o3")], capture_output=True, text=True
    )
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith(f"error: {model / 'shard_info.json'}: ")
    assert not (tmp_path / "o3").exists()
    shim = subprocess.run([sys.executable, str(Path(__file__).parent.parent / "cli.py"), "--version"],
                          capture_output=True, text=True)  # fmt: skip
    assert shim.returncode == 0 and shardload.__version__ in shim.stdout


def test_convert_with_other_shard_info_copies_neither(runner: CliRunner, example_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.json"
    other.write_text((example_dir / "shard_info.json").read_text())
    out = tmp_path / "out"
    result = runner.invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(out), "--shard-info", str(other)])
    assert result.exit_code == 0, result.output
    assert not (out / "shard_info.json").exists() and not (out / "other.json").exists()
    assert (out / "config.json").read_text() == (example_dir / "config.json").read_text()


# --- what a user meets ------------------------------------------------------------------------------


def _failure_doc(result: Any) -> dict[str, Any]:
    """The JSON document a failed ``--json`` command printed on stdout."""
    assert result.stdout.strip(), f"empty stdout (stderr: {result.stderr!r})"
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and doc["error"]["message"], doc
    return doc


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["plan", "{missing}", "-o", "{tmp}/p.json"], 1),
        (["convert", "{missing}", "-n", "2", "-o", "{tmp}/out"], 1),
        (["validate", "{tmp}/none.json"], 2),
        (["validate", "{example}/shard_info.json", "--model", "{missing}"], 2),
        (["inspect", "{missing}"], 1),
        (["inspect", "{example}", "-n", "3"], 1),
        (["verify", "{missing}"], 1),
        (["inspect", "{example}", "-n", "0"], 2),  # refused by click while parsing
        (["convert", "{example}", "-o", "{tmp}/out"], 2),  # a usage error from the command's body
        (["--plugin", "no_such_module_xyz", "inspect", "{example}"], 2),  # before the command runs
        (["inspect", "--plugin", "no_such_module_xyz", "{example}"], 2),
    ],
)
def test_json_failure_is_a_json_document(
    runner: CliRunner, example_dir: Path, tmp_path: Path, args: list[str], code: int
) -> None:
    where = {"missing": str(tmp_path / "nope"), "tmp": str(tmp_path), "example": str(example_dir)}
    result = runner.invoke(main, [a.format(**where) for a in args] + ["--json"])
    assert result.exit_code == code, result.output
    doc = _failure_doc(result)
    assert doc["exit_code"] == code
    assert result.stderr.startswith("error: ") or "Error:" in result.stderr, result.stderr


def test_validate_missing_model_is_a_usage_error(runner: CliRunner, example_dir: Path, tmp_path: Path) -> None:
    result = runner.invoke(main, ["validate", str(example_dir / "shard_info.json"), "--model", str(tmp_path / "no")])
    assert result.exit_code == 2
    says = f"error: {tmp_path / 'no'}: no such file or directory (see `main validate --help`)\n"
    assert result.stdout == "" and result.stderr == says


def test_planned_note_comes_before_the_progress_bar(example_dir: Path, tmp_path: Path) -> None:
    """On a terminal the note naming MODEL is printed first, then the bar, each on its own line."""
    pty = pytest.importorskip("pty")
    model = tmp_path / "model"
    shutil.copytree(example_dir, model)
    (model / "shard_info.json").unlink()
    leader, follower = pty.openpty()
    done = subprocess.run(
        [_installed_command(), "convert", str(model), "-n", "2", "-o", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=follower, text=True, timeout=120,
    )  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal is closed once everything was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    err = b"".join(chunks).decode()
    assert done.returncode == 0, err
    note = f"note: {model}: no shard_info.json: planned in memory from {model / 'config.json'}"
    assert err.startswith(note), err
    assert "converting" in err.split("\n", 1)[1]


def test_hint_never_names_a_command_that_fails_the_same_way(
    runner: CliRunner, example_dir: Path, tmp_path: Path
) -> None:
    """Weights with neither shard_info.json nor config.json: `shardload plan` cannot help, so no hint names it."""
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(example_dir / "model.safetensors", bare)
    inspected = runner.invoke(main, ["inspect", str(bare), "-n", "2"])
    assert inspected.exit_code == 1 and "config.json" in inspected.stderr
    assert "shardload plan" not in inspected.output
    assert runner.invoke(main, ["plan", str(bare)]).exit_code == 1  # the command the hint would have named
    quantized = runner.invoke(main, ["quantize", str(bare), "-o", str(tmp_path / "q")])
    assert quantized.exit_code == 0, quantized.output
    assert "shardload plan" not in quantized.output
    assert runner.invoke(main, ["plan", str(tmp_path / "q")]).exit_code == 1


def test_plugin_found_in_the_current_directory(example_dir: Path, tmp_path: Path) -> None:
    """--plugin NAME imports NAME.py from the current directory, as `python -m NAME` would find it."""
    (tmp_path / "my_steps_here.py").write_text("import sys\nsys.stderr.write('my steps registered\\n')\n")
    done = subprocess.run(
        [_installed_command(), "--plugin", "my_steps_here", "validate", str(example_dir / "shard_info.json")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and done.stderr == "my steps registered\n", done.stderr


def test_verify_takes_a_plugin(example_dir: Path, tmp_path: Path, runner: CliRunner) -> None:
    """A directory converted with a plugin's steps is verified with ``--source`` only with those steps registered:
    ``verify --plugin`` was a usage error, as the other planning commands take it."""
    plugin = tmp_path / "my_plugin_steps.py"
    plugin.write_text("import sys\nsys.stderr.write('plugin imported\\n')\n")
    out = tmp_path / "tp2"
    shardload.convert(example_dir, 2, out)
    done = runner.invoke(main, ["verify", str(out), "--source", str(example_dir), "--plugin", str(plugin)])
    assert done.exit_code == 0 and "plugin imported" in done.stderr, done.output


@pytest.mark.parametrize(
    ("typed", "meant"),
    [("shard_dim", "shard_funcs.shard_dim"), ("pad_dim", "shard_funcs.pad_dim"),
     ("shard_segment", "shard_funcs.shard_segments"), ("shard_funcs.shard_dims", "shard_funcs.shard_dim")],
)  # fmt: skip
def test_did_you_mean_prefers_the_last_dotted_part(typed: str, meant: str) -> None:
    from shardload.errors import StepArgumentError
    from shardload.planning.registry import lookup

    with pytest.raises(StepArgumentError, match=rf"did you mean '{re.escape(meant)}'\?"):
        lookup(typed)


def test_readme_first_command_needs_only_the_core_dependencies(tmp_path: Path) -> None:
    """README's first command installs shardload without extras; `example` and `convert` then run with every
    optional and test dependency unimportable."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    first, second = [ln for ln in block.splitlines() if ln.startswith("pip install")]
    assert "pip install -e . &&" in first and "[test]" not in first and "shardload example" in first
    assert '".[test]"' in second
    extras = ("transformers", "accelerate", "compressed_tensors", "gguf", "boto3", "huggingface_hub", "tvm",
              "pytest", "hypothesis", "moto", "importlinter", "mkdocs")  # fmt: skip
    code = (
        "import sys\n"
        f"blocked = {extras!r}\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in blocked:\n"
        "            raise ImportError(f'{name} is not a core dependency')\n"
        "sys.meta_path.insert(0, Block())\n"
        "for m in list(sys.modules):\n"
        "    if m.split('.')[0] in blocked: del sys.modules[m]\n"
        "import blake3, click, jsonschema, jsonschema_rs, numpy, re2, safetensors, torch  # the core dependencies\n"
        "core = {m.split('.')[0] for m in sys.modules}\n"
        "from shardload.cli.main import main\n"
        "for args in (['example', sys.argv[1]], ['convert', sys.argv[1], '-n', '8', '-o', sys.argv[2]]):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit as e:\n"
        "        assert not e.code, e.code\n"
        "more = {m.split('.')[0] for m in sys.modules} - core - set(sys.stdlib_module_names)\n"
        "more = {m for m in more if not m.startswith(('_cython_', 'cython_runtime'))}  # numpy.random's runtime\n"
        "more = {m for m in more if not m.startswith('_sysconfigdata_')}  # the interpreter's own, for site paths\n"
        "assert more <= {'shardload', 'shard_funcs'}, more\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m"), str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "o" / "rank-00007-of-00008.safetensors").exists()


def test_planned_note_names_a_hub_id_as_typed(
    runner: CliRunner, example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The note names MODEL as the user typed it, not the cache snapshot a Hub id resolved to."""
    hub = pytest.importorskip("huggingface_hub")
    from helpers.hub import put_revision

    source = tmp_path / "source"
    shutil.copytree(example_dir, source)
    (source / "shard_info.json").unlink()
    cache = tmp_path / "hub"
    put_revision(cache, "shardload-test/no-plan", source, "c" * 40, "main")
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(main, ["inspect", "shardload-test/no-plan", "-n", "2"])
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("note: shardload-test/no-plan: no shard_info.json: planned in memory from ")
