"""One NATS subscription per router for every request's token events.

Decode workers publish a step's events for this router as one `TokenEventBatch` to its events
subject, `<prefix>.events`; each request is published with the reply subject
`<prefix>.r.<request id>`, so that NATS's "no responders" answer, which carries nothing but a
status, still names its request. `EventInbox` subscribes `<prefix>.>` once and hands each event
to the queue of its request (`open` / `close`); an event for a request nobody waits for (one
that finished or left) is dropped. The request ids come from the router itself (128 random
bits in hex), so they are valid subject tokens.

Every `poll_s` the inbox also puts `TICK` in every open queue: a stream that waits for its next
event wakes then to check its worker's record and its deadline. One timer for all requests,
where a timeout around each wait would arm and cancel one per token.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Final

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvrail.bus import unsubscribe
from kvrail.codec import MessageError, decode
from kvrail.outputs import TokenEvent, TokenEventBatch

log = logging.getLogger(__name__)

NO_RESPONDERS: Final = "no_responders"
"""Put in a request's queue when NATS found no decode worker subscribed to its subject."""
TICK: Final = "tick"
"""Put in every open queue every `poll_s` (and by a stream at its own deadline)."""
POLL_S: Final = 0.5


class Mailbox:
    """One request's queue: what the inbox puts, read by that request's stream alone.

    The part of `asyncio.Queue` a stream uses (`put_nowait`, `empty`, `get_nowait`, `get`),
    for one reader and without a bound: a deque and the reader's one waiting future. An
    `asyncio.Queue` also keeps a list of getters, counts unfinished items for `join` and clears
    an event on every put; a router passes every token through one (2.1 against 2.8 us per item
    with its loop turn on the 2-vCPU VM, `bench/studies/router/loop_parts.txt`).
    """

    __slots__ = ("_items", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._items: collections.deque[TokenEvent | str] = collections.deque()
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: TokenEvent | str) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> TokenEvent | str:
        """The oldest item; raises IndexError when there is none."""
        return self._items.popleft()

    async def get(self) -> TokenEvent | str:
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class EventInbox:
    """Start with `start()` (once the event loop runs), stop with `stop()`."""

    def __init__(self, nc: NatsClient, poll_s: float = POLL_S) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox()
        self.events_subject = f"{self._prefix}.events"
        self._replies = f"{self._prefix}.r."
        self._queues: dict[str, Mailbox] = {}
        self._sub: Subscription | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._poll_s = poll_s
        self.num_invalid = 0

    async def start(self) -> None:
        if self._sub is None:
            self._sub = await self._nc.subscribe(f"{self._prefix}.>", cb=self._on_message)
            self._ticker = asyncio.create_task(self._tick(), name="event-inbox-ticks")

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        sub, self._sub = self._sub, None
        await unsubscribe(sub)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            for queue in self._queues.values():
                queue.put_nowait(TICK)

    def reply_subject(self, request_id: str) -> str:
        return self._replies + request_id

    def open(self, request_id: str) -> Mailbox:
        """The queue of `request_id`'s events (and `NO_RESPONDERS`), until `close`. Call it on
        the event loop."""
        queue = self._queues.get(request_id)
        if queue is None:
            queue = self._queues[request_id] = Mailbox(asyncio.get_running_loop())
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _on_message(self, msg: Msg) -> None:
        if msg.subject == self.events_subject:
            try:
                batch = decode(msg.data, TokenEventBatch)
            except MessageError as err:
                self.num_invalid += 1
                log.warning("ignoring an invalid token event batch error=%s", err)
                return
            for event in batch.events:
                queue = self._queues.get(event.request_id)
                if queue is not None:
                    queue.put_nowait(event)
            return
        no_responders = msg.headers is not None and msg.headers.get("Status") == "503"
        if msg.subject.startswith(self._replies) and no_responders:
            queue = self._queues.get(msg.subject[len(self._replies) :])
            if queue is not None:
                queue.put_nowait(NO_RESPONDERS)
