"""The equivalence matrix: every way shardload reads a checkpoint gives rank r exactly rank r's tensors.

Each cell loads (or converts, then reads back) one model from one kind of source on one path, for one N and one
thread count, and compares every rank tensor, element for element, with ``helpers/tp_split.py``: rank r's slices
cut by plain torch indexing from the full tensors (read by safetensors itself), following the architecture's
tensor parallelism, with no shardload code and no shard_info involved. A converted directory's rank files are
also read back by safetensors itself, not only through ``load_rank``.

Models (tests/helpers/tiny_models.py, random weights, float32, hidden 96, 2 layers, a vocabulary of 380 rows, which
N = 3, 6, 8 do not divide: padded to 384 rows by vLLM's rule; N = 1, 2, 4 split it as it is):

- ``phi3``: fused ``qkv_proj`` with GQA (24 query heads, 2 KV heads: split at N = 2, each replicated on N/2 ranks
  at N = 4, 6, 8) and a fused ``gate_up_proj``; it serves N = 1, 2, 4, 6, 8. Its 2 KV heads refuse N = 3
  (``test_model_refuses_n``),
- ``llama``: separate q/k/v (3 KV heads, one per rank) and gate/up projections, which ``--layout vllm`` fuses;
  it serves N = 3.

Axes:

- source: a single safetensors file, an HF index over 3 files, a converted directory (plain layout, written for
  the cell's N and loaded at it), a TVM tensor cache (TVM's own writer), a GGUF file (gguf's own writer), S3
  (the index, served by the suite's moto server on loopback, the ``s3`` fixture of ``conftest.py``), a Hugging
  Face Hub id (an offline cache laid out as huggingface_hub does). Safetensors sources are
  planned in memory from config.json; TVM and GGUF carry the shard_info.json ``shardload plan`` wrote;
- path: ``load`` (all ranks), ``load_rank``, ``load_rank`` with ``ReadOptions(strategy="view")`` (``mmap``),
  ``load_rank`` by planned cold reads (``planned``: ``ReadOptions(strategy="plan")``, one-page reads, ``io_depth`` =
  the cell's threads, a model under which every gap is worth reading, the byte budget 0 or unbounded by N's parity;
  then again with the pinned ``verify`` root, the checking reader's tiles read as planned cold reads), ``convert``
  (the CLI) then the rank files read back, ``convert --layout vllm`` (the CLI) against vLLM's per-rank layout,
  ``device`` and ``device_load``: ``load_rank`` (then again with the pinned ``verify`` root) and ``load`` through
  the GPU's data path with the CPU as its device (spans of one page read into staging buffers, uploaded, cut:
  ``engine/paths/device.py``; ``load`` at even N with every rank on a device of its own, each device's pieces
  packed together, at odd N every rank on one), ``load_rank(share_reads=True)`` under torchrun (gloo), and ``verify``:
  ``load_rank(verify=...)`` through the
  checking reader against the source's integrity record (``shardload hash``, made once per source and session; an S3
  model's is hashed from the objects and put beside them by ``hash`` itself; a converted directory checks the record
  convert wrote, or its rank files' sha256 for True);
- destination: where ``load_rank`` puts a rank's tensors: fresh tensors (every path above), or the caller's own
  (``into=Destination(tensors, only=names)``, a server's parameter memory): ``out_mapping`` (``tensors`` a mapping
  holding a tensor for every name), ``out_callable`` (``tensors`` a callable giving a tensor for half the names,
  None, a fresh tensor, for the others) and ``out_params`` (``only`` half the stored names, ``tensors`` a tensor for
  each of them); the half alternates with the rank. Every destination starts as 0xFF bytes (a float32 NaN) in one
  buffer with guard bytes between them (``helpers/destinations.py``), so a byte left unwritten (a padded
  vocabulary's zero rows included) differs from the reference, and a byte written outside a destination shows as a
  changed guard; the returned dict must hold the caller's very objects (``is``) for every name given;
- N in 1, 2, 3, 4, 6, 8;
- threads in 1, 2, 8: reader threads (``ReadOptions(threads=)`` of ``load`` and ``load_rank``; for the CLI's
  ``convert``, which takes no read options, the defaults ``read_strategy.READ_THREADS`` and an S3 reader's
  ``ObjectReader.threads``), an S3 reader's GET pool ``objects.CONCURRENCY`` and writer threads
  (``writer.WRITE_THREADS``) together. Read jobs and
  writer chunks are made small (4 KiB jobs and 2-8 KiB chunks; 32 KiB and 16-64 KiB from S3, where each
  costs requests), so even these tensors are many jobs for the threads to share.

Coverage, and why it is enough:

- source x path x N is the full product (every cell of it runs, or is an explicit cell: see below);
- threads are full (all three counts) on ``load``, ``convert`` and ``convert --layout vllm``: the paths on which
  one thread serves several ranks (a writer thread owns a group of N / threads ranks, a reader thread takes jobs
  of every rank), so a bug needs N and the thread count together (N > threads) and only the full product
  finds it for every source (the S3 convert bug below hides at N <= threads);
- on ``load_rank`` and ``mmap`` (one rank per call: threads only share that rank's jobs) the thread count is
  covered pairwise: cell (source, path, N) gets ``THREADS[(source + path + N) % 3]`` (indices in the axis
  tuples), so every (source, threads), (path, threads) and (N, threads) pair occurs;
- destination x source x N is the full product too (141 cells, about 10 s on 2 cores, two thirds of it S3's): the
  destination is filled by a different reader for each kind of source (a source's planned runs, a converted
  directory's whole stored tensors, a pre-sharded cache's rank view, S3's and the Hub's object readers), and N
  decides the shapes and whether a vocabulary is padded (N = 3, 6, 8: zero rows the load must write into the
  caller's tensor). Its sources are the seven above plus an MLC-LLM cache pre-sharded for the cell's N itself
  (``tvm_presharded``, at N = 2 to 8: cut 1 way it is the tvm row's cache), as MLC-LLM writes it, with no
  shard_info.json beside it (with the whole model's plan beside it, which reading it at another N takes, its own
  N is refused: "lists steps, but the checkpoint is already pre-sharded"). Threads are rotated pairwise, as on
  ``load_rank`` (every (source, threads), (destination, threads) and (N, threads) pair occurs), and so is the data
  path (host memory, or the GPU's with the CPU as its device: spans cut into the caller's tensors, whose storage
  offsets and alignments the slab varies). ``out`` applies to
  ``load_rank`` alone (``load`` takes none). The destination cells that do not apply are refused, and are not
  cells here: a sharded_state directory (``convert --layout vllm``, vLLM's ``save_model``) at any N, and a
  converted directory or a pre-sharded cache read for another N than it was cut for (boxes of several files or
  records), as are ``out`` with ``mmap=True`` or ``share_reads``. A destination's own checks (shape, dtype,
  layout, device, aliasing, unknown names) and the refusals with ``mmap=True`` and of a converted directory read
  for another N are tests/test_fill_api.py's, a vLLM ``save_model`` directory's test_reshard_vllm_saved.py's;
- a converted directory is also loaded at another N (``test_converted_directory_serves_another_n``; the
  full N_old x N_new matrix is ``tests/test_reshard.py``);
- sources made for another N are rows of their own (``test_resharded_source_equals_reference``): a converted
  directory, a ``convert --layout vllm`` directory, a vLLM-style ``save_model`` directory
  (``helpers/vllm_saved.py``) and an MLC-LLM pre-sharded TVM cache (records cut by ``tp_split``), each made for
  N_old and read at every N of the matrix through both ``load`` (all ranks under one open, one plan and one
  reader) and ``load_rank`` (each rank opened, planned and checked alone; the second of the two costs under 1 s
  over all the rows): phi3 from 4 ways (2 at N = 4; its TVM cache from 2 ways, 4 at N = 2), llama from 6 ways
  (each KV head on two ranks), and llama from 3 ways (vocabulary padded on the old side) at N = 1. The
  documented one-line refusals are cells too, each refused by ``load_rank`` and ``load`` alike: vLLM's own save
  of a phi3, and a pre-sharded cache whose records cannot be told apart from another whole shape (KV heads
  replicated; padded vocabularies);
- ``verify`` runs for every source and N, threads rotated as on ``load_rank``; a third of its cells pin the
  record's root (``Verify(root=...)``, cell ids ``-pinned``: every source and every N has some), the rest pass
  True. The share_reads launches load every source a second time with ``verify`` (pinned by the same rule), so
  the receivers' checks of what peers sent run on every source too;
- ``share_reads`` costs a torchrun launch (N processes importing torch), so it runs at N = 2 and N = 3 only, one
  launch each, every source in the same launch (one cell per source and N), threads rotated as above;
- a path that does not apply to a source is a cell asserting its documented one-line refusal, with nothing
  written: ``--layout vllm`` converts safetensors sources and converted directories only (not TVM, GGUF),
  the view strategy maps local files only (S3) and is no checked copy (``verify`` with it): those refusals are read
  from the option table (``sources/source_types.py``, ``EXCLUSIONS``). A source whose
  package is missing skips its cells with the reason (never in CI, which installs them all).

No cell is marked as a known failure. The matrix found three bugs: when it was written, convert from S3 gave a
rank's replicated tensors other tensors' bytes whenever N > writer threads, and a Hub id failed in any fresh
process; its resharding rows found a TVM cache pre-sharded with a padded vocabulary read at another N with the
padding rows as real ones;
all are fixed, and their cells are ordinary cells now.

S3 uses the test server with the default request cost (``ObjectCost()``), which merges a column slice's rows
into few GETs; exact fetching (a GET per row, seconds per cell) is tested in test_object_storage.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import shardload
import shardload.engine.paths.device as device_path
import shardload.engine.read_strategy as read_strategy
import shardload.engine.run as run
import shardload.engine.transfer as transfer
import shardload.engine.writer as writer
from helpers import destinations, hub, matrix_sources, tp_split
from helpers.reading import stand_in, stand_in_apart
from helpers.vllm_saved import fake_vllm_save
from shardload.cli.main import main
from shardload.engine.hashing import hash_model
from shardload.engine.paths.device import count_device
from shardload.errors import ShardloadError
from shardload.integrations.vllm.writer import convert_vllm
from shardload.sources import objects, read_plan
from shardload.sources.object_reader import ObjectReader
from shardload.sources.source_types import EXCLUSIONS
from shardload.sources.verified import VerifiedReader

try:  # boto3 and moto serve conftest.py's `s3` (module-scoped), requested by the S3 cells only
    import boto3  # noqa: F401
    import moto.server  # noqa: F401

    HAVE_S3 = True
except ImportError:  # boto3 or moto missing: never in CI (the test extra has both)
    HAVE_S3 = False

pytest.importorskip("transformers")
from helpers import tiny_models

SOURCES = ("single", "index", "converted", "tvm", "gguf", "s3", "hub")
PATHS = ("load", "load_rank", "mmap", "convert", "vllm", "share_reads", "verify", "planned", "device", "device_load")
NS = (1, 2, 3, 4, 6, 8)
THREADS = (1, 2, 8)
FULL_THREADS = ("load", "convert", "vllm")
SHARED_NS = (2, 3)

COMMON = {"hidden_size": 96, "intermediate_size": 96, "vocab_size": 380, "num_attention_heads": 24}
MODELS = {
    "phi3": ("phi3", {**COMMON, "num_key_value_heads": 2}),
    "llama": ("llama", {**COMMON, "num_key_value_heads": 3}),
}
MODEL_OF_N = {1: "phi3", 2: "phi3", 3: "llama", 4: "phi3", 6: "phi3", 8: "phi3"}

REFUSED = {  # (source, path) -> the documented refusal
    ("tvm", "vllm"): "--layout vllm converts a safetensors source checkpoint",
    ("gguf", "vllm"): "--layout vllm converts a safetensors source checkpoint",
    ("s3", "mmap"): EXCLUSIONS[frozenset({"mmap", "remote"})],  # the option table's refusal, read from it
}
PACKAGES = {"tvm": "tvm", "gguf": "gguf", "hub": "huggingface_hub", "s3": "moto"}


def rotated(source: str, path: str, n: int) -> int:
    return THREADS[(SOURCES.index(source) + PATHS.index(path) + NS.index(n)) % len(THREADS)]


def _cells() -> list[Any]:
    cells = []
    for source in SOURCES:
        for path in PATHS:
            if (source, path) in REFUSED or path in ("share_reads", "verify"):
                continue
            for n in NS:
                for threads in THREADS if path in FULL_THREADS else (rotated(source, path, n),):
                    ident = f"{source}-{path}-n{n}-t{threads}"
                    cells.append(pytest.param(source, path, n, threads, id=ident))
    return cells


class World:
    """The models of the matrix, each written as every source, built when a cell first needs them."""

    def __init__(self, root: Path, mp: pytest.MonkeyPatch) -> None:
        self.root = root
        self.mp = mp
        self.built: dict[str, dict[str, Any]] = {}
        self.refs: dict[tuple[str, int, str], list[tp_split.State]] = {}
        self.s3_ready = False
        self.hub_ready = False
        self.roots: dict[tuple[str, str], str] = {}

    def model(self, name: str) -> dict[str, Any]:
        if name not in self.built:
            kind, overrides = MODELS[name]
            base = self.root / name
            single = base / "single"
            tiny_models.build(kind, single, **overrides)
            plan = base / "shard_info.json"
            planned = CliRunner().invoke(main, ["plan", str(single), "-o", str(plan), "-q"])
            assert planned.exit_code == 0, planned.output
            config = json.loads((single / "config.json").read_text())
            self.built[name] = {"base": base, "plan": plan, "config": config,
                                "state": matrix_sources.read_state(single), "single": single}  # fmt: skip
        return self.built[name]

    def source(self, request: pytest.FixtureRequest, name: str, n: int) -> Any:
        """The cell's source of the model that serves N: a local path, an s3:// URI or a Hub id."""
        model = MODEL_OF_N[n]
        built = self.model(model)
        key = f"converted-{n}" if name == "converted" else name
        if key in built:
            return built[key]
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None:
            assert os.environ.get("CI") != "true", f"{PACKAGES[name]} is in the test extra"
            pytest.skip(f"n/a here: {PACKAGES[name]} is not installed")
        base, single = built["base"], built["single"]
        if name == "single":
            value: Any = single
        elif name == "index":
            value = matrix_sources.write_index(single, base / "index")
        elif name == "converted":
            value = base / f"tp{n}"
            shardload.convert(single, n, value)
        elif name == "tvm":
            value = matrix_sources.write_tvm(single, base / "tvm", built["plan"])
        elif name == "gguf":
            value = matrix_sources.write_gguf(single, base / "gguf", built["plan"])
        elif name == "s3":
            if not HAVE_S3:
                pytest.skip("n/a here: boto3 or moto is not installed")
            server = request.getfixturevalue("s3")
            if not self.s3_ready:
                from helpers.s3 import use_endpoint

                use_endpoint(self.mp, server.url, self.root)
                self.s3_ready = True
            value = server.upload_dir(self.source(request, "index", n), f"matrix-{model}")
        else:
            value = f"shardload-test/matrix-{model}"
            if not self.hub_ready:
                import huggingface_hub.constants

                cache = self.root / "hub"
                self.mp.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
                self.mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
                self.mp.setenv("HF_HUB_CACHE", str(cache))
                self.mp.setenv("HF_HUB_OFFLINE", "1")
                self.hub_ready = True
            hub.put_revision(self.root / "hub", value, single, "c" * 40, "main")
        built[key] = value
        return value

    def record_root(self, request: pytest.FixtureRequest, name: str, n: int) -> str:
        """The root hash of the cell's source's integrity record, hashed once per session (a converted directory
        carries the record convert wrote; an S3 model's is hashed from the objects and put beside them)."""
        model = self.source(request, name, n)
        key = (str(model), name)
        if key not in self.roots:
            if name == "converted":
                self.roots[key] = json.loads((model / "shard_manifest.json").read_text())["integrity"]["root"]
            else:  # an S3 model's record is put beside its objects
                self.roots[key] = hash_model(model).root
        return self.roots[key]

    def reference(self, n: int, layout: str = "plain", model: str | None = None) -> list[tp_split.State]:
        """Every rank's reference tensors at N, of the model that serves N (or of ``model``)."""
        model = model or MODEL_OF_N[n]
        key = (model, n, layout)
        if key not in self.refs:
            built = self.model(model)
            split = tp_split.vllm_rank if layout == "vllm" else tp_split.plain_rank
            self.refs[key] = [split(built["state"], built["config"], n, r) for r in range(n)]
        return self.refs[key]

    def resharded(self, kind: str, model: str, n_old: int) -> Path:
        """``model`` as a source made for N_old alone (the original not needed to read it at another N)."""
        built = self.model(model)
        key = f"{kind}-{n_old}"
        if key in built:
            return built[key]
        if kind == "tvm_presharded" and importlib.util.find_spec("tvm") is None:
            assert os.environ.get("CI") != "true", "tvm is in the test extra"
            pytest.skip("n/a here: tvm is not installed")
        base, single = built["base"], built["single"]
        out = base / f"{kind}-{n_old}"
        if kind == "converted":
            shardload.convert(single, n_old, out)
        elif kind == "vllm_layout":
            convert_vllm(single, n_old, out)
        elif kind == "vllm_saved":
            fake_vllm_save(single, n_old, out)
        else:  # MLC-LLM's records, cut by the independent reference
            ranks = self.reference(n_old, model=model)
            matrix_sources.write_tvm_presharded(single, out, built["plan"], ranks)
        built[key] = out
        return out

    def presharded_own(self, n: int) -> Path:
        """The model that serves N as an MLC-LLM cache pre-sharded for N itself, with the whole model's plan beside it
        (which reading it at another N takes): at its own N the records are the ranks' tensors, the plan checked
        against them. (Without the plan, as MLC-LLM writes it, is tests/test_tvm_cache.py's.)"""
        return self.resharded("tvm_presharded", MODEL_OF_N[n], n)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from shardload.sources.location import forget_stores

    with pytest.MonkeyPatch.context() as mp:  # S3 endpoint and Hub cache settings, for this module only
        yield World(tmp_path_factory.mktemp("matrix"), mp)
    forget_stores()  # no store of this module's server outlives it


def use_threads(
    monkeypatch: pytest.MonkeyPatch, threads: int, remote: bool = False, *, cli: bool = False
) -> shardload.ReadOptions:
    """``threads`` reader and writer threads, small read jobs and write chunks (many of them per tensor); jobs of
    32 KiB from object storage, where every job costs the server requests. Returns the read options of ``load`` and
    ``load_rank``; ``cli`` sets the reader threads the CLI reads with (it takes no read options) as defaults."""
    if cli:
        monkeypatch.setattr(read_strategy, "READ_THREADS", threads)
        monkeypatch.setattr(ObjectReader, "threads", threads)
    monkeypatch.setattr(objects, "CONCURRENCY", threads)
    monkeypatch.setattr(writer, "WRITE_THREADS", threads)
    monkeypatch.setattr(transfer, "JOB_BYTES", 32 << 10 if remote else 4 << 10)
    monkeypatch.setattr(writer, "STAGE_SET_BYTES", 128 << 10 if remote else 16 << 10)
    monkeypatch.setattr(writer, "STAGE_CHUNK_LIMITS", (16 << 10, 64 << 10) if remote else (2 << 10, 8 << 10))
    monkeypatch.setattr(writer, "READ_THROUGH_BYTES", 1 << 10)
    return shardload.ReadOptions(threads=threads)


def assert_ranks(got: list[tp_split.State], want: list[tp_split.State], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} ranks, want {len(want)}"
    problems = [f"rank {r}: {p}" for r in range(len(want)) for p in tp_split.mismatches(got[r], want[r])]
    problems += [f"rank {r}: {k} is not contiguous" for r, state in enumerate(got) for k, t in state.items()
                 if not t.is_contiguous()]  # fmt: skip
    assert not problems, f"{what}: {len(problems)} wrong tensors:\n  " + "\n  ".join(problems)


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize(("source", "path", "n", "threads"), _cells())
def test_rank_tensors_equal_reference(
    world: World,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    source: str,
    path: str,
    n: int,
    threads: int,
) -> None:
    model = world.source(request, source, n)
    want = world.reference(n, "vllm" if path == "vllm" else "plain")
    options = use_threads(monkeypatch, threads, remote=source == "s3", cli=path in ("convert", "vllm"))
    if path.startswith("device"):  # the GPU's data path with a CPU "device": spans, one upload each, cuts
        monkeypatch.setattr(transfer, "STAGE_BYTES", read_plan.PAGE)  # spans of one page: many per tensor
        if n % 2 == 0:  # every span with a gap packed (its pieces side by side, its gaps into the sink)
            monkeypatch.setattr(device_path, "PACK_GAP", 0)
        apart = path == "device_load" and n % 2 == 0  # a load onto N GPUs: each device's pieces staged together
        monkeypatch.setattr(run, "data_path_for", stand_in_apart if apart else stand_in)
        with count_device() as moved:
            if path == "device":
                got = [shardload.load_rank(model, r, n, read_options=options) for r in range(n)]
            else:  # every rank on one device: the union of their spans read once, each rank cut from it
                got = shardload.load(model, n, devices=["cpu"] * n, read_options=options)
        assert_ranks(got, want, path)
        assert moved.spans or source == "converted", "the device path read nothing"  # rank files: whole tensors
        if n % 2 == 0 and source != "converted":
            assert moved.packed, "no span was packed"
        if path == "device":  # the spans read through the checking reader
            pin = shardload.Verify(root=world.record_root(request, source, n))
            checked = [shardload.load_rank(model, r, n, verify=pin, read_options=options) for r in range(n)]
            assert_ranks(checked, want, "device, verify")
    elif path == "load":
        got = shardload.load(model, n, devices=["cpu"] * n, read_options=options)
        assert_ranks(got, want, "load")
    elif path in ("load_rank", "mmap"):
        if path == "mmap":  # views of the file where a tensor is one stretch of it
            options = dataclasses.replace(options or shardload.ReadOptions(), strategy="view")
        got = [shardload.load_rank(model, r, n, read_options=options) for r in range(n)]
        assert_ranks(got, want, path)
    elif path == "planned":
        monkeypatch.setattr(read_plan, "MAX_READ", read_plan.PAGE)  # many reads, each its own job's share
        planned = replace(options, strategy="plan", io_depth=threads, io_model=read_plan.IoModel(1.0, 1e9),
                          max_waste=float("inf") if n % 2 else 0.0)  # fmt: skip
        got = [shardload.load_rank(model, r, n, read_options=planned) for r in range(n)]
        assert_ranks(got, want, path)
        root = world.record_root(request, source, n)
        monkeypatch.setattr(VerifiedReader, "_cached", lambda *args: False)  # tiles read as from cold storage
        pin = shardload.Verify(root=root)
        checked = [shardload.load_rank(model, r, n, verify=pin, read_options=planned) for r in range(n)]
        assert_ranks(checked, want, "planned, verify")
    else:
        out = tmp_path / "out"
        layout = ["--layout", "vllm"] if path == "vllm" else []
        done = cli("convert", model, "-n", str(n), "-o", out, "-q", *layout)
        assert done.exit_code == 0, done.output
        name = "model-rank-{r}-part-0.safetensors" if path == "vllm" else "rank-{r:05d}-of-{n:05d}.safetensors"
        files = [load_file(str(out / name.format(r=r, n=n))) for r in range(n)]  # read by safetensors itself
        assert_ranks(files, want, f"{path}: the rank files")
        if path == "convert":  # and as a load of the output reads them, checksums verified
            back = [shardload.load_rank(out, r, n, verify=True, read_options=options) for r in range(n)]
            assert_ranks(back, want, "convert: load_rank")


@pytest.mark.parametrize(("source", "path"), sorted(REFUSED), ids=[f"{s}-{p}-refused" for s, p in sorted(REFUSED)])
def test_path_that_does_not_apply_is_refused(
    world: World, request: pytest.FixtureRequest, tmp_path: Path, source: str, path: str
) -> None:
    """One line naming the reason, nothing returned, nothing written."""
    n = 2
    model = world.source(request, source, n)
    out = tmp_path / "out"
    if path == "mmap":
        with pytest.raises(ShardloadError, match=re.escape(REFUSED[source, path])) as err:
            shardload.load_rank(model, 0, n, read_options=shardload.ReadOptions(strategy="view"))
        assert "\n" not in str(err.value)
    else:
        layout = ["--layout", "vllm"] if path == "vllm" else []
        done = cli("convert", model, "-n", str(n), "-o", out, *layout)
        assert done.exit_code == 1 and REFUSED[source, path] in done.output, done.output
        assert done.output.count("\n") == 1, done.output
    assert list(tmp_path.iterdir()) == []


def pinned(source: str, n: int) -> bool:
    """Whether a verify cell pins the record's root (a third of them: every source and every N has some)."""
    return (SOURCES.index(source) + NS.index(n)) % 3 == 0


def _verify_cells() -> list[Any]:
    cells = []
    for source in SOURCES:
        for n in NS:
            threads = rotated(source, "verify", n)
            ident = f"{source}-verify{'-pinned' if pinned(source, n) else ''}-n{n}-t{threads}"
            cells.append(pytest.param(source, n, threads, id=ident))
    return cells


@pytest.mark.parametrize(("source", "n", "threads"), _verify_cells())
def test_verified_rank_tensors_equal_reference(
    world: World, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, source: str, n: int, threads: int
) -> None:
    """Every rank loaded with ``verify`` (True, or the pinned root) through the checking reader equals the
    reference; each source is hashed once (a converted directory checks its own record, or its rank files'
    sha256 for True)."""
    model = world.source(request, source, n)
    root = world.record_root(request, source, n)
    options = use_threads(monkeypatch, threads, remote=source == "s3")
    verify: bool | shardload.Verify = shardload.Verify(root=root) if pinned(source, n) else True
    got = [shardload.load_rank(model, r, n, verify=verify, read_options=options) for r in range(n)]
    assert_ranks(got, world.reference(n), f"verify={verify!r}")


VERIFY_REFUSED = {  # (source, verify) -> the documented refusal of a verified path that does not apply
    ("single", "mmap"): EXCLUSIONS[frozenset({"checked_reads", "mmap"})],  # the option table's refusal, read from it
    ("converted", "mmap"): EXCLUSIONS[frozenset({"checked_reads", "mmap"})],
}


@pytest.mark.parametrize(("source", "path"), sorted(VERIFY_REFUSED),
                         ids=[f"{s}-verify-{p}-refused" for s, p in sorted(VERIFY_REFUSED)])  # fmt: skip
def test_verified_path_that_does_not_apply_is_refused(
    world: World, request: pytest.FixtureRequest, source: str, path: str
) -> None:
    """``verify`` (the pinned root) with ``mmap=True``: one line, nothing returned."""
    n = 2
    model = world.source(request, source, n)
    root = world.record_root(request, source, n)
    with pytest.raises(ShardloadError, match=re.escape(VERIFY_REFUSED[source, path])) as err:
        shardload.load_rank(
            model, 0, n, verify=shardload.Verify(root=root), read_options=shardload.ReadOptions(strategy="view")
        )
    assert "\n" not in str(err.value)


def test_converted_directory_serves_another_n(world: World, request: pytest.FixtureRequest) -> None:
    """A converted directory serves another N (docs/reshard.md): ``load`` and ``load_rank`` equal the reference."""
    model = world.source(request, "converted", 2)
    want = world.reference(4)
    assert_ranks([shardload.load_rank(model, r, 4) for r in range(4)], want, "converted 2 -> 4: load_rank")
    assert_ranks(shardload.load(model, 4, devices=["cpu"] * 4), want, "converted 2 -> 4: load")


# --- sources made for another N: resharded -----------------------------------------------------------------------

RESHARD_SOURCES = ("converted", "vllm_layout", "vllm_saved", "tvm_presharded")
SAVED_PHI3 = "model_type 'phi3': reading vLLM's own sharded_state back is supported for llama"
RESHARD_REFUSED = {  # (source, model, N_old, N) -> the documented one-line refusal
    **{("vllm_saved", "phi3", 2 if n == 4 else 4, n): SAVED_PHI3 for n in NS if MODEL_OF_N[n] == "phi3"},
    # each KV head on N_old / KV-heads ranks: no whole shape is a dim of the records times N_old
    ("tvm_presharded", "phi3", 4, 2): "cannot tell the whole shape its num_shards=4 records of [32, 96]",
    ("tvm_presharded", "llama", 6, 3): "cannot tell the whole shape its num_shards=6 records",  # padded too
    # the old side padded the vocabulary (380 rows to 384): records of 128 rows come from several row counts alike
    ("tvm_presharded", "llama", 3, 1): "cannot tell the whole shape its num_shards=3 records of [128, 96]",
}


def old_n(source: str, model: str, n: int) -> int:
    """The N a cell's source was made for: 4 ways for phi3 (2 when the cell's N is 4), 2 ways for its TVM cache
    (whose records cannot be KV heads replicated; 4 when N is 2), 6 ways for llama (each KV head on two ranks)."""
    if model == "llama":
        return 6
    first, second = (2, 4) if source == "tvm_presharded" else (4, 2)
    return first if n != first else second


def _reshard_cells() -> list[Any]:
    cells = []
    for source in RESHARD_SOURCES:
        plan = [(MODEL_OF_N[n], old_n(source, MODEL_OF_N[n], n), n) for n in NS] + [("llama", 3, 1)]
        for model, n_old, n in plan:
            refused = "-refused" if (source, model, n_old, n) in RESHARD_REFUSED else ""
            cells.append(pytest.param(source, model, n_old, n, id=f"{source}-{model}-n{n_old}to{n}{refused}"))
    return cells


@pytest.mark.parametrize(("source", "model", "n_old", "n"), _reshard_cells())
def test_resharded_source_equals_reference(
    world: World, source: str, model: str, n_old: int, n: int, tmp_path: Path
) -> None:
    """A source made for N_old alone (a converted directory, our ``--layout vllm`` directory, a vLLM-style
    ``save_model`` directory, an MLC-LLM pre-sharded TVM cache) read at N: every rank equals the reference through
    both ``load_rank`` (rank by rank) and ``load`` (all ranks), or both refuse with the documented line."""
    path = world.resharded(source, model, n_old)
    reason = RESHARD_REFUSED.get((source, model, n_old, n))
    if reason is not None:
        calls = {
            "load_rank": lambda: shardload.load_rank(path, 0, n),
            "load": lambda: shardload.load(path, n, devices=["cpu"] * n),
        }
        for how, call in calls.items():
            with pytest.raises(ShardloadError, match=re.escape(reason)) as err:
                call()
            assert "\n" not in str(err.value), how
        return
    want = world.reference(n, model=model)
    assert_ranks([shardload.load_rank(path, r, n) for r in range(n)], want, f"{source} {n_old} -> {n}: load_rank")
    assert_ranks(shardload.load(path, n, devices=["cpu"] * n), want, f"{source} {n_old} -> {n}: load")


# --- destination tensors: load_rank(into=) ------------------------------------------------------------------

FILL_SOURCES = (*SOURCES, "tvm_presharded")
DESTINATIONS = ("mapping", "callable", "params")


def fill_threads(source: str, destination: str, n: int) -> int:
    """The reader threads of a destination cell: every (source, threads), (destination, threads) and (N, threads)
    pair occurs."""
    index = FILL_SOURCES.index(source) + DESTINATIONS.index(destination) + NS.index(n)
    return THREADS[index % len(THREADS)]


def _fill_cells() -> list[Any]:
    cells = []
    for source in FILL_SOURCES:
        for destination in DESTINATIONS:
            for n in NS[1:] if source == "tvm_presharded" else NS:  # cut 1 way, it is the tvm row's cache
                threads = fill_threads(source, destination, n)
                # the data path alternates too: host memory, or the GPU's (spans cut into the caller's tensors)
                data = ("host", "device")[(FILL_SOURCES.index(source) + DESTINATIONS.index(destination) + n) % 2]
                ident = f"{source}-out_{destination}-n{n}-t{threads}-{data}"
                cells.append(pytest.param(source, destination, n, threads, data, id=ident))
    return cells


def _asking(views: dict[str, torch.Tensor], asked: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Any:
    """An ``out`` callable giving ``views[name]``, None (a fresh tensor) for any other name, noting what it was
    asked."""

    def out(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        asked[name] = (tuple(shape), dtype)
        return views.get(name)

    return out


@pytest.mark.parametrize(("source", "destination", "n", "threads", "data"), _fill_cells())
def test_destination_tensors_equal_reference(
    world: World,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    source: str,
    destination: str,
    n: int,
    threads: int,
    data: str,
) -> None:
    """Every rank filled into caller-owned tensors equals the reference: a mapping for every tensor, a callable giving
    a tensor for half the names and None for the others, or ``only`` half the names with a tensor for each. The
    destinations start as 0xFF bytes (NaN) in one buffer with guard bytes between them (helpers/destinations.py):
    the returned tensors for the names given are the caller's very objects, every element equals the reference's,
    and no byte outside them was written. Which half alternates with the rank."""
    model = world.presharded_own(n) if source == "tvm_presharded" else world.source(request, source, n)
    options = use_threads(monkeypatch, threads, remote=source == "s3")
    if data == "device":
        monkeypatch.setattr(transfer, "STAGE_BYTES", read_plan.PAGE)
        monkeypatch.setattr(run, "data_path_for", stand_in)
    got, want = [], []
    for r, ref in enumerate(world.reference(n)):
        names = sorted(ref)
        half = names[r % 2 :: 2]
        held = destinations.slab(ref, names if destination == "mapping" else half)
        asked: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        out = _asking(held.views, asked) if destination == "callable" else held.views
        params = half if destination == "params" else None
        state = shardload.load_rank(model, r, n, read_options=options, into=shardload.Destination(out, only=params))
        mine = [name for name, t in held.views.items() if state.get(name) is not t]
        assert not mine, f"rank {r}: not the caller's own tensors: {mine}"
        assert held.guards_intact(), f"rank {r}: bytes outside the destinations were written"
        if destination == "callable":
            assert asked == {name: (tuple(t.shape), t.dtype) for name, t in ref.items()}, f"rank {r}: asked {asked}"
        got.append(state)
        want.append({name: ref[name] for name in half} if destination == "params" else ref)
    assert_ranks(got, want, f"out={destination}")


def test_model_refuses_n(world: World, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """N = 3 is not in phi3's matrix: its 2 KV heads neither divide by 3 nor divide 3, which every path refuses."""
    model = world.model("phi3")["single"]
    with pytest.raises(tp_split.NotSplittable):
        tp_split.plain_rank(world.model("phi3")["state"], world.model("phi3")["config"], 3, 0)
    message = "num_shards=3 neither divides its 2 KV heads nor is a multiple of them"
    with pytest.raises(ShardloadError, match=message):
        shardload.load_rank(model, 0, 3)
    done = cli("convert", model, "-n", "3", "-o", tmp_path / "out")
    assert done.exit_code == 1 and message in done.output, done.output
    assert list(tmp_path.iterdir()) == []


# --- share_reads under torchrun -------------------------------------------------------------------------------

WORKER = Path(__file__).resolve().parent / "helpers" / "matrix_worker.py"


@pytest.fixture(scope="module")
def shared_runs(world: World) -> Any:
    """``run(n, request)``: the output directory of the one torchrun launch for N that loaded every source with
    share_reads (launched on first use); raises the launch's failure."""
    runs: dict[int, Any] = {}

    def run(n: int, request: pytest.FixtureRequest) -> Path:
        if n not in runs:
            out = world.root / f"shared-{n}"
            cases = []
            for source in SOURCES:
                try:
                    model = world.source(request, source, n)
                except pytest.skip.Exception:
                    continue
                threads = rotated(source, "share_reads", n)
                cases.append({"id": source, "model": str(model), "threads": threads, "out": str(out / source)})
                root = world.record_root(request, source, n)  # hashed once, whether pinned or not
                verify = root if pinned(source, n) else True
                cases.append({"id": f"{source}-verify", "model": str(model), "threads": threads, "verify": verify,
                              "out": str(out / f"{source}-verify")})  # fmt: skip
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
                       str(WORKER), json.dumps(cases)]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # with the S3 and Hub settings
            done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
            runs[n] = out if done.returncode == 0 else AssertionError(done.stdout[-3000:] + done.stderr[-3000:])
        if isinstance(runs[n], AssertionError):
            raise runs[n]
        return runs[n]

    return run


def _shared_cells() -> list[Any]:
    cells = []
    for source in SOURCES:
        for n in SHARED_NS:
            threads = rotated(source, "share_reads", n)
            cells.append(pytest.param(source, n, False, id=f"{source}-share_reads-n{n}-t{threads}"))
            how = "verify-pinned" if pinned(source, n) else "verify"
            cells.append(pytest.param(source, n, True, id=f"{source}-share_reads-{how}-n{n}-t{threads}"))
    return cells


@pytest.mark.parametrize(("source", "n", "verify"), _shared_cells())
@pytest.mark.slow
def test_share_reads_equals_reference(
    world: World, request: pytest.FixtureRequest, shared_runs: Any, source: str, n: int, verify: bool
) -> None:
    """Each rank's share_reads load (with ``verify``: True or the pinned root, peers' bytes checked) equals the
    reference."""
    world.source(request, source, n)  # skips where the source's package is missing
    out = shared_runs(n, request) / (f"{source}-verify" if verify else source)
    errors = sorted(out.glob("rank-*.error"))
    assert not errors, "\n".join(f.read_text() for f in errors)
    got = [load_file(str(out / f"rank-{r}.safetensors")) for r in range(n)]
    assert_ranks(got, world.reference(n), "share_reads")
