"""vLLM as the engine of a pool: the `vllm serve` command line and the kvrail agent beside it."""
