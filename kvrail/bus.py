"""The request plane and the prefill work queue, on NATS and JetStream.

`PrefillQueue` owns one pool's work-queue stream. Jobs go either to any prefill worker (one
durable pull consumer shared by all of them) or to one named worker (its own durable consumer,
for prefix-cache affinity); the two filters never overlap, as a work-queue stream requires. A job
is published with its request id as the JetStream message id, so a duplicate publish within the
dedupe window is dropped by the server. A consumer acks only after the KV write completed. After
a failure it hands the job over to another prefill worker (`PrefillQueue.hand_over`: the job is
republished to that worker's subject with its attempt count, and the failed delivery terminated)
or, with nobody else to take it, naks it with a delay; either way a job runs at most
`max_deliver` times. A payload that does not decode is terminated (never redelivered) and counted
by the caller.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, RetentionPolicy, StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from kvrail.codec import MessageError, decode
from kvrail.errors import ConfigError
from kvrail.keys import PoolKeys
from kvrail.messages import PrefillJob
from kvrail.settings import Settings, read_secret
from kvrail.tasks import cancel_and_wait
from kvrail.tls import nats_ssl_context, require_nats_tls

log = logging.getLogger(__name__)

DUPLICATE_WINDOW_S = 120.0
TOKENS_HEADER = "Kvrail-Tokens"
"""Prompt tokens of a queued job, so the planner sums the backlog without decoding payloads."""
ATTEMPTS_HEADER = "Kvrail-Attempts"
"""Deliveries a handed-over job had before it was republished (absent: none)."""
UNSUBSCRIBE_S = 2.0
"""How long `unsubscribe` waits for the connection to take an unsubscription."""


async def connect(settings: Settings, name: str, **options: Any) -> NatsClient:
    """A NATS connection with credentials read from their files; `name` shows in server logs.

    TLS as `kvrail.tls` decides (a `tls://` URL or a CA file), and then never plaintext: the
    password is only sent once the server required TLS. The first connection fails fast with
    ConfigError when the server's certificate does not verify or it refuses the credentials (nats-py
    would retry those forever); once connected, it reconnects forever. `options` go to
    `nats.connect` (deadlines, callbacks).
    """
    url = settings.nats_url
    tls = nats_ssl_context(url, settings.nats_ca_file)
    password = read_secret(settings.nats_password_file)
    nc = NatsClient()
    connected = False
    error_cb = options.pop("error_cb", None)

    def tls_checked_password() -> str:
        # NOTE(kvrail): nats-py upgrades to TLS only when the server's INFO asks for it.
        require_nats_tls(url, nc._server_info)
        assert password is not None
        return password

    async def on_error(err: Exception) -> None:
        if not connected:
            _raise_if_permanent(url, settings.nats_user, err)
        if error_cb is not None:
            await error_cb(err)
        else:
            log.warning("nats error url=%s error=%s", url, err)

    try:
        await nc.connect(
            url,
            name=name,
            user=settings.nats_user,
            password=tls_checked_password if tls is not None and password is not None else password,
            tls=tls,
            error_cb=on_error,
            **{"max_reconnect_attempts": -1, "reconnect_time_wait": 0.5, **options},
        )
        if tls is not None:
            require_nats_tls(url, nc._server_info)
    except ConfigError:
        connected = True  # close() reports its own errors through on_error
        await _close_quietly(nc)
        raise
    connected = True
    return nc


class Subscribed(Protocol):
    """A core NATS subscription or a JetStream pull subscription."""

    async def unsubscribe(self) -> None: ...


async def unsubscribe(sub: Subscribed | None, timeout_s: float = UNSUBSCRIBE_S) -> None:
    """End `sub` as its owner stops, waiting at most `timeout_s`: nats-py stops its deliveries,
    then sends the unsubscription; a connection that is closed or draining refuses it (its
    subscriptions end with it) and one that stalls must not keep a process from stopping, so
    neither raises here. A cancellation of the caller goes on up."""
    if sub is None:
        return
    with contextlib.suppress(nats.errors.Error, TimeoutError):
        async with asyncio.timeout(timeout_s):
            await sub.unsubscribe()


async def _close_quietly(nc: NatsClient) -> None:
    """Close a connection whose TLS or CONNECT failed, without waiting long: the socket of a
    failed TLS upgrade may never report itself closed."""
    with contextlib.suppress(TimeoutError, OSError, nats.errors.Error):
        await asyncio.wait_for(nc.close(), 1.0)


def _raise_if_permanent(url: str, user: str | None, err: Exception) -> None:
    """Errors of a first connection that a retry cannot fix: a certificate that does not verify,
    refused credentials, a TLS requirement the server does not meet."""
    if isinstance(err, ConfigError):
        raise err
    if isinstance(err, ssl.SSLError):
        raise ConfigError(
            f"NATS {url}: TLS failed ({err.reason or err}): is nats_ca_file the CA that signed the "
            "server's certificate, and the URL's host in its subjectAltName?"
        ) from err
    if isinstance(err, nats.errors.Error) and "authorization violation" in str(err).lower():
        raise ConfigError(f"NATS {url} refused the credentials of user {user!r}") from err


@dataclass
class QueuedJob:
    """One delivery. `job` is None when the payload was invalid (it has been terminated)."""

    job: PrefillJob | None
    msg: Msg
    error: str = ""

    @property
    def num_delivered(self) -> int:
        """Attempts at this job so far, this one included (across hand-overs)."""
        earlier = (self.msg.headers or {}).get(ATTEMPTS_HEADER, "0")
        return int(self.msg.metadata.num_delivered) + (int(earlier) if earlier.isdigit() else 0)

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
            await cancel_and_wait(task)

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
        return await self._publish(job, to_worker, job.request_id, {})

    async def hand_over(self, queued: QueuedJob, to_worker: str) -> None:
        """After a failed attempt: queue the job for `to_worker` (another prefill worker), then
        terminate this delivery. The attempt count travels along, so `max_deliver` still bounds
        the attempts; the message id names the attempt, so the dedupe window does not drop it."""
        assert queued.job is not None
        attempts = queued.num_delivered
        msg_id = f"{queued.job.request_id}@{attempts}"
        await self._publish(queued.job, to_worker, msg_id, {ATTEMPTS_HEADER: str(attempts)})
        await queued.drop()

    async def _publish(
        self, job: PrefillJob, to_worker: str | None, msg_id: str, headers: dict[str, str]
    ) -> bool:
        subject = self.keys.prefill_to(to_worker) if to_worker else self.keys.prefill_any
        ack = await self.js.publish(
            subject, job.encode(), stream=self.keys.prefill_stream,
            headers={"Nats-Msg-Id": msg_id, TOKENS_HEADER: str(len(job.token_ids)), **headers},
        )  # fmt: skip
        return not ack.duplicate

    async def consumer(self, worker_id: str, *, shared: bool = True) -> PrefillConsumer:
        """Pull subscriptions for jobs addressed to `worker_id` and, unless `shared` is False
        (a decode worker prefilling only what a peer asks of it), for the shared queue."""
        own = await self._pull(self.keys.prefill_to(worker_id), f"prefill-to-{worker_id}")
        if not shared:
            return PrefillConsumer(own, None)
        return PrefillConsumer(
            own, await self._pull(self.keys.prefill_any, self.keys.prefill_consumer)
        )

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
    """Fetches jobs for one prefill worker: its own (addressed to it) before the shared queue's.

    One pull request per subscription is outstanding at any time, and a call waits on both at
    once, so a job is handed over as soon as it arrives on either. (Waiting on the worker's own
    subscription first, then on the shared one, made every shared job wait out the first pull's
    expiry: 50 ms of fixed cost per prefill.) A pull that delivers while the caller is not
    waiting keeps its job for the next call; `close` returns unstarted jobs to the queue.
    """

    def __init__(
        self,
        own: JetStreamContext.PullSubscription,
        shared: JetStreamContext.PullSubscription | None,
    ) -> None:
        self._subs = (own,) if shared is None else (own, shared)
        self._pulls: list[asyncio.Future[list[Msg]] | None] = [None] * len(self._subs)
        self._ready: collections.deque[QueuedJob] = collections.deque()

    async def fetch(self, timeout_s: float = 1.0) -> QueuedJob | None:
        """One job, or None when none arrived within about `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self._ready:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            for i, sub in enumerate(self._subs):
                if self._pulls[i] is None:
                    self._pulls[i] = asyncio.ensure_future(sub.fetch(1, timeout=remaining))
            pending = [p for p in self._pulls if p is not None]
            first = asyncio.FIRST_COMPLETED
            await asyncio.wait(pending, timeout=remaining + 1.0, return_when=first)
            for i, pull in enumerate(self._pulls):  # the worker's own first
                if pull is None or not pull.done():
                    continue
                self._pulls[i] = None
                try:
                    msgs = pull.result()
                except nats.errors.TimeoutError:
                    continue  # expired empty: pull again while time is left
                for msg in msgs:
                    self._ready.append(await _parse(msg))
        return self._ready.popleft()

    async def close(self) -> None:
        for pull in self._pulls:
            if pull is not None:
                pull.cancel()
        await asyncio.gather(*(p for p in self._pulls if p is not None), return_exceptions=True)
        while self._ready:  # fetched, never started: another worker may take them at once
            queued = self._ready.popleft()
            with contextlib.suppress(nats.errors.Error):
                await queued.msg.nak()
        for sub in self._subs:
            await unsubscribe(sub)


async def _parse(msg: Msg) -> QueuedJob:
    try:
        return QueuedJob(decode(msg.data, PrefillJob), msg)
    except MessageError as err:
        log.warning("terminating an invalid prefill job error=%s bytes=%d", err, len(msg.data))
        await msg.term()
        return QueuedJob(None, msg, error=str(err))
