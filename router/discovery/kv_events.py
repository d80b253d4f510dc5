"""KV events and state fetches: the half of `WorkerView` that keeps its `KvIndex` in step.

`KvEventFollower` applies each kvrail worker's live `KvEvent`s (`PoolKeys.kv_events`; every role,
every KV tier) to the index, and fetches the worker's whole state (`PoolKeys.kv_state`,
request/reply) when an event is out of step or a new incarnation registers; events that arrive
during a fetch are buffered and replayed on top of the state. The guarantees are in the
docstring of `kvrail.router.discovery.view`.
The class holds no state of its own: `WorkerView.__init__` sets every attribute declared on it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from kvrail.codec import MessageError, decode
from kvrail.keys import PoolKeys
from kvrail.messages import KvEvent, WorkerRecord
from kvrail.router.discovery.index import KvIndex

log = logging.getLogger(__name__)

MAX_BUFFERED_EVENTS = 1024
INDEXED_ENGINES = ("kvrail",)
"""Engines whose workers publish KV events."""


class KvEventFollower:
    """The KV-event and state-fetch methods of `WorkerView`; not used on its own."""

    keys: PoolKeys
    index: KvIndex
    num_malformed_events: int
    num_dropped_events: int
    num_state_failures: int
    _nc: NatsClient
    _state_timeout_s: float
    _retry_initial_s: float
    _retry_max_s: float
    _rng: random.Random
    _records: dict[str, WorkerRecord]
    _fetches: dict[str, asyncio.Task[None]]
    _buffers: dict[str, list[KvEvent]]
    _changed: asyncio.Event

    # KV events ----------------------------------------------------------------------------------
    async def _on_message(self, msg: Msg) -> None:
        try:
            event = decode(msg.data, KvEvent)
            if msg.subject != self.keys.kv_events(event.worker_id):
                raise MessageError("kv event published on another worker's subject")
        except (MessageError, ValueError) as err:
            self.num_malformed_events += 1
            log.warning("ignoring a malformed kv event subject=%s error=%s", msg.subject, err)
            self._notify()
            return
        self.on_event(event)

    def on_event(self, event: KvEvent) -> None:
        """Apply one decoded live event (the subscription's callback; never blocks)."""
        worker_id = event.worker_id
        record = self._records.get(worker_id)
        if (
            record is None
            or record.engine not in INDEXED_ENGINES
            or event.incarnation < record.incarnation
        ):
            self.num_dropped_events += 1
            self._notify()
            return
        buffer = self._buffers.get(worker_id)
        if buffer is not None:  # a fetch is in flight: replay after its state is loaded
            if len(buffer) < MAX_BUFFERED_EVENTS:
                buffer.append(event)
            else:  # the replay will find a gap and fetch again
                self.num_dropped_events += 1
            self._notify()
            return
        if self.index.apply(event):
            self._notify()
            return
        log.info(
            "kv events out of step, fetching state worker=%s incarnation=%d seq=%d last_seq=%s",
            worker_id, event.incarnation, event.seq, self.index.last_seq(worker_id),
        )  # fmt: skip
        self._start_fetch(worker_id, (event,))

    # State fetches ------------------------------------------------------------------------------
    def _start_fetch(self, worker_id: str, events: Sequence[KvEvent]) -> None:
        buffer = self._buffers.setdefault(worker_id, [])
        buffer.extend(events)
        if worker_id not in self._fetches:
            self._fetches[worker_id] = asyncio.create_task(
                self._fetch_state(worker_id), name=f"view:kvstate:{worker_id}"
            )

    def _cancel_fetch(self, worker_id: str) -> None:
        task = self._fetches.pop(worker_id, None)
        self._buffers.pop(worker_id, None)
        if task is not None:
            task.cancel()

    async def _fetch_state(self, worker_id: str) -> None:
        """Fetch and load the worker's state until it is loaded or the worker is gone."""
        delay_s = self._retry_initial_s
        attempt = 0
        try:
            while worker_id in self._records:
                attempt += 1
                state = await self._request_state(worker_id, attempt)
                record = self._records.get(worker_id)
                if record is None:
                    return
                if state is not None and state.incarnation >= record.incarnation:
                    if self._load(worker_id, state):
                        return
                elif state is not None:
                    log.info("kv state of an old incarnation, retrying worker=%s", worker_id)
                self.num_state_failures += 1
                self._notify()
                await asyncio.sleep(self._jittered(delay_s))
                delay_s = min(delay_s * 2, self._retry_max_s)
        finally:
            if self._fetches.get(worker_id) is asyncio.current_task():
                del self._fetches[worker_id]
                self._buffers.pop(worker_id, None)

    async def _request_state(self, worker_id: str, attempt: int) -> KvEvent | None:
        # The first failure and every tenth after it are warnings; the rest are debug lines, so a
        # worker that never answers costs one line per about a minute and a half.
        level = logging.WARNING if attempt % 10 == 1 else logging.DEBUG
        try:
            reply = await self._nc.request(
                self.keys.kv_state(worker_id), b"", timeout=self._state_timeout_s
            )
        except nats.errors.Error as err:
            log.log(level, "kv state fetch failed worker=%s attempt=%d error=%s",
                    worker_id, attempt, type(err).__name__)  # fmt: skip
            return None
        try:
            state = decode(reply.data, KvEvent)
            if state.worker_id != worker_id or not state.cleared or state.tier != "gpu":
                raise MessageError("kv state reply is not a cleared state of this worker")
        except MessageError as err:
            self.num_malformed_events += 1
            log.log(level, "invalid kv state reply worker=%s attempt=%d error=%s",
                    worker_id, attempt, err)  # fmt: skip
            return None
        return state

    def _load(self, worker_id: str, state: KvEvent) -> bool:
        """Load `state` and replay the buffered events newer than it; False: fetch again."""
        self.index.load_state(state)
        buffered = sorted(self._buffers.get(worker_id, ()), key=lambda e: (e.incarnation, e.seq))
        for i, event in enumerate(buffered):
            if event.incarnation < state.incarnation:
                continue
            if not self.index.apply(event):
                self._buffers[worker_id] = buffered[i:]
                log.info("kv events out of step after a state load worker=%s", worker_id)
                self._notify()
                return False
        log.info(
            "kv state loaded worker=%s incarnation=%d seq=%d num_hashes=%d num_replayed=%d",
            worker_id, state.incarnation, state.seq, self.index.num_hashes(worker_id),
            len(buffered),
        )  # fmt: skip
        self._notify()
        return True

    # Helpers ------------------------------------------------------------------------------------
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _jittered(self, delay_s: float) -> float:
        return delay_s * (0.5 + self._rng.random() / 2)
