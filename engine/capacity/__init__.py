"""Who gets the model, and when: forward passes shared out among requests (passes),
micro-batching of concurrent misses (batching), the per-client miss budget (fairness), the
work-conserving admission of a miss (admission) and who a client is behind proxies
(forwarding).

May import: engine.errors, engine.inputs, engine.models, storage, settings, common.
"""
