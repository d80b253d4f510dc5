"""The agent that registers a `vllm serve` process as a worker of its pool.

Run as `python -P -m kvrail.agent` beside the server (see `kvrail.agent.vllm`).
"""
