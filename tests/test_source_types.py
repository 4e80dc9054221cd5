"""The source-type table is what the loaders do: every refused cell of ``SUPPORT`` and every pair of ``EXCLUSIONS``
is the one-line refusal ``load_rank`` raises (read from the table, so a cell and the loader cannot drift apart), a
cell the table allows loads, and each kind of model opens as its type.

Sources (the built-in example model, N = 2): a single safetensors file (whole tensors), its ``convert`` output at
N = 2 (rank files) and at N = 4 (boxes of a conversion), its ``convert --layout vllm`` output (a registered split
format), and an MLC-LLM cache pre-sharded for 2 (split records at 2, boxes at 4).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardload
from helpers.tvm_cache import presharded
from shardload.cli.main import main
from shardload.engine.load_options import Destination, Verify
from shardload.errors import ShardloadError
from shardload.planning.mesh import Mesh
from shardload.sources.source_types import (
    EXCLUSIONS,
    SUPPORT,
    ConvertedBoxes,
    PreshardedBoxes,
    RankFiles,
    SavedBoxes,
    Source,
    SplitRecords,
    WholeTensors,
    open_source,
)

pytest.importorskip("tvm")  # the pre-sharded cache is written by TVM's own writer

OPTION_ARGS: dict[str, Callable[[int], dict[str, Any]]] = {
    "shard_info": lambda n: {"shard_info": {}},
    "verify_root": lambda n: {"verify": Verify(root="0" * 64)},
    "verify": lambda n: {"verify": True},
    "group": lambda n: {"group": True},
    "mmap": lambda n: {"read_options": shardload.ReadOptions(strategy="view")},
    "read_options": lambda n: {"read_options": shardload.ReadOptions(threads=1)},
    "into": lambda n: {"into": Destination(only=[])},
    "stages": lambda n: {"mesh": f"pp=2,tp={n}"},
}
"""How a call gives each option of the table (with the cell's N)."""


@pytest.fixture(scope="module")
def sources(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[type[Source], tuple[Path, int]]:
    """One model of each source type, with the N it is that type at."""
    from click.testing import CliRunner

    tmp = tmp_path_factory.mktemp("source_types")
    shardload.convert(example_dir, 2, tmp / "tp2")
    done = CliRunner().invoke(main, ["convert", str(example_dir), "-n", "2", "-o", str(tmp / "vllm"), "--layout",
                                     "vllm"])  # fmt: skip
    assert done.exit_code == 0, done.output
    cache, _ = presharded(tmp, 2)
    return {
        WholeTensors: (example_dir, 2),
        RankFiles: (tmp / "tp2", 2),
        ConvertedBoxes: (tmp / "tp2", 4),
        SavedBoxes: (tmp / "vllm", 2),
        SplitRecords: (cache, 2),
        PreshardedBoxes: (cache, 4),
    }


def test_each_model_opens_as_its_type(sources: dict[type[Source], tuple[Path, int]]) -> None:
    for kind, (model, n) in sources.items():
        assert type(open_source(model, Mesh(tp=n))) is kind, (kind, model, n)


def _cells(refused: bool) -> list[Any]:
    cells = []
    for kind, row in SUPPORT.items():
        for option in OPTION_ARGS:
            if (row.get(option) is not None) == refused:
                cells.append(pytest.param(kind, option, id=f"{kind.__name__}-{option}"))
    return cells


@pytest.mark.parametrize(("kind", "option"), _cells(refused=True))
def test_a_refused_cell_is_the_loaders_one_line(
    sources: dict[type[Source], tuple[Path, int]], kind: type[Source], option: str
) -> None:
    model, n = sources[kind]
    layout = Mesh.parse(f"pp=2,tp={n}") if option == "stages" else Mesh(tp=n)
    want = open_source(model, layout).refusal(option, layout)
    assert want is not None
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(model, 0, n, **OPTION_ARGS[option](n))
    assert err.value.reason == want
    assert "\n" not in str(err.value)


ALLOWED = ("mmap", "read_options", "into")
"""The allowed cells a plain call can load (the others need a record, a process group or a mesh of the model)."""


@pytest.mark.parametrize(("kind", "option"), [c for c in _cells(refused=False) if c.values[1] in ALLOWED])
def test_an_allowed_cell_loads(sources: dict[type[Source], tuple[Path, int]], kind: type[Source], option: str) -> None:
    model, n = sources[kind]
    plain = shardload.load_rank(model, 1, n)
    got = shardload.load_rank(model, 1, n, **OPTION_ARGS[option](n))
    want = {} if option == "into" else plain  # Destination(only=[]): nothing read
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


PAIR_ARGS: dict[str, dict[str, Any]] = {
    "group": {"group": True},
    "mmap": {"read_options": shardload.ReadOptions(strategy="view")},
    "read_options": {"read_options": shardload.ReadOptions(threads=1)},
    "into": {"into": Destination(only=["model.norm.weight"])},
    "out": {"into": {}},
    "checked_reads": {"verify": True},
}


@pytest.mark.parametrize("pair", [p for p in EXCLUSIONS if p <= set(PAIR_ARGS)], ids=lambda p: "+".join(sorted(p)))
def test_options_that_exclude_each_other_are_the_tables_line(
    sources: dict[type[Source], tuple[Path, int]], pair: frozenset[str]
) -> None:
    model, n = sources[WholeTensors]
    args: dict[str, Any] = {}
    for option in sorted(pair):
        if "read_options" in args and option in ("mmap", "read_options"):
            continue  # one ReadOptions cannot hold both
        args.update(PAIR_ARGS[option])
    if pair == {"mmap", "read_options"}:
        pytest.skip("one ReadOptions is both")
    with pytest.raises(ShardloadError) as err:
        shardload.load_rank(model, 0, n, **args)
    assert err.value.reason == EXCLUSIONS[pair]


def test_old_spellings_warn_and_load_the_same(sources: dict[type[Source], tuple[Path, int]]) -> None:
    """mmap=, share_reads=, params= and out= keep working for one release, each with a DeprecationWarning."""
    model, n = sources[RankFiles]
    views = shardload.load_rank(model, 1, n, read_options=shardload.ReadOptions(strategy="view"))
    with pytest.warns(DeprecationWarning, match=r"mmap= is deprecated: use read_options=ReadOptions\(strategy=\"view"):
        old = shardload.load_rank(model, 1, n, mmap=True)
    assert set(old) == set(views) and all(torch.equal(old[k], views[k]) for k in views)
    mine = {"model.norm.weight": torch.empty_like(views["model.norm.weight"])}
    with pytest.warns(DeprecationWarning, match="out= is deprecated"):
        got = shardload.load_rank(model, 1, n, params=list(mine), out=mine)
    assert list(got) == ["model.norm.weight"] and got["model.norm.weight"] is mine["model.norm.weight"]
    assert torch.equal(mine["model.norm.weight"], views["model.norm.weight"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = shardload.load_rank(model, 1, n, into=Destination(mine, only=list(mine)))
    assert new["model.norm.weight"] is mine["model.norm.weight"]
    with pytest.raises(ShardloadError, match="give into= or params=/out=, not both"):
        shardload.load_rank(model, 1, n, into=mine, out=mine)
    with pytest.raises(TypeError, match="unexpected keyword argument 'mmapp'"):
        shardload.load_rank(model, 1, n, mmapp=True)


def test_verify_is_a_typed_value(sources: dict[type[Source], tuple[Path, int]]) -> None:
    """Verify(root=) pins the record; a root that is not 64 hex digits is one line; a converted directory's own
    record pins its loads."""
    with pytest.raises(ShardloadError, match="must be 64 hex digits"):
        Verify(root="abc")
    model, n = sources[RankFiles]
    root = __import__("json").loads((model / "shard_manifest.json").read_text())["integrity"]["root"]
    got = shardload.load_rank(model, 1, n, verify=Verify(root=root))
    assert torch.equal(got["model.norm.weight"], shardload.load_rank(model, 1, n)["model.norm.weight"])
    with pytest.raises(shardload.ShardloadError, match="root"):
        shardload.load_rank(model, 1, n, verify=Verify(root="f" * 64))


DOC_ROWS = {
    "whole tensors": WholeTensors,
    "rank files": RankFiles,
    "split records": SplitRecords,
    "boxes of a conversion": ConvertedBoxes,
    "boxes of a pre-sharded cache": PreshardedBoxes,
    "boxes of a registered split format": SavedBoxes,
}
DOC_COLUMNS = ("shard_info", "verify", "verify_root", "group", "mmap", "read_options", "into", "stages")


def test_the_docs_table_is_the_code_table() -> None:
    """docs/python-api.md's "Options by source" table says yes exactly where SUPPORT takes the option."""
    text = (Path(__file__).parent.parent / "docs" / "python-api.md").read_text()
    rows = [ln for ln in text.split("## Options by source", 1)[1].splitlines() if ln.startswith("| ")][1:]
    seen = set()
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == "old":
            break
        kind = next(k for label, k in DOC_ROWS.items() if cells[0].startswith(label))
        seen.add(kind)
        for option, cell in zip(DOC_COLUMNS, cells[1:], strict=True):
            assert cell == ("no" if SUPPORT[kind].get(option) else "yes"), (kind.__name__, option, cell)
    assert seen == set(SUPPORT)


def test_each_deprecation_points_at_the_callers_line(
    sources: dict[type[Source], tuple[Path, int]], tmp_path: Path
) -> None:
    """A deprecated spelling's warning names the line that used it, whichever entry point it was given to:
    load_rank, load, convert (a warning pointing inside shardload, or past the caller, is one nobody can act on)."""
    from helpers.checkpoints import parallel_model
    from shardload.engine.hashing import hash_model

    model, n = sources[RankFiles]
    root = __import__("json").loads((model / "shard_manifest.json").read_text())["integrity"]["root"]
    plain = parallel_model(tmp_path / "m")
    plain_root = hash_model(plain).root
    lines = []
    with pytest.warns(DeprecationWarning) as caught:
        lines.append(sys._getframe().f_lineno + 1)
        shardload.load_rank(model, 1, n, mmap=True)
        lines.append(sys._getframe().f_lineno + 1)
        shardload.load_rank(model, 1, n, verify=root)
        lines.append(sys._getframe().f_lineno + 1)
        shardload.load(model, n, verify=root)
        lines.append(sys._getframe().f_lineno + 1)
        shardload.convert(plain, 2, tmp_path / "out", verify=plain_root)
    assert [(Path(w.filename).name, w.lineno) for w in caught] == [(Path(__file__).name, k) for k in lines]
