"""The shard_info.json file: its two forms, expressions over ``num_shards``, strict JSON, the JSON Schema.

Holds: :mod:`.shard_info` (``ShardInfo``, ``StepSpec``: parse, check against the schema, write),
:mod:`.expr` (the whitelisted ``num_shards`` expression language, never ``eval``), :mod:`.strictjson`
(JSON with duplicate keys refused), :mod:`.smallfile` (a size-capped read of a regular file) and the shipped
``shard_info.schema.json``.
May import: ``shardload.errors`` only. Checking a file against a model is planning: see ``shardload.planning``.
"""
