"""This replica as one member of the fleet sharing one Redis: the replica registry, fleet-wide
flush/bump/evict with acknowledgements (member), and single flight across replicas with a short
lease per key (flight).

May import: engine.errors, engine.inputs, engine.cache, storage, settings, common.
"""
