"""The real NATS server of the harness: a JetStream work queue acks, naks and redelivers."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import nats
import pytest
from nats.js.api import ConsumerConfig, RetentionPolicy, StreamConfig
from nats.js.client import JetStreamContext

from kvrail.keys import PoolKeys
from kvrail.local.servers import NatsServer


@pytest.fixture
async def js_pool(nats_server: NatsServer) -> AsyncIterator[tuple[JetStreamContext, PoolKeys]]:
    keys = PoolKeys("default", f"p-{uuid.uuid4().hex[:8]}")
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(
            name=keys.prefill_stream,
            subjects=list(keys.prefill_subjects),
            retention=RetentionPolicy.WORK_QUEUE,
        )
    )
    yield js, keys
    await js.delete_stream(keys.prefill_stream)
    await nc.close()


async def _pull_one(js: JetStreamContext, keys: PoolKeys, timeout_s: float = 2.0):  # type: ignore[no-untyped-def]
    sub = await js.pull_subscribe(
        keys.prefill_any,
        durable=keys.prefill_consumer,
        stream=keys.prefill_stream,
        config=ConsumerConfig(ack_wait=30, max_deliver=3),
    )
    msgs = await sub.fetch(1, timeout=timeout_s)
    return sub, msgs[0]


async def test_acked_job_is_not_redelivered(js_pool: tuple[JetStreamContext, PoolKeys]) -> None:
    js, keys = js_pool
    await js.publish(keys.prefill_any, b"job-1")
    sub, msg = await _pull_one(js, keys)
    assert msg.data == b"job-1"
    assert msg.metadata.num_delivered == 1
    await msg.ack_sync()
    with pytest.raises(nats.errors.TimeoutError):
        await sub.fetch(1, timeout=1.0)
    info = await js.stream_info(keys.prefill_stream)
    assert info.state.messages == 0  # work-queue retention removes acked messages


async def test_nakd_job_is_redelivered(js_pool: tuple[JetStreamContext, PoolKeys]) -> None:
    js, keys = js_pool
    await js.publish(keys.prefill_any, b"job-2")
    sub, msg = await _pull_one(js, keys)
    await msg.nak()
    again = (await sub.fetch(1, timeout=5.0))[0]
    assert again.data == b"job-2"
    assert again.metadata.num_delivered == 2
    await again.ack_sync()
