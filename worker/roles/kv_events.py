"""KV events: tell routers which prompt blocks this worker caches.

The engine thread hands over its net prefix-cache changes (`KvChanges`, see `EngineService`) on
the event loop; each batch becomes one `KvEvent` on `PoolKeys.kv_events(worker_id)`, split into
several events with consecutive seqs when a list would exceed the block limit (see Limits, at
most `MAX_BLOCKS`). Hashes are `block_hash.hex()`, the 16-byte `kvrail.hashing` hashes the
engine's prefix cache is keyed by.

Guarantees (the router's contract):
- `seq` is 1 for an incarnation's first event and grows by exactly one per event (a publish
  that fails is logged and leaves a gap, so routers fetch the state again);
- a stored hash's KV is fully written here, so a request with that prefix would hit it; a
  removed hash left the cache (evicted on reuse, or reset); no hash is in both lists of one
  event, and a hash is never removed before it was stored;
- `PoolKeys.kv_state(worker_id)` answers with one `KvEvent` (`cleared=True`, `stored` = every
  hash cached after event `seq`, `seq` = the last event's seq, 0 before any). It is read from a
  mirror updated in the same place seqs are assigned, so it is exactly the state after `seq`: a
  router that subscribed to the events before asking applies only the events with a greater seq.

Limits: one NATS message must fit the server's `max_payload` (1 MiB by default; each hash costs
35 bytes of JSON), so the limits follow it (`block_limits`): an event holds at most
min(`MAX_BLOCKS`, ~14,900 at 1 MiB) hashes per list (a larger batch is split, as above), and a
kvstate reply at most min(`MAX_BLOCKS`, ~29,900 at 1 MiB) hashes. A worker caching more replies
with the first of them, in the order they were stored, and logs a warning; a router then misses
the rest until their events come again. A NATS `max_payload` of 8 MiB (kvrail's
`MAX_MESSAGE_BYTES`, which `kvrail.local.servers` and the chart's NATS set) lifts both limits to
`MAX_BLOCKS` (65,536).
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvrail.bus import unsubscribe
from kvrail.codec import MAX_BLOCKS, MessageError
from kvrail.keys import PoolKeys
from kvrail.messages import KvEvent
from kvrail.worker.engine.block_pool import KvChanges

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 5.0
_HASH_JSON_BYTES = 35  # '"' + 32 hex digits + '",'
_ENVELOPE_BYTES = 512  # the rest of a KvEvent (ids, seq, keys), generously


def block_limits(max_payload_bytes: int) -> tuple[int, int]:
    """(hashes per list of one event, hashes in one kvstate reply) such that the message fits in
    `max_payload_bytes` and within `MAX_BLOCKS`."""
    fit = (max_payload_bytes - _ENVELOPE_BYTES) // _HASH_JSON_BYTES
    if fit < 2:
        raise ValueError(f"a max payload of {max_payload_bytes} bytes holds no KV event")
    return min(MAX_BLOCKS, fit // 2), min(MAX_BLOCKS, fit)


class KvEventLog:
    """The pure half: seq numbering, splitting and the mirror of the cached hashes.

    `events_for` turns one batch of changes into the events to publish, in order, and applies
    them to `cached` before it returns; `state` is the kvstate reply for the same moment.
    """

    def __init__(
        self,
        worker_id: str,
        incarnation: int,
        *,
        max_event_blocks: int = MAX_BLOCKS,
        max_state_blocks: int = MAX_BLOCKS,
    ) -> None:
        if not 1 <= max_event_blocks <= MAX_BLOCKS or not 1 <= max_state_blocks <= MAX_BLOCKS:
            raise ValueError(f"block limits must be within 1..{MAX_BLOCKS}")
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.max_event_blocks = max_event_blocks
        self.max_state_blocks = max_state_blocks
        self.seq = 0  # the last seq handed out
        self.cached: dict[str, None] = {}  # every hash cached after event `seq`, in stored order

    def events_for(self, changes: KvChanges) -> list[KvEvent]:
        """The events of one batch (none if it is empty), with consecutive seqs."""
        stored = [h.hex() for h in changes.stored]
        removed = [h.hex() for h in changes.removed]
        events: list[KvEvent] = []
        step = self.max_event_blocks
        for start in range(0, max(len(stored), len(removed)), step):
            self.seq += 1
            events.append(
                KvEvent(
                    worker_id=self.worker_id,
                    incarnation=self.incarnation,
                    seq=self.seq,
                    stored=tuple(stored[start : start + step]),
                    removed=tuple(removed[start : start + step]),
                )
            )
        for block_hash in removed:
            self.cached.pop(block_hash, None)
        for block_hash in stored:
            self.cached[block_hash] = None
        return events

    def state(self) -> KvEvent:
        """Every cached hash (at most `max_state_blocks`, see the module's limits) as of event
        `seq`."""
        if len(self.cached) > self.max_state_blocks:
            log.warning(
                "kv state truncated worker=%s cached_blocks=%d reply_blocks=%d",
                self.worker_id,
                len(self.cached),
                self.max_state_blocks,
            )
        stored = tuple(itertools.islice(self.cached, self.max_state_blocks))
        return KvEvent(
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            seq=self.seq,
            stored=stored,
            cleared=True,
        )


class KvEventPublisher:
    """The I/O half: publishes a `KvEventLog`'s events in seq order and answers kvstate.

    `on_changes` is the `EngineService` callback (called on the event loop); it numbers the
    events at once and queues them for one publishing task, so publishes never reorder. `nc`
    must be connected: its server's `max_payload` sets the block limits.
    """

    def __init__(self, nc: NatsClient, keys: PoolKeys, worker_id: str, incarnation: int) -> None:
        self.nc = nc
        self.subject = keys.kv_events(worker_id)
        self.state_subject = keys.kv_state(worker_id)
        event_blocks, state_blocks = block_limits(nc.max_payload)
        self.event_log = KvEventLog(
            worker_id, incarnation, max_event_blocks=event_blocks, max_state_blocks=state_blocks
        )
        self._queue: asyncio.Queue[KvEvent | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None

    async def start(self) -> None:
        """Answer kvstate requests and start publishing (events queued before are kept)."""
        self._sub = await self.nc.subscribe(self.state_subject, cb=self._answer_state)
        self._task = asyncio.create_task(self._publish_all(), name="kv-events")
        log.info(
            "kv events publishing worker=%s subject=%s event_blocks=%d state_blocks=%d",
            self.event_log.worker_id,
            self.subject,
            self.event_log.max_event_blocks,
            self.event_log.max_state_blocks,
        )

    def on_changes(self, changes: KvChanges) -> None:
        for event in self.event_log.events_for(changes):
            self._queue.put_nowait(event)

    async def close(self) -> None:
        """Stop answering, publish what is queued (bounded wait), stop the task."""
        sub, self._sub = self._sub, None
        await unsubscribe(sub)
        if self._task is None:
            return
        self._queue.put_nowait(None)
        try:
            await asyncio.wait_for(self._task, _CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.warning("kv events left unpublished worker=%s", self.event_log.worker_id)
        self._task = None

    async def _publish_all(self) -> None:
        while (event := await self._queue.get()) is not None:
            try:
                await self.nc.publish(self.subject, event.encode())
            except (nats.errors.Error, MessageError) as err:  # routers see the gap, fetch the state
                log.warning(
                    "kv event publish failed worker=%s seq=%d error=%s",
                    event.worker_id,
                    event.seq,
                    type(err).__name__,
                )
                continue
            log.debug(
                "kv event published worker=%s seq=%d stored=%d removed=%d",
                event.worker_id,
                event.seq,
                len(event.stored),
                len(event.removed),
            )

    async def _answer_state(self, msg: Msg) -> None:
        state = self.event_log.state()  # no await before this: consistent with the seq
        await msg.respond(state.encode())
        log.debug(
            "kv state answered worker=%s seq=%d blocks=%d",
            state.worker_id,
            state.seq,
            len(state.stored),
        )
