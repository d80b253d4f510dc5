"""What polling for NIXL completions costs the decode worker's event loop, per interval.

    .venv/bin/python -P bench/sweep/poll_interval.py   # output: poll_interval.txt

The decode worker's loop (`worker/roles/kv_receiver.py`) asks its NIXL agent for new
notifications, then sleeps. This runs that loop on uvloop, as the worker does, for 2 s per
interval against a real agent with nothing to deliver, and counts polls and the process's CPU.
Below 1 ms uvloop's timers (whole milliseconds) do not wait: the loop spins.
"""

from __future__ import annotations

import asyncio
import time

import torch
import uvloop

from kvrail.worker.kv_cache import KVCache
from kvrail.worker.transfer.kv_connector import KvConnector

SECONDS = 2.0


async def poll(connector: KvConnector, interval_s: float) -> tuple[float, float]:
    """(polls per second, share of a core)"""
    cpu, start, polls = time.process_time(), time.monotonic(), 0
    while time.monotonic() - start < SECONDS:
        for _note in connector.notifications():
            pass
        await asyncio.sleep(interval_s)
        polls += 1
    return polls / SECONDS, (time.process_time() - cpu) / SECONDS


def main() -> None:
    region = KVCache(torch.zeros(64, 1024), 64)
    connector = KvConnector("decode-0-1", region)
    try:
        for interval_s in (0.05, 0.002, 0.001, 0.00025):
            rate, share = uvloop.run(poll(connector, interval_s))
            print(f"every {interval_s * 1e3:5.2f} ms: {rate:9,.0f} polls/s, {share:6.1%} of a core")
    finally:
        connector.close()


if __name__ == "__main__":
    main()
