"""Trust in one cached answer: which input an inspect/evict call names, the shadow report
(service), and the console panel to inspect or evict an entry (tab).

May import: admin.auth, admin.bodies, admin.console, engine, storage, settings, common.
"""
