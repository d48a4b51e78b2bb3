"""The operator console: a package per console feature, each holding its service, JSON routes,
tab and charts side by side. Each package's `__init__` says what it owns and what it may import
(tests/test_floors.py holds them to it):

- `console/`        the core: `AdminService` (flush, version bump, stats), the admin router and the
                    Admin tab that assemble every feature, request-log read models, charts, CSV exports
- `insights/`       the operator's questions answered: is caching worth it (verdict), sizing, health
- `hard_examples/`  the inputs the model was unsure of: review, label, export as a data set
- `trust/`          one cached answer inspected or evicted; shadow verification's report
- `clients/`        who uses the app: the busiest clients and refusals
- `models/`         the Models panel (live reload) and the warm-up panel
- `replicas/`       the fleet's replicas table
- `monitoring/`     Prometheus metrics and the Redis and GPU health they include

`auth.py` (the bearer token) and `bodies.py` (strict JSON bodies) serve every feature's routes.

May import: engine, storage, settings, common.
"""
