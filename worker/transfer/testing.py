"""A decode-side NIXL peer in its own process, for transfer tests and benchmarks.

It lives in the package (not in a test module) because a spawned process must import its target
by name.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch

from kvrail.worker.kv_cache import KVCache
from kvrail.worker.transfer.envelope import block_checksums
from kvrail.worker.transfer.kv_connector import KvConnector


def recv(conn: Connection, timeout_s: float = 60.0) -> object:
    """`conn.recv()` with a deadline (a dead peer must fail the test, not hang it)."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"peer sent nothing within {timeout_s:.0f}s")
    return conn.recv()


def _decode_peer(
    conn: Connection, agent_name: str, num_blocks: int, block_elems: int, device: str
) -> None:
    """Sends its metadata, loads the writer's, collects notifications until asked which blocks
    to report on, answers (notifications, checksums, block contents on the CPU), then exits on
    any word."""
    region = KVCache(torch.zeros(num_blocks, block_elems, device=device), num_blocks)
    nixl = KvConnector(agent_name, region)
    conn.send(nixl.metadata())
    nixl.add_peer(recv(conn))  # type: ignore[arg-type]
    notes: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + 120
    while not conn.poll(0.001) and time.monotonic() < deadline:
        notes += nixl.notifications()
    block_ids = recv(conn)
    notes += nixl.notifications()
    assert isinstance(block_ids, list)
    conn.send((notes, block_checksums(region, block_ids), region.tensor[block_ids].cpu()))
    recv(conn)
    nixl.close()


def start_decode_peer(
    agent_name: str, num_blocks: int, block_elems: int, device: str = "cpu"
) -> tuple[Connection, BaseProcess]:
    """The peer's region is `num_blocks` float32 blocks of `block_elems` on `device`."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_decode_peer,
        args=(child, agent_name, num_blocks, block_elems, device),
        daemon=True,
    )
    proc.start()
    return parent, proc
