"""`shardload plan` pads a vocabulary N does not divide (vLLM's rule or the plain one), and the padded model still
computes the unsharded model's logits once a server masks the padded rows.

Tiny transformers models with a vocabulary of 250 rows (4 does not divide it) are planned, loaded for 4 ranks
and run tensor-parallel by tests/helpers/tp_reference.py; every rank tensor is also compared with the stored rows,
element for element, and its padding must be zeros.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import shardload
from helpers import tiny_models
from helpers import tp_reference as tp
from shardload.cli.main import main
from shardload.models.generated import generate
from shardload.models.placement import Placement, placement_from_steps
from shardload.models.stored_layouts import companion_steps

pytest.importorskip("transformers")

VOCAB = 250
IDS = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
RULES = {"vllm": 256, "plain": 252}  # rows the vocabulary is padded to for N=4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("vocab")
    return {kind: (root / kind, tiny_models.build(kind, root / kind, vocab_size=VOCAB)) for kind in ("llama", "qwen2")}


def _plan(model_dir: Path, *args: str) -> Path:
    out = model_dir / f"shard_info{'_'.join(args).replace('-', '')}.json"
    result = CliRunner().invoke(main, ["plan", str(model_dir), "-o", str(out), "--overwrite", *args])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: tied embeddings, stored once
def test_padded_vocabulary_computes_the_model(models: dict, kind: str, rule: str) -> None:
    model_dir, model = models[kind]
    info = _plan(model_dir, "--vocab-padding", rule)
    doc = json.loads(info.read_text())
    assert f"Vocabulary of {VOCAB} rows" in doc["description"] and f"{RULES[rule]} rows for N=4" in doc["description"]
    stored = dict(model.state_dict())
    heads = ["model.embed_tokens.weight"] + (["lm_head.weight"] if kind == "llama" else [])
    assert ("lm_head.weight" in doc["params"]) == (kind == "llama")
    n = 4
    shards = shardload.load(model_dir, n, devices=["cpu"] * n, shard_info=info)
    per = RULES[rule] // n
    for name in heads:
        rows = [s[name] for s in shards]
        assert all(t.shape == (per, 64) for t in rows)
        whole = torch.cat(rows)
        torch.testing.assert_close(whole[:VOCAB], stored[name], rtol=0, atol=0)  # every stored row, in order
        assert (whole[VOCAB:] == 0).all() and len(whole) == RULES[rule]
    config = json.loads((model_dir / "config.json").read_text())
    with torch.no_grad():
        logits = tp.decoder_logits(config, shards, IDS)
        want = model(input_ids=IDS).logits
    assert logits.shape[-1] == RULES[rule]
    assert (logits[..., VOCAB:] == 0).all()  # zero rows give zero logits: a server masks them to -inf
    masked = logits.masked_fill(torch.arange(RULES[rule]) >= VOCAB, float("-inf"))
    torch.testing.assert_close(masked[..., :VOCAB], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(masked.argmax(-1), want.argmax(-1))
    for r in (1, 3):  # one rank alone, from the N-agnostic file: the same tensors as load()'s
        alone = shardload.load_rank(model_dir, r, n, shard_info=info)
        assert all(torch.equal(alone[k], shards[r][k]) for k in alone)


def test_a_divisible_n_pads_nothing(models: dict) -> None:
    model_dir, model = models["llama"]
    info = _plan(model_dir)
    shards = shardload.load(model_dir, 2, devices=["cpu"] * 2, shard_info=info)
    assert [s["lm_head.weight"].shape[0] for s in shards] == [125, 125]
    assert torch.equal(torch.cat([s["lm_head.weight"] for s in shards]), model.state_dict()["lm_head.weight"])


def _fake_model(directory: Path, config: dict[str, Any], tensors: dict[str, tuple[int, ...]]) -> Path:
    from safetensors.numpy import save_file

    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    save_file({k: rng.standard_normal(s).astype(np.float32) + 3 for k, s in tensors.items()},
              str(directory / "model.safetensors"))  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_lm_head_bias_is_padded_like_its_weight(tmp_path: Path) -> None:
    config = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 301}
    model_dir = _fake_model(tmp_path / "m", config, {
        "model.embed_tokens.weight": (301, 8), "lm_head.weight": (301, 8), "lm_head.bias": (301,),
        "model.norm.weight": (8,),
    })  # fmt: skip
    generated = generate(model_dir, vocab_padding="plain")
    for name in ("model.embed_tokens.weight", "lm_head.weight", "lm_head.bias"):
        assert generated.document["params"][name][0][:1] == ["shard_funcs.pad_dim"], name
    assert "model.norm.weight" not in generated.document["params"]
    assert generated.supported == list(range(1, 65))  # plain padding serves every N
    generated.save(model_dir / "shard_info.json")
    from safetensors.numpy import load_file

    stored = load_file(str(model_dir / "model.safetensors"))
    for n in (3, 7):
        per = -(-301 // n)
        for r in range(n):
            got = shardload.load_rank(model_dir, r, n)
            for name in ("lm_head.weight", "lm_head.bias", "model.embed_tokens.weight"):
                want = np.zeros((per, *stored[name].shape[1:]), np.float32)
                rows = stored[name][r * per : (r + 1) * per]
                want[: len(rows)] = rows
                np.testing.assert_array_equal(got[name].numpy(), want, err_msg=f"n={n} rank {r} {name}")


def test_plan_refuses_a_file_for_one_rank_without_allow_single(tmp_path: Path) -> None:
    """A prime vocabulary left unpadded works for N=1 only: plan says why in one line, writes nothing, exits 1."""
    config = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 251}
    model_dir = _fake_model(tmp_path / "m", config, {"model.embed_tokens.weight": (251, 8), "lm_head.weight": (251, 8)})
    runner = CliRunner()
    result = runner.invoke(main, ["plan", str(model_dir), "--vocab-padding", "none"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {model_dir}: the plan works for num_shards=1 only")
    assert "dim 0 of size 251 is not divisible by num_shards=2" in lines[0]
    assert "--vocab-padding plain" in lines[0] and "--allow-single" in lines[0]
    assert not (model_dir / "shard_info.json").exists()
    result = runner.invoke(main, ["plan", str(model_dir), "--vocab-padding", "none", "--allow-single"])
    assert result.exit_code == 0 and "num_shards 1\n" in result.output
    assert (model_dir / "shard_info.json").exists()
    result = runner.invoke(main, ["plan", str(model_dir), "--overwrite", "-n", "3"])  # vllm: 251 -> 256, not 3
    assert result.exit_code == 1
    assert "num_shards=3: " in result.output and "size 251 padded to 256 (a multiple of 64)" in result.output
    assert "--vocab-padding plain" in result.output
    result = runner.invoke(main, ["plan", str(model_dir), "--overwrite", "-n", "3", "--vocab-padding", "plain"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["plan", str(model_dir), "--vocab-padding", "odd"])
    assert result.exit_code == 2


def test_padding_carries_over_to_quantized_tensors() -> None:
    """A dense file's pad_dim + shard_dim reads back as a padded placement; a per-row scale pads like its weight,
    a grouped one cannot, so that weight is left unpadded."""
    steps = [["shard_funcs.pad_dim", [None, None], 0, 64, "num_shards"],
             ["shard_funcs.shard_dim", [None, None], 0, "num_shards"]]  # fmt: skip
    placement = placement_from_steps("lm_head.weight", steps)
    assert placement == Placement("lm_head.weight", "column", 0, rule="carried over", pad_to=64)

    class H:
        def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
            self.shape, self.dtype = shape, dtype

    per_row = {"lm_head.weight": H((250, 64), "float8_e4m3fn"), "lm_head.weight_scale": H((250, 1), "float32")}
    out = companion_steps(placement, per_row)
    assert [s[0] for s in out["lm_head.weight"]] == ["shard_funcs.pad_dim", "shard_funcs.shard_dim"]
    assert [s[0] for s in out["lm_head.weight_scale"]] == ["shard_funcs.pad_dim", "shard_funcs.shard_dim"]
    blocks = {"lm_head.weight": H((250, 256), "float8_e4m3fn"), "lm_head.weight_scale_inv": H((2, 2), "float32")}
    out = companion_steps(placement, blocks, {"weight_block_size": [128, 128]})
    assert [s[0] for s in out["lm_head.weight"]] == ["shard_funcs.shard_dim"]


def test_the_default_split_is_the_documented_one(tmp_path: Path) -> None:
    """With no shard_info (the plan made in memory, as ``plan`` writes it by default), an N that divides the
    vocabulary splits it evenly (1000 rows at N=2: 500 per rank, where vLLM pads to 1024 and gives 512), and an N
    that does not gives vLLM's padded partition row for row (1001 rows: 512 per rank, rank 1 rows 512..1000 then 23
    zeros). docs/model-plans.md says exactly this."""
    from safetensors.torch import load_file

    from shardload.integrations.vllm.names import vocab_range

    for vocab, per_rank in ((1000, 500), (1001, 512)):
        config = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "vocab_size": vocab}
        shapes = {"model.embed_tokens.weight": (vocab, 8), "lm_head.weight": (vocab, 8)}
        model = _fake_model(tmp_path / str(vocab), config, shapes)
        stored = load_file(str(model / "model.safetensors"))
        for rank in range(2):
            state = shardload.load_rank(model, rank, 2)
            start, stop, vllm_rows = vocab_range(vocab, rank, 2)
            assert vllm_rows == 512
            for name in shapes:
                got = state[name]
                assert list(got.shape) == [per_rank, 8], (vocab, name)
                if vocab % 2 == 0:  # an even split, unpadded: not vLLM's rows
                    assert torch.equal(got, stored[name][rank * per_rank : (rank + 1) * per_rank])
                else:  # vLLM's partition: its stored rows, then zeros
                    assert torch.equal(got[: stop - start], stored[name][start:stop])
                    assert not got[stop - start :].any() and (rank == 0 or per_rank - (stop - start) == 23)
    text = " ".join((Path(__file__).parents[1] / "docs" / "model-plans.md").read_text().split())
    assert (
        "A vocabulary of 1000 rows at N=2 gives each rank 500 rows (`lm_head` `[500, H]`), where vLLM gives 512" in text
    )
    assert "one of 1001 rows gives each rank 512 rows, as vLLM does" in text
    assert "pads nothing" not in text.replace("splits it evenly and pads nothing", "")
