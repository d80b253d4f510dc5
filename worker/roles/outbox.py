"""The decode role's token outbox: a step's events leave as one message per router.

`TokenOutbox.add(subject, event)` queues an event and, on the first one of a turn of the event
loop, schedules a flush for the next turn. Every request's task takes its update from the same
engine step in the same turn (the service hands a step's updates to the loop at once), so the
flush finds the whole step and publishes one `TokenEventBatch` per subject, events in the order
they were added (a request's in its `seq` order).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict

import nats.errors
from nats.aio.client import Client as NatsClient

from kvrail.outputs import MAX_EVENTS_PER_BATCH, TokenEvent, TokenEventBatch

log = logging.getLogger(__name__)


class TokenOutbox:
    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self._queued: dict[str, list[TokenEvent]] = defaultdict(list)
        self._flush: asyncio.Task[None] | None = None

    def add(self, subject: str, event: TokenEvent) -> None:
        self._queued[subject].append(event)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        await asyncio.sleep(0)  # the other requests of this step add theirs meanwhile
        self._flush = None
        await self.flush()

    async def flush(self) -> None:
        """Publish everything queued now (also at shutdown, before the connection drains)."""
        queued, self._queued = self._queued, defaultdict(list)
        for subject, events in queued.items():
            for start in range(0, len(events), MAX_EVENTS_PER_BATCH):
                batch = TokenEventBatch(tuple(events[start : start + MAX_EVENTS_PER_BATCH]))
                with contextlib.suppress(nats.errors.Error):  # the router is gone: nobody reads
                    await self._nc.publish(subject, batch.encode())
