"""A request's mailbox in the router's event inbox: items in order, a reader that waits is woken
by the next put, and a reader cancelled while waiting loses nothing."""

from __future__ import annotations

import asyncio

import pytest

from kvrail.router.streams.inbox import TICK, Mailbox


async def test_items_come_out_in_order_and_a_waiting_reader_wakes_on_the_next_put() -> None:
    box = Mailbox(asyncio.get_running_loop())
    assert box.empty()
    with pytest.raises(IndexError):
        box.get_nowait()
    box.put_nowait("a")
    box.put_nowait(TICK)
    assert not box.empty() and await box.get() == "a" and box.get_nowait() == TICK
    reader = asyncio.create_task(box.get())
    await asyncio.sleep(0)  # the reader waits
    assert not reader.done()
    box.put_nowait("b")
    assert await asyncio.wait_for(reader, 1) == "b"


async def test_a_reader_cancelled_while_waiting_loses_nothing() -> None:
    box = Mailbox(asyncio.get_running_loop())
    reader = asyncio.create_task(box.get())
    await asyncio.sleep(0)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    box.put_nowait("c")  # nobody waits: kept for the next reader
    assert await asyncio.wait_for(box.get(), 1) == "c"
