"""Meshes on a real architecture: pipeline stages in order, each tensor-parallel, reproduce the logits.

A tiny 4-layer Llama (and a tied-embedding Qwen2) is planned with `shardload plan`, loaded for
meshes pp x tp (x dp), and run stage by stage with tests/helpers/tp_reference.py: stage 0 embeds, every
stage runs its own layers over its tp ranks, the last stage applies the head. Every rank must hold
exactly the parameters its stage needs, and converted mesh directories must load the same tensors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import shardload
from helpers import tiny_models
from helpers import tp_reference as tp
from shardload.cli.main import main
from shardload.errors import ShardloadError
from shardload.models.generated import generate
from shardload.planning.mesh import Mesh

pytest.importorskip("transformers")

IDS = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
MESHES = ["pp=2,tp=2", "pp=4,tp=1", "pp=1,tp=4", "dp=2,pp=2,tp=1"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    """4-layer Llama and tied Qwen2 with generated shard_info, and their unsharded logits."""
    root = tmp_path_factory.mktemp("mesh")
    out = {}
    for kind in ("llama", "qwen2"):
        model = tiny_models.build(kind, root / kind, num_hidden_layers=4)
        generate(root / kind).save(root / kind / "shard_info.json")
        with torch.no_grad():
            out[kind] = (root / kind, model(input_ids=IDS).logits)
    return out


def _config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def _even_stages(layers: int, pp: int) -> list[range]:
    base, extra = divmod(layers, pp)
    counts = [base + (i < extra) for i in range(pp)]
    return [range(sum(counts[:i]), sum(counts[: i + 1])) for i in range(pp)]


def _pipeline_logits(
    config: dict[str, Any], shards: list[dict[str, torch.Tensor]], mesh: Mesh, dp: int = 0
) -> torch.Tensor:
    stages = _even_stages(config["num_hidden_layers"], mesh.pp)
    h = None
    for pp in range(mesh.pp):
        group = [shards[mesh.rank(dp, pp, t)] for t in range(mesh.tp)]
        if pp == 0:
            h = tp.decoder_embed(config, group, IDS)
        h = tp.decoder_layers(config, group, h, stages[pp])
        if pp == mesh.pp - 1:
            return tp.decoder_head(config, group, h)
    raise AssertionError("unreachable")


def _expected_names(all_names: list[str], stage: range, first: bool, last: bool, tied: bool) -> set[str]:
    """Which stored tensors a stage needs, derived from the names alone (not from shardload's rules)."""
    want = set()
    for name in all_names:
        m = re.search(r"\.layers\.(\d+)\.", name)
        if m:
            if int(m.group(1)) in stage:
                want.add(name)
        elif name.startswith("model.embed_tokens."):
            if first or (tied and last):
                want.add(name)
        elif last:
            want.add(name)
    return want


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("mesh_text", MESHES)
def test_stages_reproduce_logits(models: dict, kind: str, mesh_text: str) -> None:
    model_dir, want = models[kind]
    config = _config(model_dir)
    mesh = Mesh.parse(mesh_text)
    shards = shardload.load(model_dir, mesh=mesh, devices=["cpu"] * mesh.world_size)
    assert len(shards) == mesh.world_size
    for dp in range(mesh.dp):
        _assert_close(_pipeline_logits(config, shards, mesh, dp), want)
    names = list(shardload.plan_model(model_dir, 1).params)
    stages = _even_stages(config["num_hidden_layers"], mesh.pp)
    tied = bool(config.get("tie_word_embeddings"))
    for rank, state in enumerate(shards):
        c = mesh.coord(rank)
        expected = _expected_names(names, stages[c.pp], c.pp == 0, c.pp == mesh.pp - 1, tied)
        assert set(state) == expected, (rank, set(state) ^ expected)
        single = shardload.load_rank(model_dir, rank, mesh=mesh_text)
        assert single.keys() == state.keys()
        assert all(torch.equal(single[k], state[k]) for k in state)
        twin = shards[mesh.rank((c.dp + 1) % mesh.dp, c.pp, c.tp)]
        assert all(torch.equal(twin[k], state[k]) for k in state), "dp replicas hold identical shards"


def test_wrong_stage_layers_change_the_answer(models: dict) -> None:
    """Control: a pipeline that runs one stage's layers twice does not reproduce the logits."""
    model_dir, want = models["llama"]
    config = _config(model_dir)
    mesh = Mesh.parse("pp=2,tp=1")
    shards = shardload.load(model_dir, mesh=mesh, devices=["cpu"] * 2)
    h = tp.decoder_embed(config, [shards[0]], IDS)
    h = tp.decoder_layers(config, [shards[0]], h, range(0, 2))
    with pytest.raises(KeyError):
        tp.decoder_layers(config, [shards[1]], h, range(0, 2))
    # stage 0's layers relabelled as layers 2 and 3: the shapes fit, the answer must not
    wrong = {k.replace("layers.0.", "layers.2.").replace("layers.1.", "layers.3."): v
             for k, v in shards[0].items() if ".layers." in k}  # fmt: skip
    wrong.update({k: v for k, v in shards[1].items() if ".layers." not in k})
    right = tp.decoder_head(config, [shards[1]], tp.decoder_layers(config, [shards[1]], h, range(2, 4)))
    _assert_close(right, want)
    bad = tp.decoder_head(config, [wrong], tp.decoder_layers(config, [wrong], h, range(2, 4)))
    assert not torch.allclose(bad, want, rtol=1e-3, atol=1e-3)


def test_uneven_pp_layers_and_converted_mesh_directory(models: dict, tmp_path: Path) -> None:
    model_dir, want = models["llama"]
    config = _config(model_dir)
    mesh = Mesh.parse("pp=2,tp=2", pp_layers="1,3")
    shards = shardload.load(model_dir, mesh=mesh, devices=["cpu"] * 4)
    assert {k for k in shards[0] if ".layers." in k} == {k for k in shards[0] if ".layers.0." in k}
    h = tp.decoder_embed(config, shards[0:2], IDS)
    h = tp.decoder_layers(config, shards[0:2], h, range(0, 1))
    h = tp.decoder_layers(config, shards[2:4], h, range(1, 4))
    _assert_close(tp.decoder_head(config, shards[2:4], h), want)

    out = tmp_path / "pp2tp2"
    result = shardload.convert(model_dir, None, out, mesh=mesh)
    names = sorted(f.path for f in result.rank_files)
    assert names == [f"pp-0000{p}-of-00002-rank-0000{t}-of-00002.safetensors" for p in range(2) for t in range(2)]
    manifest = json.loads((out / "shard_manifest.json").read_text())
    assert manifest["mesh"] == {"pp": 2, "tp": 2, "pp_layers": [1, 3]}
    assert shardload.verify_dir(out).ok
    for rank in range(4):
        got = shardload.load_rank(out, rank, mesh=mesh, verify=True)
        assert got.keys() == shards[rank].keys()
        assert all(torch.equal(got[k], shards[rank][k]) for k in got)
    dp2 = shardload.load(out, mesh="dp=2,pp=2,tp=2", devices=["cpu"] * 8)
    assert all(torch.equal(dp2[4 + r][k], shards[r][k]) for r in range(4) for k in shards[r])
    for other in ("pp=1,tp=2", Mesh.parse("pp=2,tp=2", pp_layers="2,2")):  # another mesh: docs/reshard.md
        direct = shardload.load(model_dir, mesh=other, devices=["cpu"] * 4 if isinstance(other, Mesh) else None)
        for rank, want_rank in enumerate(direct):
            got = shardload.load_rank(out, rank, mesh=other)
            assert got.keys() == want_rank.keys() and all(torch.equal(got[k], want_rank[k]) for k in got)


def test_a_mesh_without_layers_keeps_a_converted_directorys_own(models: dict, tmp_path: Path) -> None:
    """A directory converted with uneven stages (1 + 3 layers), loaded or converted again with the same ``pp`` and no
    layers given, keeps its own stages at any tp: before, its own tp kept them, another tp and ``convert`` split the
    layers evenly (2 + 2), so one mesh string gave three layer sets by route."""
    model_dir, _ = models["llama"]
    out = tmp_path / "pp2tp2"
    shardload.convert(model_dir, None, out, mesh=Mesh.parse("pp=2,tp=2", pp_layers="1,3"))
    own = shardload.load(model_dir, mesh=Mesh.parse("pp=2,tp=1", pp_layers="1,3"), devices=["cpu"] * 2)
    for rank in range(2):
        got = shardload.load_rank(out, rank, mesh="pp=2,tp=1")
        assert got.keys() == own[rank].keys() and all(torch.equal(got[k], own[rank][k]) for k in got), rank
    shardload.convert(out, None, tmp_path / "again", mesh="pp=2,tp=1")
    manifest = json.loads((tmp_path / "again" / "shard_manifest.json").read_text())
    assert manifest["mesh"] == {"pp": 2, "tp": 1, "pp_layers": [1, 3]}, manifest["mesh"]
    shown = CliRunner().invoke(main, ["inspect", str(out), "--mesh", "pp=2,tp=1", "--json"])
    assert shown.exit_code == 0, shown.output
    stages = [r for r in json.loads(shown.stdout)["mesh"]["ranks"] if r.get("tp", 0) == 0]
    assert [r.get("layers") for r in stages] == [[0, 1], [1, 4]], stages  # [first, stop)


def test_bytes_read_per_rank_follow_the_mesh(models: dict) -> None:
    """Each rank reads its stage's layers' shard: about 1/(pp*tp) of the layer bytes, plus its own extras."""
    model_dir, _ = models["llama"]
    plan = shardload.plan_model(model_dir, 2)
    mesh = Mesh.parse("pp=2,tp=2")
    layer_bytes = sum(p.source.nbytes for n, p in plan.params.items() if ".layers." in n)
    from shardload.engine.run import stages_of

    for pp, stage in enumerate(stages_of(plan, mesh)):
        for t in range(2):
            read = {n: p.read_nbytes(t) for n, p in stage.params.items()}
            layers_read = sum(v for n, v in read.items() if ".layers." in n)
            norms = sum(p.source.nbytes for n, p in stage.params.items() if ".layers." in n and p.replicated)
            replicated_layers = sum(p.source.nbytes for n, p in plan.params.items() if ".layers." in n and p.replicated)
            assert layers_read - norms == (layer_bytes - replicated_layers) // (mesh.pp * mesh.tp)
            others = {n for n in read if ".layers." not in n}
            assert others == ({"model.embed_tokens.weight"} if pp == 0 else {"model.norm.weight", "lm_head.weight"})


def test_device_mesh_and_process_group(models: dict, tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model_dir, _ = models["llama"]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        device_mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "tp"))
        got = shardload.load_rank(model_dir, mesh=device_mesh)
        want = shardload.load_rank(model_dir, 0, 1)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
        inferred = shardload.load_rank(model_dir, mesh="pp=-1,tp=1")
        assert inferred.keys() == want.keys()
        with pytest.raises(ShardloadError, match="disagrees with the DeviceMesh"):
            shardload.load_rank(model_dir, 1, mesh=device_mesh)
    finally:
        dist.destroy_process_group()


def test_cli_mesh(models: dict, tmp_path: Path) -> None:
    model_dir, _ = models["llama"]
    runner = CliRunner()
    shown = runner.invoke(main, ["inspect", str(model_dir), "--mesh", "pp=2,tp=-1", "--world-size", "4"])
    assert shown.exit_code == 0, shown.output
    assert "mesh dp=1,pp=2,tp=2 (4 ranks)" in shown.output
    rows = [ln.split() for ln in shown.output.splitlines() if re.match(r"^\d+\s+[01]\s+[01]\s", ln)]
    assert [r[:4] for r in rows] == [["0", "0", "0", "0..1"], ["1", "0", "1", "0..1"], ["2", "1", "0", "2..3"],
                                     ["3", "1", "1", "2..3"]]  # fmt: skip
    as_json = json.loads(runner.invoke(main, ["inspect", str(model_dir), "--mesh", "pp=2,tp=2", "--json"]).output)
    plan = shardload.plan_model(model_dir, 2)
    total = sum(p.source.nbytes for p in plan.params.values())
    # every stored byte is read once, except replicated tensors, which each of the tp ranks reads
    assert sum(r["bytes_read"] for r in as_json["mesh"]["ranks"]) == total + (2 - 1) * plan.replicated_nbytes
    info = str(model_dir / "shard_info.json")
    ok = runner.invoke(main, ["validate", info, "--model", str(model_dir), "--mesh", "pp=2,tp=2"])
    assert ok.exit_code == 0 and "valid for mesh dp=1,pp=2,tp=2" in ok.output
    bad = runner.invoke(main, ["validate", info, "--model", str(model_dir), "--mesh", "pp=8,tp=1"])
    assert bad.exit_code == 1 and "pp=8 is more stages than the model's 4 layers" in bad.output
    usage = runner.invoke(main, ["inspect", str(model_dir), "--mesh", "pp=2,tp=4", "--world-size", "4"])
    assert usage.exit_code == 2 and "has 8 ranks, but the world size is 4" in usage.output
    out = tmp_path / "cli"
    done = runner.invoke(main, ["convert", str(model_dir), "--mesh", "pp=2,tp=2", "-o", str(out), "-q"])
    assert done.exit_code == 0, done.output
    assert (out / "pp-00001-of-00002-rank-00001-of-00002.safetensors").exists()
    assert runner.invoke(main, ["verify", str(out)]).exit_code == 0
