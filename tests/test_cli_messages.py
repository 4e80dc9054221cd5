"""What the command line tells a user when an N, a file or an option does not fit (issue 44): the reason that blocks,
the file it is about, and the N a generated shard_info records. Models here are tiny numpy checkpoints (no
transformers)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from shardload.cli.main import main

HIDDEN = 64


def _model(directory: Path, model_type: str, heads: int, kv_heads: int, head_dim: int, vocab: int = 256) -> Path:
    """A one-layer checkpoint with separate q/k/v projections (biases for qwen2) and its config.json."""
    attn = "model.layers.0.self_attn."
    shapes = {
        "model.embed_tokens.weight": (vocab, HIDDEN),
        attn + "q_proj.weight": (heads * head_dim, HIDDEN),
        attn + "k_proj.weight": (kv_heads * head_dim, HIDDEN),
        attn + "v_proj.weight": (kv_heads * head_dim, HIDDEN),
        attn + "o_proj.weight": (HIDDEN, heads * head_dim),
        "model.layers.0.mlp.gate_proj.weight": (128, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": (128, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": (HIDDEN, 128),
        "lm_head.weight": (vocab, HIDDEN),
    }
    if model_type == "qwen2":
        shapes |= {attn + f"{p}_proj.bias": (shapes[attn + f"{p}_proj.weight"][0],) for p in "qkv"}
    directory.mkdir(parents=True)
    save_file({k: np.ones(s, dtype=np.float16) for k, s in shapes.items()}, str(directory / "model.safetensors"))
    config = {
        "model_type": model_type, "hidden_size": HIDDEN, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "vocab_size": vocab, "num_hidden_layers": 1,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture()
def runner() -> CliRunner:
    return CliRunner()


def test_validate_without_model_refuses_an_n_the_file_records_it_does_not_plan_for(
    runner: CliRunner, tmp_path: Path
) -> None:
    model = _model(tmp_path / "gemma2", "gemma2", heads=4, kv_heads=2, head_dim=16)
    plan_file = tmp_path / "gemma2-plan.json"
    written = runner.invoke(main, ["plan", str(model), "-o", str(plan_file)])
    assert written.exit_code == 0 and "num_shards 1, 2, 4\n" in written.output, written.output
    result = runner.invoke(main, ["validate", str(plan_file), "-n", "64"])
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        f"{plan_file}: num_shards=64 is not among the N this file records it plans for "
        "(num_shards 1, 2, 4; checked 1..64 when it was written)"
    ]
    report = json.loads(runner.invoke(main, ["validate", str(plan_file), "-n", "64", "--json"]).output)
    assert report["verdict"] == "fail" and report["valid_for"] == []
    assert runner.invoke(main, ["validate", str(plan_file), "-n", "4"]).exit_code == 0
    listed = runner.invoke(main, ["validate", str(plan_file), "--list-valid-n"])
    assert listed.exit_code == 0 and listed.output.endswith(f"{plan_file}: valid for num_shards 1, 2, 4\n")


def test_validate_checks_the_n_the_file_records_by_default(runner: CliRunner, tmp_path: Path) -> None:
    model = _model(tmp_path / "qwen2p", "qwen2", heads=4, kv_heads=2, head_dim=16)
    assert runner.invoke(main, ["plan", str(model)]).exit_code == 0
    for extra in ([], ["--model", str(model)]):
        result = runner.invoke(main, ["validate", str(model / "shard_info.json"), *extra])
        assert result.exit_code == 0, result.output
        assert result.output == f"{model / 'shard_info.json'}: valid for num_shards 1, 2, 4\n"


def test_a_plan_made_in_memory_blames_the_heads_before_the_vocabulary_padding(
    runner: CliRunner, tmp_path: Path
) -> None:
    model = _model(tmp_path / "llama", "llama", heads=8, kv_heads=8, head_dim=8, vocab=250)  # 250 pads to 256
    result = runner.invoke(main, ["convert", str(model), "-n", "3", "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    error = result.stderr.splitlines()[-1]
    first = error.split(" (and ")[0]
    assert "self_attn." in first and "(shard_funcs.shard_segments)" in first, error
    assert first.endswith(("so a head would be cut", "neither divides its 8 KV heads nor is a multiple of them"))
    assert "pad" not in first
    assert (
        "num_attention_heads=8 is not divisible by num_shards=3"
        in runner.invoke(main, ["plan", str(model), "-n", "3", "-o", "-"]).stderr
    )


def test_a_head_cut_in_separate_projections_is_not_called_a_fused_qkv(runner: CliRunner, tmp_path: Path) -> None:
    model = _model(tmp_path / "gemma2", "gemma2", heads=4, kv_heads=2, head_dim=16)
    result = runner.invoke(main, ["convert", str(model), "-n", "8", "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    error = result.stderr.splitlines()[-1]
    assert "segment 0 holds 4 units of 16 (4 heads of head_dim 16); 4 is not divisible by num_shards=8" in error
    assert "fused" not in error


def test_share_reads_refused_on_another_n_does_not_sound_missing(example_dir: Path, tmp_path: Path) -> None:
    import shardload
    from shardload.errors import ShardloadError

    out = tmp_path / "tp2"
    shardload.convert(example_dir, 2, out)
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(out, 0, 4, mmap=True)
    assert str(err.value) == (
        f"{out}: was converted for num_shards=2: loading it for dp=1,pp=1,tp=4 reads boxes of several rank files; "
        'ReadOptions(strategy="view") does not apply there (load without it)'
    )


def test_the_hint_after_the_first_problem_names_what_to_validate(example_dir: Path) -> None:
    import shardload
    from shardload.errors import PlanError
    from shardload.format.shard_info import ShardInfo
    from shardload.planning.plan import build_plan

    file = example_dir / "shard_info.json"
    with pytest.raises(PlanError) as err:
        build_plan(ShardInfo.load(file), None, 3)
    assert str(err.value).endswith(f"more problems; see `shardload validate {file} -n 3`)"), str(err.value)
    with pytest.raises(PlanError) as err:
        shardload.plan_model(example_dir, 3, shard_info=json.loads(file.read_text()))
    assert str(err.value).endswith(
        "more problems; see `shardload.validate(shard_info, model, num_shards=3)`, which lists them)"
    ), str(err.value)


def test_an_interrupted_convert_names_the_output_it_removed(
    runner: CliRunner, example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardload.engine.convert

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(shardload.engine.convert, "convert", interrupted)
    out = tmp_path / "out"
    result = runner.invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(out)])
    assert result.exit_code == 130
    assert result.stderr == f"interrupted: {out} was not written (the partial output was removed)\n"


def test_a_bad_verify_root_is_told_in_the_command_lines_terms(
    runner: CliRunner, example_dir: Path, tmp_path: Path
) -> None:
    out = str(tmp_path / "o")
    result = runner.invoke(main, ["convert", str(example_dir), "-n", "2", "-o", out, "--verify", "0000"])
    assert result.exit_code == 2
    assert result.stderr == (
        "error: --verify takes a 64-digit root hash from `shardload hash` (or no value: check MODEL's record), "
        "got '0000' (see `main convert --help`)\n"
    )


def test_a_bad_verify_root_is_a_usage_error_in_the_command_lines_terms(runner: CliRunner, example_dir: Path) -> None:
    """``verify MODEL --root`` with a value that is no root hash is told as ``convert --verify`` tells it (exit 2,
    the option's name), not in the Python API's terms (``verify='00'``, exit 1)."""
    result = runner.invoke(main, ["verify", str(example_dir), "--root", "00"])
    assert result.exit_code == 2, result.output
    assert (
        result.stderr
        == "error: --root takes a 64-digit root hash from `shardload hash`, got '00' (see `main verify --help`)\n"
    )


def test_an_interrupted_verify_does_not_claim_an_output_was_removed(
    runner: CliRunner, example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify`` writes nothing: stopped by Ctrl-C it says it was interrupted, not that OUT "was not written"."""
    import shardload.engine.verify_dir

    out = tmp_path / "out"
    assert runner.invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(out)]).exit_code == 0

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(shardload.engine.verify_dir, "verify_dir", interrupted)
    result = runner.invoke(main, ["verify", str(out)])
    assert result.exit_code == 130 and result.stderr == "interrupted\n", result.stderr


def test_convert_counts_only_the_companion_files_it_copied(
    runner: CliRunner, example_dir: Path, tmp_path: Path
) -> None:
    result = runner.invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    companions = sorted(p.name for p in example_dir.iterdir() if p.suffix == ".json" and p.name != "shard_info.json")
    assert len(companions) == 3  # config, generation_config, tokenizer_config
    assert result.output.endswith(f"wrote 2 rank files and 3 copied file(s) to {tmp_path / 'o'}\n")


def test_example_help_says_what_example_builds(runner: CliRunner) -> None:
    from shardload.cli.example import EXAMPLE_CONFIG

    assert EXAMPLE_CONFIG["model_type"] == "phi3"
    text = " ".join(runner.invoke(main, ["example", "--help"]).output.split())
    assert "tiny Phi-3" in text and "Llama" not in text
    assert "a tiny Phi-3" in Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()


def test_load_rank_with_no_shards_names_the_model(tmp_path: Path) -> None:
    """``load_rank(model, 0, 0)`` is one line that says where (the model) and what (num_shards)."""
    import shardload
    from shardload.errors import ShardloadError

    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(tmp_path / "ex", 0, 0)
    assert str(err.value).startswith(str(tmp_path / "ex")) and "num_shards must be a positive integer" in str(err.value)


def test_validate_against_a_converted_directory_is_one_line_not_a_line_per_parameter(
    runner: CliRunner, example_dir: Path, tmp_path: Path
) -> None:
    """A converted directory carries its own plan: checking a shard_info against it is refused in one line naming
    what it is, not a "names no parameter" line for each listed parameter."""
    import shardload

    out = tmp_path / "tp2"
    shardload.convert(example_dir, 2, out)
    result = runner.invoke(main, ["validate", str(example_dir / "shard_info.json"), "--model", str(out), "-n", "2"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "converted" in lines[0] and "the checkpoint it was made from" in lines[0], lines
    assert lines[0].startswith(str(out)), lines
    report = runner.invoke(main, ["validate", str(example_dir / "shard_info.json"), "--model", str(out), "--json"])
    assert report.exit_code == 1 and not json.loads(report.output)["valid"], report.output


def test_an_empty_model_argument_is_refused_not_taken_for_the_current_directory(runner: CliRunner) -> None:
    """``Path('')`` is ``.``: an empty MODEL (an unset shell variable) hashed or validated the current directory."""
    for args in (["hash", ""], ["inspect", ""], ["convert", "", "-n", "2", "-o", "out"]):
        result = runner.invoke(main, args)
        assert result.exit_code == 2 and "empty" in result.output, (args, result.output)


@pytest.mark.parametrize(
    ("raised", "code", "said"),
    [
        (KeyboardInterrupt(), 130, "interrupted: {out} was not written (the partial output was removed)"),
        (MemoryError(), 1, "model: out of memory"),  # the input named
        (
            RuntimeError("Stride calculation overflowed"),
            1,
            "internal error: RuntimeError: Stride calculation overflowed",
        ),
    ],
    ids=["interrupt", "memory", "unexpected"],
)
def test_a_command_that_stops_on_anything_says_one_line_and_json_stays_json(
    runner: CliRunner, example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raised: BaseException,
    code: int, said: str,
) -> None:  # fmt: skip
    """Whatever stops a command (a signal, memory running out, a bug), stderr is one line and, with ``--json``,
    stdout is the failure document: a script never reads an empty stdout, and a user never a traceback."""
    import shardload.engine.convert

    def stopped(*args: object, **kwargs: object) -> None:
        raise raised

    monkeypatch.setattr(shardload.engine.convert, "convert", stopped)
    out = tmp_path / "out"
    for extra in ([], ["--json"]):
        result = runner.invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(out), *extra])
        assert result.exit_code == code, result.output
        (line,) = result.stderr.strip().splitlines()
        assert said.format(out=out) in line, line
        if extra:
            doc = json.loads(result.stdout)
            assert doc["ok"] is False and doc["exit_code"] == code and said.format(out=out) in doc["error"]["message"]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["convert", "{model}", "--mesh", "pp=2,tp=2", "-n", "8", "-o", "{out}"], "--num-shards 8 disagrees"),
        (["inspect", "{model}", "--mesh", "tp=2", "-n", "4"], "--num-shards 4 disagrees"),
        (["inspect", "{model}", "--mesh", "tp=0"], "mesh"),
        (["convert", "{model}", "--mesh", "tp=x", "-o", "{out}"], "mesh"),
    ],
    ids=["convert-conflict", "inspect-conflict", "inspect-bad", "convert-bad"],
)
def test_a_bad_or_conflicting_mesh_is_a_usage_error_in_one_line(
    runner: CliRunner, example_dir: Path, tmp_path: Path, args: list[str], said: str
) -> None:
    """Every command says a bad ``--mesh`` (or one whose tp is not ``-n``) the same way: exit 2, one ``error:``
    line (convert said exit 1, inspect four lines of click's usage text)."""
    argv = [a.format(model=example_dir, out=tmp_path / "out") for a in args]
    result = runner.invoke(main, argv)
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and said in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args", [["validate", "{info}", "-n", "0"], ["inspect", "{model}", "--bogus"], ["no-such-command"]]
)
def test_a_usage_error_is_one_error_line(runner: CliRunner, example_dir: Path, args: list[str]) -> None:
    """Click's own usage errors (a value out of range, an unknown option or command) are one ``error:`` line naming
    the help to read, exit 2, as shardload's own usage errors are (click printed four lines)."""
    argv = [a.format(info=example_dir / "shard_info.json", model=example_dir) for a in args]
    result = runner.invoke(main, argv)
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and line.endswith("--help`)"), line


@pytest.mark.parametrize("target", ["model.safetensors", "config.json", "a-folder"])
def test_plan_with_overwrite_replaces_only_a_shard_info_file(runner: CliRunner, tmp_path: Path, target: str) -> None:
    """``plan -o F --overwrite`` replaces F only where F is a shard_info file (or empty): the model's own weights or
    config.json named by mistake are refused in one line and left as they were (old code wrote the plan over them
    and exited 0), and a folder is refused up front, not as a temporary file's error."""
    model = _model(tmp_path / "m", "llama", 4, 2, 16)
    (model / "a-folder").mkdir()
    path = model / target
    before = path.read_bytes() if path.is_file() else None
    result = runner.invoke(main, ["plan", str(model), "-o", str(path), "--overwrite"])
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(f"error: {path}: "), result.output
    assert ".tmp-" not in result.output
    if before is not None:
        assert path.read_bytes() == before
    shard_info = model / "shard_info.json"
    assert runner.invoke(main, ["plan", str(model), "-o", str(shard_info)]).exit_code == 0
    again = runner.invoke(main, ["plan", str(model), "-o", str(shard_info), "--overwrite"])
    assert again.exit_code == 0, again.output  # a shard_info file is replaced


def test_plan_into_a_folder_that_does_not_exist_names_the_path_given(runner: CliRunner, tmp_path: Path) -> None:
    model = _model(tmp_path / "m", "llama", 4, 2, 16)
    target = tmp_path / "nowhere" / "x.json"
    result = runner.invoke(main, ["plan", str(model), "-o", str(target)])
    assert result.exit_code == 1 and result.output.startswith(f"error: {target}: "), result.output
    assert ".tmp-" not in result.output and result.output.count("\n") == 1, result.output


def test_plan_with_overwrite_replaces_a_seed_form_shard_info(runner: CliRunner, tmp_path: Path) -> None:
    """MLC's seed form (parameters at the top, no ``params``) is a shard_info file too."""
    model = _model(tmp_path / "m", "llama", 4, 2, 16)
    seed = model / "seed.json"
    seed.write_text(json.dumps({"lm_head.weight": [["shard_funcs.shard_dim", [[2, 128, 64], "float16"], 0, 2]]}))
    result = runner.invoke(main, ["plan", str(model), "-o", str(seed), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert "params" in json.loads(seed.read_text())


@pytest.mark.parametrize("command", ["plan", "preflight", "convert", "inspect"])
def test_an_unknown_architecture_hints_only_at_options_the_command_has(
    runner: CliRunner, tmp_path: Path, command: str
) -> None:
    """No plan source knows the model_type: every command says so in one line, and only a command that has
    ``--shard-info`` (convert, inspect) suggests it; plan and preflight have no such option (old code told them to
    pass one)."""
    model = _model(tmp_path / "m", "llama", 4, 2, 16)
    (model / "config.json").write_text(json.dumps({"model_type": "not-a-known-type", "num_hidden_layers": 1}))
    args = {"plan": ["-o", "-"], "preflight": [], "convert": ["-n", "2", "-o", str(tmp_path / "o")],
            "inspect": ["-n", "2"]}[command]  # fmt: skip
    result = runner.invoke(main, [command, str(model), *args])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert "no plan source knows this architecture" in result.stderr, result.stderr
    assert ("--shard-info" in result.stderr) == (command in ("convert", "inspect")), result.stderr


def test_plan_json_to_stdout_reports_a_failure_on_stderr_too(runner: CliRunner, example_dir: Path) -> None:
    """``plan --json -o -`` prints its report on stderr, since stdout holds the file; a failure printed its document
    on stdout and a plain line on stderr, so a script reading stderr as the report met no JSON."""
    done = runner.invoke(main, ["plan", str(example_dir), "-o", "-", "--json", "-n", "3"])
    assert done.exit_code == 1 and done.stdout == "", done.stdout
    doc = json.loads(done.stderr)
    assert doc["ok"] is False and doc["exit_code"] == 1 and "num_shards=3" in doc["error"]["message"], doc
    good = runner.invoke(main, ["plan", str(example_dir), "-o", "-", "--json"])
    assert good.exit_code == 0 and json.loads(good.stderr)["ok"] is True and json.loads(good.stdout)["params"]
    usage = runner.invoke(main, ["plan", str(example_dir), "--json", "-o", "-", "--vocab-padding", "bogus"])
    assert usage.exit_code == 2 and usage.stdout == "", usage.stdout
    assert json.loads(usage.stderr)["error"]["kind"] == "UsageError", usage.stderr


def test_an_empty_output_path_is_a_usage_error(runner: CliRunner, example_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``-o ''`` (an unset variable) was the current directory: ``hash MODEL -o ''`` wrote its record there. Every
    output path that is empty is refused as a usage error, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    for args in (
        ["hash", str(example_dir), "-o", ""],
        ["convert", str(example_dir), "-n", "2", "-o", ""],
        ["example", ""],
        ["plan", str(example_dir), "-o", ""],
        ["quantize", str(example_dir), "-o", ""],
    ):
        done = runner.invoke(main, args)
        assert done.exit_code == 2 and "is empty" in done.stderr, (args, done.output)
    assert list(tmp_path.iterdir()) == []


def test_an_output_in_object_storage_is_refused_where_only_local_outputs_are_written(
    runner: CliRunner, example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``convert ... -o s3://b/out`` wrote a local tree ``./s3:/b/out`` and said it wrote ``s3:/b/out``; every output
    that is written locally refuses a URI in one line (API and command line), and nothing is written."""
    import shardload
    from shardload.errors import ShardloadError
    from shardload.integrations.vllm.writer import convert_vllm

    monkeypatch.chdir(tmp_path)
    for args in (
        ["convert", str(example_dir), "-n", "2", "-o", "s3://b/out"],
        ["convert", str(example_dir), "-n", "2", "--layout", "vllm", "-o", "s3://b/out"],
        ["example", "s3://b/out"],
        ["plan", str(example_dir), "-o", "s3://b/out.json"],
        ["quantize", str(example_dir), "-o", "s3://b/out"],
    ):
        done = runner.invoke(main, args)
        assert done.exit_code == 2 and "s3://b/out" in done.stderr and "local" in done.stderr, (args, done.output)
    for call in (
        lambda: shardload.convert(example_dir, 2, "s3://b/out"),
        lambda: shardload.quantize(example_dir, "s3://b/out"),
        lambda: convert_vllm(example_dir, 2, "s3://b/out"),
    ):
        with pytest.raises(ShardloadError, match="local") as err:
            call()
        assert "s3://b/out" in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_preflight_without_config_json_says_there_is_none(runner: CliRunner, tmp_path: Path) -> None:
    """A model with neither shard_info.json nor config.json: preflight names the missing file, as plan does, not a
    ``model_type None`` of a config.json that does not exist."""
    model = _model(tmp_path / "m", "llama", 4, 2, 16)
    (model / "config.json").unlink()
    result = runner.invoke(main, ["preflight", str(model)])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert "no config.json" in result.stderr and "model_type None" not in result.stderr, result.stderr


def test_every_json_document_says_ok_and_its_exit_code(runner: CliRunner, example_dir: Path, tmp_path: Path) -> None:
    """Every ``--json`` document, on success as on failure, carries ``ok`` and ``exit_code`` (the process's), so a
    script reads ``doc["ok"]`` whatever happened (old success documents of plan, convert, inspect and validate had
    neither, and verify's had no exit_code)."""
    from shardload.engine.hashing import hash_model

    out, vllm_out = tmp_path / "tp2", tmp_path / "vllm"
    hashed = tmp_path / "hashed"
    hashed.mkdir()
    for f in example_dir.iterdir():
        (hashed / f.name).write_bytes(f.read_bytes())
    hash_model(hashed)
    commands = [
        ["plan", str(example_dir), "-o", str(tmp_path / "plan.json"), "--json"],
        ["convert", str(example_dir), "-n", "2", "-o", str(out), "--json"],
        ["convert", str(example_dir), "-n", "2", "-o", str(vllm_out), "--layout", "vllm", "--json"],
        ["inspect", str(example_dir), "-n", "2", "--json"],
        ["validate", str(example_dir / "shard_info.json"), "--model", str(example_dir), "-n", "2", "--json"],
        ["validate", str(example_dir / "shard_info.json"), "--model", str(example_dir), "-n", "3", "--json"],
        ["verify", str(out), "--json"],
        ["verify", str(hashed), "--json"],
        ["preflight", str(example_dir), "--json"],
    ]
    for args in commands:
        result = runner.invoke(main, args)
        doc = json.loads(result.stdout)
        assert doc.get("exit_code") == result.exit_code and doc.get("ok") is (result.exit_code == 0), (args, doc)
    assert runner.invoke(main, commands[5]).exit_code == 1  # one that fails is among them


@pytest.mark.parametrize("as_json", [False, True])
def test_inspect_of_a_mesh_the_model_cannot_take_prints_only_the_error(
    runner: CliRunner, example_dir: Path, as_json: bool
) -> None:
    """More pipeline stages than layers: one located line and nothing else on stdout (old code printed the whole
    per-parameter table first, then an error naming no model)."""
    result = runner.invoke(main, ["inspect", str(example_dir), "--mesh", "pp=3,tp=2"] + ["--json"] * as_json)
    assert result.exit_code == 1, result.output
    assert result.stderr == f"error: {example_dir}: pp=3 is more stages than the model's 2 layers\n", result.stderr
    if as_json:
        assert json.loads(result.stdout)["ok"] is False
    else:
        assert result.stdout == ""


def test_verify_against_a_source_that_does_not_exist_is_a_usage_error(
    runner: CliRunner, example_dir: Path, tmp_path: Path
) -> None:
    """``verify OUT --source nope``: the mistake is the argument's, told as validate tells ``--model nope`` (exit 2),
    not a problem reported against OUT (old code: exit 1 and "OUT: 1 problem(s)")."""
    out = tmp_path / "tp2"
    assert runner.invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(out)]).exit_code == 0
    result = runner.invoke(main, ["verify", str(out), "--source", str(tmp_path / "nope")])
    assert result.exit_code == 2, result.output
    says = f"error: {tmp_path / 'nope'}: no such file or directory (--source) (see `main verify --help`)\n"
    assert result.stderr == says, result.stderr


def test_a_bad_config_value_names_the_config_file_by_its_path(runner: CliRunner, tmp_path: Path) -> None:
    """A config.json value a plan cannot use is located at that config.json's path, as its other errors are, not a
    bare ``config.json`` (which of a user's models was it?)."""
    model = _model(tmp_path / "m", "llama", 4, 2, 16)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": True}))
    result = runner.invoke(main, ["plan", str(model), "-o", "-"])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"error: {model / 'config.json'}: num_attention_heads must be"), result.stderr


def test_a_pinned_root_refused_for_boxes_speaks_the_command_line_too(example_dir: Path, tmp_path: Path) -> None:
    """``convert OUT2 -n 4 --verify ROOT`` is refused with a line a command-line user can follow (old code: only
    the Python spelling, ``verify=True``)."""
    import shardload

    out = tmp_path / "c2"
    shardload.convert(example_dir, 2, out)
    got = CliRunner().invoke(main, ["convert", str(out), "-n", "4", "-o", str(tmp_path / "c4"), "--verify", "0" * 64])
    assert got.exit_code == 1 and "--verify with no ROOT" in got.output, got.output
    assert not (tmp_path / "c4").exists()


@pytest.mark.parametrize(
    ("args", "help_of"),
    [
        (["convert", "{m}", "--mesh", "foo=2", "-o", "{o}"], "convert"),
        (["convert", "{m}", "-n", "2", "--mesh", "tp=4", "-o", "{o}"], "convert"),
        (["inspect", "{m}", "-n", "2", "--mesh", "tp=4"], "inspect"),
        (["convert", "{m}", "-n", "2", "-o", "{o}", "--verify", "zzz"], "convert"),
        (["verify", "{m}", "--root", "abc"], "verify"),
    ],
)  # fmt: skip
def test_a_bad_option_value_names_the_help_to_read(
    example_dir: Path, tmp_path: Path, args: list[str], help_of: str
) -> None:
    """docs/commands.md: a usage error is one ``error:`` line naming the help to read (old code: the lines the
    command raised itself, a bad mesh or root hash, named none)."""
    got = CliRunner().invoke(main, [a.format(m=example_dir, o=tmp_path / "o") for a in args], prog_name="shardload")
    assert got.exit_code == 2, got.output
    assert got.stderr.count("\n") == 1 and got.stderr.rstrip().endswith(f"(see `shardload {help_of} --help`)"), (
        got.stderr
    )


def test_a_usage_error_s_json_message_leaves_the_help_hint_to_the_line(example_dir: Path) -> None:
    """``--json``: the document's message is the error alone, as it is for click's own usage errors; the
    stderr line names the help (review: the hint had leaked into the document's message)."""
    got = CliRunner().invoke(main, ["verify", str(example_dir), "--root", "abc", "--json"], prog_name="shardload")
    assert got.exit_code == 2
    doc = json.loads(got.stdout)
    assert doc["error"]["message"] == "--root takes a 64-digit root hash from `shardload hash`, got 'abc'", doc
    assert got.stderr.rstrip().endswith("(see `shardload verify --help`)"), got.stderr
