"""Everything that talks to Redis: the L2 store (store), clients for each REDIS_URL form
(clients) and where keys live (cluster), the private redis-server (embedded), the fleet's keys
(fleet), memory and churn from INFO (health), per-client token buckets (buckets) and the hard
examples' keys (hard_examples).

May import: storage.breaker, storage.errors, settings, common.
"""
