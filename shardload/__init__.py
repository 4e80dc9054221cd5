"""shardload: shard one (quantized) safetensors checkpoint for any tensor-parallel size at load time.

The public surface::

    shards = shardload.load("model-dir", num_shards=8)            # N state dicts, shard r on device r
    state = shardload.load_rank("model-dir", rank=3, num_shards=8)  # just this rank's tensors
    shardload.load_rank("model-dir", 3, 8, into=params)             # into your tensors, in place
    shardload.convert("model-dir", 8, "model-tp8")                  # pre-sharded files + manifest
    shardload.quantize("model-dir", "model-int4", "int4-g128")      # quantize once, load at any N
    info = shardload.ShardInfo.load("shard_info.json")              # parse and check against the schema
    problems = shardload.validate(info, model="model-dir", num_shards=8)  # [] when every parameter plans
    p = shardload.plan_model("model-dir", 8)                        # the pure plan: shapes, read boxes
    shardload.verify_dir("model-tp8").problems                      # every converted file vs its manifest
    shardload.hash_checkpoint("model-dir")                          # integrity record, for load(verify=True)
    state = shardload.load_rank("model-dir", rank=5, mesh="pp=2,tp=4")  # a pipeline stage's tensor shard
    with shardload.count_reads() as seen: ...                         # tensor bytes read inside the block
    shardload.open_checkpoint("model-dir").tensors                    # headers only: name -> TensorInfo

    @shardload.register("myorg.step", shape=rule)                    # add a step function
    def step(x, num_shards: int): ...

Importing shardload does not import torch; the loaders import it when called. It registers the
built-in step functions by importing ``shard_funcs`` (the one place that does).

The package is layered by stage of the flow, each layer importing only those below it (an
import-linter contract in pyproject.toml checks it): ``cli`` | ``integrations`` > ``engine`` >
``models`` > ``planning`` > ``sources`` > ``format`` > ``errors``.
"""

from __future__ import annotations

import shard_funcs as _builtin_steps  # noqa: F401  (registers the built-in steps: the one place that does)

from .engine.convert import ConvertResult, convert
from .engine.hashing import hash_checkpoint
from .engine.load import load, load_rank
from .engine.load_options import Destination, Verify
from .engine.quantize import QuantizeResult, quantize
from .engine.read_strategy import ReadOptions
from .engine.verify import VerifyReport
from .engine.verify_dir import verify_dir
from .errors import CheckpointError, FormatError, PlanError, ShardloadError
from .format.shard_info import ShardInfo, StepSpec
from .models.placement import Placement
from .models.plan_source import plan_model
from .planning.mesh import Mesh
from .planning.plan import ModelPlan, ParamPlan
from .planning.registry import register
from .planning.validate import validate
from .sources.checkpoint import Checkpoint, open_checkpoint
from .sources.objects import ObjectCost
from .sources.read_plan import IoModel
from .sources.reader import ReadCount, count_reads
from .version import __version__

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConvertResult",
    "Destination",
    "FormatError",
    "IoModel",
    "Mesh",
    "ModelPlan",
    "ObjectCost",
    "ParamPlan",
    "Placement",
    "PlanError",
    "QuantizeResult",
    "ReadCount",
    "ReadOptions",
    "ShardInfo",
    "ShardloadError",
    "StepSpec",
    "Verify",
    "VerifyReport",
    "__version__",
    "convert",
    "count_reads",
    "hash_checkpoint",
    "load",
    "load_rank",
    "open_checkpoint",
    "plan_model",
    "quantize",
    "register",
    "validate",
    "verify_dir",
]
