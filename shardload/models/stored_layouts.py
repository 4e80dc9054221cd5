"""Stored layouts: the shard_info steps for every stored tensor of a placed weight, quantized or not.

A plan decides how each (logical) weight ``W[..., out, in]`` is split across ranks: a
:class:`~shardload.models.placement.Placement` (column, row, vocab, expert or replicated, fused segments
in units, KV flags). A quantized checkpoint stores ``W`` as several tensors whose dims relate to
``W``'s dims by a pack factor (int4 in int32) or a group/block size (scales, zero points, GGUF
blocks), plus a shape vector or a group index whose values change per rank.
:func:`companion_steps` turns the one placement into steps for each of them (for a dense tensor:
for itself); :func:`logical_tensors` shows a plan generator each quantized module as its logical
weight; :func:`quantized_shard_info` carries a dense model's shard_info over to its quantized
checkpoint. Pure: only names, shapes, dtypes and the ``quantization_config`` are read.

Formats (:func:`detect_format`), with the tensors each stores next to the module prefix ``P``:

- ``compressed-tensors``: ``P.weight_packed`` int32 ``[out, in/8]`` (int4; int8 packs 4; NVFP4 uint8 packs 2),
  ``P.weight_scale`` ``[out, in/group]`` or ``[out, 1]``, ``P.weight_zero_point`` packed along
  ``out``, ``P.weight_shape`` (rewritten per rank), ``P.weight_g_idx``;
- ``mlc``: ``P.q_weight`` uint32 ``[out, in/8]``, ``P.q_scale`` ``[out, in/group]``;
- ``gptq``: ``P.qweight`` int32 ``[in/8, out]``, ``P.qzeros`` ``[groups, out/8]``,
  ``P.scales`` ``[groups, out]``, ``P.g_idx`` ``[in]``; ``awq``: ``P.qweight`` ``[in, out/8]``,
  ``P.qzeros``, ``P.scales`` as GPTQ;
- ``scaled``: a full-size ``P.weight`` (FP8 ``float8_e4m3fn``, int8) with ``P.weight_scale`` or
  ``P.weight_scale_inv`` per tensor, per channel or per 128x128 block (ceil division);
- ``gguf``: ``P.weight`` uint8 ``[rows, blocks, bytes per block]`` (see :mod:`shardload.sources.gguf`);
- ``dense``: a plain ``P.weight``.

Scalars (per-tensor scales, ``input_scale``) are replicated. With act-order (GPTQ ``desc_act``,
compressed-tensors ``actorder``) a row split replicates scales and zero points and gives each
rank its slice of ``g_idx``; without it scales are split and ``g_idx`` made local.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from math import prod
from pathlib import Path
from typing import Any

from ..errors import PlanError, StepArgumentError
from ..sources.dtypes import DTYPES, itemsize
from .placement import Header, Placement, TensorHeader, placement_from_steps

__all__ = [
    "FORMATS",
    "companion_steps",
    "detect_format",
    "logical_tensors",
    "module_tensors",
    "quantized_shard_info",
    "read_quantization_config",
]

FORMATS = ("dense", "scaled", "compressed-tensors", "mlc", "gptq", "awq", "gguf")

Tensors = Mapping[str, TensorHeader]
"""Stored tensor name -> header (``.shape``, ``.dtype``), e.g. ``open_checkpoint(model).tensors``."""

Step = list[Any]
"""One shard_info step in document form: ``[function, [shape or None, dtype], *args]``."""

_SCALE_NAMES = ("weight_scale", "weight_scale_inv", "weight_zero_point")
_KNOWN = (
    "weight", "weight_packed", "weight_scale", "weight_scale_inv", "weight_zero_point", "weight_shape",
    "weight_g_idx", "weight_global_scale", "input_scale", "input_global_scale", "input_zero_point",
    "output_scale", "qweight", "qzeros", "scales", "g_idx", "q_weight", "q_scale",
)  # fmt: skip
MODULE_SUFFIXES = _KNOWN
"""The stored tensors a module's weight may be made of (a dense weight; a quantized one's parts, scales and
indices): a tensor under a split module named otherwise is in a layout no rule knows."""


def refuse_unknown_parts(
    tensors: Tensors, splitter: Callable[[str], str | None], path: Callable[[str], str] = str
) -> None:
    """Raise for a matrix of ``tensors`` under a module that is split, none of the tensors a module's weight is made
    of (marlin's ``P.B``, a 2:4 layout's ``P.weight.compressed``): copied whole to every rank, or cut as if it were
    the weight, it would be no part of a tensor-parallel split. ``splitter(module)`` says who splits the module
    (``"the preset"``), ``""`` for a module named but kept whole, None for one not named; the innermost named module
    of ``path(name)`` decides."""
    for name, info in tensors.items():
        parts = path(name).split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:cut])
            who = splitter(module)
            if who is None:
                continue
            if who:
                _refuse_unknown_part(name, len(info.shape), module, ".".join(parts[cut:]), who)
            break


def _refuse_unknown_part(name: str, ndim: int, module: str, rest: str, splitter: str) -> None:
    """Raise for ``name`` (``module`` + ``rest``) unless it is a vector or one of a module weight's tensors."""
    if ndim < 2 or rest in ("weight", "bias") or rest in MODULE_SUFFIXES:
        return
    raise PlanError(
        f"a {ndim}-d tensor of {module}, which {splitter} splits, in a layout no rule knows ({rest!r} is not a "
        "weight, a bias or a known quantized part): every rank would get all of it or a cut of it that is no split "
        "of the module; write a shard_info.json for this checkpoint, or convert it to a layout shardload knows "
        "(docs/quantized.md)",
        param=name,
    )


_ACT_ORDER_VALUES = (True, "group", "dynamic", "static")


@dataclass(frozen=True)
class _Axis:
    """How one stored dim relates to the logical weight: which logical dim, and how many elements per stored one."""

    logical: int | None  # None: a broadcast (size 1) or byte dim, never split
    kind: str = "plain"  # "plain" | "packed" | "group"
    factor: int = 1
    size: int = 0  # logical length covered (for groups with a partial last one)


@dataclass
class _Weight:
    """One weight's format, logical shape, and the layout of each stored tensor."""

    format: str
    logical: tuple[int, ...]
    layouts: dict[str, tuple[_Axis, ...] | str] = field(default_factory=dict)  # or "scalar" | "shape" | "g_idx"
    act_order: bool = False
    num_groups: int = 0


def module_tensors(weight: str, tensors: Tensors) -> dict[str, tuple[tuple[int, ...], str]]:
    """The stored tensors of ``weight`` (a module prefix or its ``.weight`` name): suffix -> (shape, dtype)."""
    prefix = weight.removesuffix(".weight")
    found = {}
    for suffix in _KNOWN:
        entry = tensors.get(f"{prefix}.{suffix}")
        if entry is not None:
            found[suffix] = (tuple(int(d) for d in entry.shape), str(entry.dtype))
    return found


def detect_format(weight: str, tensors: Tensors, quantization_config: Mapping[str, Any] | None = None) -> str:
    """Which of :data:`FORMATS` stores ``weight``, from tensor names and shapes and the quantization_config."""
    stored = module_tensors(weight, tensors)
    method = str((quantization_config or {}).get("quant_method", "")).lower()
    if "weight_packed" in stored:
        return "compressed-tensors"
    if "qweight" in stored:
        if method in ("gptq", "awq"):
            return method
        scales = stored.get("scales")
        return "gptq" if scales is None or stored["qweight"][0][-1] == scales[0][-1] else "awq"
    if "q_weight" in stored:
        return "mlc"
    if "weight" in stored:
        shape, dtype = stored["weight"]
        if method == "gguf" and dtype == "uint8" and len(shape) >= 3:
            return "gguf"
        if any(s in stored for s in _SCALE_NAMES):
            return "scaled"
        return "dense"
    prefix = weight.removesuffix(".weight")
    raise PlanError(
        f"no stored tensor of this weight (looked for {prefix}.weight, .weight_packed, .qweight, ...)", param=prefix
    )


def logical_tensors(tensors: Tensors, quantization_config: Mapping[str, Any] | None = None) -> dict[str, TensorHeader]:
    """The tensors a plan decides on: stored ones as they are, each quantized module as its logical ``P.weight``.

    A quantized module's stored tensors (``weight_packed``, ``qweight``, scales, ...) become one
    entry with the logical shape ``[..., out, in]`` and the dtype of its main stored tensor.
    Raises PlanError (naming the tensor) for a quantized layout it cannot read.
    """
    out: dict[str, TensorHeader] = {}
    formats: dict[str, str] = {}
    for name, info in tensors.items():
        module, _, suffix = name.rpartition(".")
        mlc_part = suffix != "q_scale" or f"{module}.q_weight" in tensors  # else an attention module's own q_scale
        if module and suffix in _KNOWN and mlc_part:
            if module not in formats:
                formats[module] = detect_format(module, tensors, quantization_config)
            if formats[module] != "dense":
                weight = f"{module}.weight"
                if weight not in out:
                    logical = _analyze(module, tensors, quantization_config)
                    main = module_tensors(module, tensors)[_MAIN[logical.format]]
                    out[weight] = Header(tuple(logical.logical), main[1])
                continue
        out[name] = info
    return out


def companion_steps(
    placement: Placement, tensors: Tensors, quantization_config: Mapping[str, Any] | None = None
) -> dict[str, list[Step]]:
    """Steps for every stored tensor ``placement`` covers, so each rank holds (the quantized form of) its part.

    ``placement.name`` is a stored dense tensor, or the logical ``P.weight`` of a module stored in
    a quantized layout (then every stored tensor of ``P`` gets steps); ``tensors`` holds every
    stored tensor's header; ``quantization_config`` is config.json's (None: format, bits and group
    size come from names and shapes). Returns stored name -> N-agnostic steps (``[]`` = replicated).
    Raises PlanError (naming the tensor) where the layout cannot follow the split for any N.

    Example::

        qkv = Placement("model.layers.0.self_attn.qkv_proj.weight", "column", 0, (32, 8, 8), 128, (False, True, True))
        steps = companion_steps(qkv, open_checkpoint("llama-w4a16").tensors, qconfig)
    """
    name = placement.name
    if name in tensors and not name.endswith(".weight"):  # a stored tensor of no quantized module (bias, experts)
        info = tensors[name]
        shape = tuple(int(d) for d in info.shape)
        weight = _Weight("dense", shape, {name: tuple(_Axis(i) for i in range(len(shape)))})
        stored = {name: (shape, str(info.dtype))}
        prefix = ""
    else:
        prefix = name.removesuffix(".weight")
        weight = _analyze(prefix, tensors, quantization_config)
        stored = {f"{prefix}.{k}": v for k, v in module_tensors(prefix, tensors).items()}
        weight.layouts = {f"{prefix}.{k}": v for k, v in weight.layouts.items()}
    try:
        split_dim = _split_dim(placement, len(weight.logical))
    except StepArgumentError as err:
        raise PlanError(str(err), param=name) from None
    if placement.pad_to is not None and not _paddable(weight, split_dim):
        placement = replace(placement, pad_to=None)  # packed or grouped along the split: N must divide it
    out: dict[str, list[Step]] = {}
    for tensor, layout in weight.layouts.items():
        shape, dtype = stored[tensor]
        try:
            out[tensor] = _steps(weight, layout, shape, dtype, placement, split_dim)
        except StepArgumentError as err:
            raise PlanError(str(err), param=tensor) from None
    return out


def quantized_shard_info(
    dense_params: Mapping[str, Sequence[Any]],
    tensors: Tensors,
    quantization_config: Mapping[str, Any] | None = None,
) -> dict[str, list[Step]]:
    """Carry a dense model's shard_info ``params`` over to a quantized checkpoint's tensors.

    A parameter stored as is keeps its steps; a ``*.weight`` stored in a quantized layout is
    replaced by :func:`companion_steps` for all of its tensors. Returns the new ``params``.
    """
    out: dict[str, list[Step]] = {}
    for name, steps in dense_params.items():
        prefix = name.removesuffix(".weight")
        fmt = detect_format(prefix, tensors, quantization_config) if name.endswith(".weight") else "dense"
        if fmt == "dense":
            if name not in tensors:
                raise PlanError("names no tensor of the quantized checkpoint", param=name)
            out[name] = [list(s) if isinstance(s, list) else s.to_json() for s in steps]
            continue
        placement = placement_from_steps(name, steps)
        for tensor, tsteps in companion_steps(placement, tensors, quantization_config).items():
            if tsteps:
                out[tensor] = tsteps
    return out


def read_quantization_config(model: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The quantization_config of a model: config.json's, or for a GGUF file its per-tensor block types."""
    from ..sources.checkpoint import read_config

    path = Path(model)
    if path.suffix == ".gguf" or (path.is_dir() and any(path.glob("*.gguf")) and not any(path.glob("*.safetensors"))):
        from ..sources.gguf import quantization_config

        return quantization_config(path)
    qc = read_config(path if path.is_dir() else path.parent, missing_ok=True).get("quantization_config")
    return qc if isinstance(qc, dict) else None


def _paddable(weight: _Weight, split_dim: int | None) -> bool:
    """Whether every stored tensor of ``weight`` holds the split dim element for element (or not at all), so zero
    padding along it pads each of them alike; packed, grouped, shape-vector and g_idx layouts along it do not."""
    for layout in weight.layouts.values():
        if layout == "scalar":
            continue
        if isinstance(layout, str):
            if layout == "shape" or split_dim == len(weight.logical) - 1:
                return False
            continue
        if any(axis.logical == split_dim and axis.kind != "plain" for axis in layout):
            return False
    return True


def _split_dim(placement: Placement, ndim: int) -> int | None:
    """The placement's split dim of an ``ndim``-d (logical) tensor, normalised; None when replicated."""
    if placement.dim is None:
        return None
    if not -ndim <= placement.dim < ndim:
        raise StepArgumentError(f"{placement.style} split dim {placement.dim} is out of range for a {ndim}-d weight")
    return placement.dim % ndim


# --- analysis -------------------------------------------------------------------------------


def _analyze(prefix: str, tensors: Tensors, qc: Mapping[str, Any] | None) -> _Weight:
    fmt = detect_format(prefix, tensors, qc)
    stored = module_tensors(prefix, tensors)
    try:
        info = _LAYOUTS[fmt](prefix, stored, qc or {})
    except _LayoutError as err:
        raise PlanError(f"{fmt} layout: {err}", param=f"{prefix}.{err.suffix}") from None
    except StepArgumentError as err:
        raise PlanError(f"{fmt} layout: {err}", param=prefix) from None
    for suffix, (shape, _) in stored.items():
        if suffix not in info.layouts:
            if prod(shape) != 1:
                raise PlanError(f"{fmt} weight has a tensor this planner does not know: {suffix} {list(shape)}",
                                param=f"{prefix}.{suffix}")  # fmt: skip
            info.layouts[suffix] = "scalar"
    return info


class _LayoutError(StepArgumentError):
    """A stored tensor whose shape does not fit its format's layout; ``suffix`` names it."""

    def __init__(self, suffix: str, reason: str) -> None:
        super().__init__(reason)
        self.suffix = suffix


def _batch(shape: Sequence[int], core: int) -> list[_Axis]:
    """Leading dims (experts) of a stored tensor whose last ``core`` dims are the weight's own."""
    return [_Axis(i) for i in range(len(shape) - core)]


def _pack_factor(bits: Any, where: str, width: int = 32) -> int:
    """Values of ``bits`` bits per stored element of ``width`` bits (int4 in int32: 8; NVFP4 in uint8: 2)."""
    if type(bits) is not int or bits < 1 or width % bits:
        raise StepArgumentError(f"{where}: {bits!r}-bit values do not pack evenly into {width}-bit elements")
    return width // bits


def _fit(
    name: str, shape: Sequence[int], dims: Sequence[int | None], logical: Sequence[int], hints: Mapping[int, int]
) -> tuple[_Axis, ...]:
    """Classify each dim of a scale-like tensor: full size (plain), size 1 (broadcast) or grouped (a group size no
    hint gives: the one that fills every group exactly)."""
    if len(shape) != len(dims):
        raise _LayoutError(name, f"shape {list(shape)} has not the expected {len(dims)} dims")
    axes = []
    for c, d in zip(shape, dims, strict=True):
        if d is None:
            axes.append(_Axis(None))
            continue
        size = logical[d]
        if c == size:
            axes.append(_Axis(d))
        elif c == 1:
            axes.append(_Axis(None))
        else:
            group = hints.get(d) or (size // c if size % c == 0 else 0)
            if not group or -(-size // group) != c:
                reason = (
                    f"{c} entries along a dim of {size} do not fit the configured group size {hints[d]}"
                    if d in hints
                    else f"{c} entries along a dim of {size}: cannot tell the group size (give the quantization_config)"
                )
                raise _LayoutError(name, reason)
            axes.append(_Axis(d, "group", group, size))
    return tuple(axes)


def _ct_args(prefix: str, qc: Mapping[str, Any]) -> dict[str, Any]:
    """compressed-tensors: the weight args of the config group whose targets match this module."""
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        return {}
    candidates = [g for g in groups.values() if isinstance(g, dict)]
    # as vLLM and compressed-tensors pick: a layer's own name first, then a regex, then a class such as "Linear"
    for kind in ("name", "re", "class"):
        for group in candidates:
            if any(_target_kind(t) == kind and _target_matches(prefix, t) for t in group.get("targets") or []):
                weights = group.get("weights")
                return weights if isinstance(weights, dict) else {}
    if len(candidates) == 1 and isinstance(candidates[0].get("weights"), dict):
        return candidates[0]["weights"]
    return {}


MAX_PATTERN = 4096
"""Cap on a ``re:`` target's length (real ones are a few dozen characters)."""


@functools.lru_cache(maxsize=256)
def _target_pattern(text: str) -> Any:
    """A ``re:`` target compiled by RE2 (linear time in the name, whatever the pattern: a config file cannot make
    matching hang), or None when RE2 refuses it (backreferences, lookaround) or it is over :data:`MAX_PATTERN`."""
    import re2  # google-re2

    if len(text) > MAX_PATTERN:
        return None
    options = re2.Options()
    options.log_errors = False
    try:
        return re2.compile(text, options)
    except re2.error:
        return None


def _target_kind(target: Any) -> str:
    """A config group target's kind: a regex (``re:``), a module class name (``Linear``) or a layer name."""
    if isinstance(target, str) and target.startswith("re:"):
        return "re"
    if isinstance(target, str) and "." not in target and target[:1].isupper():
        return "class"
    return "name"


def _target_matches(module: str, target: Any) -> bool:
    if not isinstance(target, str):
        return False
    kind = _target_kind(target)
    if kind == "re":
        pattern = _target_pattern(target[3:])
        return pattern is not None and pattern.match(module) is not None
    if kind == "class":  # a module class name such as "Linear"
        return True
    return module == target or module.endswith("." + target)


def _block_hints(block: Any, k: int) -> dict[int, int]:
    if isinstance(block, str) and "x" in block:  # older compressed-tensors spelling "128x128"
        block = block.split("x")
    try:
        b0, b1 = (int(b) for b in block)
    except (TypeError, ValueError):
        return {}
    return {k - 2: b0, k - 1: b1}


def _compressed_tensors(prefix: str, stored: dict[str, Any], qc: Mapping[str, Any]) -> _Weight:
    args = _ct_args(prefix, qc)
    shape, dtype = stored["weight_packed"]
    name = str(dtype).removeprefix("torch.")
    width = 8 * itemsize(name) if "int" in name and name in DTYPES else 32  # int32 words; NVFP4's uint8 bytes
    pf = _pack_factor(args.get("num_bits", 4), "num_bits", width)
    if len(shape) < 2:
        raise _LayoutError("weight_packed", f"shape {list(shape)} is not [..., out, in/{pf}]")
    k = len(shape)
    out_dim, in_dim = k - 2, k - 1
    logical = (*shape[:-1], shape[-1] * pf)
    hints = {in_dim: args["group_size"]} if isinstance(args.get("group_size"), int) and args["group_size"] > 0 else {}
    hints.update(_block_hints(args.get("block_structure"), k))
    info = _Weight("compressed-tensors", logical)
    info.layouts["weight_packed"] = (*_batch(shape, 2), _Axis(out_dim), _Axis(in_dim, "packed", pf))
    if "weight_scale" in stored:
        s = stored["weight_scale"][0]
        info.layouts["weight_scale"] = "scalar" if prod(s) == 1 else _fit(
            "weight_scale", s, [*range(len(s) - 2), out_dim, in_dim], logical, hints
        )  # fmt: skip
        info.num_groups = s[-1] if len(s) >= 2 else 1
    if "weight_zero_point" in stored:
        z = stored["weight_zero_point"][0]
        if prod(z) == 1:
            info.layouts["weight_zero_point"] = "scalar"
        else:
            zdims = [*range(len(z) - 2), None, in_dim]
            cols = _fit("weight_zero_point", z, zdims, logical, hints)
            out = logical[out_dim]
            if z[-2] == out:
                rows = _Axis(out_dim)
            elif z[-2] == -(-out // pf):
                rows = _Axis(out_dim, "packed", pf, out)
            else:
                raise _LayoutError("weight_zero_point", f"{z[-2]} rows for {out} outputs")
            info.layouts["weight_zero_point"] = (*cols[:-2], rows, cols[-1])
    if "weight_shape" in stored:
        info.layouts["weight_shape"] = "shape"
    if "weight_g_idx" in stored:
        info.layouts["weight_g_idx"] = "g_idx"
        info.act_order = args.get("actorder", True) in _ACT_ORDER_VALUES
    return info


def _mlc(prefix: str, stored: dict[str, Any], qc: Mapping[str, Any]) -> _Weight:
    pf = _pack_factor(qc.get("bits", 4), "bits")
    shape = stored["q_weight"][0]
    k = len(shape)
    logical = (*shape[:-1], shape[-1] * pf)
    info = _Weight("mlc", logical)
    info.layouts["q_weight"] = (*_batch(shape, 2), _Axis(k - 2), _Axis(k - 1, "packed", pf))
    if "q_scale" in stored:
        s = stored["q_scale"][0]
        hints = {k - 1: qc["group_size"]} if isinstance(qc.get("group_size"), int) else {}
        info.layouts["q_scale"] = _fit("q_scale", s, [*range(len(s) - 2), k - 2, k - 1], logical, hints)
    return info


def _dynamic(prefix: str, qc: Mapping[str, Any]) -> Mapping[str, Any]:
    """GPTQModel's per-module ``dynamic`` settings over the global ones: the first pattern (``+:``, bare, or ``-:``
    for a module left unquantized) that matches the module's name from its start wins, as vLLM reads them."""
    dynamic = qc.get("dynamic")
    if not isinstance(dynamic, dict):
        return qc
    for key, override in dynamic.items():
        if not isinstance(key, str):
            continue
        pattern = _target_pattern(key[2:] if key[:2] in ("+:", "-:") else key)
        if pattern is None or pattern.match(prefix) is None:
            continue
        if key.startswith("-:") or not isinstance(override, dict):
            return qc
        return {**qc, **{k: v for k, v in override.items() if k in ("bits", "group_size", "desc_act", "sym")}}
    return qc


def _gptq_awq(prefix: str, stored: dict[str, Any], qc: Mapping[str, Any], awq: bool) -> _Weight:
    qc = _dynamic(prefix, qc)
    qweight = stored["qweight"][0]
    scales = stored.get("scales", (None,))[0]
    qzeros = stored.get("qzeros", (None,))[0]
    if "bits" in qc:
        pf = _pack_factor(qc["bits"], "bits")
    elif scales is not None and (awq or qzeros is not None):
        packed = qweight[-1] if awq else qzeros[-1]
        if scales[-1] % packed:
            raise _LayoutError("scales", f"{scales[-1]} outputs do not pack evenly into {packed} words")
        pf = scales[-1] // packed
    else:
        pf = 8
    if len(qweight) != 2:
        raise _LayoutError("qweight", f"shape {list(qweight)} is not 2-d")
    out_dim, in_dim = 0, 1  # logical W[out, in]; these formats store [in, out]
    logical = (qweight[1] * pf, qweight[0]) if awq else (qweight[1], qweight[0] * pf)
    group = qc.get("group_size")
    hints = {in_dim: group} if isinstance(group, int) and group > 0 else {}
    info = _Weight("awq" if awq else "gptq", logical)
    info.layouts["qweight"] = (
        (_Axis(in_dim), _Axis(out_dim, "packed", pf)) if awq else (_Axis(in_dim, "packed", pf), _Axis(out_dim))
    )
    if scales is not None:
        info.layouts["scales"] = _fit("scales", scales, [in_dim, out_dim], logical, hints)
        info.num_groups = scales[0]
    if qzeros is not None:
        (rows,) = _fit("qzeros", qzeros[:1], [in_dim], logical, hints)
        if qzeros[1] * pf != logical[out_dim]:
            raise _LayoutError("qzeros", f"{qzeros[1]} columns for {logical[out_dim]} outputs packed {pf}")
        info.layouts["qzeros"] = (rows, _Axis(out_dim, "packed", pf))
    if "g_idx" in stored and not awq:
        if tuple(stored["g_idx"][0]) != (logical[in_dim],):
            raise _LayoutError("g_idx", f"shape {list(stored['g_idx'][0])}: {prod(stored['g_idx'][0])} entries for "
                                        f"{logical[in_dim]} packed inputs")  # fmt: skip
        info.layouts["g_idx"] = "g_idx"
        info.act_order = qc.get("desc_act", True) is not False
    return info


def _scaled(prefix: str, stored: dict[str, Any], qc: Mapping[str, Any]) -> _Weight:
    shape = stored["weight"][0]
    k = len(shape)
    info = _Weight("scaled", shape)
    info.layouts["weight"] = tuple(_Axis(i) for i in range(k))
    args = _ct_args(prefix, qc) if qc.get("quant_method") == "compressed-tensors" else {}
    hints = _block_hints(qc.get("weight_block_size") or args.get("block_structure"), k)
    if isinstance(args.get("group_size"), int) and args["group_size"] > 0:
        hints[k - 1] = args["group_size"]
    for suffix in _SCALE_NAMES:
        if suffix not in stored:
            continue
        s = stored[suffix][0]
        if prod(s) == 1:
            info.layouts[suffix] = "scalar"
        elif len(s) == 1 and k >= 2 and s[0] == shape[-2]:  # per-channel vector [out]
            info.layouts[suffix] = (_Axis(k - 2),)
        elif len(s) == k:
            blocks = dict(hints)
            for d in range(max(k - 2, 0), k):  # no block size configured: 128, where it gives the count
                if d not in blocks and s[d] not in (1, shape[d]) and -(-shape[d] // DEFAULT_BLOCK) == s[d]:
                    blocks[d] = DEFAULT_BLOCK
            info.layouts[suffix] = _fit(suffix, s, range(k), shape, blocks)
        else:
            raise _LayoutError(suffix, f"shape {list(s)} does not fit weight {list(shape)}")
    if "weight_g_idx" in stored:
        info.layouts["weight_g_idx"] = "g_idx"
        info.act_order = args.get("actorder", True) in _ACT_ORDER_VALUES
        info.num_groups = stored.get("weight_scale", ((1,), ""))[0][-1]
    return info


DEFAULT_BLOCK = 128
"""The block size of a full-size weight's 2-d scales where the quantization_config gives none: every FP8 block
producer's (DeepSeek-V3, Qwen3 FP8, llm-compressor), and the one vLLM implies for ModelOpt's ``FP8_PB_WO``."""


def _gguf(prefix: str, stored: dict[str, Any], qc: Mapping[str, Any]) -> _Weight:
    shape = stored["weight"][0]
    types = qc.get("tensor_types") or {}
    entry = types.get(f"{prefix}.weight")
    if not isinstance(entry, dict) or not isinstance(entry.get("block_size"), int):
        raise _LayoutError("weight", "no block size for this tensor in the quantization_config's tensor_types")
    block = entry["block_size"]
    k = len(shape) - 1  # logical dims: [..., rows, blocks * block]
    logical = (*shape[:-2], shape[-2] * block)
    info = _Weight("gguf", logical)
    info.layouts["weight"] = (*_batch(shape, 3), _Axis(k - 2), _Axis(k - 1, "group", block, logical[-1]), _Axis(None))
    return info


def _dense(prefix: str, stored: dict[str, Any], qc: Mapping[str, Any]) -> _Weight:
    shape = stored["weight"][0]
    return _Weight("dense", shape, {"weight": tuple(_Axis(i) for i in range(len(shape)))})


_MAIN = {"compressed-tensors": "weight_packed", "mlc": "q_weight", "gptq": "qweight", "awq": "qweight",
         "scaled": "weight", "gguf": "weight", "dense": "weight"}  # fmt: skip
"""The stored tensor of each format that holds the weight's values."""

_LAYOUTS = {
    "compressed-tensors": _compressed_tensors,
    "mlc": _mlc,
    "gptq": lambda p, s, q: _gptq_awq(p, s, q, awq=False),
    "awq": lambda p, s, q: _gptq_awq(p, s, q, awq=True),
    "scaled": _scaled,
    "gguf": _gguf,
    "dense": _dense,
}


# --- steps ----------------------------------------------------------------------------------


def _steps(
    info: _Weight,
    layout: tuple[_Axis, ...] | str,
    shape: tuple[int, ...],
    dtype: str,
    placement: Placement,
    split_dim: int | None,
) -> list[Step]:
    if split_dim is None or layout == "scalar":
        return []
    in_dim = len(info.logical) - 1
    segments, kv, unit = _segments(placement, split_dim, info.logical[split_dim])
    if layout == "shape":
        out = [["num_shards", shape[0]], dtype]
        if any(kv):
            return [["shard_funcs.shard_shape", out, split_dim, "num_shards", segments, kv, unit]]
        packed = _packed_length(info, split_dim)
        if packed:  # what the packed tensors hold along the dim: a shorter entry (a partly filled pack) is refused
            return [["shard_funcs.shard_shape", out, split_dim, "num_shards", [], [], 1, packed]]
        return [["shard_funcs.shard_shape", out, split_dim, "num_shards"]]
    if layout == "g_idx":
        if split_dim != in_dim:
            return []
        if info.act_order:  # every rank keeps all scales; g_idx is sliced like the inputs
            if placement.segmented:
                return [_segments_step(shape, dtype, 0, segments, kv, unit, 1)]
            return [_split_step("shard_funcs.shard_dim", shape, dtype, 0, [])]
        if any(kv):
            raise StepArgumentError("a row split that replicates KV segments cannot make g_idx rank-local")
        return [["shard_funcs.shard_group_index", [["num_shards", f"{shape[0]} // num_shards"], dtype],
                 info.num_groups, "num_shards"]]  # fmt: skip
    assert isinstance(layout, tuple)
    hits = [d for d, axis in enumerate(layout) if axis.logical == split_dim]
    if not hits:
        return []
    d = hits[0]
    axis = layout[d]
    if axis.kind == "group" and split_dim == in_dim and info.act_order:
        return []  # act-order: every rank needs every group's scale
    fused = len(segments) > 1 or any(kv)
    # A single unit-counted segment on a dim of groups with a partial last one (FP8 ceil blocks) is split
    # by groups: the module's packed or plain tensors keep heads whole.
    if placement.segmented and (fused or axis.kind != "group" or axis.size % axis.factor == 0):
        _check_boundaries(segments, unit, axis.factor)
        return [_segments_step(shape, dtype, d, segments, kv, unit, axis.factor)]
    if axis.kind == "packed":
        return [
            _split_step("shard_funcs.shard_packed", shape, dtype, d, [axis.factor], [axis.size] if axis.size else [])
        ]
    if axis.kind == "group":
        return [_split_step("shard_funcs.shard_groups", shape, dtype, d, [axis.factor], [axis.size])]
    if placement.pad_to is not None:  # a vocabulary: zero rows where N does not divide it, then the split
        return [
            ["shard_funcs.pad_dim", [None, dtype], d, placement.pad_to, "num_shards"],
            ["shard_funcs.shard_dim", [None, dtype], d, "num_shards"],
        ]
    return [_split_step("shard_funcs.shard_dim", shape, dtype, d, [])]


def _packed_length(info: _Weight, dim: int) -> int:
    """The values the weight's main tensor packs along logical ``dim`` (packs x per pack), 0 where it is not packed."""
    main = _MAIN[info.format]
    layout = next((v for k, v in info.layouts.items() if k == main or k.endswith("." + main)), None)
    if not isinstance(layout, tuple):
        return 0
    return next((info.logical[dim] for axis in layout if axis.logical == dim and axis.kind == "packed"), 0)


def _segments(placement: Placement, dim: int, size: int) -> tuple[list[int], list[int], int]:
    """The placement's segments (whole dim when it names none), 0/1 KV flags and unit, checked against ``size``."""
    unit = placement.unit
    segments = list(placement.segments) or [size // unit]
    if sum(segments) * unit != size:
        raise StepArgumentError(f"segments {segments} x unit {unit} do not add up to dim {dim} of size {size}")
    return segments, [int(f) for f in placement.kv] or [0] * len(segments), unit


def _segments_step(
    shape: Sequence[int], dtype: str, d: int, segments: list[int], kv: list[int], unit: int, pack: int
) -> Step:
    out: list[Any] | None = None  # a replicated KV head has no size linear in N: the shape rule infers it
    if not any(kv):
        out = ["num_shards", *shape]
        out[d + 1] = f"{shape[d]} // num_shards"
    tail = [unit, pack] if pack != 1 else [unit] if unit != 1 else []  # defaults left out
    return ["shard_funcs.shard_segments", [out, dtype], d, segments, kv, "num_shards", *tail]


def _split_step(
    func: str, shape: Sequence[int], dtype: str, d: int, before: list[Any], after: Sequence[Any] = ()
) -> Step:
    out: list[Any] = ["num_shards", *shape]
    out[d + 1] = f"{shape[d]} // num_shards"
    return [func, [out, dtype], d, *before, "num_shards", *after]


def _check_boundaries(segments: Sequence[int], unit: int, factor: int) -> None:
    """Fused segments must each hold whole packs or groups of ``factor`` elements, or no N > 1 can separate them."""
    for i, s in enumerate(segments):
        if (s * unit) % factor:
            raise StepArgumentError(
                f"fused segment {i} ({s} x {unit} elements) does not end on a boundary of {factor} "
                "(pack factor or group size): its parts cannot be separated"
            )
