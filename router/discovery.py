"""The router's live picture of the pool: worker records from etcd, cached blocks from NATS.

`WorkerView` follows the registry (a snapshot, then every change from the revision after it) and
the pool's KV events, and feeds both into one `KvIndex`:

- A decode worker that appears, or comes back with a new incarnation, has its old index state
  dropped and its whole state fetched (`PoolKeys.kv_state`, request/reply). A worker whose record
  disappears (lease expired or revoked) leaves `records()`, `decode_workers()` and the index at
  once, and any fetch for it stops.
- A live event is applied if it is the next one of the loaded incarnation. Otherwise (a gap, no
  state yet, a newer incarnation) the state is fetched again. While a fetch is in flight the
  worker's events are buffered (at most `MAX_BUFFERED_EVENTS`) and the ones newer than the state
  are replayed on top of it, because NATS delivers the reply and the events on different
  subscriptions, in no fixed order between them.
- vLLM servers (`engine="vllm"`) publish no KV events and answer no state request: they are
  never fetched nor indexed, so the index matches no block on them.
- Events of a worker that is not in the registry, or of an older incarnation than its record, are
  dropped and counted in `num_dropped_events`: the state fetch when the worker's record appears
  covers everything they carried. Prefill-only workers are not indexed.
- A fetch that times out, finds no responder or gets an invalid reply is retried with exponential
  backoff (jittered, capped at `retry_max_s`) for as long as the worker is registered.
- A malformed event is logged without its payload and counted in `num_malformed_events`.
- Every `resync_interval_s` the records are read again and anything the watch missed is
  corrected (a watch that stalled without an error); a change the watch delivered after a read
  began always wins over that read. A broken watch is re-established from a fresh read.

The event callback never awaits: it only updates memory and starts fetch tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Collection, Mapping, Sequence

import aetcd
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvrail.errors import DeadlineExceededError
from kvrail.keys import PoolKeys
from kvrail.messages import KvEvent, MessageError, WorkerRecord, decode
from kvrail.registry import Registry
from kvrail.router.index import KvIndex
from kvrail.router.policy import Candidate

log = logging.getLogger(__name__)

STATE_TIMEOUT_S = 2.0
RETRY_INITIAL_S = 0.1
RETRY_MAX_S = 10.0
RESYNC_INTERVAL_S = 30.0
MAX_BUFFERED_EVENTS = 1024
DECODE_ROLES = ("decode", "both")
INDEXED_ENGINES = ("kvrail",)
"""Engines whose workers publish KV events."""


class WorkerView:
    """Worker records and their KV index, kept current; see the module docstring."""

    def __init__(
        self,
        registry: Registry,
        nc: NatsClient,
        keys: PoolKeys,
        *,
        state_timeout_s: float = STATE_TIMEOUT_S,
        retry_initial_s: float = RETRY_INITIAL_S,
        retry_max_s: float = RETRY_MAX_S,
        resync_interval_s: float = RESYNC_INTERVAL_S,
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.keys = keys
        self.index = KvIndex()
        self.ready = asyncio.Event()
        """Set once the first etcd snapshot has been applied."""
        self.num_malformed_events = 0
        """Events and state replies that did not decode or named another worker."""
        self.num_dropped_events = 0
        """Events of unknown workers, of an older incarnation, or past a full buffer."""
        self.num_state_loads = 0
        self.num_state_failures = 0
        self._nc = nc
        self._state_timeout_s = state_timeout_s
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._resync_interval_s = resync_interval_s
        self._rng = rng if rng is not None else random.Random()
        self._records: dict[str, WorkerRecord] = {}
        # A logical clock: the stamp of each worker's latest applied change (removals included),
        # so a registry read never overwrites a change the watch delivered after the read began.
        self._clock = 0
        self._stamps: dict[str, int] = {}
        self._fetches: dict[str, asyncio.Task[None]] = {}
        self._buffers: dict[str, list[KvEvent]] = {}
        self._changed = asyncio.Event()
        self._sub: Subscription | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # Lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Subscribe to the pool's KV events, then follow the registry (in background tasks)."""
        if self._sub is not None:
            raise RuntimeError("WorkerView already started")
        # Subscribe before any state is fetched, so no event published after a reply is missed.
        self._sub = await self._nc.subscribe(self.keys.kv_events_all, cb=self._on_message)
        self._tasks = [
            asyncio.create_task(self._follow_registry(), name="view:registry"),
            asyncio.create_task(self._resync_periodically(), name="view:resync"),
        ]

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
        tasks = [*self._tasks, *self._fetches.values()]
        self._tasks = []
        self._fetches.clear()
        self._buffers.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # Queries ------------------------------------------------------------------------------------
    def records(self) -> dict[str, WorkerRecord]:
        """Every live record, by worker id (a copy)."""
        return dict(self._records)

    def decode_workers(self) -> list[WorkerRecord]:
        """Ready workers that take decode requests, by worker id."""
        return [
            r for _, r in sorted(self._records.items()) if r.role in DECODE_ROLES and r.is_ready
        ]

    def prefill_workers(self) -> list[WorkerRecord]:
        """Ready prefill-only workers, by worker id."""
        return [r for _, r in sorted(self._records.items()) if r.role == "prefill" and r.is_ready]

    def candidates(
        self,
        hashes: Sequence[str],
        in_flight: Mapping[str, int] | None = None,
        fingerprint: str | None = None,
        engines: Collection[str] | None = None,
    ) -> list[Candidate]:
        """A routing `Candidate` per ready decode worker (of `fingerprint` and `engines`, when
        given), with the leading blocks of the prompt `hashes` it caches and this router's
        `in_flight` on it."""
        matched = self.index.match_all(hashes)
        return _candidates(self.decode_workers(), matched, in_flight, fingerprint, engines)

    def prefill_candidates(
        self,
        in_flight: Mapping[str, int] | None = None,
        fingerprint: str | None = None,
        engines: Collection[str] | None = None,
    ) -> list[Candidate]:
        """A `Candidate` per ready prefill worker (of `fingerprint` and `engines`, when given),
        for a choice by load (no cached blocks)."""
        return _candidates(self.prefill_workers(), {}, in_flight, fingerprint, engines)

    def has_state(self, worker_id: str) -> bool:
        """Whether the index holds the state of the worker's registered incarnation."""
        record = self._records.get(worker_id)
        loaded = self.index.incarnation(worker_id)
        return record is not None and loaded is not None and loaded >= record.incarnation

    def num_pending_events(self, worker_id: str) -> int:
        """Events held for replay while the worker's state is being fetched."""
        return len(self._buffers.get(worker_id, ()))

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Return once `predicate()` holds (checked after every change); raises
        DeadlineExceededError after `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    changed = self._changed
                    if predicate():
                        return
                    await changed.wait()
        except TimeoutError as err:
            raise DeadlineExceededError(f"worker view condition not met in {timeout_s}s") from err

    async def wait_for_workers(self, n: int, timeout_s: float, *, with_state: bool = False) -> None:
        """Wait until at least `n` decode workers are ready (and, with `with_state`, their KV
        state is loaded); raises DeadlineExceededError after `timeout_s`."""

        def enough() -> bool:
            workers = self.decode_workers()
            if with_state:
                workers = [r for r in workers if self.has_state(r.worker_id)]
            return len(workers) >= n

        await self.wait_until(enough, timeout_s)

    # Registry -----------------------------------------------------------------------------------
    async def _follow_registry(self) -> None:
        """Apply a snapshot, then watch from exactly the revision after it, until cancelled.

        NOTE: this does not iterate `Registry.watch()`, which reads its own snapshot: a record
        deleted between our read (which sets `ready`) and that one would never be reported gone.
        Watching from our read's revision leaves no such window.
        """
        delay_s = self._retry_initial_s
        while True:
            try:
                revision = await self._resync()
                self.ready.set()
                self._notify()
                watch = await self.registry.client.watch_prefix(
                    self.keys.workers_prefix.encode(), start_revision=revision + 1
                )
                try:
                    async for event in watch:
                        change = self.registry.change_of(event.kind, event.kv.key, event.kv.value)
                        if change is not None:
                            self._apply_record(change.worker_id, change.record)
                        delay_s = self._retry_initial_s
                finally:
                    await watch.cancel()
                log.warning("registry watch ended, following again")
            except (aetcd.exceptions.ClientError, ConnectionError) as err:
                log.warning("registry watch failed, retrying error=%s", type(err).__name__)
            await asyncio.sleep(self._jittered(delay_s))
            delay_s = min(delay_s * 2, self._retry_max_s)

    async def _resync_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._resync_interval_s)
            try:
                await self._resync()
            except (aetcd.exceptions.ClientError, ConnectionError) as err:
                log.warning("registry resync failed error=%s", type(err).__name__)

    async def _resync(self) -> int:
        """Read every record and apply what changed, except where the watch was newer; returns
        the etcd revision of the read."""
        mark = self._clock
        records, revision = await self.registry.workers()
        for worker_id, record in records.items():
            if self._stamps.get(worker_id, -1) <= mark:
                self._apply_record(worker_id, record)
        for worker_id in list(self._records):
            if worker_id not in records and self._stamps.get(worker_id, -1) <= mark:
                self._apply_record(worker_id, None)
        for worker_id, stamp in list(self._stamps.items()):
            if worker_id not in self._records and stamp <= mark:
                del self._stamps[worker_id]
        return revision

    def _apply_record(self, worker_id: str, record: WorkerRecord | None) -> None:
        self._clock += 1
        self._stamps[worker_id] = self._clock
        old = self._records.get(worker_id)
        if record is None:
            if old is None:
                return
            del self._records[worker_id]
            self._cancel_fetch(worker_id)
            self.index.forget(worker_id)
            log.info("worker left worker=%s incarnation=%d", worker_id, old.incarnation)
            self._notify()
            return
        if record == old:
            return
        self._records[worker_id] = record
        if (
            old is None
            or old.incarnation != record.incarnation
            or old.role != record.role
            or old.engine != record.engine
        ):
            log.info(
                "worker joined worker=%s incarnation=%d role=%s engine=%s is_ready=%s "
                "fingerprint=%s", worker_id, record.incarnation, record.role, record.engine,
                record.is_ready, record.fingerprint[:12],
            )  # fmt: skip
            if record.role not in DECODE_ROLES or record.engine not in INDEXED_ENGINES:
                self._cancel_fetch(worker_id)
                self.index.forget(worker_id)
            elif self.index.incarnation(worker_id) != record.incarnation:
                # The state held (if any) is an older process's. A state loaded from the new
                # incarnation's events, which may beat its record here, is kept.
                self._cancel_fetch(worker_id)
                self.index.forget(worker_id)
                self._start_fetch(worker_id, ())
        self._notify()

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
            or record.role not in DECODE_ROLES
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
            if state.worker_id != worker_id or not state.cleared:
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
        self.num_state_loads += 1
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


def _candidates(
    records: Sequence[WorkerRecord],
    matched: Mapping[str, int],
    in_flight: Mapping[str, int] | None,
    fingerprint: str | None,
    engines: Collection[str] | None,
) -> list[Candidate]:
    counts = in_flight or {}
    return [
        Candidate(
            worker_id=r.worker_id,
            matched_blocks=matched.get(r.worker_id, 0),
            num_running=r.num_running,
            num_waiting=r.num_waiting,
            in_flight=counts.get(r.worker_id, 0),
            kv_utilization=r.kv_utilization,
        )
        for r in records
        if (fingerprint is None or r.fingerprint == fingerprint)
        and (engines is None or r.engine in engines)
    ]
