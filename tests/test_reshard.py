"""A converted directory as a source for any N (docs/reshard.md).

For each tiny model (a GQA Llama whose KV heads replicate at N > 2, a Qwen2 with biases, tied embeddings and a
vocabulary of 250 that N = 4 pads, a Mixtral, a GPTQ int4 Llama whose ``g_idx`` a compute step rewrites, a
compressed-tensors int4 Llama whose ``weight_shape`` one rewrites, a pp x tp mesh), converted for N_old in
{2, 4, 8} where the model allows, every rank at N_new in {1, 2, 3, 4, 8} must equal the rank made straight from
the original checkpoint, element for element, and read at most 1.05x its own bytes; an N the model refuses is
refused from the shards too, in one line. The same grid runs on a pp=2 x tp=N_old mesh directory (read as pp 1
and 2 x tp=N_new) and on vLLM ``sharded_state`` directories made for N_old (``convert --layout vllm``, and as
vLLM's ``save_model`` writes them) of the GQA Llama, the Qwen2 and the Mixtral. The GQA Llama's ranks also equal
an independent reference (tests/helpers/tp_split.py). Bad directories are one located line, nothing written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import shardload
from helpers import tp_split
from helpers.checkpoints import rank_bytes, unseal
from shardload.cli.main import main
from shardload.errors import CheckpointError, ShardloadError
from shardload.sources.reader import count_reads

OLD_N = (2, 4, 8)
NEW_N = (1, 2, 3, 4, 8)
SLACK = 1.05
State = dict[str, torch.Tensor]


class Model:
    """A source model, its converted directories (made once per N_old) and its direct ranks (once per N_new)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._direct: dict[int, list[State] | ShardloadError] = {}
        self._converted: dict[int, Path | None] = {}

    def direct(self, n: int) -> list[State] | ShardloadError:
        if n not in self._direct:
            try:
                self._direct[n] = shardload.load(self.path, n, devices=["cpu"] * n)
            except ShardloadError as err:
                self._direct[n] = err
        return self._direct[n]

    def converted(self, n: int) -> Path | None:
        """The model converted for ``n`` (None when the model does not allow ``n``)."""
        if n not in self._converted:
            out = self.path.parent / f"{self.path.name}-tp{n}"
            self._converted[n] = None if isinstance(self.direct(n), ShardloadError) else out
            if self._converted[n] is not None:
                shardload.convert(self.path, n, out)
        return self._converted[n]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    pytest.importorskip("transformers")
    from helpers import tiny_models
    from helpers.quant_llama import SYNTHETIC, write_llama

    root = tmp_path_factory.mktemp("reshard")
    tiny_models.build("llama_gqa", root / "llama_gqa")
    tiny_models.build("qwen2", root / "qwen2", vocab_size=250)
    tiny_models.build("mixtral", root / "mixtral")
    write_llama(root / "gptq", *SYNTHETIC["gptq"])
    return {name: Model(root / name) for name in ("llama_gqa", "qwen2", "mixtral", "gptq")}


def own_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def assert_equal(got: State, want: State, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), f"{what}: {name}"


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2", "mixtral", "gptq", "compressed"])
def test_any_n_from_any_n(models: dict[str, Model], kind: str, request: pytest.FixtureRequest) -> None:
    if kind == "compressed":  # the compressed-tensors int4 Llama of test_quant_llama.py (weight_shape: computed)
        models.setdefault(kind, Model(request.getfixturevalue("tiny_llama")))
    model = models[kind]
    cells = 0
    for n_old in OLD_N:
        out = model.converted(n_old)
        if out is None:
            continue
        for n_new in NEW_N:
            want = model.direct(n_new)
            if isinstance(want, ShardloadError):  # the model refuses this N: so do its shards, in one line
                with pytest.raises(ShardloadError) as err:
                    shardload.load_rank(out, 0, n_new)
                assert "\n" not in str(err.value)
                continue
            for rank in range(n_new):
                with count_reads() as seen:
                    got = shardload.load_rank(out, rank, n_new)
                what = f"{kind} {n_old} -> {n_new} rank {rank}"
                assert_equal(got, want[rank], what)
                assert seen.bytes <= SLACK * own_bytes(got), f"{what}: read {seen.bytes} for {own_bytes(got)}"
                cells += 1
    assert cells >= 10


def test_gqa_ranks_equal_an_independent_split(models: dict[str, Model]) -> None:
    """The 8-head, 2-KV-head Llama from its 2-way shards at N = 8 (each KV head on four ranks) against plain
    torch slicing of the original tensors."""
    from safetensors.torch import load_file

    model = models["llama_gqa"]
    config = json.loads((model.path / "config.json").read_text())
    state = load_file(str(model.path / "model.safetensors"))
    out = model.converted(2)
    assert out is not None
    got = shardload.load(out, 8, devices=["cpu"] * 8)
    for rank in range(8):
        want = tp_split.plain_rank(state, config, 8, rank)
        assert tp_split.mismatches(got[rank], want) == [], rank


def test_replicated_kv_heads_are_read_once(models: dict[str, Model]) -> None:
    """From 8-way shards (each of the 2 KV heads on four ranks) to N = 1: every stored byte is read once."""
    model = models["llama_gqa"]
    out = model.converted(8)
    assert out is not None
    with count_reads() as seen:
        got = shardload.load_rank(out, 0, 1)
    assert seen.bytes == own_bytes(got)


def test_convert_from_shards(models: dict[str, Model], tmp_path: Path) -> None:
    """``convert OUT4 -n 2`` writes what converting the original for 2 writes; the result reshards again."""
    model = models["qwen2"]
    out4 = model.converted(4)
    assert out4 is not None
    result = CliRunner().invoke(main, ["convert", str(out4), "-n", "2", "-o", str(tmp_path / "o2")])
    assert result.exit_code == 0, result.output
    direct = model.converted(2)
    assert direct is not None
    for r in range(2):
        name = f"rank-{r:05d}-of-00002.safetensors"
        assert rank_bytes(tmp_path / "o2" / name) == rank_bytes(direct / name)
    assert shardload.verify_dir(tmp_path / "o2").ok
    want = model.direct(4)
    assert not isinstance(want, ShardloadError)
    for r in range(4):
        assert_equal(shardload.load_rank(tmp_path / "o2", r, 4), want[r], f"4 -> 2 -> 4 rank {r}")


def test_a_resharded_output_carries_the_record_every_convert_writes(models: dict[str, Model], tmp_path: Path) -> None:
    """``convert OUT4 -n 2`` writes what converting the original writes, record included: a version-2 manifest
    whose ``integrity`` root pins the output (it wrote a version-1 manifest with no record); ``--sha256`` writes
    version 1 with each file's sha256, as a convert of the original does."""
    out4 = models["qwen2"].converted(4)
    assert out4 is not None
    direct = models["qwen2"].converted(2)
    assert direct is not None
    from shardload.engine.hashing import output_record
    from shardload.format.hash_record import root_of

    for extra, version in (([], 2), (["--sha256"], 1)):
        out = tmp_path / f"o2-{version}"
        result = CliRunner().invoke(main, ["convert", str(out4), "-n", "2", "-o", str(out), *extra])
        assert result.exit_code == 0, result.output
        manifest = json.loads((out / "shard_manifest.json").read_text())
        assert manifest["version"] == version and (out / "shardload.hashes").is_file(), manifest
        names = [f"rank-{r:05d}-of-00002.safetensors" for r in range(2)]
        assert (out / "shardload.hashes").read_bytes() == output_record(out, names)  # hashed as written: read back
        assert manifest["integrity"]["root"] == root_of(output_record(out, names))
        assert shardload.verify_dir(out).ok
        pinned = shardload.Verify(root=manifest["integrity"]["root"])
        assert_equal(shardload.load_rank(out, 1, 2, verify=pinned), shardload.load_rank(direct, 1, 2), "pinned")


def test_inspect_shards_as_the_original(models: dict[str, Model]) -> None:
    """``inspect OUT8 -n 2`` reports the plan ``inspect MODEL -n 2`` does; an N the model refuses is one line."""
    model = models["mixtral"]
    out = model.converted(4)
    assert out is not None
    runner = CliRunner()
    direct = runner.invoke(main, ["inspect", str(model.path), "-n", "2", "--json"])
    shards = runner.invoke(main, ["inspect", str(out), "-n", "2", "--json"])
    assert shards.exit_code == 0 and direct.exit_code == 0, shards.output
    assert json.loads(shards.stdout) == json.loads(direct.stdout)
    refused = runner.invoke(main, ["inspect", str(out), "-n", "3"])
    assert refused.exit_code == 1 and refused.stderr.count("\n") == 2, refused.stderr  # the note, the error
    assert "each rank reads its boxes out of those rank files" in shards.stderr, shards.stderr
    own = runner.invoke(main, ["inspect", str(out), "--json"])  # no -n: the directory's own N (it took 8)
    assert own.exit_code == 0 and json.loads(own.stdout)["totals"]["num_shards"] == 4, own.output
    assert "num_shards=4: each rank reads its own rank file" in own.stderr, own.stderr  # not boxes (reviewer D)


# --- bad directories: one located line, nothing written ------------------------------------------


def _copy(models: dict[str, Model], tmp_path: Path) -> Path:
    out = models["llama_gqa"].converted(2)
    assert out is not None
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    return bad


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "shard_manifest.json").read_text())


def _refused(source: Path, tmp_path: Path, reason: str) -> None:
    """Loading ``source`` for 4 and converting it for 4 both fail with one line holding ``reason``; no output."""
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(source, 0, 4)
    assert reason in str(err.value) and "\n" not in str(err.value), str(err.value)
    result = CliRunner().invoke(main, ["convert", str(source), "-n", "4", "-o", str(tmp_path / "new")])
    assert result.exit_code == 1 and reason in result.output and result.output.count("\n") == 1, result.output
    assert not (tmp_path / "new").exists()
    assert [p.name for p in tmp_path.iterdir()] == [source.name]


def test_missing_rank_file(models: dict[str, Model], tmp_path: Path) -> None:
    bad = _copy(models, tmp_path)
    (bad / "rank-00001-of-00002.safetensors").unlink()
    _refused(bad, tmp_path, "rank-00001-of-00002.safetensors: is missing (listed in the manifest)")


def test_duplicated_rank_file(models: dict[str, Model], tmp_path: Path) -> None:
    bad = _copy(models, tmp_path)
    shutil.copy(bad / "rank-00000-of-00002.safetensors", bad / "rank-00001-of-00002.safetensors")
    _refused(bad, tmp_path, "its header says rank 0 of 2, not rank 1 of 2")


def test_rank_file_of_another_conversion(models: dict[str, Model], tmp_path: Path) -> None:
    """Rank 1 from the Qwen2 conversion: its size disagrees with the manifest; with the size fixed up too, it names
    another conversion than the manifest; under a manifest naming none (an older one), its tensors disagree with the
    manifest's plan."""
    bad = _copy(models, tmp_path)
    other = models["qwen2"].converted(2)
    assert other is not None
    shutil.copy(other / "rank-00001-of-00002.safetensors", bad / "rank-00001-of-00002.safetensors")
    _refused(bad, tmp_path, "rank-00001-of-00002.safetensors: is ")
    manifest = _manifest(bad)
    for entry in manifest["files"]:
        if entry["path"] == "rank-00001-of-00002.safetensors":
            entry["size"] = (bad / entry["path"]).stat().st_size
    (bad / "shard_manifest.json").write_text(json.dumps(manifest))
    _refused(bad, tmp_path, "rank-00001-of-00002.safetensors: was written by another conversion")
    del manifest["conversion"]
    (bad / "shard_manifest.json").write_text(json.dumps(manifest))
    _refused(bad, tmp_path, "rank-00000-of-00002.safetensors: its header or the plan in shard_manifest.json was "
             "changed after convert wrote them")  # fmt: skip
    _unsealed(bad)
    _refused(
        bad,
        tmp_path,
        "rank-00001-of-00002.safetensors: model.embed_tokens.weight: is float32 [125, 64], but the manifest's plan",
    )


def _unsealed(bad: Path) -> None:
    """Take the seals out of ``bad``: a directory an older shardload wrote, whose manifest's plan only the rank
    files' shapes check."""
    unseal(bad)


def test_shapes_disagree_with_the_plan(models: dict[str, Model], tmp_path: Path) -> None:
    bad = _copy(models, tmp_path)
    manifest = _manifest(bad)
    manifest["source_plan"]["tensors"]["model.norm.weight"][1] = [32]
    (bad / "shard_manifest.json").write_text(json.dumps(manifest))
    _refused(bad, tmp_path, "rank-00000-of-00002.safetensors: its header or the plan in shard_manifest.json was "
             "changed")  # fmt: skip
    _unsealed(bad)
    _refused(
        bad, tmp_path, "rank-00000-of-00002.safetensors: model.norm.weight: is float32 [64], but the manifest's plan"
    )


def test_without_a_source_record(models: dict[str, Model], tmp_path: Path) -> None:
    bad = _copy(models, tmp_path)
    manifest = _manifest(bad)
    del manifest["source_plan"]
    (bad / "shard_manifest.json").write_text(json.dumps(manifest))
    _refused(bad, tmp_path, "without a source record")
    with pytest.raises(ShardloadError, match="its seal does not match"):  # the manifest it was written with, changed
        shardload.load_rank(bad, 1, 2)
    _unsealed(bad)  # as an older shardload wrote it
    _refused(bad, tmp_path, "without a source record")
    assert shardload.load_rank(bad, 1, 2).keys()  # its own N still loads


@pytest.mark.parametrize("damage", ["malformed", "shapes"])
def test_verify_reports_a_source_record_no_other_n_could_use(
    models: dict[str, Model], tmp_path: Path, damage: str
) -> None:
    """``verify OUT`` checks the manifest's source record as a load at another N reads it: it said ok, and every
    load or convert at another N then failed."""
    bad = _copy(models, tmp_path)
    manifest = _manifest(bad)
    if damage == "malformed":
        manifest["source_plan"] = {"shard_info": "/etc/passwd"}
    else:
        manifest["source_plan"]["tensors"]["model.norm.weight"][1] = [32]
    (bad / "shard_manifest.json").write_text(json.dumps(manifest))
    report = shardload.verify_dir(bad)
    assert not report.ok and len(report.problems) == 2, report.problems  # each rank file's seal
    assert all("its seal does not match" in str(p) for p in report.problems), report.problems


def test_refusals_are_checkpoint_errors(models: dict[str, Model]) -> None:
    out = models["llama_gqa"].converted(2)
    assert out is not None
    with pytest.raises(CheckpointError, match="rank 3 is out of range for num_shards=3"):
        shardload.load_rank(out, 3, 3)


# --- a TVM/MLC cache pre-sharded for one N ------------------------------------------------------------

TVM_PLAN = {
    "version": 1,
    "num_shards": None,
    "params": {
        "param_0": [["shard_funcs.shard_dim", [None, "float16"], 0, "num_shards"]],
        "param_1": [["shard_funcs.shard_dim", [None, "float32"], 1, "num_shards"]],
    },
}


def test_presharded_cache_to_any_n(tmp_path: Path) -> None:
    """A cache cut 2 ways (records ``NAME_shard-K-of-2``) and the shard_info saying how: any N, each rank its own
    bytes, equal to splitting the whole parameters; then converted for 4 and loaded for 8 from that."""
    pytest.importorskip("tvm")
    import numpy as np

    from helpers.tvm_cache import presharded

    path, split = presharded(tmp_path, 2)
    whole = {"param_0": np.concatenate(split["param_0"], 0), "param_1": np.concatenate(split["param_1"], 1)}

    def want(n: int, r: int) -> dict[str, np.ndarray]:
        return {"param_0": np.split(whole["param_0"], n, 0)[r], "param_1": np.split(whole["param_1"], n, 1)[r]}

    for n in (1, 4, 8):
        for r in range(n):
            with count_reads() as seen:
                got = shardload.load_rank(path, r, n, shard_info=TVM_PLAN)
            for name, array in want(n, r).items():
                assert np.array_equal(got[name].numpy(), array), (n, r, name)
            assert got["norm"].numel() == 16 and seen.bytes == own_bytes(got)
    shardload.convert(path, 4, tmp_path / "tp4", shard_info=TVM_PLAN)
    assert shardload.verify_dir(tmp_path / "tp4").ok
    got = shardload.load(tmp_path / "tp4", 8, devices=["cpu"] * 8)
    for r in range(8):
        for name, array in want(8, r).items():
            assert np.array_equal(got[r][name].numpy(), array), (r, name)


def test_inspect_presharded_cache_at_another_n(tmp_path: Path) -> None:
    """``inspect CACHE2 -n 4 --shard-info`` prints the plan ``inspect`` prints for the cache of the whole parameters
    (a note on stderr says where the bytes come from); without the shard_info, one line."""
    pytest.importorskip("tvm")
    import numpy as np

    from helpers.tvm_cache import dump, presharded

    path, split = presharded(tmp_path, 2)
    whole = {"param_0": np.concatenate(split["param_0"], 0), "param_1": np.concatenate(split["param_1"], 1),
             "norm": np.ones(16, dtype="float16")}  # fmt: skip
    plain = dump(whole, tmp_path / "whole")
    plan = tmp_path / "shard_info.json"
    plan.write_text(json.dumps(TVM_PLAN))
    runner = CliRunner()
    for n in ("1", "4", "8"):
        shards = runner.invoke(main, ["inspect", str(path), "-n", n, "--shard-info", str(plan), "--json"])
        direct = runner.invoke(main, ["inspect", str(plain), "-n", n, "--shard-info", str(plan), "--json"])
        assert shards.exit_code == 0 and direct.exit_code == 0, shards.output
        got, want = json.loads(shards.stdout), json.loads(direct.stdout)
        assert got["totals"] == want["totals"], n
        rows = [sorted(doc["rows"], key=lambda row: row["parameter"]) for doc in (got, want)]  # records' order
        assert rows[0] == rows[1], n
        assert shards.stderr.startswith("note: a pre-sharded checkpoint for num_shards=2"), shards.stderr
    refused = runner.invoke(main, ["inspect", str(path), "-n", "4"])
    assert refused.exit_code == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "param_0: is pre-sharded for num_shards=2; loading it for another N needs a shard_info" in refused.stderr


def test_presharded_cache_needs_its_plan(tmp_path: Path) -> None:
    """Without a shard_info (how was it cut?), or with one that two whole shapes satisfy, one line."""
    pytest.importorskip("tvm")
    from helpers.tvm_cache import presharded

    path, _ = presharded(tmp_path, 2)
    with pytest.raises(ShardloadError, match="param_0: is pre-sharded for num_shards=2; loading it for another N"):
        shardload.load_rank(path, 0, 4)
    replicate = {"version": 1, "num_shards": None, "params": {
        **TVM_PLAN["params"], "param_0": [["shard_funcs.replicate", [None, "float16"], "num_shards"]]}}  # fmt: skip
    with pytest.raises(ShardloadError, match="param_0: cannot tell the whole shape") as err:
        shardload.convert(path, 4, tmp_path / "out", shard_info=replicate)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_vllm_layout_from_shards(models: dict[str, Model], tmp_path: Path) -> None:
    """``convert OUT4 --layout vllm -n 2`` writes the rank files ``convert MODEL --layout vllm -n 2`` writes (Qwen2:
    fused qkv with biases, the vocabulary padded to vLLM's multiple of 64, a tied head)."""
    model = models["qwen2"]
    out4 = model.converted(4)
    assert out4 is not None
    runner = CliRunner()
    for source, out in ((out4, tmp_path / "from-shards"), (model.path, tmp_path / "direct")):
        result = runner.invoke(main, ["convert", str(source), "-n", "2", "-o", str(out), "--layout", "vllm"])
        assert result.exit_code == 0, result.output
    for r in range(2):
        name = f"model-rank-{r}-part-0.safetensors"
        assert rank_bytes(tmp_path / "from-shards" / name) == rank_bytes(tmp_path / "direct" / name), name


def test_own_n_keeps_the_fast_path(models: dict[str, Model], monkeypatch: pytest.MonkeyPatch) -> None:
    """At the N it was converted for, a directory is read file by file as before: the resharding source is never
    opened, and share_reads or mmap at another N is one line."""
    import shardload.engine.routes as load_module

    out = models["llama_gqa"].converted(2)
    assert out is not None

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the resharding path was taken")

    monkeypatch.setattr(load_module, "open_shards", refuse)
    want = models["llama_gqa"].direct(2)
    assert not isinstance(want, ShardloadError)
    assert_equal(shardload.load_rank(out, 1, 2, mmap=True), want[1], "own N, mmap")
    monkeypatch.undo()
    with pytest.raises(ShardloadError, match=r"; ReadOptions\(strategy=.view.\) does not apply there") as err:
        shardload.load_rank(out, 0, 4, mmap=True)
    assert "\n" not in str(err.value)
    with pytest.raises(ShardloadError, match="which read_options does not steer") as err:
        shardload.load_rank(out, 0, 4, read_options=shardload.ReadOptions(strategy="plan"))
    assert "\n" not in str(err.value) and "converted for num_shards=2" in str(err.value)
    assert shardload.load_rank(out, 1, 2, read_options=shardload.ReadOptions(strategy="read")).keys() == want[1].keys()


@pytest.mark.parametrize("kind", ["qwen2", "mixtral"])
def test_vllm_sharded_state_as_a_source(models: dict[str, Model], kind: str, tmp_path: Path) -> None:
    """A directory ``convert --layout vllm -n 2`` wrote (vLLM's names, fused qkv and gate_up, stacked experts, the
    vocabulary padded to a multiple of 64) converts to the plain layout and to vLLM's at N = 1, 2, 4: the same
    ranks (plain) and the same files (vLLM) as converting the original."""
    model = models[kind]
    runner = CliRunner()
    vllm2 = tmp_path / "vllm2"
    result = runner.invoke(main, ["convert", str(model.path), "-n", "2", "-o", str(vllm2), "--layout", "vllm"])
    assert result.exit_code == 0, result.output
    for n in (1, 2, 4):
        want = model.direct(n)
        assert not isinstance(want, ShardloadError)
        plain = tmp_path / f"plain{n}"
        shardload.convert(vllm2, n, plain)
        for r in range(n):
            assert_equal(shardload.load_rank(plain, r, n), want[r], f"{kind} vllm 2 -> plain {n} rank {r}")
        for source, out in ((vllm2, tmp_path / f"v{n}"), (model.path, tmp_path / f"direct{n}")):
            result = runner.invoke(main, ["convert", str(source), "-n", str(n), "-o", str(out), "--layout", "vllm"])
            assert result.exit_code == 0, result.output
        for r in range(n):
            name = f"model-rank-{r}-part-0.safetensors"
            assert rank_bytes(tmp_path / f"v{n}" / name) == rank_bytes(tmp_path / f"direct{n}" / name)


def test_vllm_sharded_state_bad_input(models: dict[str, Model], tmp_path: Path) -> None:
    """A missing rank file, or one without a source record (as vLLM's own save_model writes): one line, nothing
    written."""
    model = models["qwen2"]
    vllm2 = tmp_path / "vllm2"
    result = CliRunner().invoke(main, ["convert", str(model.path), "-n", "2", "-o", str(vllm2), "--layout", "vllm"])
    assert result.exit_code == 0, result.output
    (vllm2 / "model-rank-1-part-0.safetensors").unlink()
    with pytest.raises(ShardloadError, match=r"model-rank-1-part-0\.safetensors: is missing") as err:
        shardload.convert(vllm2, 4, tmp_path / "out")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    manifest = _manifest(vllm2)
    del manifest["source_plan"]
    (vllm2 / "shard_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardloadError, match="without a source record") as err:
        shardload.convert(vllm2, 4, tmp_path / "out")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_verify_when_resharding(models: dict[str, Model], tmp_path: Path) -> None:
    """verify=True reads another conversion's rank files checked against the manifest's sha256 (a flipped byte fails
    in one line); a pinned root cannot be checked there and is refused, never loaded unchecked."""
    bad = _copy(models, tmp_path)
    want = models["llama_gqa"].direct(4)
    assert not isinstance(want, ShardloadError)
    assert_equal(shardload.load_rank(bad, 1, 4, verify=True), want[1], "verify=True, 2 -> 4")
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(bad, 1, 4, verify="0" * 64)
    assert "verify=<root hash>, --verify ROOT) is not supported" in str(err.value)
    result = CliRunner().invoke(
        main, ["convert", str(bad), "-n", "4", "-o", str(tmp_path / "new"), "--verify", "0" * 64]
    )
    assert result.exit_code == 1 and "verify=<root hash>, --verify ROOT) is not supported" in result.output, (
        result.output
    )
    assert not (tmp_path / "new").exists()
    rank = bad / "rank-00001-of-00002.safetensors"
    data = bytearray(rank.read_bytes())
    data[-1] ^= 0xFF
    rank.write_bytes(bytes(data))
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(bad, 1, 4, verify=True)
    assert "does not match its leaves" in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_verify_refused_for_a_presharded_cache_read_for_another_n(tmp_path: Path) -> None:
    pytest.importorskip("tvm")
    from helpers.tvm_cache import presharded

    path, _ = presharded(tmp_path, 2)
    shardload.hash_checkpoint(path)  # a record, so only the read for another N is left to refuse
    for call in (lambda: shardload.load_rank(path, 0, 4, verify=True), lambda: shardload.load(path, 4, verify=True)):
        with pytest.raises(ShardloadError) as err:
            call()
        assert "verify is not supported when a pre-sharded cache is read for another N" in str(err.value)


# --- the proof grid on the other layouts: pipeline meshes, vLLM's sharded_state (ours and save_model's) ----------


@pytest.mark.parametrize("tp_old", OLD_N)
def test_mesh_grid(models: dict[str, Model], tp_old: int, tmp_path: Path) -> None:
    """A pp=2 x tp=N_old directory (N_old in 2, 4, 8) loads as pp in 1, 2 x tp=N_new for every N_new: each rank
    equal to the original's for that mesh, at most 1.05x its own bytes; tp=3 (2 KV heads) refused in one line."""
    model = models["llama_gqa"]
    out = tmp_path / "mesh"
    shardload.convert(model.path, None, out, mesh=f"pp=2,tp={tp_old}")
    cells = 0
    for pp in (1, 2):
        for tp in NEW_N:
            mesh = f"pp={pp},tp={tp}"
            if isinstance(model.direct(tp), ShardloadError):
                with pytest.raises(ShardloadError) as err:
                    shardload.load_rank(out, 0, mesh=mesh)
                assert "\n" not in str(err.value)
                continue
            want = shardload.load(model.path, mesh=mesh, devices=["cpu"] * pp * tp)
            for rank in range(pp * tp):
                with count_reads() as seen:
                    got = shardload.load_rank(out, rank, mesh=mesh)
                assert_equal(got, want[rank], f"pp=2,tp={tp_old} -> {mesh} rank {rank}")
                assert seen.bytes <= SLACK * own_bytes(got)
                cells += 1
    assert cells == 2 * 15 + 15  # pp=2 and pp=1 over tp 1, 2, 4, 8


@pytest.mark.parametrize("layout", ["ours", "saved"])
@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2", "mixtral"])
def test_sharded_state_grid(models: dict[str, Model], kind: str, layout: str, tmp_path: Path) -> None:
    """A ``sharded_state`` directory made for N_old in 2, 4, 8 (``convert --layout vllm``, or as vLLM's
    ``save_model`` writes it) loads at every N_new the model allows: every rank equal to the original's."""
    from helpers.vllm_saved import fake_vllm_save
    from shardload.integrations.vllm.writer import convert_vllm

    model = models[kind]
    cells = 0
    for n_old in OLD_N:
        if isinstance(model.direct(n_old), ShardloadError):
            continue
        source = tmp_path / f"{layout}{n_old}"
        (convert_vllm if layout == "ours" else fake_vllm_save)(model.path, n_old, source)
        for n_new in NEW_N:
            want = model.direct(n_new)
            if isinstance(want, ShardloadError):
                with pytest.raises(ShardloadError) as err:
                    shardload.load_rank(source, 0, n_new)
                assert "\n" not in str(err.value)
                continue
            got = shardload.load(source, n_new, devices=["cpu"] * n_new)
            for rank in range(n_new):
                assert_equal(got[rank], want[rank], f"{kind} {layout} {n_old} -> {n_new} rank {rank}")
                cells += 1
    assert cells == {"llama_gqa": 3 * 15, "qwen2": 2 * 7, "mixtral": 2 * 7}[kind]  # 4 heads: N <= 4


def test_compressed_sharded_state_to_another_n(
    models: dict[str, Model], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """``convert --layout vllm -n 2`` of the compressed-tensors int4 Llama, loaded at N = 1 and 4: every rank equal
    to the original's (vLLM's files hold no ``weight_shape``: the manifest records it); a manifest without that
    record is one line."""
    from shardload.integrations.vllm.writer import convert_vllm

    model = models.setdefault("compressed", Model(request.getfixturevalue("tiny_llama")))
    convert_vllm(model.path, 2, tmp_path / "vllm2")
    _serves(model, tmp_path / "vllm2", (1, 4), "compressed vllm 2")
    manifest = _manifest(tmp_path / "vllm2")
    manifest["source_plan"]["values"] = {}
    (tmp_path / "vllm2" / "shard_manifest.json").write_text(json.dumps(manifest))
    unseal(tmp_path / "vllm2")  # as an older shardload wrote it
    with pytest.raises(ShardloadError, match="weight_shape: its num_shards=2 files hold none of it") as err:
        shardload.load_rank(tmp_path / "vllm2", 0, 4)
    assert "\n" not in str(err.value)


def test_a_directory_converted_from_a_compressed_sharded_state_serves_another_n(
    models: dict[str, Model], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """``convert -n 2`` of a ``--layout vllm -n 2`` directory of the compressed-tensors int4 Llama: vLLM's files keep
    o_proj's and down_proj's ``weight_shape`` whole, where the plain plan rewrites them (``shard_shape``); the new
    directory records their values, so it serves N = 1 and 4 (it was refused there, and ``verify`` passed it)."""
    from shardload.integrations.vllm.writer import convert_vllm

    model = models.setdefault("compressed", Model(request.getfixturevalue("tiny_llama")))
    convert_vllm(model.path, 2, tmp_path / "vllm2")
    shardload.convert(tmp_path / "vllm2", 2, tmp_path / "plain2")
    _serves(model, tmp_path / "plain2", (1, 4), "compressed vllm 2 -> plain 2")


def _serves(model: Model, directory: Path, ns: tuple[int, ...], label: str) -> None:
    """Every rank of ``directory`` loaded at each of ``ns`` equals the original's."""
    for n in ns:
        want = model.direct(n)
        assert not isinstance(want, ShardloadError)
        got = shardload.load(directory, n, devices=["cpu"] * n)
        for rank in range(n):
            assert_equal(got[rank], want[rank], f"{label} -> {n} rank {rank}")


@pytest.mark.parametrize("n_old", [2, 4])
def test_a_rank_local_g_idx_too_large_for_the_record_is_undone(
    models: dict[str, Model], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n_old: int
) -> None:
    """Every real GPTQ g_idx (4096 inputs and more) is over the manifest's 4 KiB value cap: its rank-local parts were
    refused as a compute step that cannot be undone. The global index is the local one plus r x groups per rank,
    checked by running the step again."""
    import shardload.engine.reshard as reshard

    monkeypatch.setattr(reshard, "VALUE_BYTES", 0)  # nothing recorded: as for a model of real size
    model = models["gptq"]
    out = tmp_path / f"gptq-{n_old}"
    shardload.convert(model.path, n_old, out)
    record = json.loads((out / "shard_manifest.json").read_text())["source_plan"]
    assert not [k for k in record["values"] if k.endswith("g_idx")]
    for n_new in (1, 2, 4):
        want = model.direct(n_new)
        assert not isinstance(want, ShardloadError)
        for rank in range(n_new):
            assert_equal(shardload.load_rank(out, rank, n_new), want[rank], f"{n_old} -> {n_new} rank {rank}")


def test_a_rank_local_g_idx_that_no_stored_index_gives_is_refused(
    models: dict[str, Model], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank file's local g_idx with a value outside the rank's groups (written by something else) is refused."""
    import struct

    import shardload.engine.reshard as reshard

    monkeypatch.setattr(reshard, "VALUE_BYTES", 0)
    out = tmp_path / "gptq-2"
    shardload.convert(models["gptq"].path, 2, out)
    rank1 = out / "rank-00001-of-00002.safetensors"
    with open(rank1, "r+b") as f:  # one int32 of a g_idx, in place (the file's size and header unchanged)
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        name = next(k for k in header if k.endswith("g_idx"))
        assert header[name]["dtype"] == "I32"
        f.seek(8 + size + header[name]["data_offsets"][0])
        f.write(struct.pack("<i", 10_000))
    with pytest.raises(ShardloadError, match=r"hold results of shard_funcs\.shard_group_index that no one stored"):
        shardload.load_rank(out, 0, 4)


def test_an_output_inside_a_converted_source_is_refused(models: dict[str, Model], tmp_path: Path) -> None:
    """Converting a converted directory again into a folder inside it was let through (a checkpoint, or a plain
    convert to --layout vllm, refused it): the new output landed among the source's own files."""
    source = _copy(models, tmp_path)
    for args in (["-n", "4"], ["--mesh", "pp=2,tp=2"]):
        out = source / "inner"
        result = CliRunner().invoke(main, ["convert", str(source), "-o", str(out), *args])
        assert result.exit_code == 1 and "lies inside the source directory" in result.output, result.output
        assert not out.exists()


def test_an_empty_tensor_made_by_a_compute_step_reshards(tmp_path: Path) -> None:
    """A ``[0, 24]`` tensor whose plan has a compute step, converted for 2 and loaded for 4, raised a bare ValueError
    from ``torch.frombuffer`` on its empty record (an internal error on the command line): each rank gets its empty
    part, as from the source. Strides are a fresh tensor's (a ``[8, 1]`` came back with strides ``(1, 8)``)."""
    import numpy as np

    from helpers.checkpoints import write_model

    shardload.register("tests.reverse_rows", shape=lambda s, d: (tuple(s), d), replace=True)(lambda x: x.flip(0))
    shardload.register("tests.swap01", shape=lambda s, d: ((s[1], s[0]), d), replace=True)(lambda x: x.transpose(0, 1))
    steps = [["tests.reverse_rows", [None, None]], ["shard_funcs.shard_dim", [None, None], 1, "num_shards"]]
    tall = [["tests.swap01", [None, None]], ["shard_funcs.replicate", [None, None], "num_shards"]]
    tensors = {"w": np.zeros((0, 24), dtype=np.int16), "t": np.arange(8, dtype=np.float32).reshape(1, 8)}
    model = write_model(tmp_path / "m", tensors, {"version": 1, "num_shards": None, "params": {"w": steps, "t": tall}})
    shardload.convert(model, 2, tmp_path / "tp2")
    for r in range(4):
        got, want = shardload.load_rank(tmp_path / "tp2", r, 4), shardload.load_rank(model, r, 4)
        assert got["w"].shape == want["w"].shape == (0, 6)
        assert torch.equal(got["t"], want["t"]) and got["t"].stride() == want["t"].stride() == (1, 1), got["t"].stride()
        got["t"].view(torch.uint8)  # a tensor of standard strides views as bytes
