"""The router's tokenizer threads: results and errors come back to the awaiting coroutine, the
work runs off the event loop's thread, and a caller that stops waiting breaks nothing."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvrail.router.text.threads import TokenizerThreads


async def test_a_job_runs_on_a_tokenizer_thread_and_returns_its_result() -> None:
    threads = TokenizerThreads(2)
    total, name = await threads.run(lambda a, b: (a + b, threading.current_thread().name), 2, 3)
    assert total == 5 and name.startswith("tokenize-")
    names = await asyncio.gather(*(threads.run(lambda: threading.current_thread().name)
                                   for _ in range(20)))  # fmt: skip
    assert set(names) <= {"tokenize-0", "tokenize-1"}
    assert threading.current_thread().name not in names
    threads.shutdown()


async def test_an_exception_reaches_the_caller_and_the_thread_goes_on() -> None:
    threads = TokenizerThreads(1)

    def fail() -> None:
        raise ValueError("no such token")

    with pytest.raises(ValueError, match="no such token"):
        await threads.run(fail)
    assert await threads.run(len, "abc") == 3
    threads.shutdown()


async def test_a_caller_that_stops_waiting_leaves_the_threads_serving() -> None:
    threads = TokenizerThreads(1)
    release = threading.Event()
    waiting = asyncio.create_task(threads.run(release.wait, 10))
    await asyncio.sleep(0.05)
    waiting.cancel()  # the client left while its prompt was being encoded
    with pytest.raises(asyncio.CancelledError):
        await waiting
    release.set()
    assert await asyncio.wait_for(threads.run(len, "abcd"), 5) == 4
    threads.shutdown()
