"""Model knowledge: which parameter of which architecture is split how, turned into shard_info steps.

Holds: :mod:`.presets` (plans from config.json for known families, ``shardload plan``), :mod:`.hf_plans`
(transformers' own TP plans, and the table of them shipped as ``hf_tp_plans.json``), :mod:`.placement`
(a placement -> steps), :mod:`.quant_plan` (quantized companions: scales, zero points, packed weights).
May import: ``shardload.planning``, ``shardload.sources``, ``shardload.format``, ``shardload.errors``.
"""
