"""The router's live picture of the pool: worker records from etcd, cached blocks from NATS.

`WorkerView` follows the registry (a snapshot, then every change from the revision after it) and
the pool's KV events, and feeds both into one `KvIndex`:

- A kvrail worker that appears (any role), or comes back with a new incarnation, has its old
  index state dropped and its whole state fetched (`PoolKeys.kv_state`, request/reply). A worker
  whose record disappears (lease expired or revoked: stopped, or killed -9) leaves `records()`,
  `decode_workers()` and the index (every KV tier of it) at once, and any fetch for it stops.
- A live event is applied if it is the next one of the loaded incarnation. Otherwise (a gap, no
  state yet, a newer incarnation) the state is fetched again. While a fetch is in flight the
  worker's events are buffered (at most `kv_events.MAX_BUFFERED_EVENTS`) and the ones newer than
  the state are replayed on top of it, because NATS delivers the reply and the events on
  different subscriptions, in no fixed order between them.
- vLLM servers (`engine="vllm"`) publish no KV events and answer no state request: they are
  never fetched nor indexed, so the index matches no block on them.
- Events of a worker that is not in the registry, or of an older incarnation than its record, are
  dropped and counted in `num_dropped_events`: the state fetch when the worker's record appears
  covers everything they carried. Prefill-only workers are indexed too (`prefill_candidates`),
  so a prompt's remote prefill can go to the prefill worker holding its prefix.
- A fetch that times out, finds no responder or gets an invalid reply is retried with exponential
  backoff (jittered, capped at `retry_max_s`) for as long as the worker is registered.
- A malformed event is logged without its payload and counted in `num_malformed_events`.
- Every `resync_interval_s` the records are read again and anything the watch missed is
  corrected (a watch that stalled without an error); a change the watch delivered after a read
  began always wins over that read. A broken watch is re-established from a fresh read.

The event callback never awaits: it only updates memory and starts fetch tasks.

`WorkerView` holds the state, its lifecycle and the queries; it inherits the registry half from
`worker_records.RecordFollower` and the KV-event and state-fetch half from
`kv_events.KvEventFollower`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Collection, Mapping, Sequence

from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from kvrail.bus import unsubscribe
from kvrail.errors import DeadlineExceededError
from kvrail.keys import PoolKeys
from kvrail.messages import DECODE_ROLES, KvEvent, WorkerRecord
from kvrail.registry import Registry
from kvrail.router.discovery.index import KvIndex, PrefixMatch
from kvrail.router.discovery.records import RecordFollower
from kvrail.router.policy import Candidate

STATE_TIMEOUT_S = 2.0
RETRY_INITIAL_S = 0.1
RETRY_MAX_S = 10.0
RESYNC_INTERVAL_S = 30.0
_NO_MATCH = PrefixMatch(0)


class WorkerView(RecordFollower):
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
        self.num_state_failures = 0
        self._nc = nc
        self._state_timeout_s = state_timeout_s
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._resync_interval_s = resync_interval_s
        self._rng = rng if rng is not None else random.Random()
        self._records: dict[str, WorkerRecord] = {}
        self._ready_by_role: tuple[tuple[WorkerRecord, ...], tuple[WorkerRecord, ...]] | None = None
        """`_ready`'s tuples, None once the records change."""
        self._ours: Callable[[str], int] | None = None
        self._ours_at_report: dict[str, int] = {}
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
        # Bounded (a clean-clone CI run once waited 600 s in a plain unsubscribe here, while a
        # state fetch kept retrying): a send that never completes must not keep the tasks alive.
        await unsubscribe(self._sub)
        tasks = [*self._tasks, *self._fetches.values()]
        self._tasks = []
        self._fetches.clear()
        self._buffers.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def track_load(self, ours: Callable[[str], int]) -> None:
        """Have candidates weigh a worker's load as the others' requests at its last report
        plus this router's now: `ours(worker_id)`, read as each report arrives, is how many of
        this router's requests that report may count (`Candidate.in_flight_at_report`)."""
        self._ours = ours

    # Queries ------------------------------------------------------------------------------------
    def records(self) -> dict[str, WorkerRecord]:
        """Every live record, by worker id (a copy)."""
        return dict(self._records)

    def record(self, worker_id: str) -> WorkerRecord | None:
        """`worker_id`'s live record, if it has one."""
        return self._records.get(worker_id)

    def decode_workers(self) -> tuple[WorkerRecord, ...]:
        """Ready workers that take decode requests, by worker id."""
        return self._ready()[0]

    def prefill_workers(self) -> tuple[WorkerRecord, ...]:
        """Ready prefill-only workers, by worker id."""
        return self._ready()[1]

    def _ready(self) -> tuple[tuple[WorkerRecord, ...], tuple[WorkerRecord, ...]]:
        """The ready decode and prefill workers, sorted once per change of the records (every
        request reads them, several times; immutable, so no reader copies them)."""
        if self._ready_by_role is None:
            ready = [r for _, r in sorted(self._records.items()) if r.is_ready]
            self._ready_by_role = (
                tuple(r for r in ready if r.role in DECODE_ROLES),
                tuple(r for r in ready if r.role == "prefill"),
            )
        return self._ready_by_role

    def candidates(
        self,
        hashes: Sequence[str],
        in_flight: Mapping[str, int] | None = None,
        fingerprint: str | None = None,
        engines: Collection[str] | None = None,
    ) -> list[Candidate]:
        """A routing `Candidate` per ready decode worker (of `fingerprint` and `engines`, when
        given), with the leading blocks of the prompt `hashes` it caches (in any KV tier, and how
        many only in a lower one) and this router's `in_flight` on it."""
        matched = self.index.match_tiers(hashes)
        return _candidates(
            self.decode_workers(), matched, in_flight, self._at_report(), fingerprint, engines
        )

    def prefill_candidates(
        self,
        in_flight: Mapping[str, int] | None = None,
        fingerprint: str | None = None,
        engines: Collection[str] | None = None,
        *,
        hashes: Sequence[str] = (),
    ) -> list[Candidate]:
        """A `Candidate` per ready prefill worker (of `fingerprint` and `engines`, when given),
        with the leading blocks of the prompt `hashes` it caches, as `candidates` counts them
        (none without `hashes`: a choice by load)."""
        matched = self.index.match_tiers(hashes)
        return _candidates(
            self.prefill_workers(), matched, in_flight, self._at_report(), fingerprint, engines
        )

    def holders(
        self,
        hashes: Sequence[str],
        in_flight: Mapping[str, int] | None = None,
        fingerprint: str | None = None,
        engines: Collection[str] | None = None,
    ) -> tuple[list[Candidate], list[Candidate]]:
        """`candidates` and `prefill_candidates` of one prompt from one match of the index:
        (decode workers, prefill workers)."""
        matched = self.index.match_tiers(hashes)
        at_report = self._at_report()
        return (
            _candidates(self.decode_workers(), matched, in_flight, at_report, fingerprint, engines),
            _candidates(
                self.prefill_workers(), matched, in_flight, at_report, fingerprint, engines
            ),
        )

    def _at_report(self) -> Mapping[str, int] | None:
        return self._ours_at_report if self._ours is not None else None

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
                return sum(self.has_state(r.worker_id) for r in workers) >= n
            return len(workers) >= n

        await self.wait_until(enough, timeout_s)


def _candidates(
    records: Sequence[WorkerRecord],
    matched: Mapping[str, PrefixMatch],
    in_flight: Mapping[str, int] | None,
    at_report: Mapping[str, int] | None,
    fingerprint: str | None,
    engines: Collection[str] | None,
) -> list[Candidate]:
    counts = in_flight or {}
    return [
        Candidate(
            worker_id=r.worker_id,
            matched_blocks=(m := matched.get(r.worker_id, _NO_MATCH)).num_blocks,
            num_host_blocks=m.num_host_blocks,
            num_disk_blocks=m.num_disk_blocks,
            num_running=r.num_running,
            num_waiting=r.num_waiting,
            in_flight=counts.get(r.worker_id, 0),
            kv_utilization=r.kv_utilization,
            in_flight_at_report=None if at_report is None else at_report.get(r.worker_id, 0),
        )
        for r in records
        if (fingerprint is None or r.fingerprint == fingerprint)
        and (engines is None or r.engine in engines)
    ]
