"""The inference engine: every request goes through `pipeline.service.InferenceEngine`.

A package per concern; each one's `__init__` says what it owns and what it may import
(tests/test_floors.py holds them to it):

- `pipeline/`   the request pipeline: `InferenceEngine.classify`, results, request events
- `cache/`      the cache core: keys, the stored value format, generation, L1 gate, L2 write batches
- `models/`     the classifiers, their loading, devices and backends (torch, ONNX Runtime)
- `capacity/`   who gets the model: passes, micro-batching, fairness budgets, client identity
- `fleet/`      this replica among the others sharing one Redis: registry, fleet single flight
- `lifecycle/`  a model's life: live reload, warm-up after a swap, clean-up of old versions
- `quality/`    answer quality: shadow verification, hard examples
- `sizing/`     what hit ratio each tier size would give (miss-ratio curves)

`errors.py` (the exception tree) and `inputs.py` (canonical inputs) are the vocabulary all of
them share. The engine knows nothing of Gradio, HTTP or the console.

May import: storage, settings, common.
"""
