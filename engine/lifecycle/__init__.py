"""A model's life while serving: live reload beside the serving model (reload), the hottest
inputs recomputed after a swap or bump (warmup), and the entries of old versions removed from
L2 (cleanup).

May import: engine.errors, engine.inputs, engine.cache, engine.models, storage, settings, common.
"""
