"""What `/metrics` serves: per-request counters fed by the engine's listener and cache state
(metrics), Redis memory and GPU figures read at scrape time (health_metrics), the GPU monitor
(device_health).

May import: engine, storage, settings, common.
"""
