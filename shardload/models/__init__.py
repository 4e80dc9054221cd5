"""Model knowledge: which parameter of which architecture is split how, turned into shard_info steps.

Holds: :mod:`.families` (one entry per model family: model types, tensor-name roles, GGUF names),
:mod:`.presets` (a family's roles -> placements), :mod:`.hf_tp_tables` (transformers' own TP tables, and the table
of them shipped as ``hf_tp_plans.json``), :mod:`.vocab_padding`, :mod:`.generated` (the generated shard_info of
``shardload plan``), :mod:`.choices` (its options), :mod:`.placement` (a placement -> steps), :mod:`.stored_layouts`
(quantized companions: scales, zero points, packed weights), :mod:`.plan_source` (which shard_info a model is
planned with; ``plan_model``).
May import: ``shardload.planning``, ``shardload.sources``, ``shardload.format``, ``shardload.errors``.
"""
