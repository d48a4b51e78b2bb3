"""Answer quality: a sample of hits recomputed off the request path (shadow) and the inputs the
model was unsure of, kept to be labelled (hard_examples).

May import: engine.errors, engine.inputs, engine.cache, engine.models, engine.lifecycle, storage,
settings, common.
"""
