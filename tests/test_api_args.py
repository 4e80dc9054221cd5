"""Bad arguments to the Python API and the validate command are one located line, never a traceback; and the
paths taken when a parameter has too many runs to list give the reference's slices."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import shardload
import shardload.planning.runs as runs_module
from helpers.model_reference import reference_shards
from shardload.cli.main import main
from shardload.errors import ShardloadError


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda m: shardload.load(m, 2, devices=["gpu", "gpu"]), "device 'gpu' is not a device torch knows"),
        (lambda m: shardload.load(m, 2, devices="cpu"), "devices must be a list of 2 devices"),
        (lambda m: shardload.load(m, 2, devices=[None, "cpu"]), "device must be a string, an int or a torch.device"),
        (lambda m: shardload.load_rank(m, "0", 2), "rank must be an int, got '0'"),
        (lambda m: shardload.load_rank(m, 0, 2, device=1.5), "device must be a string"),
        (lambda m: shardload.load(m, 2, shard_info=5), "shard_info .* must be a path"),
        (lambda m: shardload.load(None, 2), "model must be a path"),
        (lambda m: shardload.convert(m, 2, None), "out_dir must be a path"),
        (lambda m: shardload.load(m, 10**9), "over the limit of 65536"),
        (lambda m: shardload.load_rank(m, 0, mesh="pp=2,tp=100000"), "over the limit of 65536"),
        (
            lambda m: shardload.load_rank(m, 0, 2, read_options=shardload.ReadOptions(strategy="fast")),
            "read strategy must be one of auto, map, read, plan, view, got 'fast'",
        ),
        (
            lambda m: shardload.load(m, 2, read_options=shardload.ReadOptions(threads=-1)),
            "reader threads must be None or an int >= 0, got -1",
        ),
        (lambda m: shardload.load_rank(m, 0, 2, progress=1), "progress must be True, False or a callable"),
        (lambda m: shardload.load(m, 2, progress="yes"), "progress must be True, False or a callable"),
        (lambda m: shardload.load_rank(m, 0, mesh="pp=3,tp=1"), r"^/.+: pp=3 is more stages"),
    ],
)
def test_bad_api_arguments_are_one_line_errors(example_dir: Path, call: Any, says: str) -> None:
    with pytest.raises(ShardloadError, match=says) as err:
        call(example_dir)
    assert "\n" not in err.value.message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda m: shardload.load(m, -2), "num_shards must be a positive integer, got -2"),
        (lambda m: shardload.load(m), "give num_shards (or a mesh)"),
        (lambda m: shardload.load(m, 2, mesh="tp=4"), "num_shards=2 disagrees with the mesh's tp=4"),
        (lambda m: shardload.convert(m, 0, m.parent / "o"), "num_shards must be a positive integer, got 0"),
        (lambda m: shardload.load_rank(m), "rank and num_shards are required"),
        (lambda m: shardload.load_rank(m, mesh="tp=2"), "rank is required"),
    ],
)  # fmt: skip
def test_a_bad_size_is_located_in_the_model(example_dir: Path, call: Any, says: str) -> None:
    """A size or rank the call cannot work with is one line that starts with the model it was for (old code named
    no model, and spoke of a mesh axis for ``load(m, -2)``)."""
    with pytest.raises(ShardloadError) as err:
        call(example_dir)
    assert err.value.message.startswith(f"{example_dir}: {says}"), err.value.message


def test_a_cuda_device_this_machine_lacks_is_named(example_dir: Path) -> None:
    """``cuda:K`` past the GPUs torch sees is one line: on a machine without one that it needs a GPU, on a GPU host
    how many there are (a GPU host failed the first form, which only a machine without CUDA can give)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    says = (
        "needs a CUDA GPU, and this torch .* sees none" if count == 0 else f"does not exist: this machine has {count}"
    )
    with pytest.raises(ShardloadError, match=rf"device 'cuda:{count}' {says}"):
        shardload.load_rank(example_dir, 0, 2, device=f"cuda:{count}")


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda m: shardload.load_rank(m, 0, 2, device="meta"), "device 'meta' holds no memory"),
        (lambda m: shardload.load(m, 2, devices=["meta", "meta"]), "device 'meta' holds no memory"),
        (lambda m: shardload.load(m, 2, devices=(d for d in ["cpu", "cpu"])), "devices must be a list of 2 devices"),
    ],
)  # fmt: skip
def test_a_device_that_cannot_hold_the_bytes_is_refused(example_dir: Path, call: Any, says: str) -> None:
    """The meta device read every byte and returned tensors without them (verify=True too); a generator of devices
    was a bare TypeError."""
    with shardload.count_reads() as seen, pytest.raises(ShardloadError) as err:
        call(example_dir)
    assert err.value.message.startswith(f"{example_dir}: {says}"), err.value.message
    assert seen.bytes == 0


def test_validate_usage_errors_exit_2_and_json_verdict(example_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    for target, says in ((tmp_path / "nope.json", "no such file"), (example_dir, "is a directory")):
        result = runner.invoke(main, ["validate", str(target)])
        assert result.exit_code == 2 and result.stderr.startswith(f"error: {target}: {says}")
    info = json.loads((example_dir / "shard_info.json").read_text())
    for i in range(10):
        info["params"][f"extra.{i}"] = [["shard_funcs.shard_dim", [["num_shards", 1], "float16"], 0, "num_shards"]]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(info))
    result = runner.invoke(main, ["validate", str(bad), "--model", str(example_dir), "-n", "2"])
    lines = result.output.splitlines()
    assert result.exit_code == 1 and sum("extra." in ln for ln in lines) == 3, result.output
    assert "... and 7 more parameters with the same problem" in lines[-1]
    for args, code in ((["-n", "2"], 1), (["--list-valid-n"], 1)):
        result = runner.invoke(main, ["validate", str(bad), "--model", str(example_dir), "--json", *args])
        assert result.exit_code == code and json.loads(result.output)["verdict"] == ("pass" if code == 0 else "fail")
    result = runner.invoke(main, ["validate", str(example_dir / "shard_info.json"), "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["verdict"] == "pass"


@pytest.mark.parametrize("n", [2, 4])
def test_too_many_runs_to_list_still_match_the_reference(
    example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """With the run limit set to 0 every parameter takes the paths a tall, narrow tensor takes: one rank copies out
    of the mapping, several read whole and split, convert reads whole; all give the reference's slices."""
    monkeypatch.setattr(runs_module, "MANY_RUNS", 0)
    want = reference_shards(example_dir, n)
    shards = shardload.load(example_dir, n, devices=["cpu"] * n)
    shardload.convert(example_dir, n, tmp_path / "out")
    for r in range(n):
        for got in (shards[r], shardload.load_rank(example_dir, r, n), shardload.load_rank(tmp_path / "out", r, n)):
            assert got.keys() == want[r].keys()
            for name, t in got.items():
                np.testing.assert_array_equal(t.numpy(), want[r][name], err_msg=f"rank {r} {name}")


def test_json_reports_and_quiet_plan(example_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "out"
    result = runner.invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(out), "--json"])
    doc = json.loads(result.output)
    assert result.exit_code == 0 and doc["num_shards"] == 2 and len(doc["rank_files"]) == 2
    assert {f["path"] for f in doc["rank_files"] + doc["other_files"]} == {
        f["path"] for f in json.loads((out / "shard_manifest.json").read_text())["files"]
    }
    result = runner.invoke(main, ["verify", str(out), "--source", str(example_dir), "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["ok"] is True
    (out / "rank-00001-of-00002.safetensors").write_bytes(b"x" * 16)
    result = runner.invoke(main, ["verify", str(out), "--json"])
    assert result.exit_code == 1 and json.loads(result.output)["problems"][0]["file"].endswith("00002.safetensors")
    target = tmp_path / "si.json"
    result = runner.invoke(main, ["plan", str(example_dir), "-o", str(target), "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["written"] == str(target) and target.is_file()
    result = runner.invoke(main, ["plan", str(example_dir), "-o", str(target), "-q", "--overwrite"])
    assert result.exit_code == 0 and result.output == ""


def test_a_closed_pipe_is_silent(example_dir: Path) -> None:
    import subprocess
    import sys

    cli = Path(__file__).resolve().parents[1] / "cli.py"
    cmd = f"{sys.executable} {cli} plan {example_dir} -o - | head -c 1 >/dev/null"
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert "Broken pipe" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize(
    "args",
    [["inspect", "{m}", "-n", "2", "--json"], ["inspect", "{m}", "-n", "2"], ["validate", "{m}/shard_info.json",
     "-n", "2", "--json"], ["plan", "{m}", "-o", "-"], ["inspect", "{m}/nothing-here", "--json"],
     ["convert", "{m}", "-n", "2", "-o", "{o}/tp2", "--json"], ["hash", "{m}", "-o", "{o}/record"]],
)  # fmt: skip
def test_an_unwritable_stdout_is_one_line(example_dir: Path, tmp_path: Path, args: list[str]) -> None:
    """One line whatever the command; a command that wrote its output before stdout failed says the output is
    there and complete (old code's line left the user to guess)."""
    import subprocess
    import sys

    cli = Path(__file__).resolve().parents[1] / "cli.py"
    with open("/dev/full", "w") as full:  # every write: ENOSPC
        argv = [sys.executable, str(cli), *(a.format(m=example_dir, o=tmp_path) for a in args)]
        done = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if not line.startswith("note: ")]
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    if "nothing-here" in args[1]:  # the failure itself is the line; its JSON document could not be written
        assert lines[0].startswith("error: ") and "nothing-here" in lines[0]
    elif args[0] in ("convert", "hash"):
        out = tmp_path / ("tp2" if args[0] == "convert" else "record")
        assert lines[0] == (f"error: cannot write to standard output: No space left on device ({out} was written "
                            "and is complete)")  # fmt: skip
        assert out.exists()
    else:
        assert lines[0] == "error: cannot write to standard output: No space left on device"


def test_layer_numbers_are_ascii_and_bounded(tmp_path: Path) -> None:
    from shardload.planning.mesh import param_stages

    stages = [range(0, 2), range(2, 4)]
    assert param_stages("model.layers.3.mlp.weight", stages, False) == [1]
    assert param_stages("model.layers.\u0663.mlp.weight", stages, False) == [0]  # Arabic-Indic 3: not a layer
    with pytest.raises(ShardloadError, match="layer number of 5000 digits"):
        param_stages("model.layers." + "9" * 5000 + ".mlp.weight", stages, False)


def test_unknown_function_gets_a_hint() -> None:
    from shardload.errors import StepArgumentError
    from shardload.planning.registry import lookup

    with pytest.raises(StepArgumentError, match=r"did you mean 'shard_funcs\.shard_dim'"):
        lookup("shard_funcs.shard_dims")


def test_convert_never_writes_a_header_the_loader_refuses(
    example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardload.engine.writer as writer

    monkeypatch.setattr(writer, "MAX_HEADER_BYTES", 256)
    with pytest.raises(ShardloadError, match="over the 256 bytes a load accepts"):
        shardload.convert(example_dir, 2, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_quantize_reports_progress(example_dir: Path, tmp_path: Path) -> None:
    from shardload.sources.checkpoint import open_checkpoint

    seen: list[tuple[int, str]] = []
    shardload.quantize(example_dir, tmp_path / "q", "int8", progress=lambda done, name: seen.append((done, name)))
    stored = open_checkpoint(example_dir)
    assert [name for _, name in seen] == list(stored.tensors)
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == stored.nbytes


def test_whole_model_load_reports_progress(example_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import sys

    import shardload.engine.transfer as transfer

    monkeypatch.setattr(transfer, "JOB_BYTES", 4096)  # many jobs for the small example
    seen: list[tuple[int, int]] = []
    shards = shardload.load(example_dir, 2, devices=["cpu", "cpu"], progress=lambda d, t: seen.append((d, t)))
    assert len(seen) > 1 and [d for d, _ in seen] == list(range(1, seen[-1][1] + 1)) and seen[-1][0] == seen[-1][1]
    want = reference_shards(example_dir, 2)
    for r in range(2):
        for name, t in shards[r].items():
            np.testing.assert_array_equal(t.numpy(), want[r][name])

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    shardload.load(example_dir, 2, devices=["cpu", "cpu"], progress=True)
    assert screen.getvalue().startswith("\rloading: 1/") and screen.getvalue().endswith("(100%)\n")


def test_progress_is_reported_from_a_cache_presharded_for_its_n(tmp_path: Path) -> None:
    """A TVM cache pre-sharded for N, loaded at N (its ranks' own records), never called ``progress=``."""
    pytest.importorskip("tvm")
    import shardload.engine.transfer as transfer
    from helpers.tvm_cache import presharded

    path, split = presharded(tmp_path, 2)
    seen: list[tuple[int, int]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transfer, "JOB_BYTES", 4096)
        state = shardload.load_rank(path, 1, 2, progress=lambda d, t: seen.append((d, t)))
    assert seen and [d for d, _ in seen] == list(range(1, seen[-1][1] + 1)), seen
    assert np.array_equal(state["param_0"].numpy(), split["param_0"][1])


@pytest.mark.parametrize("case", ["model threads=0", "converted own N", "converted other N", "converted into="])
def test_progress_is_reported_from_every_source(example_dir: Path, tmp_path: Path, case: str) -> None:
    """``progress=`` is reported by every load (docs/python-api.md): a converted directory at its own N or another,
    and ``threads=0``, never called it, so a server showing load progress saw nothing. Calls count up to a total."""
    import shardload.engine.transfer as transfer

    converted = tmp_path / "tp2"
    shardload.convert(example_dir, 2, converted)
    seen: list[tuple[int, int]] = []
    kwargs: dict[str, object] = {"progress": lambda d, t: seen.append((d, t))}
    source, n = (example_dir, 2) if case.startswith("model") else (converted, 4 if "other" in case else 2)
    if case == "model threads=0":
        kwargs["read_options"] = shardload.ReadOptions(threads=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transfer, "JOB_BYTES", 4096)
        if case == "converted into=":
            want = shardload.load_rank(converted, 1, 2)
            into = {k: torch.empty_like(v) for k, v in want.items()}
            state = shardload.load_rank(source, 1, n, into=into, **kwargs)
        else:
            state = shardload.load_rank(source, 1, n, **kwargs)
            want = reference_shards(example_dir, n)[1]
    assert len(seen) > 1 and [d for d, _ in seen] == list(range(1, seen[-1][1] + 1)), seen
    for name, t in state.items():
        np.testing.assert_array_equal(t.numpy(), np.asarray(want[name]))


@pytest.mark.parametrize("converted", [False, True])
def test_a_load_of_views_reports_its_end(example_dir: Path, tmp_path: Path, converted: bool) -> None:
    """A load whose every tensor comes back as a view of its file reads nothing: ``progress`` was never called, so a
    server waiting for ``done == total`` never saw the load end. It is called once, with ``(0, 0)``."""
    source = example_dir
    if converted:
        source = shardload.convert(example_dir, 2, tmp_path / "tp2").out_dir
    seen: list[tuple[int, int]] = []
    views = shardload.ReadOptions(strategy="view")
    only = {"into": shardload.Destination(only=["model.norm.weight"])} if not converted else {}
    state = shardload.load_rank(source, 1, 2, read_options=views, progress=lambda d, t: seen.append((d, t)), **only)
    assert state and seen and seen[-1][0] == seen[-1][1], seen


OLD_WORDS = re.compile(r"\b(share_reads|params|out|mmap)\b")
"""The load options' deprecated spellings, which a refusal must not use (the caller gave today's)."""


@pytest.mark.parametrize(
    "case",
    ["group without torch.distributed", "only an unknown name", "into an unknown name", "into a non-tensor",
     "into a wrong shape", "into with the view strategy", "into a converted directory at another N",
     "group with read options"],
)  # fmt: skip
def test_a_refused_option_is_named_as_the_caller_spelled_it(example_dir: Path, tmp_path: Path, case: str) -> None:
    """A load refusing an option speaks of ``group=``, ``into=`` / ``Destination(only=)`` and
    ``ReadOptions(strategy="view")``, which the caller gave, not of the deprecated ``share_reads``, ``params``,
    ``out`` and ``mmap`` (old code named those)."""
    from shardload import Destination, ReadOptions

    view = ReadOptions(strategy="view")
    calls = {
        "group without torch.distributed": lambda: shardload.load_rank(example_dir, 0, 2, group=True),
        "only an unknown name": lambda: shardload.load_rank(example_dir, 0, 2, into=Destination(only=["nope"])),
        "into an unknown name": lambda: shardload.load_rank(example_dir, 0, 2, into={"nope": torch.zeros(1)}),
        "into a non-tensor": lambda: shardload.load_rank(example_dir, 0, 2, into={"lm_head.weight": 3}),
        "into a wrong shape": lambda: shardload.load_rank(example_dir, 0, 2, into={"lm_head.weight": torch.zeros(1)}),
        "into with the view strategy": lambda: shardload.load_rank(example_dir, 0, 2, into={}, read_options=view),
        "into a converted directory at another N": lambda: shardload.load_rank(
            converted, 0, 2, into=lambda name, shape, dtype: None
        ),
        "group with read options": lambda: shardload.load_rank(
            example_dir, 0, 2, group=True, read_options=ReadOptions(threads=2)
        ),
    }
    converted = tmp_path / "tp4"
    if case == "into a converted directory at another N":
        shardload.convert(example_dir, 4, converted)
    with pytest.raises(ShardloadError) as err:
        calls[case]()
    message = str(err.value)
    assert "\n" not in message and not OLD_WORDS.search(message), message


def test_no_refusal_in_the_source_type_table_uses_a_deprecated_spelling() -> None:
    """Every refusal the source-type table can give (each source type x option, each pair of options) speaks of the
    options as spelled today (the pre-sharded TVM cache's said "without mmap")."""
    from shardload.sources.source_types import EXCLUSIONS, SUPPORT

    texts = [t for table in SUPPORT.values() for t in table.values() if t] + list(EXCLUSIONS.values())
    assert texts and not [t for t in texts if OLD_WORDS.search(t)], [t for t in texts if OLD_WORDS.search(t)]


def test_validate_without_num_shards_checks_the_n_the_command_checks(tmp_path: Path) -> None:
    """``shardload.validate(f, model=m)`` checks what ``shardload validate f --model m`` checks: an N-agnostic file
    that records no N, at 1, 2, 4 and 8 (old code: N = 1 alone, ``[]`` for a split of 6 rows the command refuses at
    4 and 8). A problem of only some N names them."""
    from helpers.checkpoints import write_model

    tensors = {"w": np.arange(6 * 4, dtype=np.float32).reshape(6, 4)}
    info = {"version": 1, "params": {"w": [["shard_funcs.shard_dim", [None, None], 0, "num_shards"]]}}
    model = write_model(tmp_path / "m", tensors, info)
    problems = shardload.validate(model / "shard_info.json", model=model)
    assert [p.message[-14:] for p in problems] == ["[num_shards=4]", "[num_shards=8]"], problems
    assert all(p.param == "w" and "not divisible" in p.reason for p in problems)
    assert shardload.validate(model / "shard_info.json", model=model, num_shards=2) == []
    cli = CliRunner().invoke(main, ["validate", str(model / "shard_info.json"), "--model", str(model)])
    assert cli.exit_code == 1 and all(p.message in cli.output for p in problems), cli.output


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"threads": -1}, "threads must be None or an int >= 1, got -1"),
        ({"threads": 0}, "threads must be None or an int >= 1, got 0"),
        ({"threads": True}, "threads must be None or an int >= 1, got True"),
        ({"progress": "x"}, "progress must be True, False or a callable (done, total), got 'x'"),
    ],
)
def test_hash_checkpoint_arguments_are_checked(example_dir: Path, kwargs: dict, says: str) -> None:
    """A bad ``threads`` or ``progress`` is one line naming the model, as ``load_rank``'s are (old code: a bare
    ``ValueError`` from the thread pool for -1, 0 silently the default, a string taken as progress)."""
    with pytest.raises(ShardloadError) as err:
        shardload.hash_checkpoint(example_dir, **kwargs)
    assert err.value.message == f"{example_dir}: {says}"
    assert not (example_dir / "shardload.hashes").exists()
