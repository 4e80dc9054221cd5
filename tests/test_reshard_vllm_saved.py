"""A ``sharded_state`` directory vLLM's own ``save_model`` wrote (no manifest, vLLM's names, config.json copied
beside it) as a source for ``convert`` at any N (docs/reshard.md).

The directories are made as vLLM writes them (``helpers/vllm_saved.py``; tests_vllm/test_vllm_saved.py uses vLLM's
own ``save_model``). From a TP=2 save of a GQA Llama, a Qwen2 (biases, tied embeddings, a vocabulary of 250 that
vLLM pads) and a Mixtral, ``convert --layout vllm -n N`` writes byte for byte the files converting the original
writes, and the plain layout the same rank tensors; ``load``, ``load_rank`` and ``inspect`` read such a directory
(and ``convert --layout vllm`` output) at any N as the original. Bad directories are one located line, nothing
written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import shardload
from helpers.checkpoints import rank_bytes
from helpers.vllm_saved import fake_vllm_save
from shardload.cli.main import main
from shardload.errors import ShardloadError
from shardload.integrations.vllm.writer import convert_vllm
from shardload.sources.manifest import MANIFEST_NAME
from shardload.sources.reader import count_reads

KINDS = {"llama_gqa": {}, "qwen2": {"vocab_size": 250}, "mixtral": {}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per kind: the original checkpoint and its TP=2 save."""
    pytest.importorskip("transformers")
    from helpers import tiny_models

    root = tmp_path_factory.mktemp("vllm_saved")
    out = {}
    for kind, overrides in KINDS.items():
        tiny_models.build(kind, root / kind, **overrides)
        out[kind] = (root / kind, fake_vllm_save(root / kind, 2, root / f"{kind}-saved2"))
    return out


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"model-rank-{rank}-part-0.safetensors"


@pytest.mark.parametrize("kind", list(KINDS))
def test_saved_to_any_n_and_layout(saved: dict[str, tuple[Path, Path]], kind: str, tmp_path: Path) -> None:
    original, save = saved[kind]
    runner = CliRunner()
    for n in (1, 2, 4):
        for source, out in ((save, tmp_path / f"v{n}"), (original, tmp_path / f"direct{n}")):
            result = runner.invoke(main, ["convert", str(source), "-n", str(n), "-o", str(out), "--layout", "vllm"])
            assert result.exit_code == 0, result.output
        for r in range(n):
            assert rank_bytes(rank_file(tmp_path / f"v{n}", r)) == rank_bytes(rank_file(tmp_path / f"direct{n}", r))
        result = runner.invoke(main, ["convert", str(save), "-n", str(n), "-o", str(tmp_path / f"plain{n}")])
        assert result.exit_code == 0, result.output
        want = shardload.load(original, n, devices=["cpu"] * n)
        for r in range(n):
            got = shardload.load_rank(tmp_path / f"plain{n}", r, n)
            assert got.keys() == want[r].keys()
            assert all(got[k].dtype == t.dtype and torch.equal(got[k], t) for k, t in want[r].items()), (n, r)


@pytest.mark.parametrize("kind", ["qwen2", "mixtral"])
def test_load_load_rank_inspect_any_n(saved: dict[str, tuple[Path, Path]], kind: str, tmp_path: Path) -> None:
    """``load``, ``load_rank`` and ``inspect`` straight from vLLM's save and from ``convert --layout vllm`` output:
    the ranks and the plan the original gives, at any N."""
    original, save = saved[kind]
    ours = tmp_path / "ours2"
    convert_vllm(original, 2, ours)
    runner = CliRunner()
    for source in (save, ours):
        for n in (1, 2, 4):
            want = shardload.load(original, n, devices=["cpu"] * n)
            got = shardload.load(source, n, devices=["cpu"] * n)
            for r in range(n):
                one = shardload.load_rank(source, r, n)
                for state in (got[r], one):
                    assert state.keys() == want[r].keys()
                    assert all(torch.equal(state[k], t) and state[k].dtype == t.dtype for k, t in want[r].items())
        direct = runner.invoke(main, ["inspect", str(original), "-n", "4", "--json"])
        shards = runner.invoke(main, ["inspect", str(source), "-n", "4", "--json"])
        assert shards.exit_code == 0 and direct.exit_code == 0, shards.output
        got_doc, want_doc = json.loads(shards.stdout), json.loads(direct.stdout)
        assert got_doc["totals"] == want_doc["totals"]
        assert sorted(got_doc["rows"], key=str) == sorted(want_doc["rows"], key=str)  # the record's order may differ
        with pytest.raises(ShardloadError, match=r"; ReadOptions\(strategy=.view.\) does not apply there"):
            shardload.load_rank(source, 0, 4, mmap=True)
        with pytest.raises(ShardloadError, match="sharded_state directory is read in boxes of vLLM's rank files, "
                           "which read_options does not steer"):  # fmt: skip
            shardload.load_rank(source, 0, 4, read_options=shardload.ReadOptions(threads=1))


def test_reads_only_the_checks_and_each_byte_once(saved: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """Converting the save reads each stored byte at most once, plus the small replicated tensors the content
    checks compare across ranks."""
    original, save = saved["llama_gqa"]
    with count_reads() as seen:
        shardload.convert(save, 1, tmp_path / "one")
    stored = shardload.load(original, 1, devices=["cpu"])[0]
    own = sum(t.numel() * t.element_size() for t in stored.values())
    assert own <= seen.bytes <= 1.05 * own


def _copy(save: Path, tmp_path: Path) -> Path:
    out = tmp_path / "save"
    shutil.copytree(save, out)
    return out


def _refused(source: Path, tmp_path: Path, match: str, **kwargs: object) -> str:
    out = tmp_path / "out"
    with pytest.raises(ShardloadError, match=match) as err:
        shardload.convert(source, 4, out, **kwargs)  # type: ignore[arg-type]
    message = str(err.value)
    assert "\n" not in message and not out.exists()
    return message


def _rewrite(path: Path, change: object) -> None:
    tensors = load_file(path)
    change(tensors)  # type: ignore[operator]
    save_file(tensors, path, metadata={"format": "pt"})


def test_without_config_json(saved: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    save = _copy(saved["qwen2"][1], tmp_path)
    (save / "config.json").unlink()
    _refused(save, tmp_path, "save_model does not write one; copy the model's config.json into this directory")


def test_missing_rank_file(saved: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    original = saved["llama_gqa"][0]
    save = fake_vllm_save(original, 4, tmp_path / "save4")
    rank_file(save, 1).unlink()
    _refused(save, tmp_path, r"model-rank-1-part-0\.safetensors: is missing .*ranks 0, 2, 3")
    rank_file(save, 3).unlink()
    rank_file(save, 2).rename(rank_file(save, 1))  # ranks 0, 1 of 4 left: read as num_shards=2, shapes disagree
    message = _refused(save, tmp_path, "its rank files for num_shards=2 do not fit config.json: .*o_proj.weight: "
                       "input dim")  # fmt: skip
    assert "is the file of a higher rank missing" in message  # N is read from the highest rank found


def test_verify_of_a_save_says_what_it_is(saved: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """`shardload verify` of a directory vLLM's save_model wrote said 'lm_head.weight: tensor is stored in two
    files', as of a broken checkpoint."""
    from click.testing import CliRunner

    from shardload.cli.main import main

    save = _copy(saved["llama_gqa"][1], tmp_path)
    with pytest.raises(ShardloadError, match=r"is vLLM.s own sharded_state .*no shard_manifest\.json") as err:
        shardload.verify_dir(save)
    assert "\n" not in str(err.value)
    result = CliRunner().invoke(main, ["verify", str(save)])
    assert result.exit_code == 1 and "is vLLM's own sharded_state" in result.output, result.output


def test_duplicated_rank_file(saved: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """Rank 0's file copied over rank 1's name: the same shapes, so only the content tells."""
    save = _copy(saved["llama_gqa"][1], tmp_path)
    shutil.copy(rank_file(save, 0), rank_file(save, 1))
    message = _refused(save, tmp_path, "as rank 0's file")
    assert "model-rank-1-part-0.safetensors: " in message


def test_rank_files_of_two_saves(saved: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """Rank 1 from the save of another model of the same architecture (another seed): the same shapes."""
    pytest.importorskip("transformers")
    from helpers import tiny_models

    tiny_models.build("llama_gqa", tmp_path / "other", seed=1)
    other = fake_vllm_save(tmp_path / "other", 2, tmp_path / "other-saved2")
    save = _copy(saved["llama_gqa"][1], tmp_path)
    shutil.copy(rank_file(other, 1), rank_file(save, 1))
    message = _refused(save, tmp_path, "differs from rank 0's: rank files of two different saves")
    assert "model-rank-1-part-0.safetensors: " in message


def _split_parts(save: Path, rank: int) -> None:
    """Rank ``rank``'s file as two parts, as save_model writes a rank over its max_size."""
    tensors = load_file(rank_file(save, rank))
    names = list(tensors)
    rank_file(save, rank).unlink()
    for part, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        path = save / f"model-rank-{rank}-part-{part}.safetensors"
        save_file({k: tensors[k] for k in chunk}, path, metadata={"format": "pt"})


def test_rank_files_in_parts(saved: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """Ranks saved in two parts each read as one; a tensor in two parts, or a part missing, is one located line."""
    original, _ = saved["qwen2"]
    save = _copy(saved["qwen2"][1], tmp_path)
    for r in range(2):
        _split_parts(save, r)
    convert_vllm(save, 4, tmp_path / "p4")
    convert_vllm(original, 4, tmp_path / "d4")
    for r in range(4):
        assert rank_bytes(rank_file(tmp_path / "p4", r)) == rank_bytes(rank_file(tmp_path / "d4", r))
    part1 = save / "model-rank-1-part-1.safetensors"
    moved = save / "moved.safetensors"
    part1.rename(moved)
    _refused(save, tmp_path, r"model-rank-1-part-0\.safetensors: .*: is missing, but config.json's plan gives")
    moved.rename(part1)
    shutil.copy(save / "model-rank-0-part-0.safetensors", save / "model-rank-0-part-2.safetensors")
    _refused(save, tmp_path, r"model-rank-0-part-2\.safetensors: .*: is also in model-rank-0-part-0\.safetensors")
    (save / "model-rank-0-part-2.safetensors").rename(save / "model-rank-0-part-3.safetensors")
    _refused(save, tmp_path, r"model-rank-0-part-2\.safetensors: is missing")


def test_shapes_disagree_with_config(saved: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    for key, value in (("num_key_value_heads", 4), ("vocab_size", 300)):
        save = _copy(saved["qwen2"][1], tmp_path)
        config = json.loads((save / "config.json").read_text())
        config[key] = value
        (save / "config.json").write_text(json.dumps(config))
        message = _refused(save, tmp_path, "but config.json's plan gives")
        assert "model-rank-0-part-0.safetensors: " in message
        shutil.rmtree(save)


def test_extra_or_missing_tensor(saved: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    save = _copy(saved["llama_gqa"][1], tmp_path)
    _rewrite(rank_file(save, 1), lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    _refused(save, tmp_path, r"model.layers.0.extra.weight: is no tensor of config.json's plan")
    shutil.rmtree(save)
    save = _copy(saved["llama_gqa"][1], tmp_path)
    _rewrite(rank_file(save, 1), lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    _refused(save, tmp_path, r"model-rank-1-part-0\.safetensors: model.layers.1.mlp.down_proj.weight: is missing")


def test_cpu_save_without_linear_weights(saved: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """vLLM on the CPU drops every linear weight it packs for oneDNN from its state: its save_model writes none."""
    save = _copy(saved["qwen2"][1], tmp_path)
    for r in range(2):
        _rewrite(rank_file(save, r), lambda t: [t.pop(k) for k in list(t) if k.endswith("proj.weight")])
    _refused(save, tmp_path, "qkv_proj.weight: is missing: this save has no such projection .*vLLM on the CPU")


def test_refusals(saved: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    save = _copy(saved["llama_gqa"][1], tmp_path)
    _refused(save, tmp_path, "vLLM's save_model writes none", verify=True)
    config = json.loads((save / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (save / "config.json").write_text(json.dumps(config))
    _refused(save, tmp_path, "is quantized \\(quant_method='fp8'\\): vLLM's save_model writes the weights as vLLM")
    config.pop("quantization_config")
    config["model_type"] = "phi3"
    (save / "config.json").write_text(json.dumps(config))
    _refused(save, tmp_path, "model_type 'phi3': reading vLLM's own sharded_state back is supported for")
    shutil.copy(rank_file(save, 0), save / "model-pp-0-tp-0-part-0.safetensors")
    _refused(save, tmp_path, "pipeline-parallel engine")


def test_expert_parallel_save_refused(saved: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """A save made with expert parallelism holds E/N experts per rank file: its shapes agree across ranks, so only
    config.json's expert count tells it apart; it is refused in one line, never read back as a model of E/N experts
    (seen loading 29 of 41 tensors, two experts missing, before the check)."""
    original, _ = saved["mixtral"]
    ep = fake_vllm_save(original, 2, tmp_path / "ep2", expert_parallel=True)
    with pytest.raises(ShardloadError, match="expert parallelism") as err:
        shardload.load_rank(ep, 0, 1)
    assert "\n" not in str(err.value) and "w13_weight" in str(err.value)
    _refused(ep, tmp_path, "expert parallelism")


def test_load_rank_of_a_save_refuses_params_and_out(saved: dict[str, tuple[Path, Path]]) -> None:
    """params= and out= are refused on a sharded_state directory rather than ignored (seen returning every tensor,
    the caller's tensor left unwritten, before the check)."""
    _, save = saved["llama_gqa"]
    mine = {"model.norm.weight": torch.full((4,), 7.0)}
    for kwargs in ({"params": mine, "out": mine}, {"params": ["nope"]}):
        with pytest.raises(ShardloadError, match="into= does not apply there"):
            shardload.load_rank(save, 1, 2, **kwargs)  # type: ignore[arg-type]
    assert torch.equal(mine["model.norm.weight"], torch.full((4,), 7.0))


def test_a_model_directory_holding_rank_files_too_is_refused(
    saved: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """A checkpoint's own directory that also holds vLLM rank files (a ``save_model`` written into it, or one left
    over from another fine-tune) is refused in one line naming both, not read as the rank files with the
    checkpoint's weights silently ignored."""
    original, save = next(iter(saved.values()))
    mixed = tmp_path / "mixed"
    shutil.copytree(original, mixed)
    for path in save.glob("model-rank-*"):
        shutil.copy(path, mixed / path.name)
    for verify in (False, True):
        with pytest.raises(ShardloadError) as err:
            shardload.load_rank(mixed, 0, 2, verify=verify)
        text = str(err.value)
        assert text.startswith(str(mixed)) and "model.safetensors" in text and "rank files" in text, text
        assert "\n" not in text, text
    result = CliRunner().invoke(main, ["inspect", str(mixed), "-n", "2"])
    assert result.exit_code != 0 and "model.safetensors" in result.output, result.output
    # vLLM's save_sharded_state example copies every file of the source but its weights: an index is no weights
    with_index = tmp_path / "with-index"
    shutil.copytree(save, with_index)
    (with_index / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    assert shardload.load_rank(with_index, 0, 2).keys() == shardload.load_rank(save, 0, 2).keys()


@pytest.mark.parametrize("verify", [False, True])
def test_an_edited_plan_in_a_vllm_layout_manifest_is_refused(
    saved: dict[str, tuple[Path, Path]], tmp_path: Path, verify: bool
) -> None:
    """``convert --layout vllm``'s manifest had no check of its source record against its rank files: one edit of
    gate_proj's steps (shapes kept) gave every rank at another N wrong rows, with ``verify`` too, and
    ``shardload verify`` passed it. The rank files' seals now name the edit."""
    original, _ = saved["llama_gqa"]
    ours = tmp_path / "ours2"
    convert_vllm(original, 2, ours)
    want = shardload.load(original, 1, devices=["cpu"])[0]
    got = shardload.load_rank(ours, 0, 1, verify=verify)
    assert all(torch.equal(got[k], t) for k, t in want.items()) and got.keys() == want.keys()
    manifest = json.loads((ours / MANIFEST_NAME).read_text())
    info = manifest["source_plan"]["shard_info"]["params"]
    name = next(k for k in info if k.endswith("mlp.gate_proj.weight"))
    rows, cols = manifest["source_plan"]["tensors"][name][1]
    dtype = manifest["source_plan"]["tensors"][name][0]
    info[name] = [["shard_funcs.shard_segments", [["num_shards", f"{rows} // num_shards", cols], dtype], 0,
                   [rows // 2, rows // 2], [0, 0], "num_shards"]]  # fmt: skip
    (ours / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ShardloadError, match="seal") as excinfo:
        shardload.load_rank(ours, 0, 1, verify=verify)
    assert "\n" not in str(excinfo.value)
    assert not shardload.verify_dir(ours).ok
