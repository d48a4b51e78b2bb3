"""Inference engine: models, canonical inputs, cache keys and the tiered cache."""
