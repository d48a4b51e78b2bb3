"""The request pipeline: `InferenceEngine.classify(task, raw)` (service), what it hands out
(results) and what it tells its listeners of each request (request_events).

It composes the other engine packages; none of them imports it back.

May import: engine.errors, engine.inputs, engine.cache, engine.capacity, engine.fleet, engine.models,
engine.quality, engine.lifecycle, engine.sizing, storage, settings, common.
"""
