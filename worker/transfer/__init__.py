"""KV transfer between workers.

`kv_connector.py` writes blocks into a peer's KV region (NIXL over UCX: DRAM on CPU, RDMA across
nodes; CUDA IPC between two GPU processes on one node) and delivers the completion notification;
`envelope.py` checks what arrived before a request may run on it; `blocks.py` holds the pure
helpers both sides share.
"""
