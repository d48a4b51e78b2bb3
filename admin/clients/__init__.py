"""Who uses the app: per-client activity and refusals (service) and the console's "Busiest
clients" table (tab).

May import: admin.auth, admin.bodies, admin.console, engine, storage, settings, common.
"""
