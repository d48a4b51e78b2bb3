"""Storage backends: L1 memory store, Redis store, embedded redis-server, SQL log."""
