"""kvrail.router.discovery.view against the harness's real etcd and NATS.

The worker records, the KV events and the kv_state answers are published by these tests, standing
in for worker processes: this tests the router's view of the pool alone. Routing against real
workers is tested with the router app.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvrail.codec import decode
from kvrail.keys import PoolKeys
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.messages import Cancel, GenerateRequest, KvEvent, WorkerRecord
from kvrail.outputs import RequestOutput, TokenEvent, TokenEventBatch
from kvrail.registry import Registration, Registry, etcd_client
from kvrail.router.discovery.index import prompt_hashes
from kvrail.router.discovery.view import WorkerView
from kvrail.router.policy import Chooser
from kvrail.router.streams.dispatcher import Dispatcher, DispatchError, Job
from kvrail.sampling import SamplingParams
from kvrail.settings import Settings
from kvrail.testing.pool import flushed

FINGERPRINT = "f" * 64
BLOCK_SIZE = 4
WAIT_S = 5.0


@dataclass
class Pool:
    registry: Registry
    nc: NatsClient
    keys: PoolKeys
    view: WorkerView


@pytest.fixture
async def pool(etcd_server: EtcdServer, nats_server: NatsServer) -> AsyncIterator[Pool]:
    keys = PoolKeys("default", f"rd-{uuid.uuid4().hex[:8]}")
    client = etcd_client(Settings(etcd_endpoints=(etcd_server.endpoint,)))
    async with client:
        nc = await nats.connect(nats_server.url)
        registry = Registry(client, keys)
        view = WorkerView(registry, nc, keys, state_timeout_s=0.5, retry_initial_s=0.05,
                          retry_max_s=0.2)  # fmt: skip
        try:
            yield Pool(registry, nc, keys, view)
        finally:
            await view.stop()
            await registry.delete_pool()
            await nc.close()


def record(worker_id: str, incarnation: int = 1, **kw: object) -> WorkerRecord:
    values: dict[str, object] = dict(
        worker_id=worker_id, pod_uid=f"uid-{incarnation}", incarnation=incarnation,
        role="decode", fingerprint=FINGERPRINT, block_size=BLOCK_SIZE, is_ready=True,
    )  # fmt: skip
    values.update(kw)
    return WorkerRecord(**values)  # type: ignore[arg-type]


def hashes(*token_ids: int) -> list[str]:
    return list(prompt_hashes(list(token_ids), BLOCK_SIZE, FINGERPRINT))


PROMPT = hashes(*range(16))  # 4 blocks


@dataclass
class FakeWorker:
    """A stand-in for one worker's KV publisher: its cached hashes, its event seq, and a
    responder on its kv_state subject."""

    nc: NatsClient
    keys: PoolKeys
    worker_id: str
    incarnation: int = 1
    seq: int = 0
    cached: set[str] = field(default_factory=set)
    num_state_requests: int = 0
    requested: asyncio.Event = field(default_factory=asyncio.Event)
    gate: asyncio.Event | None = None
    """When set, a state request is answered with the state as it was when the request came,
    but only once the gate opens (events published meanwhile race the reply)."""
    _sub: Subscription | None = None

    async def serve_state(self) -> FakeWorker:
        self._sub = await self.nc.subscribe(self.keys.kv_state(self.worker_id), cb=self._answer)
        await flushed(self.nc)  # the view, on another connection, finds it answering
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _answer(self, msg: Msg) -> None:
        self.num_state_requests += 1
        self.requested.set()
        state = KvEvent(worker_id=self.worker_id, incarnation=self.incarnation, seq=self.seq,
                        stored=tuple(sorted(self.cached)), cleared=True)  # fmt: skip
        if self.gate is not None:
            await self.gate.wait()
        await msg.respond(state.encode())

    async def publish(
        self, stored: Sequence[str] = (), removed: Sequence[str] = (), lose: bool = False
    ) -> KvEvent:
        """The next event; with `lose`, the worker changes its cache but the event is lost."""
        self.seq += 1
        self.cached = (self.cached - set(removed)) | set(stored)
        event = KvEvent(worker_id=self.worker_id, incarnation=self.incarnation, seq=self.seq,
                        stored=tuple(stored), removed=tuple(removed))  # fmt: skip
        if not lose:
            await self.nc.publish(self.keys.kv_events(self.worker_id), event.encode())
        return event


async def until(pool: Pool, predicate: Callable[[], bool]) -> None:
    await pool.view.wait_until(predicate, WAIT_S)


def matched(pool: Pool, prompt: list[str] = PROMPT) -> dict[str, int]:
    return {c.worker_id: c.matched_blocks for c in pool.view.candidates(prompt)}


async def test_the_snapshot_is_applied_before_ready_and_states_are_fetched(pool: Pool) -> None:
    w0 = await FakeWorker(pool.nc, pool.keys, "d-0", cached=set(PROMPT[:3])).serve_state()
    w1 = await FakeWorker(pool.nc, pool.keys, "d-1", cached=set(PROMPT[:1])).serve_state()
    regs = [await pool.registry.register(record("d-0")),
            await pool.registry.register(record("d-1")),
            await pool.registry.register(record("p-0", role="prefill")),
            await pool.registry.register(record("d-2", is_ready=False))]  # fmt: skip
    await pool.view.start()
    await pool.view.ready.wait()
    assert set(pool.view.records()) == {"d-0", "d-1", "p-0", "d-2"}
    assert [r.worker_id for r in pool.view.decode_workers()] == ["d-0", "d-1"]
    await pool.view.wait_for_workers(2, WAIT_S, with_state=True)
    assert matched(pool) == {"d-0": 3, "d-1": 1}
    assert pool.view.index.workers() == {"d-0", "d-1"}  # d-2 and p-0 have no responder yet
    assert w0.num_state_requests == w1.num_state_requests == 1
    for reg in regs:
        await reg.close()


async def test_live_events_update_the_index_in_order(pool: Pool) -> None:
    w0 = await FakeWorker(pool.nc, pool.keys, "d-0").serve_state()
    reg = await pool.registry.register(record("d-0"))
    await pool.view.start()
    await pool.view.wait_for_workers(1, WAIT_S, with_state=True)
    assert matched(pool) == {"d-0": 0}
    await w0.publish(stored=PROMPT[:2])
    await w0.publish(stored=PROMPT[2:])
    await until(pool, lambda: matched(pool) == {"d-0": 4})
    await w0.publish(removed=PROMPT[1:2])
    await until(pool, lambda: matched(pool) == {"d-0": 1})
    assert pool.view.index.last_seq("d-0") == 3
    assert w0.num_state_requests == 1  # no gap, no re-fetch
    await reg.close()


async def test_a_gap_in_the_events_makes_the_view_fetch_the_state_again(pool: Pool) -> None:
    w0 = await FakeWorker(pool.nc, pool.keys, "d-0", cached=set(PROMPT[:1])).serve_state()
    reg = await pool.registry.register(record("d-0"))
    await pool.view.start()
    await pool.view.wait_for_workers(1, WAIT_S, with_state=True)
    await w0.publish(stored=PROMPT[1:3], lose=True)  # seq 1 never arrives
    await w0.publish(stored=PROMPT[3:])  # seq 2: a gap
    await until(pool, lambda: matched(pool) == {"d-0": 4})
    assert w0.num_state_requests == 2
    assert pool.view.index.last_seq("d-0") == 2
    await w0.publish(removed=PROMPT[:1])  # and events apply on top of the new state
    await until(pool, lambda: matched(pool) == {"d-0": 0})
    await reg.close()


async def test_a_closed_worker_leaves_the_view_and_the_index_promptly(pool: Pool) -> None:
    await FakeWorker(pool.nc, pool.keys, "d-0", cached=set(PROMPT)).serve_state()
    await FakeWorker(pool.nc, pool.keys, "d-1", cached=set(PROMPT)).serve_state()
    reg0 = await pool.registry.register(record("d-0"), ttl_s=30)
    reg1 = await pool.registry.register(record("d-1"), ttl_s=30)
    await pool.view.start()
    await pool.view.wait_for_workers(2, WAIT_S, with_state=True)
    await reg0.close()  # the lease is revoked: gone within WAIT_S, long before its 30 s TTL
    await until(pool, lambda: "d-0" not in pool.view.records())
    assert [r.worker_id for r in pool.view.decode_workers()] == ["d-1"]
    assert pool.view.index.workers() == {"d-1"}
    assert pool.view.index.match_all(PROMPT) == {"d-1": 4}
    await reg1.close()


async def test_a_new_incarnation_drops_the_old_state_and_fetches_the_new_one(pool: Pool) -> None:
    w0 = await FakeWorker(pool.nc, pool.keys, "d-0", cached=set(PROMPT)).serve_state()
    old: Registration = await pool.registry.register(record("d-0", incarnation=1))
    await pool.view.start()
    await pool.view.wait_for_workers(1, WAIT_S, with_state=True)
    await w0.publish(stored=hashes(*range(100, 104)))
    await until(pool, lambda: pool.view.index.last_seq("d-0") == 1)
    # The process restarts: an empty cache, seq from 0, a new record under a new lease.
    w0.incarnation, w0.seq, w0.cached = 2, 0, set(PROMPT[:1])
    new = await pool.registry.register(record("d-0", incarnation=2))
    await until(pool, lambda: pool.view.index.incarnation("d-0") == 2)
    assert matched(pool) == {"d-0": 1}
    assert pool.view.index.num_hashes("d-0") == 1
    # A late event of the dead process is dropped, not applied and not a reason to re-fetch.
    requests = w0.num_state_requests
    dropped = pool.view.num_dropped_events
    late = KvEvent(worker_id="d-0", incarnation=1, seq=2, stored=tuple(PROMPT))
    await pool.nc.publish(pool.keys.kv_events("d-0"), late.encode())
    await until(pool, lambda: pool.view.num_dropped_events == dropped + 1)
    assert matched(pool) == {"d-0": 1}
    assert w0.num_state_requests == requests
    await old.close()  # the old lease ending must not remove the new record
    await new.update(dataclasses.replace(new.record, num_running=3))
    await until(pool, lambda: pool.view.records()["d-0"].num_running == 3)
    assert pool.view.has_state("d-0")
    await new.close()


async def test_malformed_and_misaddressed_events_are_ignored_and_counted(pool: Pool) -> None:
    w0 = await FakeWorker(pool.nc, pool.keys, "d-0").serve_state()
    reg = await pool.registry.register(record("d-0"))
    await pool.view.start()
    await pool.view.wait_for_workers(1, WAIT_S, with_state=True)
    await pool.nc.publish(pool.keys.kv_events("d-0"), b"{not a kv event")
    # A valid event naming another worker than its subject's.
    other = KvEvent(worker_id="d-1", incarnation=1, seq=1, stored=tuple(PROMPT))
    await pool.nc.publish(pool.keys.kv_events("d-0"), other.encode())
    await until(pool, lambda: pool.view.num_malformed_events == 2)
    await w0.publish(stored=PROMPT[:2])  # the stream goes on
    await until(pool, lambda: matched(pool) == {"d-0": 2})
    assert w0.num_state_requests == 1
    await reg.close()


async def test_events_of_an_unregistered_worker_are_dropped_and_its_state_fetched_on_arrival(
    pool: Pool,
) -> None:
    w0 = await FakeWorker(pool.nc, pool.keys, "d-0").serve_state()
    await pool.view.start()
    await pool.view.ready.wait()
    await w0.publish(stored=PROMPT[:2])
    await until(pool, lambda: pool.view.num_dropped_events == 1)
    assert pool.view.index.workers() == set()
    reg = await pool.registry.register(record("d-0"))
    await pool.view.wait_for_workers(1, WAIT_S, with_state=True)
    assert matched(pool) == {"d-0": 2}  # the state carried what the dropped event said
    await reg.close()


async def test_a_worker_that_answers_only_later_gets_its_state_by_retrying(pool: Pool) -> None:
    reg = await pool.registry.register(record("d-0"))
    await pool.view.start()
    await pool.view.wait_for_workers(1, WAIT_S)
    await until(pool, lambda: pool.view.num_state_failures >= 2)  # no responder yet
    assert not pool.view.has_state("d-0")
    await FakeWorker(pool.nc, pool.keys, "d-0", cached=set(PROMPT[:2])).serve_state()
    await pool.view.wait_for_workers(1, WAIT_S, with_state=True)
    assert matched(pool) == {"d-0": 2}
    await reg.close()


async def test_the_periodic_resync_removes_a_record_the_watch_missed(pool: Pool) -> None:
    view = WorkerView(pool.registry, pool.nc, pool.keys, resync_interval_s=0.1)
    reg = await pool.registry.register(record("d-0"))
    await view.start()
    try:
        await view.ready.wait()
        # A deletion the watch never delivered (as between the first read and the watch start).
        view._apply_record("d-9", record("d-9"))
        assert "d-9" in view.records()
        await view.wait_until(lambda: "d-9" not in view.records(), WAIT_S)
        assert set(view.records()) == {"d-0"}
    finally:
        await view.stop()
    await reg.close()


async def test_events_that_overtake_the_state_reply_are_replayed_on_top_of_it(pool: Pool) -> None:
    gate = asyncio.Event()
    w0 = await FakeWorker(pool.nc, pool.keys, "d-0", cached=set(PROMPT[:1]), seq=5,
                          gate=gate).serve_state()  # fmt: skip
    view = WorkerView(pool.registry, pool.nc, pool.keys, state_timeout_s=WAIT_S)
    reg = await pool.registry.register(record("d-0"))
    await view.start()
    try:
        await view.ready.wait()
        # The state (seq 5) is taken; events 6 and 7 reach the router before the reply does.
        await asyncio.wait_for(w0.requested.wait(), WAIT_S)
        await w0.publish(stored=PROMPT[1:3])
        await w0.publish(stored=PROMPT[3:], removed=PROMPT[2:3])
        await view.wait_until(lambda: view.num_pending_events("d-0") == 2, WAIT_S)
        gate.set()
        await view.wait_for_workers(1, WAIT_S, with_state=True)
        assert view.index.last_seq("d-0") == 7
        assert view.index.matched_blocks("d-0", PROMPT) == 2
        assert view.index.num_hashes("d-0") == 3
        assert w0.num_state_requests == 1  # replayed, not fetched again
    finally:
        gate.set()
        await view.stop()
    await reg.close()


async def test_duplicated_reordered_and_late_token_events_fail_cleanly_or_are_ignored(
    pool: Pool,
) -> None:
    """A stand-in decode worker answers each request with a scripted sequence of events (seq
    numbers). A duplicated or reordered event fails the request with `lost_events` (never wrong
    text) and the router tells every worker to cancel it; events after the last one, or for
    another request, are ignored."""
    scripts = {
        "dup": [0, 0, 1],
        "reordered": [1, 0],
        "late": [0, 1, 1, 2],  # 1 is last; what comes after it is never read
    }
    cancelled: list[str] = []

    async def on_cancel(msg: Msg) -> None:
        cancelled.append(decode(msg.data, Cancel).request_id.split("-")[0])

    async def answer(msg: Msg) -> None:
        request = decode(msg.data, GenerateRequest)
        seqs = scripts[request.request_id.split("-")[0]]
        last = 1 if request.request_id.startswith("late") else len(seqs) - 1
        stranger = TokenEvent(RequestOutput("someone-else", (9,)), 0, "d-0")
        await pool.nc.publish(request.stream_subject, TokenEventBatch((stranger,)).encode())
        for i, seq in enumerate(seqs):
            output = RequestOutput(
                request.request_id, (100 + seq,), "length" if i == last else None
            )
            event = TokenEvent(output, seq, "d-0")
            await pool.nc.publish(request.stream_subject, TokenEventBatch((event,)).encode())

    sub = await pool.nc.subscribe(pool.keys.decode_requests("d-0"), cb=answer)
    cancel_sub = await pool.nc.subscribe(pool.keys.cancel, cb=on_cancel)
    reg = await pool.registry.register(record("d-0"))
    await pool.view.start()
    await pool.view.wait_for_workers(1, WAIT_S)
    dispatcher = Dispatcher(pool.nc, pool.keys, pool.view, Chooser("round-robin"), BLOCK_SIZE)

    async def run(name: str) -> list[int]:
        job = Job(
            f"{name}-{uuid.uuid4().hex[:6]}",
            tuple(range(8)),
            SamplingParams(max_tokens=4),
            time.time() + 10,
        )
        async with dispatcher.open(job) as stream:
            return [t for event in [e async for e in stream] for t in event.output.token_ids]

    for name in ("dup", "reordered"):
        with pytest.raises(DispatchError) as err:
            await run(name)
        assert err.value.code == "lost_events"
    assert await run("late") == [100, 101]
    await pool.nc.flush()
    await asyncio.sleep(0.2)
    assert sorted(cancelled) == ["dup", "reordered"]  # the finished one needs no cancel
    await cancel_sub.unsubscribe()
    await sub.unsubscribe()
    await reg.close()


async def test_events_queued_behind_a_slow_reader_arrive_as_one_and_a_failure_after_them(
    pool: Pool,
) -> None:
    """A stand-in decode worker sends ten one-token events (one per step) while the reader is
    still busy with the first. The reader then gets the other nine as one event: every token in
    order, the last one's finish reason. A duplicate behind good events fails the request only
    after those events' tokens were read."""
    scripts = {"ten": list(range(10)), "dup": [0, 1, 2, 2, 3]}

    async def answer(msg: Msg) -> None:
        request = decode(msg.data, GenerateRequest)
        seqs = scripts[request.request_id.split("-")[0]]
        for i, seq in enumerate(seqs):
            output = RequestOutput(
                request.request_id, (100 + i,), "length" if i == len(seqs) - 1 else None
            )
            event = TokenEvent(output, seq, "d-0")
            await pool.nc.publish(request.stream_subject, TokenEventBatch((event,)).encode())

    sub = await pool.nc.subscribe(pool.keys.decode_requests("d-0"), cb=answer)
    reg = await pool.registry.register(record("d-0"))
    await pool.view.start()
    await pool.view.wait_for_workers(1, WAIT_S)
    dispatcher = Dispatcher(pool.nc, pool.keys, pool.view, Chooser("round-robin"), BLOCK_SIZE)

    async def read(name: str, events: list[TokenEvent]) -> None:
        job = Job(f"{name}-{uuid.uuid4().hex[:6]}", tuple(range(8)),
                  SamplingParams(max_tokens=10), time.time() + 10)  # fmt: skip
        async with dispatcher.open(job) as stream:
            async for event in stream:
                events.append(event)
                if event.seq == 0:
                    await asyncio.sleep(0.5)  # busy: the rest queue up behind

    ten: list[TokenEvent] = []
    await read("ten", ten)
    assert [e.output.token_ids for e in ten] == [(100,), tuple(range(101, 110))]
    assert [e.seq for e in ten] == [0, 1] and ten[-1].output.finish_reason == "length"
    dup: list[TokenEvent] = []
    with pytest.raises(DispatchError) as err:
        await read("dup", dup)
    assert err.value.code == "lost_events"
    assert [e.output.token_ids for e in dup] == [(100,), (101, 102)]
    await sub.unsubscribe()
    await reg.close()


async def test_a_silent_worker_fails_its_request_at_the_deadline_or_once_its_record_goes(
    pool: Pool,
) -> None:
    """A stand-in decode worker sends each request's first event, then nothing. The request
    fails at its own deadline (`deadline`, not much later), or, with a later deadline, within
    about a second of the worker's record leaving etcd (`worker_lost`)."""

    async def first_event_only(msg: Msg) -> None:
        request = decode(msg.data, GenerateRequest)
        event = TokenEvent(RequestOutput(request.request_id, (7,)), 0, "d-0")
        await pool.nc.publish(request.stream_subject, TokenEventBatch((event,)).encode())

    sub = await pool.nc.subscribe(pool.keys.decode_requests("d-0"), cb=first_event_only)
    reg = await pool.registry.register(record("d-0"))
    await pool.view.start()
    await pool.view.wait_for_workers(1, WAIT_S)
    dispatcher = Dispatcher(pool.nc, pool.keys, pool.view, Chooser("round-robin"), BLOCK_SIZE)

    async def failure(deadline_s: float, then: Callable[[], Awaitable[None]] | None) -> str:
        job = Job(uuid.uuid4().hex, tuple(range(8)), SamplingParams(max_tokens=4),
                  time.time() + deadline_s)  # fmt: skip
        async with dispatcher.open(job) as stream:
            try:
                async for event in stream:
                    assert event.seq == 0
                    if then is not None:
                        await then()
            except DispatchError as err:
                return err.code
        raise AssertionError("the stream ended without failing")

    started = time.monotonic()
    assert await failure(1.5, None) == "deadline"
    assert 1.4 < time.monotonic() - started < 2.2
    left_at: list[float] = []

    async def leave() -> None:
        await reg.close()
        left_at.append(time.monotonic())

    assert await failure(30.0, leave) == "worker_lost"
    assert time.monotonic() - left_at[0] < 2.0
    await sub.unsubscribe()
