"""The real NATS server of the harness: a JetStream work queue acks, naks and redelivers."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.js.api import ConsumerConfig, RetentionPolicy, StreamConfig
from nats.js.client import JetStreamContext

from kvrail import nats_auth
from kvrail.keys import PoolKeys
from kvrail.local.procs import ManagedProcess, free_port, port_in_use
from kvrail.local.servers import NATS_CANDIDATES, NatsServer, find_binary


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


@pytest.mark.parametrize("password", ["1234", 'k1"b\\c d}$HOME', "true", "{x}", "ünï\tcode"])
async def test_the_charts_auth_file_lets_any_password_through_a_real_server(
    tmp_path: Path, password: str
) -> None:
    """The chart's layout: nats.conf in conf/ includes ../auth/auth.conf, written by
    `kvrail.nats_auth` from the Secret's files; the right password connects, a wrong one not."""
    secret, conf = tmp_path / "secret", tmp_path / "conf"
    secret.mkdir()
    conf.mkdir()
    (secret / "username").write_text("kvrail")
    (secret / "password").write_text(password)
    assert nats_auth.main([str(secret), str(tmp_path / "auth" / "auth.conf")]) == 0
    (conf / "nats.conf").write_text("authorization {\n  include ../auth/auth.conf\n}\n")
    port = free_port()
    argv = [find_binary("nats-server", *NATS_CANDIDATES), "-c", str(conf / "nats.conf"),
            "-a", "127.0.0.1", "-p", str(port)]  # fmt: skip
    server = ManagedProcess("nats", argv, tmp_path / "nats.log").start()
    try:
        server.wait_ready(lambda: port_in_use("127.0.0.1", port), 10.0, 0.05)
        url = f"nats://127.0.0.1:{port}"
        nc = await nats.connect(url, user="kvrail", password=password, allow_reconnect=False)
        await nc.close()
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(url, user="kvrail", password=password + "x",
                               allow_reconnect=False, max_reconnect_attempts=0)  # fmt: skip
    finally:
        server.stop()
