"""Mesh parsing, rank numbering (torch DeviceMesh order), layer stages and stage membership."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from shardload.errors import ShardloadError
from shardload.planning.mesh import Mesh, param_stages


@pytest.mark.parametrize(
    ("text", "world", "want"),
    [
        ("pp=2,tp=4", None, Mesh(1, 2, 4)),
        ("pp=2,tp=-1", 8, Mesh(1, 2, 4)),
        ("tp=2, dp=-1, pp=1", 6, Mesh(3, 1, 2)),
        ("tp=8", 8, Mesh(1, 1, 8)),
    ],
)
def test_parse(text: str, world: int | None, want: Mesh) -> None:
    assert Mesh.parse(text, world) == want


@pytest.mark.parametrize(
    ("text", "world", "reason"),
    [
        ("pp=2,tp=4", 6, "has 8 ranks, but the world size is 6"),
        ("pp=-1,tp=-1", 8, "only one axis may be -1"),
        ("pp=3,tp=-1", 8, "not divisible by 3"),
        ("pp=2,tp=-1", None, "give the world size"),
        ("xp=2", None, "expected axis=size"),
        ("pp=2,pp=2", None, "given twice"),
        ("pp=two", None, "not an integer"),
        ("pp=0", None, "must be >= 1 or -1"),
        ("", None, "empty mesh"),
    ],
)
def test_parse_errors(text: str, world: int | None, reason: str) -> None:
    with pytest.raises(ShardloadError, match=reason):
        Mesh.parse(text, world)


def test_rank_numbering_is_row_major_dp_pp_tp() -> None:
    mesh = Mesh(dp=2, pp=3, tp=4)
    ranks = [mesh.rank(d, p, t) for d, p, t in itertools.product(range(2), range(3), range(4))]
    assert ranks == list(range(24))
    for r in range(24):
        c = mesh.coord(r)
        assert mesh.rank(c.dp, c.pp, c.tp) == r
    assert mesh.coord(5) == type(mesh.coord(0))(0, 1, 1)
    with pytest.raises(ShardloadError, match="out of range"):
        mesh.coord(24)


def test_matches_torch_device_mesh_order() -> None:
    torch = pytest.importorskip("torch")
    grid = torch.arange(2 * 3 * 4).reshape(2, 3, 4)  # how init_device_mesh lays ranks out
    mesh = Mesh(2, 3, 4)
    for d, p, t in itertools.product(range(2), range(3), range(4)):
        assert mesh.rank(d, p, t) == int(grid[d, p, t])


def test_stages_even_and_explicit() -> None:
    assert Mesh(pp=2).stages(4) == [range(0, 2), range(2, 4)]
    assert Mesh(pp=3).stages(8) == [range(0, 3), range(3, 6), range(6, 8)]
    assert Mesh.parse("pp=2", pp_layers="1,3").stages(4) == [range(0, 1), range(1, 4)]
    with pytest.raises(ShardloadError, match="adds up to 5"):
        Mesh.parse("pp=2", pp_layers="2,3").stages(4)
    with pytest.raises(ShardloadError, match="gives 3 stages"):
        Mesh.parse("pp=2", pp_layers="1,1,2")
    with pytest.raises(ShardloadError, match="more stages than"):
        Mesh(pp=5).stages(4)


def test_param_stages() -> None:
    stages = Mesh(pp=2).stages(4)
    assert param_stages("model.embed_tokens.weight", stages, tied=False) == [0]
    assert param_stages("model.embed_tokens.weight", stages, tied=True) == [0, 1]
    assert param_stages("model.layers.1.mlp.down_proj.weight", stages, tied=False) == [0]
    assert param_stages("model.layers.2.self_attn.qkv_proj.weight", stages, tied=False) == [1]
    assert param_stages("model.norm.weight", stages, tied=False) == [1]
    assert param_stages("lm_head.weight", stages, tied=False) == [1]
    assert param_stages("model.embed_tokens.weight", [range(0, 4)], tied=True) == [0]


def test_a_config_that_cannot_be_read_is_an_error_not_stages_by_names(example_dir: Path, tmp_path: Path) -> None:
    """The stages of a mesh follow config.json's layer count; one that was there but could not be read (an object
    store's 403, a file cut short) was taken as none, so ranks that read it and ranks that could not cut the
    stages differently, each without a word."""
    import json
    import shutil

    import shardload

    model = shutil.copytree(example_dir, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = 1  # stages by config (layer 1 out of range) differ from stages by names
    (model / "config.json").write_text(json.dumps(config)[:-5])  # cut short
    read = shardload.load_rank(example_dir, 1, mesh="pp=2,tp=1")
    with pytest.raises(shardload.ShardloadError, match=r"config\.json") as err:
        shardload.load_rank(model, 1, mesh="pp=2,tp=1")
    assert "\n" not in str(err.value) and read is not None


@pytest.mark.parametrize("extra", [2, 10**12])
def test_a_config_counting_more_layers_than_stored_is_refused(example_dir: Path, tmp_path: Path, extra: int) -> None:
    """A mesh's stages follow config.json's layer count: one above the layers the checkpoint stores gave the last
    stage no decoder layer at all (a convert wrote it and verify passed), or stage 0 layers 0..499999999999."""
    import json
    import shutil

    import shardload

    model = shutil.copytree(example_dir, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] += extra
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(shardload.ShardloadError, match=r"config\.json.*stores layers 0\.\.1") as err:
        shardload.load_rank(model, 1, mesh="pp=2,tp=1")
    assert "\n" not in str(err.value)
    with pytest.raises(shardload.ShardloadError, match="stores layers"):
        shardload.convert(model, 1, tmp_path / "out", mesh="pp=2,tp=1")
    assert not (tmp_path / "out").exists()
