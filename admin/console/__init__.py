"""The console's core: `AdminService` (operator actions: flush, version bump, evict; console
data) in service, the admin JSON router (api) and the Admin tab (tab) that assemble every
feature's routes and panels, request-log read models (stats), charts and CSV exports.

It assembles the features, so it alone may import any admin package.

May import: admin, engine, storage, settings, common.
"""
