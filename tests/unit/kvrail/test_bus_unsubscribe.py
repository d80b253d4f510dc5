"""`kvrail.bus.unsubscribe`: bounded, quiet about NATS's refusals, never about a cancellation.
(Against a real server: tests/integration/test_bus.py.)"""

from __future__ import annotations

import asyncio
import time

import nats.errors
import pytest

from kvrail.bus import unsubscribe


class Stalled:
    """A subscription whose connection never takes the unsubscription."""

    async def unsubscribe(self) -> None:
        await asyncio.Event().wait()


class Closed:
    """A subscription of a closed connection: nats-py refuses the unsubscription."""

    async def unsubscribe(self) -> None:
        raise nats.errors.ConnectionClosedError


async def test_a_stalled_connection_is_waited_for_only_as_long_as_the_bound() -> None:
    started = time.monotonic()
    await unsubscribe(Stalled(), timeout_s=0.05)
    assert time.monotonic() - started < 1.0


async def test_a_closed_connection_or_no_subscription_raises_nothing() -> None:
    await unsubscribe(Closed())
    await unsubscribe(None)


async def test_a_cancellation_of_the_caller_goes_on_up() -> None:
    task = asyncio.create_task(unsubscribe(Stalled(), timeout_s=30))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
