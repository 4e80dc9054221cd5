"""The engine: the only layer that moves tensor bytes. It executes plans.

Holds: :mod:`.load` (``load``, ``load_rank``), :mod:`.transfer` (the reader pool and device copies),
:mod:`.steps` (running step functions on whole tensors), :mod:`.convert` and :mod:`.writer` (pre-sharded
output), :mod:`.verify` (checksums of converted output), :mod:`.quantize` (quantize once, load at any N).
May import: ``shardload.models``, ``shardload.planning``, ``shardload.sources``, ``shardload.format``,
``shardload.errors``.
"""
