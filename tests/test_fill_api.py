"""``load_rank(..., params=, out=)``: the public way to fill caller-owned tensors (what server integrations use).

Filled tensors equal a plain ``load_rank``'s, are the caller's own objects, and cost the same bytes read; a
destination of the wrong shape, dtype or layout, or a name the rank does not read, is one located line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardload
from shardload.errors import ShardloadError

N, RANK = 4, 1
QKV = "model.layers.0.self_attn.qkv_proj.weight"
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def plain(example_dir: Path) -> dict[str, torch.Tensor]:
    return shardload.load_rank(example_dir, RANK, N)


def test_out_mapping_is_filled_in_place_with_the_same_bytes_read(
    example_dir: Path, plain: dict[str, torch.Tensor]
) -> None:
    out = {name: torch.full_like(t, float("nan")) for name, t in plain.items() if name in (QKV, NORM)}
    with shardload.count_reads() as seen_plain:
        shardload.load_rank(example_dir, RANK, N)
    with shardload.count_reads() as seen:
        state = shardload.load_rank(example_dir, RANK, N, out=out)
    assert seen.bytes == seen_plain.bytes
    assert list(state) == list(plain)
    assert all(state[name] is t for name, t in out.items())
    assert all(state[name].equal(t) for name, t in plain.items())


def test_out_callable_gets_shape_and_dtype_and_none_means_a_fresh_tensor(
    example_dir: Path, plain: dict[str, torch.Tensor]
) -> None:
    asked: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    mine: dict[str, torch.Tensor] = {}

    def out(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        asked[name] = (shape, dtype)
        if name.endswith("proj.weight"):
            mine[name] = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))  # requires grad: filled all the same
            return mine[name]
        return None

    state = shardload.load_rank(example_dir, RANK, N, out=out)
    assert asked == {name: (tuple(t.shape), t.dtype) for name, t in plain.items()}
    assert mine and all(state[name] is t for name, t in mine.items())
    assert all(state[name].equal(t) for name, t in plain.items())


def test_params_reads_only_the_named_tensors(example_dir: Path, plain: dict[str, torch.Tensor]) -> None:
    with shardload.count_reads() as seen:
        state = shardload.load_rank(example_dir, RANK, N, params=[QKV, NORM])
    assert sorted(state) == sorted([QKV, NORM])
    assert seen.bytes == sum(t.numel() * t.element_size() for t in state.values())
    assert state[QKV].equal(plain[QKV]) and state[NORM].equal(plain[NORM])


def test_converted_directory_fills_out_and_selects_params(example_dir: Path, tmp_path: Path) -> None:
    shardload.convert(example_dir, N, tmp_path / "tp4")
    plain = shardload.load_rank(tmp_path / "tp4", RANK, N)
    out = {QKV: torch.empty_like(plain[QKV])}
    state = shardload.load_rank(tmp_path / "tp4", RANK, N, out=out, params=[QKV, NORM])
    assert sorted(state) == sorted([QKV, NORM]) and state[QKV] is out[QKV]
    assert state[QKV].equal(plain[QKV]) and state[NORM].equal(plain[NORM])
    with pytest.raises(ShardloadError, match="reads boxes of several rank files; into= does not apply there"):
        shardload.load_rank(tmp_path / "tp4", 0, 2, out=out)


def _bad(plain: dict[str, torch.Tensor]) -> list[tuple[dict[str, object], str]]:
    qkv = plain[QKV]
    return [
        ({"out": {QKV: torch.empty(qkv.shape[0] * 2, qkv.shape[1], dtype=qkv.dtype)}},
         rf"{QKV}: into's tensor is \[256, 256\] torch.float16, this rank's tensor is \[128, 256\] torch.float16"),
        ({"out": {QKV: torch.empty(qkv.shape, dtype=torch.float32)}}, "into's tensor is .* torch.float32, this rank's"),
        ({"out": {QKV: torch.empty(qkv.shape[1], qkv.shape[0], dtype=qkv.dtype).t()}},
         "into's tensor is not contiguous"),
        ({"out": {QKV: torch.empty(qkv.shape, dtype=qkv.dtype, device="meta")}}, "into's tensor is on the meta device"),
        ({"out": {"no.such.weight": qkv}}, "no.such.weight: into names a tensor this rank does not read"),
        ({"out": {NORM: plain[NORM]}, "params": [QKV]}, f"{NORM}: into names a tensor this rank does not read"),
        ({"out": {QKV: qkv.numpy()}}, "into gives an object of type ndarray, not a tensor"),
        ({"out": [qkv]}, "into must be a Destination, a mapping of names to tensors or a callable"),
        ({"params": QKV}, "Destination.only must be a collection of tensor names"),
        ({"params": [QKV, "x.weight", "y.weight"]}, r"x.weight: Destination.only names a tensor .* \(and 1 more\)"),
        ({"out": {QKV: qkv}, "mmap": True}, "into= applies to a rank reading its own tensors; ReadOptions"),
        ({"out": _aliased(plain)}, "into's tensor shares memory with "),
        ({"out": {QKV: torch.zeros(qkv.shape, dtype=qkv.dtype)._neg_view()}},  # passed, then a bare RuntimeError
         "into's tensor is a negated or conjugated view"),
        ({"out": {QKV: torch.zeros(qkv.shape, dtype=qkv.dtype).to_sparse()}}, "into's tensor is not dense"),
    ]  # fmt: skip


def _aliased(plain: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Two destinations that are views of one buffer, overlapping by one element (seen filled silently, the two
    reads overwriting each other, before the check)."""
    qkv, norm = plain[QKV], plain[NORM]
    buf = torch.empty(qkv.numel() + norm.numel() - 1, dtype=qkv.dtype)
    assert norm.dtype == qkv.dtype
    return {QKV: buf[: qkv.numel()].view(qkv.shape), NORM: buf[qkv.numel() - 1 :].view(norm.shape)}


@pytest.mark.parametrize("case", range(14))
def test_bad_destinations_are_one_located_line(example_dir: Path, plain: dict[str, torch.Tensor], case: int) -> None:
    kwargs, says = _bad(plain)[case]
    with pytest.raises(ShardloadError, match=says) as err:
        shardload.load_rank(example_dir, RANK, N, **kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(err.value) and str(example_dir) in str(err.value)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=GPU)])
@pytest.mark.parametrize("model", ["source", "converted"])
def test_out_views_of_one_buffer(example_dir: Path, tmp_path: Path, model: str, device: str) -> None:
    """Destinations that are views into one flat buffer (as a server's parameters can be), on the CPU or a GPU
    (filled through the staging buffers): the CPU load's bytes, and nothing outside the views written."""
    path = example_dir if model == "source" else shardload.convert(example_dir, N, tmp_path / "tp4").out_dir
    plain = shardload.load_rank(path, RANK, N)
    total = sum(t.numel() * t.element_size() + 32 for t in plain.values())
    buffer = torch.full((total,), -1, dtype=torch.int8, device=device)
    covered = torch.zeros(total, dtype=torch.bool)
    out, at = {}, 0
    for name, t in plain.items():
        nbytes = t.numel() * t.element_size()
        out[name] = buffer[at : at + nbytes].view(t.dtype).view(t.shape)
        covered[at : at + nbytes] = True
        at = (at + nbytes + 16 + 15) // 16 * 16  # at least 16 guard bytes after each, the next view aligned
    state = shardload.load_rank(path, RANK, N, out=out)
    assert all(state[name] is out[name] and state[name].cpu().equal(t) for name, t in plain.items())
    assert bool((buffer.cpu()[~covered] == -1).all())


@pytest.mark.parametrize("device_path", [False, True])
def test_destinations_hold_no_byte_of_a_load_that_failed(
    example_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device_path: bool
) -> None:
    """A verified load that fails (a byte flipped in the file) left the byte it had read in the caller's tensor, next
    to the rest: a server that catches the error would serve it. Every destination is now zero-filled before the
    error is raised."""
    import shutil

    from helpers.reading import stand_in
    from shardload.engine import run

    if device_path:  # the device data path, the CPU standing in for the device
        monkeypatch.setattr(run, "data_path_for", stand_in)
    model = shutil.copytree(example_dir, tmp_path / "model")
    shardload.hash_checkpoint(model)
    plain = shardload.load_rank(model, RANK, N)
    info = shardload.open_checkpoint(model).tensors[NORM]
    with open(info.file, "r+b") as f:
        f.seek(info.offset + 1)
        byte = f.read(1)[0]
        f.seek(info.offset + 1)
        f.write(bytes([byte ^ 0x40]))
    out = {name: torch.full_like(t, 3.0) for name, t in plain.items()}
    with pytest.raises(ShardloadError, match=NORM):
        shardload.load_rank(model, RANK, N, into=out, verify=True, read_options=shardload.ReadOptions(threads=0))
    assert all(not t.any() for t in out.values()), [n for n, t in out.items() if t.any()]
