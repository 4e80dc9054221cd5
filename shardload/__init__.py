"""shardload: shard one (quantized) safetensors checkpoint for any tensor-parallel size at load time.

The public surface::

    shards = shardload.load("model-dir", num_shards=8)            # N state dicts, shard r on device r
    state = shardload.load_rank("model-dir", rank=3, num_shards=8)  # just this rank's tensors
    shardload.convert("model-dir", 8, "model-tp8")                  # pre-sharded files + manifest
    shardload.quantize("model-dir", "model-int4", "int4-g128")      # quantize once, load at any N
    info = shardload.ShardInfo.load("shard_info.json")              # parse; info.validate(model=...)
    p = shardload.plan_model("model-dir", 8)                        # the pure plan: shapes, read boxes
    shardload.verify_dir("model-tp8").problems                      # sha256 of every converted file
    state = shardload.load_rank("model-dir", rank=5, mesh="pp=2,tp=4")  # a pipeline stage's tensor shard

    @shardload.register("myorg.step", shape=rule)                    # add a step function
    def step(x, num_shards: int): ...

Importing shardload does not import torch; the loaders import it when called.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .convert import ConvertResult, convert
from .errors import CheckpointError, FormatError, PlanError, ShardloadError
from .execute import load, load_rank
from .format import ShardInfo, StepSpec
from .mesh import Mesh
from .plan import ModelPlan, ParamPlan, plan_model
from .quantize import quantize
from .registry import register
from .verify import VerifyReport, verify_dir

__all__ = [
    "CheckpointError",
    "ConvertResult",
    "FormatError",
    "Mesh",
    "ModelPlan",
    "ParamPlan",
    "PlanError",
    "ShardInfo",
    "ShardloadError",
    "StepSpec",
    "VerifyReport",
    "__version__",
    "convert",
    "load",
    "load_rank",
    "plan_model",
    "quantize",
    "register",
    "verify_dir",
]
