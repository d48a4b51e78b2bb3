"""The operator's questions answered for the console and the admin API: is caching worth it
here (verdict), how big each tier should be (sizing), Redis and GPU health, money saved; its
service, JSON routes, tab and charts.

May import: admin.auth, admin.bodies, admin.console, admin.monitoring, engine, storage, settings, common.
"""
