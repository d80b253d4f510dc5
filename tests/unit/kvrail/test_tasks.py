"""Stopping a helper task (`cancel_and_wait`): what it died of is raised, and a cancel of the
task that stops it is never swallowed. The prefill job's heartbeat (`QueuedJob.working`) is
the case that matters: the prefill role relies on that cancel when a drain runs out of time.
The heartbeat's exchange with a real JetStream runs in tests/integration/test_bus.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import cast

import pytest
from nats.aio.msg import Msg

from kvrail.bus import QueuedJob
from kvrail.tasks import cancel_and_wait


async def test_a_cancel_that_comes_as_the_heartbeat_stops_is_not_lost() -> None:
    beats: list[None] = []

    async def in_progress() -> None:
        beats.append(None)

    job = QueuedJob(None, cast(Msg, SimpleNamespace(in_progress=in_progress)))
    after_block = asyncio.Event()

    async def work() -> None:
        me = asyncio.current_task()
        assert me is not None
        async with job.working(interval_s=0.001):
            while not beats:  # noqa: ASYNC110 (the heartbeat beats on its own task)
                await asyncio.sleep(0.001)
            # Lands in the turn after the block ends, while the heartbeat is being stopped.
            asyncio.get_running_loop().call_soon(me.cancel)
        after_block.set()  # the cancel was lost: the task ran on past the block

    task = asyncio.create_task(work())
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not after_block.is_set()


async def test_the_error_a_stopped_task_died_of_is_raised() -> None:
    async def broken() -> None:
        raise RuntimeError("a bug")

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="a bug"):
        await cancel_and_wait(task)
    idle = asyncio.create_task(asyncio.sleep(60))
    await cancel_and_wait(idle)  # cancelled as asked: nothing to raise
    assert idle.cancelled()
