"""kvrail.bus against the harness's real NATS JetStream."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvrail.bus import PrefillQueue, connect, unsubscribe
from kvrail.keys import PoolKeys
from kvrail.local.servers import NatsServer
from kvrail.messages import PrefillJob
from kvrail.sampling import SamplingParams
from kvrail.settings import Settings


def job(request_id: str = "req-1", **kw: Any) -> PrefillJob:
    base: dict[str, Any] = dict(
        request_id=request_id, token_ids=(1, 2, 3), fingerprint="f" * 64,
        dest_worker_id="decode-0", dest_incarnation=1, dest_agent_name="a",
        dest_block_ids=(4,), first_block_index=0, deadline_unix_s=time.time() + 60,
        sampling=SamplingParams(max_tokens=1),
    )  # fmt: skip
    base.update(kw)
    return PrefillJob(**base)


@pytest.fixture
async def queue(nats_server: NatsServer) -> AsyncIterator[PrefillQueue]:
    nc = await connect(Settings(nats_url=nats_server.url), name="test")
    q = PrefillQueue(nc.jetstream(), PoolKeys("default", f"q-{uuid.uuid4().hex[:8]}"),
                     ack_wait_s=5, max_deliver=2)  # fmt: skip
    await q.ensure_stream()
    await q.ensure_stream()  # idempotent
    yield q
    await q.delete_stream()
    await nc.close()


async def test_a_job_is_pulled_acked_and_gone(queue: PrefillQueue) -> None:
    sent = job()
    assert await queue.publish(sent)
    consumer = await queue.consumer("prefill-0")
    got = await consumer.fetch(timeout_s=2)
    assert got is not None and got.job == sent
    await got.ack()
    assert await consumer.fetch(timeout_s=0.5) is None
    assert await queue.backlog() == 0
    await consumer.close()


async def test_a_duplicate_publish_is_dropped_by_the_server(queue: PrefillQueue) -> None:
    assert await queue.publish(job("dup"))
    assert not await queue.publish(job("dup"))
    assert await queue.backlog() == 1


async def test_an_addressed_job_reaches_only_its_worker(queue: PrefillQueue) -> None:
    await queue.publish(job("for-p1"), to_worker="prefill-1")
    other = await queue.consumer("prefill-0")
    assert await other.fetch(timeout_s=0.5) is None
    mine = await queue.consumer("prefill-1")
    got = await mine.fetch(timeout_s=2)
    assert got is not None and got.job is not None and got.job.request_id == "for-p1"
    await got.ack()
    await other.close()
    await mine.close()


async def test_a_nakd_job_is_redelivered_until_max_deliver(queue: PrefillQueue) -> None:
    await queue.publish(job("flaky"))
    consumer = await queue.consumer("prefill-0")
    first = await consumer.fetch(timeout_s=2)
    assert first is not None and first.num_delivered == 1
    await first.nak(delay_s=0.1)
    second = await consumer.fetch(timeout_s=3)
    assert second is not None and second.num_delivered == 2
    await second.nak(delay_s=0.1)
    assert await consumer.fetch(timeout_s=1.5) is None  # max_deliver=2 reached
    await consumer.close()


async def test_an_invalid_payload_is_terminated_not_redelivered(queue: PrefillQueue) -> None:
    await queue.js.publish(queue.keys.prefill_any, b'{"v":1,"kind":"prefill_job"}')
    consumer = await queue.consumer("prefill-0")
    got = await consumer.fetch(timeout_s=2)
    assert got is not None and got.job is None and "lacks field" in got.error
    assert await consumer.fetch(timeout_s=1.0) is None
    await consumer.close()


async def test_a_dropped_job_is_never_redelivered(queue: PrefillQueue) -> None:
    await queue.publish(job("late", deadline_unix_s=1.0))
    consumer = await queue.consumer("prefill-0")
    got = await consumer.fetch(timeout_s=2)
    assert got is not None
    await got.drop()
    assert await consumer.fetch(timeout_s=1.0) is None
    await consumer.close()


async def test_a_job_worked_on_longer_than_the_ack_wait_is_not_redelivered(
    nats_server: NatsServer,
) -> None:
    nc = await connect(Settings(nats_url=nats_server.url), name="test")
    q = PrefillQueue(nc.jetstream(), PoolKeys("default", f"q-{uuid.uuid4().hex[:8]}"),
                     ack_wait_s=1, max_deliver=3)  # fmt: skip
    await q.ensure_stream()
    try:
        await q.publish(job("long"))
        worker, other = await q.consumer("prefill-0"), await q.consumer("prefill-1")
        got = await worker.fetch(timeout_s=2)
        assert got is not None
        async with got.working(interval_s=0.3):
            assert await other.fetch(timeout_s=3.0) is None  # three ack waits, no redelivery
        await got.ack()
        # Without the heartbeat the same wait redelivers it (the case the heartbeat prevents).
        await q.publish(job("silent"))
        first = await worker.fetch(timeout_s=2)
        assert first is not None
        again = await other.fetch(timeout_s=3.0)
        assert again is not None and again.num_delivered == 2
        await again.ack()
        await worker.close()
        await other.close()
    finally:
        await q.delete_stream()
        await nc.close()


async def test_unsubscribe_ends_deliveries_and_is_quiet_once_the_connection_closed(
    nats_server: NatsServer,
) -> None:
    nc = await connect(Settings(nats_url=nats_server.url), name="test")
    subject = f"t.{uuid.uuid4().hex[:8]}"
    got: list[bytes] = []

    async def cb(msg: Any) -> None:
        got.append(msg.data)

    sub = await nc.subscribe(subject, cb=cb)
    await nc.publish(subject, b"before")
    await nc.flush()
    for _ in range(100):
        if got:
            break
        await asyncio.sleep(0.01)
    await unsubscribe(sub)
    await nc.publish(subject, b"after")
    await nc.flush()
    await asyncio.sleep(0.2)
    assert got == [b"before"]
    late = await nc.subscribe(subject + ".late", cb=cb)
    await nc.close()
    await unsubscribe(late)  # nats-py refuses it on a closed connection; nothing is raised
