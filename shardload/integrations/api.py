"""The integration API: what a server integration (``shardload.integrations.<server>``) uses beyond the public API
(:mod:`shardload`: ``load_rank``, ``plan_model``, ``ReadOptions``, ``ShardInfo``, ``StepSpec``, ``ModelPlan``, ...).

Each name, in one line:

- :func:`plan_shard_info`: the shard_info a checkpoint is planned with (given, beside it, or made from config.json),
  and a phrase naming where it came from;
- :func:`build_plan`: a checkpoint planned with a shard_info for N ranks, without reading tensor data (what
  :func:`shardload.plan_model` does after opening the model);
- :func:`open_source`: a model opened as the kind of source it is, one type per kind (:class:`WholeTensors`,
  :class:`RankFiles`, :class:`ConvertedBoxes`, :class:`SavedBoxes`, ...); :func:`check_options` refuses, in one line,
  an option the source's type does not take (the source-type table);
- :class:`SplitFormat`, :func:`register_split_format`: a server's own per-rank layout registered as a source
  (``shardload.split_formats`` entry point group);
- :class:`LayoutTarget`, :func:`register_layout`: a server's layout registered as a ``convert --layout`` target
  (``shardload.layouts`` entry point group);
- :func:`records_inputs`: decorates an entry point so a file changed under its load is refused, as ``load_rank``'s;
  :func:`check_recorded`, inside it, refuses a file changed since (asked after copying out of views of the files);
- :func:`same_checkpoint`: a block in which each rank of a process group loads, after which the ranks compare the
  files they read, so a checkpoint replaced between two ranks' loads is one line on every rank;
- :func:`to_torch`: the torch dtype of a stored dtype name.

Names not here are internal: an integration that needs one asks for it to be added here (docs/extending.md).
"""

from __future__ import annotations

from ..engine.agreement import same_checkpoint
from ..engine.convert_targets import LayoutTarget, register_layout
from ..format.input_log import check_recorded, records_inputs
from ..models.plan_source import plan_shard_info
from ..planning.plan import ModelPlan, ParamPlan, build_plan
from ..sources.dtypes import to_torch
from ..sources.source_types import (
    ConvertedBoxes,
    RankFiles,
    SavedBoxes,
    Source,
    SplitFormat,
    SplitRecords,
    WholeTensors,
    check_options,
    open_source,
    register_split_format,
)

__all__ = [
    "ConvertedBoxes",
    "LayoutTarget",
    "ModelPlan",
    "ParamPlan",
    "RankFiles",
    "SavedBoxes",
    "Source",
    "SplitFormat",
    "SplitRecords",
    "WholeTensors",
    "build_plan",
    "check_options",
    "check_recorded",
    "open_source",
    "plan_shard_info",
    "records_inputs",
    "same_checkpoint",
    "register_layout",
    "register_split_format",
    "to_torch",
]
