"""KV events: tell routers which prompt blocks this worker caches, in which tier.

The engine thread hands over its net changes on the event loop (`KvChanges`, see
`EngineService`): the GPU prefix cache's, then each lower tier's that changed in the same loop
iteration (the host-memory and disk tiers, `KvChanges.tier`). Each batch becomes one `KvEvent`
of its tier on `PoolKeys.kv_events(worker_id)`, split into several events with consecutive seqs
when a list would exceed the block limit (`kv_event_log`, which also holds the limits). Hashes
are `block_hash.hex()`, the 16-byte `kvrail.hashing` hashes the engine's prefix cache and its
tiers are keyed by.

Guarantees (the router's contract):
- `seq` is 1 for an incarnation's first event and grows by exactly one per event, whatever its
  tier (one sequence; a publish that fails is logged and leaves a gap, so routers fetch the state
  again);
- a stored hash's KV is fully written in that tier (for a lower tier: resident and checksummed),
  so a request with that prefix would hit it there; a removed hash left that tier (evicted, or
  reset); no hash is in both lists of one event, and a hash is never removed from a tier before
  it was stored there. A block may be held by several tiers at once (a GPU block written behind
  to the host tier stays in both until one evicts it);
- `PoolKeys.kv_state(worker_id)` answers with one `KvEvent` (`cleared=True`, `tier="gpu"`,
  `stored` = every hash in the GPU cache after event `seq`, `lower_tiers` = every hash of each
  lower tier holding any, `seq` = the last event's seq, 0 before any). It is read from a mirror
  updated in the same place seqs are assigned, so it is exactly the state after `seq`: a router
  that subscribed to the events before asking applies only the events with a greater seq.

Routers from before the tiers ignore `tier` and `lower_tiers`: they take a lower tier's events
for the GPU's, so they may count a lower-tier block as a GPU hit or drop a GPU block a lower
tier evicted. Either costs a less apt route (a load instead of a hit, or a missed hit), never a
wrong answer: the worker's own cache decides what it reuses.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvrail.bus import unsubscribe
from kvrail.codec import MessageError
from kvrail.keys import PoolKeys
from kvrail.messages import KvEvent
from kvrail.worker.engine.block_pool import KvChanges
from kvrail.worker.roles.kv_event_log import KvEventLog, block_limits

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 5.0


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
                "kv event published worker=%s seq=%d tier=%s stored=%d removed=%d",
                event.worker_id,
                event.seq,
                event.tier,
                len(event.stored),
                len(event.removed),
            )

    async def _answer_state(self, msg: Msg) -> None:
        state = self.event_log.state()  # no await before this: consistent with the seq
        await msg.respond(state.encode())
        log.debug(
            "kv state answered worker=%s seq=%d blocks=%d lower_tier_blocks=%d",
            state.worker_id,
            state.seq,
            len(state.stored),
            sum(len(t.stored) for t in state.lower_tiers),
        )
