"""The router's per-request and per-token hand-offs, each beside what it replaced: CPU per call.

    taskset -c 1 .venv/bin/python -P bench/studies/router/loop_parts.py   # output: loop_parts.txt

In-process on uvloop, the figures the 2026-12-04 changes quote (bench/router/README.md):
- a tokenizer hand-off of a call that does nothing: `run_in_executor` on a two-thread pool
  against `TokenizerThreads`, one at a time and 32 at once;
- an item through a request's queue, put once per loop turn and read by one waiting reader:
  `asyncio.Queue` against `Mailbox` (a loop turn alone is printed too);
- an inter-token latency observation: prometheus-client's `Histogram` against `LoopHistogram`;
- a merged event: `dataclasses.replace` against the constructor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop
from prometheus_client import CollectorRegistry, Histogram

from kvrail.outputs import RequestOutput, TokenEvent, merged
from kvrail.router.metrics import LoopHistogram
from kvrail.router.streams.inbox import Mailbox
from kvrail.router.text.threads import TokenizerThreads

sys.path.insert(0, str(Path(__file__).parent))
from request_parts import per_call_us

N = 20_000
CALLS = 200_000  # per synchronous part (`per_call_us`)
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


async def per_await_us(fn: Callable[[], Awaitable[Any]], n: int = N, at_once: int = 1) -> float:
    for _ in range(100):
        await fn()
    start = time.process_time()
    for _ in range(n // at_once):
        await asyncio.gather(*(fn() for _ in range(at_once)))
    return (time.process_time() - start) / (n // at_once * at_once) * 1e6


async def through(queue: Any, n: int = 100_000) -> float:
    """CPU per item put once per loop turn into `queue` and read by one waiting reader."""

    async def reader() -> None:
        for _ in range(n):
            if queue.empty():
                await queue.get()
            else:
                queue.get_nowait()

    task = asyncio.ensure_future(reader())
    start = time.process_time()
    for i in range(n):
        queue.put_nowait(i)
        await asyncio.sleep(0)
    await task
    return (time.process_time() - start) / n * 1e6


async def turns(n: int = 100_000) -> float:
    start = time.process_time()
    for _ in range(n):
        await asyncio.sleep(0)
    return (time.process_time() - start) / n * 1e6


async def main() -> None:
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(2)
    threads = TokenizerThreads(2)
    nothing = lambda: None  # noqa: E731
    rows = [
        ("run_in_executor, one at a time", await per_await_us(
            lambda: loop.run_in_executor(pool, nothing))),
        ("TokenizerThreads.run, one at a time", await per_await_us(lambda: threads.run(nothing))),
        ("run_in_executor, 32 at once", await per_await_us(
            lambda: loop.run_in_executor(pool, nothing), at_once=32)),
        ("TokenizerThreads.run, 32 at once", await per_await_us(
            lambda: threads.run(nothing), at_once=32)),
        ("a loop turn alone (asyncio.sleep(0))", await turns()),
        ("asyncio.Queue, per item with its turn", await through(asyncio.Queue())),
        ("Mailbox, per item with its turn", await through(Mailbox(loop))),
    ]  # fmt: skip
    threads.shutdown()
    pool.shutdown()
    histogram = Histogram("x_seconds", "x", buckets=BUCKETS, registry=CollectorRegistry())
    ours = LoopHistogram("y_seconds", "y", BUCKETS)
    event = TokenEvent(RequestOutput("chatcmpl-x", (1,)), 5, "decode-0")
    queued = [event.output, RequestOutput("chatcmpl-x", (2,))]
    rows += [
        ("Histogram.observe", per_call_us(lambda: histogram.observe(0.0123), CALLS)),
        ("LoopHistogram.observe", per_call_us(lambda: ours.observe(0.0123, 1), CALLS)),
        ("dataclasses.replace of a TokenEvent", per_call_us(
            lambda: dataclasses.replace(event, output=queued[1]), CALLS)),
        ("two outputs merged, in a TokenEvent", per_call_us(
            lambda: event.with_output(merged(queued)), CALLS)),
    ]  # fmt: skip
    print("# CPU per call")
    for name, us in rows:
        print(f"{name:45s} {us:7.2f} us")


if __name__ == "__main__":
    uvloop.run(main())
    sys.exit(0)
