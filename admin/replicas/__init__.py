"""The console's Replicas table (the replica registry of engine.fleet) and the line saying
whether this replica is alone or one of a fleet.

May import: admin.auth, admin.bodies, admin.console, engine, storage, settings, common.
"""
