"""Lower KV tiers: pinned host memory and local disk below the GPU's prefix cache.

`tiers.KvTiers` is what the scheduler and the engine use; `host` and `disk` keep each tier's
index, `copier` moves blocks between the GPU and host memory, `checksum` proves a load intact.
docs/kv-tiers.md is the user's view: what is kept where, sizing, guarantees.
"""
