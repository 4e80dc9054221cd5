"""Quantize a safetensors model once into the compressed-tensors layout, with an N-agnostic shard_info.

The output is what inference servers and transformers read as compressed-tensors: ``int4-g*`` and ``int8`` are
``pack-quantized`` (symmetric integers packed 8 or 4 per int32 along the input dim, one scale
per group of the input dim or per output channel, and ``weight_shape``), ``fp8`` is
``float-quantized`` (``float8_e4m3fn`` weights with one scale per output channel). The
``quantization_config`` goes into config.json, and the source shard_info is carried over to the
quantized tensors (:func:`shardload.models.stored_layouts.quantized_shard_info`), so the same files serve
any N the group sizes allow.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ShardloadError
from ..format import input_log
from ..format.input_log import records_inputs
from ..models.placement import Header
from ..models.stored_layouts import quantized_shard_info
from ..planning.plan import given_shard_info, shard_info_beside
from ..sources.checkpoint import INDEX_NAME, SHARD_INFO_NAME, local_output, open_checkpoint, read_config
from ..sources.dtypes import DTYPES, itemsize, to_torch
from ..sources.objects import ObjectPath
from ..sources.reader import Reader, buffer_view
from . import writer
from .output import (
    StagingDir,
    check_output,
    check_sources_unchanged,
    copy_companions,
    source_paths,
    stamp_sources,
    write_error,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Scheme:
    """A weight quantization scheme: integer bits with a group size (0 = per output channel), or FP8."""

    name: str
    kind: str  # "int" | "float"
    bits: int
    group_size: int = 0

    @property
    def format(self) -> str:
        return "pack-quantized" if self.kind == "int" else "float-quantized"


SCHEMES: dict[str, Scheme] = {
    "int4-g128": Scheme("int4-g128", "int", 4, 128),
    "int4-g64": Scheme("int4-g64", "int", 4, 64),
    "int4-g32": Scheme("int4-g32", "int", 4, 32),
    "int8": Scheme("int8", "int", 8),
    "fp8": Scheme("fp8", "float", 8),
}

AUTO_INT4 = "int4"
"""The default scheme: int4 with the largest group size in :data:`INT4_GROUPS` that keeps the model's quantized input
dims splittable into whole groups at N up to :data:`INT4_MAX_N` (:func:`choose_int4`)."""
INT4_GROUPS = (128, 64, 32)
INT4_MAX_N = 8

DEFAULT_IGNORE = ("lm_head", "embed", "norm", "wte", "wpe")
"""Modules left unquantized: a module name whose last part contains one of these."""
ROUTERS = ("gate", "router", "shared_expert_gate")
"""MoE routers (a module's whole last name), always left unquantized: vLLM and transformers keep them plain layers
that take no quantized weight (``gate_proj`` and ``gate_up_proj`` are quantized as any projection)."""

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
BLOCK_ELEMENTS = 1 << 22
"""Values of a weight quantized or checked at once (whole rows, at least one): each copy made on the way (float32,
int64) stays near 32 MiB, and each torch operation still has enough values to keep the host's cores busy (blocks
of 1 << 20 took three times the CPU time of the whole weight at once on two cores)."""
FILE_BYTES = 5 * 10**9
"""The most tensor bytes one output file holds (Hugging Face's default shard size); a larger output is split over
``model-0000K-of-0000M.safetensors`` files with a ``model.safetensors.index.json``, as transformers writes them."""
FP8_MAX = 448.0


@dataclass
class QuantizeResult:
    """What :func:`quantize` wrote: the directory, which weights were quantized or left alone, and valid N."""

    out_dir: Path
    scheme: Scheme
    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    shard_info: bool = False
    valid_for: list[int] = field(default_factory=list)


def choose_int4(input_dims: Mapping[str, int]) -> tuple[str, int]:
    """The int4 scheme for weights with these input dims (each a multiple of 32) and the largest power-of-two N up
    to :data:`INT4_MAX_N` at which every dim splits into whole groups: the most N first, then the largest group."""
    n = INT4_MAX_N
    while n >= 1:
        for group in INT4_GROUPS:
            if all(dim % (group * n) == 0 for dim in input_dims.values()):
                return f"int4-g{group}", n
        n //= 2
    return f"int4-g{INT4_GROUPS[-1]}", 1


def resolve_scheme(
    model: str | os.PathLike[str], scheme: str, ignore: tuple[str, ...] = DEFAULT_IGNORE
) -> tuple[str, int | None]:
    """``scheme`` as given, or for ``"int4"`` the group size :func:`choose_int4` picks from ``model``'s linear weights
    (its headers only), with the largest power-of-two N that group keeps (None for a scheme given in full, or where no
    weight fits any group size: :func:`quantize` refuses that model)."""
    if scheme != AUTO_INT4:
        return scheme, None
    smallest = SCHEMES[f"int4-g{INT4_GROUPS[-1]}"]
    tensors = open_checkpoint(model).tensors
    dims = {n: t.shape[1] for n, t in tensors.items() if _skip_reason(n, t.shape, t.dtype, smallest, ignore) is None}
    if not dims:  # no group size fits: quantize refuses the model, naming the smallest
        return smallest.name, None
    return choose_int4(dims)


def _something_to_quantize(model: Any, tensors: Mapping[str, Any], scheme: Scheme, ignore: tuple[str, ...]) -> None:
    """Refuse a model none of whose weights ``scheme`` would quantize (its output would be the source relabelled)."""
    reasons = {}
    for name, t in tensors.items():
        reason = _skip_reason(name, t.shape, t.dtype, scheme, ignore)
        if reason is None:
            return
        if len(t.shape) == 2 and name.endswith(".weight"):
            reasons[name.removesuffix(".weight")] = reason
    kept = ", ".join(f"{name} ({why})" for name, why in list(reasons.items())[:4])
    more = f" and {len(reasons) - 4} more" if len(reasons) > 4 else ""
    raise ShardloadError(
        f"nothing to quantize: no 2-d floating *.weight outside the modules left alone ({', '.join(ignore)}) fits "
        f"{scheme.name}" + (f"; kept {kept}{more}" if kept else ""),
        file=str(model),
    )


@records_inputs
def quantize(
    model: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    scheme: str = AUTO_INT4,
    *,
    shard_info: Any = None,
    overwrite: bool = False,
    ignore: tuple[str, ...] = DEFAULT_IGNORE,
    progress: Callable[[int, str], None] | None = None,
) -> QuantizeResult:
    """Write ``model``'s linear weights quantized with ``scheme`` to ``out_dir`` (compressed-tensors layout).
    ``"int4"`` (the default) is int4 with the group size :func:`resolve_scheme` picks from the model (128, 64 or
    32: the largest that keeps N up to 8); a scheme given in full (``"int4-g128"``) is used as given.

    Every 2-d floating ``*.weight`` whose module is not in ``ignore`` and whose input dim fits the
    scheme is quantized (one with a zero dim is refused); other tensors are copied. ``shard_info`` (default
    ``MODEL/shard_info.json``)
    is carried over to the quantized tensors. ``progress(source_bytes_done, name)`` is called after each stored
    tensor. Written like :func:`convert` writes: into a locked temporary
    directory beside ``out_dir``, then renamed; ``overwrite`` replaces only an empty directory or an earlier
    output of shardload, fsynced first; the source's companion files (config, tokenizer) are copied.

    Example::

        shardload.quantize("llama-dir", "llama-int4", "int4-g128")
        shards = shardload.load("llama-int4", num_shards=4)
    """
    if scheme not in SCHEMES and scheme != AUTO_INT4:
        raise ShardloadError(f"unknown scheme {scheme!r} (choose from {', '.join([AUTO_INT4, *SCHEMES])})")
    scheme, _ = resolve_scheme(model, scheme, ignore)
    spec = SCHEMES[scheme]
    out = local_output(out_dir, "out_dir")
    checkpoint = open_checkpoint(model)
    if isinstance(checkpoint.path, ObjectPath):
        raise ShardloadError(
            "quantize reads a local checkpoint; this one is in object storage: convert it (or copy it) to a local "
            "directory first",
            file=str(model),
        )
    if not checkpoint.plain_safetensors:
        raise ShardloadError(f"quantize reads a safetensors model, this is a {checkpoint.kind} one", file=str(model))
    for name, t in checkpoint.tensors.items():
        if 0 in t.shape and _skip_reason(name, t.shape, t.dtype, spec, ignore) is None:
            raise CheckpointError(
                f"a linear weight of shape {list(t.shape)} has no values to quantize (a zero dim); remove it",
                file=str(t.file),
                param=name,
            )
    stamps = stamp_sources(checkpoint.files)
    info = given_shard_info(shard_info) if shard_info is not None else shard_info_beside(checkpoint)
    sources = source_paths(checkpoint.root, checkpoint.files)
    if info is not None and Path(info.source).exists():
        sources.append(Path(info.source))
    check_output(out, sources, overwrite=overwrite)
    config = _read_config(checkpoint.root)
    _something_to_quantize(model, checkpoint.tensors, spec, ignore)
    result = QuantizeResult(out, spec)
    layout = _output_layout(checkpoint.tensors, spec, ignore)
    try:
        with StagingDir(out, None, synced=False, overwrite=overwrite) as staging, Reader() as files:
            tmp = staging.dir
            outputs = _quantized(checkpoint.tensors, files, spec, ignore, result, progress)
            _write_files(layout, outputs, tmp)
            # a head tied to the embeddings stores no tensor: listed all the same, or a reader takes it for quantized
            head = {"lm_head"} if not any(m.rsplit(".", 1)[-1] == "lm_head" for m in result.quantized) else set()
            qconfig = quantization_config(spec, sorted(set(result.skipped) | head))
            (tmp / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}, indent=2) + "\n")
            copy_companions(checkpoint.root, tmp, {"config.json", SHARD_INFO_NAME}, durable=False)
            if info is not None:
                shapes = {o.name: Header(o.shape, o.dtype) for o in layout}
                dense = {k: [s.to_json() for s in v] for k, v in info.params.items()}
                params = quantized_shard_info(dense, shapes, qconfig)
                doc = {"version": 1, "num_shards": info.num_shards, "params": params}
                (tmp / SHARD_INFO_NAME).write_text(json.dumps(doc, indent=2) + "\n")
                result.shard_info = True
            check_sources_unchanged(stamps)
            staging.publish()
    except OSError as err:
        raise write_error(err, out) from None
    if info is not None:  # checked where it was published: a temporary directory is never opened as a model
        from ..planning.validate import validate_file

        ns = [info.num_shards] if info.num_shards else list(range(1, 17))
        result.valid_for = validate_file(out / SHARD_INFO_NAME, out, ns)["valid_for"]
    return result


@dataclass(frozen=True)
class _Output:
    """One tensor of quantize's output, known before any is computed: its name, shape and dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def _output_layout(tensors: Mapping[str, Any], scheme: Scheme, ignore: tuple[str, ...]) -> list[_Output]:
    """Every output tensor in the order quantize computes them, shaped by :func:`quantize_weight` run on the meta
    device (so no value is read); a computed name a stored tensor already has is refused here, before writing."""
    import torch

    layout = []
    shaped: dict[tuple[tuple[int, ...], str], list[tuple[str, tuple[int, ...], str]]] = {}  # an MoE's many alike
    for name, t in tensors.items():
        if _skip_reason(name, t.shape, t.dtype, scheme, ignore) is not None:
            layout.append(_Output(name, tuple(t.shape), t.dtype))
            continue
        module = name.removesuffix(".weight")
        key = (tuple(t.shape), t.dtype)
        if key not in shaped:
            meta = torch.empty(key[0], dtype=to_torch(t.dtype), device="meta")
            got = quantize_weight(meta, scheme).items()
            shaped[key] = [(suffix, tuple(q.shape), str(q.dtype).removeprefix("torch.")) for suffix, q in got]
        for suffix, shape, dtype in shaped[key]:
            _check_free(f"{module}.{suffix}", name, tensors, str(t.file))
            layout.append(_Output(f"{module}.{suffix}", shape, dtype))
    return layout


def _quantized(
    tensors: Mapping[str, Any],
    files: Reader,
    scheme: Scheme,
    ignore: tuple[str, ...],
    result: QuantizeResult,
    progress: Callable[[int, str], None] | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each output tensor by name, in :func:`_output_layout`'s order, one source tensor read at a time."""

    done = 0
    for name, t in tensors.items():
        reason = _skip_reason(name, t.shape, t.dtype, scheme, ignore)
        if reason is None:
            module = name.removesuffix(".weight")
            w = files.tensor(t)
            if not _finite(w):  # one inf or NaN makes its group's scale, so the group, NaN
                input_log.check_unchanged([t.file], input_log.current())  # a file changed says so first
                raise CheckpointError(
                    "holds values that are not finite (inf or NaN): the scales quantizing them would spoil "
                    "whole rows; nothing was written (fix the weight, or leave its module out: ignore= in "
                    "Python)",
                    file=str(t.file), param=name,
                )  # fmt: skip
            for suffix, q in quantize_weight(w, scheme).items():
                yield f"{module}.{suffix}", q
            result.quantized.append(module)
        else:
            if len(t.shape) == 2 and name.endswith(".weight"):
                result.skipped[name.removesuffix(".weight")] = reason
            yield name, files.tensor(t)
        done += t.nbytes
        if progress is not None:
            progress(done, name)


def _file_groups(layout: list[_Output], limit: int) -> list[list[_Output]]:
    """``layout`` cut in order into files of at most ``limit`` tensor bytes (a larger tensor gets a file alone)."""
    groups: list[list[_Output]] = [[]]
    size = 0
    for o in layout:
        if groups[-1] and size + o.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(o)
        size += o.nbytes
    return groups


def _write_files(layout: list[_Output], outputs: Iterator[tuple[str, torch.Tensor]], directory: Path) -> None:
    """Stream ``outputs`` into safetensors files laid out by ``layout`` (headers first, then each tensor as it is
    computed, at its aligned place), with an index when there are several: memory holds one source tensor's
    outputs, not the model."""
    groups = _file_groups(layout, FILE_BYTES)
    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    for group, file_name in zip(groups, names, strict=True):
        path = directory / file_name
        placed = _placed(group)
        header = _header(group, placed)
        fh = writer.create_file(path)
        try:
            writer.write_all(fh, header, path)
            for o in group:  # computed in the source's order, each put at its place (the file has no hole at the end)
                name, tensor = next(outputs)
                got = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
                if name != o.name or got != (o.shape, o.dtype):  # an internal error: never a file that lies
                    raise RuntimeError(f"quantize computed {name} {got}, its file's header says {o.name}")
                fh.seek(len(header) + placed[o.name])
                writer.write_all(fh, buffer_view(tensor.contiguous()), path)
        finally:
            fh.close()
    if next(outputs, None) is not None:
        raise RuntimeError("quantize computed more tensors than its files' headers list")
    if len(groups) > 1:
        weight_map = {o.name: f for group, f in zip(groups, names, strict=True) for o in group}
        index = {"metadata": {"total_size": sum(o.nbytes for o in layout)}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _placed(group: list[_Output]) -> dict[str, int]:
    """Each tensor's offset in its file's data, the widest dtypes first (as safetensors' own writer lays them out):
    every tensor then starts at a multiple of its element size, so a reader can map it in place."""
    placed, offset = {}, 0
    for o in sorted(group, key=lambda o: -itemsize(o.dtype)):  # stable: the source's order within a width
        placed[o.name] = offset
        offset += o.nbytes
    return placed


def _header(group: list[_Output], placed: dict[str, int]) -> bytes:
    """The safetensors header (length prefix included, padded to 8 bytes) of a file holding ``group`` at ``placed``."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for o in sorted(group, key=lambda o: placed[o.name]):
        span = [placed[o.name], placed[o.name] + o.nbytes]
        header[o.name] = {"dtype": DTYPES[o.dtype][0], "shape": list(o.shape), "data_offsets": span}
    return writer.encode_header(header)


def quantize_weight(w: torch.Tensor, scheme: Scheme) -> dict[str, torch.Tensor]:
    """Quantize one ``[out, in]`` weight; returns its compressed-tensors tensors by suffix.

    Integers: symmetric, scale = max|w| / (2**bits - 1) * 2 per group (or row), values rounded to
    ``[-2**(bits-1), 2**(bits-1) - 1]`` and packed low bits first. FP8: scale = max|row| / 448.
    Rows are taken :data:`BLOCK_ELEMENTS` values at a time (every scale is a row's), so the float and integer
    copies made on the way stay that small whatever the weight's size.
    """
    import torch

    rows, cols = w.shape
    step = max(1, BLOCK_ELEMENTS // max(cols, 1))
    if rows <= step or w.is_meta:  # shapes alone (the meta device) cost nothing to make whole
        out = _quantize_rows(w, scheme)
    else:  # each block into its rows of outputs made first: no small result left between freed copies on the heap
        first = _quantize_rows(w[:step], scheme)
        out = {k: torch.empty((rows, *v.shape[1:]), dtype=v.dtype, device=v.device) for k, v in first.items()}
        for k, v in first.items():
            out[k][:step].copy_(v)
        del first
        for i in range(step, rows, step):
            for k, v in _quantize_rows(w[i : i + step], scheme).items():
                out[k][i : i + step].copy_(v)
    if scheme.kind == "int":
        out["weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
    return out


def _finite(w: torch.Tensor) -> bool:
    """Whether every value of a 2-d weight is finite, checked :data:`BLOCK_ELEMENTS` values at a time."""
    import torch

    step = max(1, BLOCK_ELEMENTS // max(w.shape[1], 1))
    return all(bool(torch.isfinite(w[i : i + step]).all()) for i in range(0, w.shape[0], step))


def _quantize_rows(w: torch.Tensor, scheme: Scheme) -> dict[str, torch.Tensor]:
    """:func:`quantize_weight` of a block of whole rows, without ``weight_shape``."""
    import torch

    rows, cols = w.shape
    x = w.to(torch.float32)
    if scheme.kind == "float":
        scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).to(w.dtype)
        safe = torch.where(scale == 0, torch.ones_like(scale), scale).to(torch.float32)
        q = (x / safe).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale}
    group = scheme.group_size or cols
    groups = x.reshape(rows, cols // group, group)
    half_range = (2**scheme.bits - 1) / 2
    scale = (groups.abs().amax(dim=2, keepdim=True) / half_range).to(w.dtype)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).to(torch.float32)
    low, high = -(2 ** (scheme.bits - 1)), 2 ** (scheme.bits - 1) - 1
    q = torch.round(groups / safe).clamp(low, high).reshape(rows, cols).to(torch.int64)
    packed = pack_int32(q, scheme.bits)
    return {"weight_packed": packed, "weight_scale": scale.reshape(rows, cols // group).contiguous()}


def pack_int32(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed ``bits``-bit integers ``[rows, cols]`` into int32 words along cols, value j at bit ``j*bits``.

    Values are offset by ``2**(bits-1)`` to be unsigned first (compressed-tensors' convention).
    """
    import torch

    per_word = 32 // bits
    rows, cols = q.shape
    u = (q + 2 ** (bits - 1)).reshape(rows, cols // per_word, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64, device=q.device) * bits
    words = (u << shifts).sum(dim=2)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def quantization_config(scheme: Scheme, ignore: list[str]) -> dict[str, Any]:
    """The compressed-tensors ``quantization_config`` for config.json describing ``scheme``."""
    weights: dict[str, Any] = {
        "num_bits": scheme.bits,
        "type": scheme.kind,
        "symmetric": True,
        "dynamic": False,
        "strategy": "group" if scheme.group_size else "channel",
        "group_size": scheme.group_size or None,
        "observer": "minmax",
        "actorder": None,
    }
    inputs = None
    if scheme.kind == "float":  # FP8 weights with dynamic per-token FP8 activations (FP8_DYNAMIC)
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs, "output_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": scheme.format,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {**group, "format": scheme.format}},
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def _skip_reason(name: str, shape: tuple[int, ...], dtype: str, scheme: Scheme, ignore: tuple[str, ...]) -> str | None:
    """Why a tensor is not quantized, or None when it is."""
    if not name.endswith(".weight") or len(shape) != 2 or dtype not in FLOAT_DTYPES:
        return "not a 2-d floating weight"
    last = name.removesuffix(".weight").rsplit(".", 1)[-1]
    if any(word in last for word in ignore):
        return "ignored module"
    if last in ROUTERS:
        return "a MoE router (servers keep it unquantized)"
    cols = shape[1]
    need = scheme.group_size or (32 // scheme.bits if scheme.kind == "int" else 1)
    if cols % need:
        return f"input dim {cols} is not a multiple of {need}"
    return None


def _read_config(root: Path) -> dict[str, Any]:
    """The source's config.json (``{}`` when it has none); a quantized source is refused."""
    config = read_config(root, missing_ok=True)
    if "quantization_config" in config:
        raise ShardloadError(
            "model is already quantized (config.json has a quantization_config)", file=str(root / "config.json")
        )
    return config


def _check_free(name: str, origin: str, stored: dict[str, Any], file: str) -> None:
    """Refuse a computed tensor whose name a stored tensor already has (a stray ``*.weight_scale``): one would
    silently replace the other."""
    if name != origin and name in stored:
        raise CheckpointError(
            f"stored tensor {name!r} has the name quantize gives to a tensor it computes from {origin!r}; "
            "remove or rename the stored one",
            file=file,
        )
