"""The router's tokenizer threads: a prompt is encoded off the event loop, with one hand-off each
way (`TokenizerThreads`)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class TokenizerThreads:
    """`await threads.run(fn, *args)`: `fn(*args)` on one of `num_threads` daemon threads, its
    result (or its exception) given back on the caller's event loop.

    What `loop.run_in_executor` does, with less in between: a job is a tuple on a `SimpleQueue`,
    and its result goes straight into the awaiting future through `call_soon_threadsafe`.
    `run_in_executor` wraps every call in a `concurrent.futures.Future` (a lock and a condition
    of its own), chains it to an asyncio future with callbacks on both sides, and its pool
    counts idle threads with a semaphore; the router paid that once per request, on the core
    its event loop needs (about 40 of 580 us per streamed request, `bench/router/README.md`).
    A caller that stops waiting (its client left) does not stop `fn`, as with
    `run_in_executor`; the result is dropped.
    """

    def __init__(self, num_threads: int, name: str = "tokenize") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return await future

    def shutdown(self) -> None:
        """Let every thread end once the jobs queued before this are done."""
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, fn, args = job
            try:
                outcome: tuple[Any, BaseException | None] = (fn(*args), None)
            except BaseException as err:  # the caller gets whatever `fn` raised
                outcome = (None, err)
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
                loop.call_soon_threadsafe(_settle, future, *outcome)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
