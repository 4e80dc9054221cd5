"""``shardload quantize``: faithful compressed-tensors output, one quantized checkpoint served at N = 1, 2, 4, 8,
and ``shardload plan`` describing that checkpoint from scratch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.numpy import save_file
from safetensors.torch import load_file
from safetensors.torch import save_file as save_torch

import shardload
import shardload.engine.quantize
import shardload.engine.writer
from helpers.disks import DiskFull
from helpers.quantized import rank_reference
from shardload.cli.main import main
from shardload.engine.quantize import SCHEMES as SCHEMES_BY_NAME
from shardload.engine.quantize import quantize_weight
from shardload.format.shard_info import ShardInfo
from shardload.models.generated import generate
from shardload.models.placement import placement_from_steps
from shardload.planning.validate import validate_file

pytest.importorskip("compressed_tensors")

SCHEMES = ("int4-g32", "int8", "fp8")


@pytest.fixture(scope="module")
def quantized(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The example model quantized with each scheme through the command line."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for scheme in (*SCHEMES, "int4-g128"):
        done = CliRunner().invoke(main, ["quantize", str(example_dir), "-o", str(root / scheme), "--scheme", scheme])
        assert done.exit_code == 0, done.output
        assert "quantized 8 weights" in done.output and "kept lm_head: ignored module" in done.output
        valid = "1, 2" if scheme == "int4-g128" else "1, 2, 4, 8"
        assert f"shard_info.json: valid for num_shards {valid} (checked 1..16)" in done.output
        out[scheme] = root / scheme
    return out


def _decompressor(model: Path):
    """Decompress one module's tensors with compressed_tensors, as configured in ``model``'s config.json."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    qc = json.loads((model / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(qc)  # our config passes compressed-tensors' own schema
    group = config.config_groups["group_0"]
    scheme = QuantizationScheme(targets=group.targets, weights=group.weights)
    compressor = BaseCompressor.get_value_from_registry(config.format)

    def decompress(local: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = compressor.decompress(local, scheme)["weight"]
        if "weight_shape" in local:
            assert local["weight_shape"].tolist() == list(weight.shape)
        return weight

    return decompress


def _modules(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        prefix, suffix = name.rsplit(".", 1)
        if suffix.startswith("weight_") or (suffix == "weight" and t.dtype == torch.float8_e4m3fn):
            modules.setdefault(prefix, {})[suffix] = t
    return modules


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_weights_are_close_to_the_source(example_dir: Path, quantized: dict[str, Path], scheme: str) -> None:
    source = load_file(str(example_dir / "model.safetensors"))
    stored = load_file(str(quantized[scheme] / "model.safetensors"))
    decompress = _decompressor(quantized[scheme])
    modules = _modules(stored)
    assert len(modules) == 8 and "lm_head.weight" in stored and "model.embed_tokens.weight" in stored
    for prefix, local in modules.items():
        w = source[prefix + ".weight"].float()
        got = decompress(local).float()
        scale = local["weight_scale"].float()
        if scheme == "fp8":  # 3 mantissa bits: within 1/16 relative, or a subnormal step of the row's scale
            bound = w.abs() / 16 + scale * 2.0**-9
        else:  # round to nearest: half a step of the group's scale, plus float16 rounding of scale and result
            bound = torch.repeat_interleave(scale, w.shape[1] // scale.shape[1], dim=1) * 0.5 + w.abs() * 2.0**-9
        assert (got - w).abs().le(bound).all(), prefix
        assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_one_quantized_checkpoint_serves_every_n(example_dir: Path, quantized: dict[str, Path], scheme: str) -> None:
    model = quantized[scheme]
    decompress = _decompressor(model)
    dense_info = ShardInfo.load(example_dir / "shard_info.json")
    stored = load_file(str(model / "model.safetensors"))
    full = {prefix: decompress(local).float().numpy() for prefix, local in _modules(stored).items()}
    for n in (1, 2, 4, 8):
        shards = shardload.load(model, n, devices=["cpu"] * n)
        dense = shardload.load(example_dir, n, devices=["cpu"] * n)
        for r in range(n):
            modules = _modules(shards[r])
            assert set(modules) == set(full)
            for prefix, local in modules.items():
                placement = placement_from_steps(prefix, dense_info.params.get(prefix + ".weight", []))
                want = rank_reference(full[prefix], placement, n, r)
                np.testing.assert_array_equal(decompress(local).float().numpy(), want, err_msg=f"{prefix} {r}/{n}")
            kept = {name: t for name, t in dense[r].items() if name.removesuffix(".weight") not in full}
            assert len(kept) == 7  # embeddings, lm_head and norms stay as they were
            assert all(torch.equal(shards[r][name], t) for name, t in kept.items())


PLANNED_N = {"int4-g32": [1, 2, 4, 8], "int8": [1, 2, 4, 8, 16], "fp8": [1, 2, 4, 8, 16]}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_plan_describes_the_quantized_checkpoint(
    example_dir: Path, quantized: dict[str, Path], scheme: str, tmp_path: Path
) -> None:
    """``shardload plan`` on quantize's output (no shard_info used): each quantized weight is split as the dense
    plan splits it, every stored tensor follows, and every N it claims loads rank for rank."""
    model = quantized[scheme]
    out = tmp_path / "planned.json"
    done = CliRunner().invoke(main, ["plan", str(model), "-o", str(out)])
    assert done.exit_code == 0, done.output
    ns = ", ".join(map(str, PLANNED_N[scheme]))
    assert f"num_shards {ns}\n" in done.output and "note: 8 quantized weight(s) (" in done.output
    assert validate_file(out, model, PLANNED_N[scheme])["valid"]
    planned = generate(model)
    dense = generate(example_dir)
    assert planned.supported == PLANNED_N[scheme] and set(planned.supported) <= set(dense.supported)
    decompress = _decompressor(model)
    stored = load_file(str(model / "model.safetensors"))
    full = {prefix: decompress(local).float().numpy() for prefix, local in _modules(stored).items()}
    for prefix in full:
        q, d = planned.placements[prefix + ".weight"], dense.placements[prefix + ".weight"]
        assert (q.style, q.dim, q.segments, q.unit, q.kv) == (d.style, d.dim, d.segments, d.unit, d.kv), prefix
    for n in PLANNED_N[scheme]:
        shards = shardload.load(model, n, devices=["cpu"] * n, shard_info=out)
        reference = shardload.load(example_dir, n, devices=["cpu"] * n, shard_info=dense.document)
        for r in range(n):
            modules = _modules(shards[r])
            for prefix, local in modules.items():
                want = rank_reference(full[prefix], planned.placements[prefix + ".weight"], n, r)
                np.testing.assert_array_equal(decompress(local).float().numpy(), want, err_msg=f"{prefix} {r}/{n}")
            kept = {name: t for name, t in reference[r].items() if name.removesuffix(".weight") not in full}
            assert len(kept) == 7 and all(torch.equal(shards[r][name], t) for name, t in kept.items())


def test_readme_flow_quantize_once_convert_to_2_4_8(quantized: dict[str, Path], tmp_path: Path) -> None:
    runner = CliRunner()
    g128 = quantized["int4-g128"]
    done = runner.invoke(main, ["validate", str(g128 / "shard_info.json"), "--model", str(g128), "--list-valid-n"])
    assert done.exit_code == 0, done.output
    assert done.output.rstrip().endswith("valid for num_shards 1, 2")
    assert (
        "num_shards=4: " in done.output
        and "o_proj.weight_scale: step 1 (shard_funcs.shard_groups): 2 groups along dim 1 cannot be split "
        "across 4 ranks (group size 128)"
        in done.output
    )
    model = quantized["int4-g32"]
    for n in (2, 4, 8):
        out = tmp_path / f"tp{n}"
        done = runner.invoke(main, ["convert", str(model), "-n", str(n), "-o", str(out), "-q"])
        assert done.exit_code == 0, done.output
        direct = shardload.load(model, n, devices=["cpu"] * n)
        for r in (0, n - 1):
            from_file = shardload.load_rank(out, r, n, verify=True)
            assert from_file.keys() == direct[r].keys()
            assert all(torch.equal(from_file[k], direct[r][k]) for k in from_file)
        assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"


def test_quantize_errors_are_one_line(example_dir: Path, quantized: dict[str, Path], tmp_path: Path) -> None:
    runner = CliRunner()
    done = runner.invoke(main, ["quantize", str(example_dir), "-o", str(quantized["int8"]), "--scheme", "int8"])
    assert done.exit_code == 1 and "output directory exists" in done.output and done.output.count("\n") == 1
    done = runner.invoke(main, ["quantize", str(quantized["int8"]), "-o", str(tmp_path / "again")])
    assert done.exit_code == 1 and "already quantized" in done.output and not (tmp_path / "again").exists()
    done = runner.invoke(main, ["quantize", str(example_dir), "-o", str(tmp_path / "x"), "--scheme", "int3"])
    assert done.exit_code == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary directory left behind"
    (tmp_path / "bad.json").write_text('{"version": 2, "params": {}}')
    done = runner.invoke(main, ["validate", str(tmp_path / "bad.json"), "--list-valid-n"])
    assert done.exit_code == 1 and "unsupported version 2" in done.output and "valid for num_shards none" in done.output
    no_info = tmp_path / "no-info"
    no_info.mkdir()
    for f in ("model.safetensors", "config.json"):
        (no_info / f).write_bytes((example_dir / f).read_bytes())
    done = runner.invoke(main, ["quantize", str(no_info), "-o", str(tmp_path / "q"), "--scheme", "fp8"])
    assert done.exit_code == 0 and "wrote none" in done.output and not (tmp_path / "q" / "shard_info.json").exists()


@pytest.mark.parametrize("scheme", ["int4", "int4-g32", "int8"])
def test_a_model_with_nothing_to_quantize_is_refused(tmp_path: Path, scheme: str) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.embed_tokens.weight": torch.randn(64, 32), "model.norm.weight": torch.ones(32),
               "lm_head.weight": torch.randn(64, 32), "model.proj.weight": torch.randn(8, 2)},
              str(src / "model.safetensors"))  # fmt: skip
    done = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "q"), "--scheme", scheme])
    assert done.exit_code == 1 and done.output.count("\n") == 1, done.output
    assert done.output.startswith(f"error: {src}: nothing to quantize") and "lm_head (ignored module)" in done.output
    assert "model.proj (input dim 2 is not a multiple of" in done.output
    assert not (tmp_path / "q").exists() and [p.name for p in tmp_path.iterdir()] == ["src"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quantized_shards_land_on_cuda_unchanged(quantized: dict[str, Path]) -> None:
    for scheme in SCHEMES:  # int32 packs, int64 shapes, float8 weights
        on_cpu = shardload.load(quantized[scheme], 2, devices=["cpu", "cpu"])
        on_gpu = shardload.load(quantized[scheme], 2, devices=["cuda:0", "cuda:0"])
        for cpu, gpu in zip(on_cpu, on_gpu, strict=True):
            assert all(gpu[k].device.type == "cuda" and torch.equal(gpu[k].cpu(), t) for k, t in cpu.items())


def test_quantize_fsyncs_only_what_replaces_an_output(
    example_dir: Path, tmp_path: Path, fsync_calls: list[int]
) -> None:
    synced = fsync_calls
    out = tmp_path / "q"
    runner = CliRunner()
    assert runner.invoke(main, ["quantize", str(example_dir), "-o", str(out), "--scheme", "int8"]).exit_code == 0
    assert synced == []
    done = runner.invoke(main, ["quantize", str(example_dir), "-o", str(out), "--scheme", "fp8", "--overwrite"])
    assert done.exit_code == 0
    files = [p for p in out.iterdir() if p.is_file()]
    assert len(synced) == len(files) + 2  # every file, the new directory, then the parent after the swap
    assert json.loads((out / "config.json").read_text())["quantization_config"] != {}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_converted_quantized_ranks_map_whole(quantized: dict[str, Path], tmp_path: Path) -> None:
    """Rank files hold their widest elements first, so every tensor of a mixed-dtype rank file is aligned
    and load_rank(mmap=True) maps all of it (reads nothing) with the same values as a plain load."""
    from shardload.sources.dtypes import itemsize
    from shardload.sources.reader import count_reads
    from shardload.sources.safetensors_header import read_header

    out = tmp_path / "tp2"
    shardload.convert(quantized["int4-g32"], 2, out)
    for r in range(2):
        entries = sorted((t.offset, t.dtype) for t in read_header(out / f"rank-0000{r}-of-00002.safetensors").values())
        widths = [itemsize(d) for _, d in entries]
        assert len(set(widths)) > 1 and widths == sorted(widths, reverse=True), entries
        with count_reads() as seen:
            mapped = shardload.load_rank(out, r, 2, mmap=True)
        plain = shardload.load_rank(out, r, 2)
        assert seen.bytes == 0 and mapped.keys() == plain.keys()
        assert all(torch.equal(mapped[k], plain[k]) for k in plain)


def test_quantize_and_plan_model_refuse_the_same_outside_shard_info(example_dir: Path, tmp_path: Path) -> None:
    """A shard_info.json symlinked outside the model directory is refused alike by plan_model and quantize: both
    find the file beside the weights by one rule."""
    model = tmp_path / "model"
    model.mkdir()
    for f in example_dir.iterdir():
        if f.name != "shard_info.json":
            (model / f.name).write_bytes(f.read_bytes())
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((example_dir / "shard_info.json").read_bytes())
    (model / "shard_info.json").symlink_to(outside)
    for call in (lambda: shardload.plan_model(model, 2), lambda: shardload.quantize(model, tmp_path / "q", "int8")):
        with pytest.raises(shardload.ShardloadError, match="outside the model directory"):
            call()
    assert not (tmp_path / "q").exists()


def test_default_scheme_keeps_n_up_to_8(example_dir: Path, tmp_path: Path) -> None:
    """``quantize`` without ``--scheme`` picks int4's group size from the model so N up to 8 stays valid (the
    example's split input dims are 256 and 512: groups of 32), says so before writing, and ``convert -n 8`` works;
    an explicit ``--scheme int4-g128`` is kept as given."""
    runner = CliRunner()
    out = tmp_path / "q"
    done = runner.invoke(main, ["quantize", str(example_dir), "-o", str(out)])
    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    assert lines[0] == (
        f"int4: group size 32 chosen from {example_dir}: every quantized input dim splits into whole groups "
        "at N = 1, 2, 4, 8 (--scheme int4-gG picks another)"
    ), done.output
    assert "quantized 8 weights to int4-g32" in lines[1]
    assert "shard_info.json: valid for num_shards 1, 2, 4, 8 (checked 1..16)" in done.output
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["config_groups"]["group_0"]["weights"]["group_size"] == 32
    done = runner.invoke(main, ["convert", str(out), "-n", "8", "-o", str(tmp_path / "tp8"), "-q"])
    assert done.exit_code == 0, done.output
    done = runner.invoke(main, ["quantize", str(example_dir), "-o", str(tmp_path / "g128"), "--scheme", "int4-g128"])
    assert done.exit_code == 0 and "chosen" not in done.output and "to int4-g128" in done.output, done.output
    assert "valid for num_shards 1, 2 " in done.output


def test_int4_group_size_follows_the_input_dims() -> None:
    from shardload.engine.quantize import choose_int4

    assert choose_int4({"a": 4096, "b": 14336}) == ("int4-g128", 8)  # Llama-3-8B: 14336 / 8 = 1792 = 14 x 128
    assert choose_int4({"a": 4096, "b": 11008}) == ("int4-g32", 8)  # Llama-2-7B: 11008 / 8 = 1376 = 43 x 32
    assert choose_int4({"a": 256, "b": 512}) == ("int4-g32", 8)  # the example
    assert choose_int4({"a": 1024, "b": 192}) == ("int4-g32", 2)  # 192 = 6 x 32: halves of whole groups at most
    assert choose_int4({"a": 160}) == ("int4-g32", 1)
    assert choose_int4({}) == ("int4-g128", 8)


@pytest.mark.parametrize("budget", [0, 100, 5000, 100_000])
def test_a_full_disk_is_one_line_and_no_output(
    example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    """``quantize`` onto a disk that fills up (in the header, in a tensor, near the end) is one line naming the
    cause, and nothing is left at the output."""
    monkeypatch.setattr(shardload.engine.writer, "create_file", DiskFull(budget))
    out = tmp_path / "q"
    done = CliRunner().invoke(main, ["quantize", str(example_dir), "-o", str(out), "--scheme", "int8"])
    assert done.exit_code == 1, done.output
    lines = done.output.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0] and "Traceback" not in done.output, lines
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("scheme", ["int4-g32", "fp8"])
def test_an_output_larger_than_a_file_is_split_with_an_index(
    example_dir: Path, quantized: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """quantize wrote its whole output as one ``model.safetensors`` held in memory; past ``FILE_BYTES`` it is split
    in order over ``model-0000K-of-0000M.safetensors`` with an index, as transformers writes a large model: the
    same tensors, bit for bit (read by safetensors itself), and the same shards at every N."""
    whole = load_file(quantized[scheme] / "model.safetensors")
    monkeypatch.setattr(shardload.engine.quantize, "FILE_BYTES", sum(t.nbytes for t in whole.values()) // 3)
    out = tmp_path / "split"
    shardload.quantize(example_dir, out, scheme)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) >= 3 and files == sorted(set(index["weight_map"].values())), files
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    split = {}
    for name in files:
        part = load_file(out / name)
        assert all(index["weight_map"][k] == name for k in part)
        split.update(part)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in split.values())
    assert split.keys() == whole.keys()
    for k, t in whole.items():
        assert split[k].dtype == t.dtype and torch.equal(split[k].view(torch.uint8), t.view(torch.uint8)), k
    for n in (1, 2, 4):
        one, many = shardload.load(quantized[scheme], num_shards=n), shardload.load(out, num_shards=n)
        for a, b in zip(one, many, strict=True):
            assert a.keys() == b.keys()
            assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a), n


@pytest.mark.parametrize("scheme", sorted(SCHEMES_BY_NAME))
def test_a_weight_quantized_a_block_of_rows_at_a_time_is_the_weight_quantized_at_once(
    monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """quantize_weight takes rows in blocks (bounded copies); the blocks put together are bit for bit the result
    of the whole weight at once, including a last block of fewer rows and a zero row."""
    w = torch.randn(37, 256, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    w[5] = 0
    whole = quantize_weight(w, SCHEMES_BY_NAME[scheme])
    monkeypatch.setattr(shardload.engine.quantize, "BLOCK_ELEMENTS", 256 * 4 + 100)
    blocks = quantize_weight(w, SCHEMES_BY_NAME[scheme])
    assert list(blocks) == list(whole)
    for k in whole:
        assert blocks[k].shape == whole[k].shape and blocks[k].dtype == whole[k].dtype, k
        assert torch.equal(blocks[k].view(torch.uint8), whole[k].view(torch.uint8)), k


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4-g32"])
def test_every_output_tensor_starts_at_a_multiple_of_its_element_size(tmp_path: Path, scheme: str) -> None:
    """Streamed in the source's order, quantize put an int64 weight_shape at offset 2178 and bfloat16 scales at odd
    offsets (reviewer H): readable, but not mappable in place. Laid out the widest dtypes first, as safetensors'
    own writer does, every tensor is aligned, and the values are the same."""
    model = tmp_path / "m"
    model.mkdir()
    g = torch.Generator().manual_seed(3)
    tensors = {"model.layers.0.mlp.up_proj.weight": torch.randn(33, 64, generator=g).to(torch.bfloat16),
               "model.layers.0.mlp.down_proj.weight": torch.randn(65, 96, generator=g).to(torch.bfloat16),
               "model.norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),
               "model.embed_tokens.weight": torch.randn(5, 64, generator=g).to(torch.float32)}  # fmt: skip
    save_torch(tensors, str(model / "model.safetensors"))
    shardload.quantize(model, tmp_path / "q", scheme)
    raw = (tmp_path / "q" / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    size = {"I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1}
    starts = {k: (8 + len(raw[8 : 8 + int.from_bytes(raw[:8], "little")]) + v["data_offsets"][0], size[v["dtype"]])
              for k, v in header.items() if k != "__metadata__"}  # fmt: skip
    assert all(start % width == 0 for start, width in starts.values()), starts
    out = load_file(tmp_path / "q" / "model.safetensors")
    for name, w in tensors.items():
        if name.endswith("proj.weight"):
            module = name.removesuffix(".weight")
            want = quantize_weight(w, SCHEMES_BY_NAME[scheme])
            for suffix, t in want.items():
                assert torch.equal(out[f"{module}.{suffix}"].view(torch.uint8), t.view(torch.uint8)), (name, suffix)
        else:
            assert torch.equal(out[name], w), name


def test_a_refused_quantize_prints_only_its_error(example_dir: Path, tmp_path: Path) -> None:
    """quantize into an OUT that exists (no --overwrite): the one error line and nothing on stdout (old code first
    printed the group size it chose, as if it had run); a run that works names OUT's shard_info.json in full."""
    out = tmp_path / "q"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    runner = CliRunner()
    refused = runner.invoke(main, ["quantize", str(example_dir), "-o", str(out)])
    assert refused.exit_code == 1 and refused.stdout == "", refused.output
    assert refused.stderr.startswith(f"error: {out}: ") and refused.stderr.count("\n") == 1, refused.stderr
    done = runner.invoke(main, ["quantize", str(example_dir), "-o", str(tmp_path / "q2")])
    assert done.exit_code == 0 and f"{tmp_path / 'q2' / 'shard_info.json'}: valid for num_shards" in done.stdout


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_a_weight_with_values_that_are_not_finite_is_refused(tmp_path: Path, bad: float, scheme: str) -> None:
    """One inf or NaN in a weight to quantize: one line naming the file and the weight, and nothing written (old
    code wrote scales of inf or NaN, so whole rows of the output were NaN, and exited 0)."""
    w = np.ones((8, 64), dtype=np.float16)
    w[3, 5] = bad
    model = tmp_path / "m"
    model.mkdir()
    save_file({"layer.down_proj.weight": w}, str(model / "model.safetensors"))
    out = tmp_path / "q"
    with pytest.raises(shardload.CheckpointError) as err:
        shardload.quantize(model, out, scheme)
    assert str(err.value).startswith(f"{model / 'model.safetensors'}: layer.down_proj.weight: holds values that are")
    assert not out.exists()


@pytest.mark.parametrize("kind", ["qwen2", "mixtral"])
def test_transformers_reads_what_quantize_writes_for_tied_heads_and_routers(tmp_path: Path, kind: str) -> None:
    """transformers (compressed-tensors' consumer) loads the output as quantize meant it: a head tied to the
    embeddings stores no tensor, so it was never listed in ``ignore`` and transformers took it for a quantized
    Linear (fp8: a random scale and logits of inf); a MoE router (``block_sparse_moe.gate``) was quantized, and
    transformers, which keeps routers plain, loaded a random one. Logits stay near the dense model's."""
    pytest.importorskip("compressed_tensors")
    import transformers

    from helpers.tiny_models import build

    dense = build(kind, tmp_path / "src")
    done = shardload.quantize(tmp_path / "src", tmp_path / "q", "fp8")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert "lm_head" in config["quantization_config"]["ignore"], config["quantization_config"]["ignore"]
    assert not [m for m in done.quantized if m.endswith(".gate")], done.quantized
    quantized = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q", torch_dtype=torch.float32).eval()
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = dense(ids).logits, quantized(ids).logits
    assert bool(torch.isfinite(got).all())
    assert float((got - want).norm() / want.norm()) < 0.1
