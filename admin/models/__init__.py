"""The console's Models panel (each served model, its version, a live reload: tab) and the
warm-up panel (warmup_tab).

May import: admin.auth, admin.bodies, admin.console, admin.replicas, engine, storage, settings, common.
"""
