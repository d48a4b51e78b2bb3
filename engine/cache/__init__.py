"""The cache core: keys (`{prefix}:{task}:{model_version}:{generation}:{digest}`), the signed
value format (codec), the operator's generation, when L1 may serve (l1_gate), L2 writes batched
with other round trips (write_batch), in-process single flight, and one entry inspected or
evicted (entries).

May import: engine.errors, engine.inputs, engine.models, storage, settings, common.
"""
