"""Hard examples for the operator (engine.quality.hard_examples keeps them): review and label
(service), JSON routes (api), the console panel (tab) and the labelled set as Parquet (export).

May import: admin.auth, admin.bodies, admin.console, engine, storage, settings, common.
"""
