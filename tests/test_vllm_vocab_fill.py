"""``load_format="shardload"`` with a vocabulary N does not divide, without vLLM: the plan's padded rank slice
fills vLLM's padded vocabulary shard (stored rows, then zeros), read in place; a plan padded by another rule is
detected and read whole, then narrowed.

vLLM's row ranges come from :func:`shardload.models.vllm_names.vocab_range` (vLLM's ``pad_vocab_size`` rule,
which ``tests_vllm/`` checks against vLLM's own ``VocabParallelEmbedding``); the parameters are plain tensors
of vLLM's per-rank shape. vLLM serving such a model through this path is proven in ``tests_vllm/``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from shardload.cli.main import main
from shardload.integrations.vllm.loader import FillReport, _copy_into, _read_planned
from shardload.models.plan_source import plan_shard_info
from shardload.models.vllm_names import Target, vocab_range
from shardload.sources.checkpoint import open_checkpoint

pytest.importorskip("transformers")
import tiny_models

VOCAB, N = 251, 2
HEADS = ("model.embed_tokens.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("vllm_vocab")
    built = tiny_models.build("llama", root / "llama", vocab_size=VOCAB)
    plain = root / "plain.shard_info.json"
    result = CliRunner().invoke(main, ["plan", str(root / "llama"), "-o", str(plain), "--vocab-padding", "plain"])
    assert result.exit_code == 0, result.output
    return root, {k: v.detach().clone() for k, v in built.state_dict().items()}


def _fill(
    model_dir: Path, shard_info: Path | None, rank: int, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], set[str], FillReport]:
    """What the loader's planned branch puts into vLLM's rank-``rank`` vocabulary parameters (NaN where nothing)."""
    checkpoint = open_checkpoint(model_dir)
    info, _ = plan_shard_info(checkpoint, shard_info)
    vocab = {}
    targets = {}
    for name in HEADS:
        start, stop, per_rank = vocab_range(VOCAB, rank, N)
        vocab[name] = (start, stop, VOCAB, per_rank)
        targets[name] = torch.nn.Parameter(torch.full((per_rank, 64), float("nan"), dtype=dtype), requires_grad=False)
    report = FillReport()

    def route(name: str) -> Target | None:
        return Target(name) if name in HEADS else None

    tensors, direct, narrow, routes = _read_planned(checkpoint, info, rank, N, route, targets, vocab, report)
    assert set(tensors) == set(HEADS)
    filled = _copy_into(targets, tensors, routes, vocab, narrow, str(model_dir), direct)
    assert filled == set(HEADS)
    return {k: v.data for k, v in targets.items()}, direct, report


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["in_place", "scratch"])
@pytest.mark.parametrize("rule", ["vllm", "plain"])
def test_padded_vocabulary_fills_vllms_shards(
    model: tuple[Path, dict[str, torch.Tensor]], rule: str, dtype: torch.dtype
) -> None:
    """float64 parameters (vLLM's dtype is not the checkpoint's) are read into scratch tensors, then copied."""
    root, state = model
    for rank in range(N):
        info = None if rule == "vllm" else root / "plain.shard_info.json"
        got, direct, report = _fill(root / "llama", info, rank, dtype)
        start, stop, per_rank = vocab_range(VOCAB, rank, N)
        assert per_rank == 128 and stop - start == (128 if rank == 0 else 123)
        for name in HEADS:
            want = torch.zeros(per_rank, 64, dtype=dtype)
            want[: stop - start] = state[name][start:stop].to(dtype)
            assert torch.equal(got[name], want), (rule, rank, name)
        if rule == "vllm":  # the plan's padding is vLLM's: read straight into the parameters, no note
            assert direct == (set(HEADS) if dtype == torch.float32 else set()) and report.notes == []
        else:  # plain pads 251 to 252, 126 rows per rank: not vLLM's rows, so read whole and narrowed
            assert direct == set() and len(report.notes) == 1
            assert "lm_head.weight, model.embed_tokens.weight: the plan's split is not vLLM's" in report.notes[0]
