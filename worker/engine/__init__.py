"""The engine: requests, block pool, KV cache manager, scheduler, sampler, model runner."""
