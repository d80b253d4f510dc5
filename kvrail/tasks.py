"""Stopping a helper task (a heartbeat, a lease keep-alive, a watch) from the task that owns it."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and wait until it has ended. An error it died of is raised here, as
    `await task` would; a cancel of the caller while it waits goes on up. (`await task` inside
    `suppress(CancelledError)` swallowed that cancel too, and the caller ran on.)"""
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled() and (error := task.exception()) is not None:
        raise error
