"""The request plane and the prefill work queue, on NATS and JetStream.

`PrefillQueue` owns one pool's work-queue stream. Jobs go either to any prefill worker (one
durable pull consumer shared by all of them) or to one named worker (its own durable consumer,
for prefix-cache affinity); the two filters never overlap, as a work-queue stream requires. A job
is published with its request id as the JetStream message id, so a duplicate publish within the
dedupe window is dropped by the server. A consumer acks only after the KV write completed, naks
with a delay on failure, and the server stops redelivering after `max_deliver` attempts. A
payload that does not decode is terminated (never redelivered) and counted by the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, RetentionPolicy, StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from kvrail.keys import PoolKeys
from kvrail.messages import MessageError, PrefillJob, decode
from kvrail.settings import Settings, read_secret

log = logging.getLogger(__name__)

DUPLICATE_WINDOW_S = 120.0
TOKENS_HEADER = "Kvrail-Tokens"
"""Prompt tokens of a queued job, so the planner sums the backlog without decoding payloads."""


async def connect(settings: Settings, name: str) -> NatsClient:
    """A NATS connection with credentials read from their files; `name` shows in server logs."""
    return await nats.connect(
        settings.nats_url,
        name=name,
        user=settings.nats_user,
        password=read_secret(settings.nats_password_file),
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
    )


@dataclass
class QueuedJob:
    """One delivery. `job` is None when the payload was invalid (it has been terminated)."""

    job: PrefillJob | None
    msg: Msg
    error: str = ""

    @property
    def num_delivered(self) -> int:
        return int(self.msg.metadata.num_delivered)

    async def ack(self) -> None:
        """The KV write completed: remove the job from the queue for good."""
        await self.msg.ack_sync()

    async def nak(self, delay_s: float = 0.5) -> None:
        """The attempt failed: redeliver after `delay_s` (until max_deliver is reached)."""
        await self.msg.nak(delay=delay_s)

    async def in_progress(self) -> None:
        """Still working: push the ack deadline back."""
        await self.msg.in_progress()

    @contextlib.asynccontextmanager
    async def working(self, interval_s: float) -> AsyncIterator[None]:
        """Tell the server every `interval_s` that this delivery is still being worked on, so a
        job that runs longer than the consumer's ack wait (a long prompt on a slow device) is not
        redelivered to a second worker while the first still computes and writes it."""

        async def beat() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await self.in_progress()
                except nats.errors.Error as err:  # the connection is down: the ack may fail too
                    log.warning("job heartbeat failed error=%s", type(err).__name__)

        task = asyncio.create_task(beat(), name="job-heartbeat")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def drop(self) -> None:
        """Never run this job (past its deadline, stale destination): no redelivery."""
        await self.msg.term()


class PrefillQueue:
    """The prefill work queue of one pool."""

    def __init__(
        self,
        js: JetStreamContext,
        keys: PoolKeys,
        *,
        ack_wait_s: float = 30.0,
        max_deliver: int = 3,
    ) -> None:
        self.js = js
        self.keys = keys
        self.ack_wait_s = ack_wait_s
        self.max_deliver = max_deliver

    async def ensure_stream(self) -> None:
        """Create the stream, or update it to the current config (idempotent)."""
        config = StreamConfig(
            name=self.keys.prefill_stream,
            subjects=list(self.keys.prefill_subjects),
            retention=RetentionPolicy.WORK_QUEUE,
            duplicate_window=DUPLICATE_WINDOW_S,
        )
        try:
            await self.js.stream_info(self.keys.prefill_stream)
            await self.js.update_stream(config)
        except NotFoundError:
            await self.js.add_stream(config)

    async def delete_stream(self) -> bool:
        """Remove the stream and every queued job (the operator's finalizer)."""
        try:
            return bool(await self.js.delete_stream(self.keys.prefill_stream))
        except NotFoundError:
            return False

    async def publish(self, job: PrefillJob, to_worker: str | None = None) -> bool:
        """Queue `job`; returns False when the server dropped it as a duplicate."""
        subject = self.keys.prefill_to(to_worker) if to_worker else self.keys.prefill_any
        ack = await self.js.publish(
            subject, job.encode(), stream=self.keys.prefill_stream,
            headers={"Nats-Msg-Id": job.request_id, TOKENS_HEADER: str(len(job.token_ids))},
        )  # fmt: skip
        return not ack.duplicate

    async def consumer(self, worker_id: str) -> PrefillConsumer:
        """Pull subscriptions for the shared queue and for jobs addressed to `worker_id`."""
        shared = await self._pull(self.keys.prefill_any, self.keys.prefill_consumer)
        own = await self._pull(self.keys.prefill_to(worker_id), f"prefill-to-{worker_id}")
        return PrefillConsumer(own, shared)

    async def backlog(self) -> int:
        """Jobs waiting in the stream (the planner's prefill signal)."""
        info = await self.js.stream_info(self.keys.prefill_stream)
        return int(info.state.messages)

    async def _pull(self, subject: str, durable: str) -> JetStreamContext.PullSubscription:
        config = ConsumerConfig(ack_wait=self.ack_wait_s, max_deliver=self.max_deliver)
        return await self.js.pull_subscribe(
            subject, durable=durable, stream=self.keys.prefill_stream, config=config
        )


class PrefillConsumer:
    """Fetches jobs for one prefill worker: its own first, then the shared queue."""

    def __init__(
        self, own: JetStreamContext.PullSubscription, shared: JetStreamContext.PullSubscription
    ) -> None:
        self._subs = (own, shared)

    async def fetch(self, timeout_s: float = 1.0) -> QueuedJob | None:
        """One job, or None when none arrived within about `timeout_s`."""
        for i, sub in enumerate(self._subs):
            wait = 0.05 if i == 0 else timeout_s
            try:
                (msg,) = await sub.fetch(1, timeout=wait)
            except nats.errors.TimeoutError:
                continue
            return await _parse(msg)
        return None

    async def close(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()


async def _parse(msg: Msg) -> QueuedJob:
    try:
        return QueuedJob(decode(msg.data, PrefillJob), msg)
    except MessageError as err:
        log.warning("terminating an invalid prefill job error=%s bytes=%d", err, len(msg.data))
        await msg.term()
        return QueuedJob(None, msg, error=str(err))
