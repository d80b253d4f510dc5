"""KV transfer between workers: one `Connector` interface, several transports.

`connector.py` states the guarantees; `nixl.py` moves blocks with NIXL (UCX: DRAM on CPU, RDMA
across nodes); `envelope.py` checks what arrived before a sequence may run on it.
"""
