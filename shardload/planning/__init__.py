"""Planning: shard_info + checkpoint header + N -> a pure plan, with no tensor data read.

Holds: :mod:`.registry` (step functions with their shape and box rules), :mod:`.plan` (per parameter:
resolved steps, every shape and dtype, the source boxes each rank reads), :mod:`.runs` (boxes -> byte
runs), :mod:`.mesh` (dp x pp x tp meshes and pipeline stages) and :mod:`.validate` ("plan, and report
every problem").
May import: ``shardload.sources``, ``shardload.format``, ``shardload.errors``.
"""
