"""Storage backends: the L1 memory store, Redis (`redis/`), the SQL request and audit log, the
log writer, the circuit breaker. Storage knows nothing of models, keys' meaning or the console.

May import: settings, common.
"""
