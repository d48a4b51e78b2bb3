"""How big each tier should be: miss-ratio curves from the live key stream (key_sampler) and
the CPU budget that bounds the sampler (budget).

May import: engine.errors, engine.inputs, storage, settings, common.
"""
