"""vLLM as the engine of a pool: the `vllm serve` command line (`serve`) and the HTTP protocol
the router speaks to it (`protocol`). The agent that registers a server is the component
`kvrail.agent`.
"""
