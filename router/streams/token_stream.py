"""One request on a kvrail decode worker, over NATS: send, then follow its token events.

The request is a `GenerateRequest` published to the chosen worker; its events arrive through the
router's one `EventInbox` (batched per engine step by the worker), and its reply subject makes
NATS answer "no responders" at once when the worker is gone. Events come in order (a gap fails
the request with `lost_events`), only the current attempt's worker's count (a late event of an
earlier attempt is ignored); a worker whose etcd record disappears (lease expired: killed,
partitioned) or changes incarnation fails the request within about a second (checked at the
inbox's `TICK`s), or gives it to another worker if it had sent nothing yet
(`attempts.Attempts`). Leaving the stream early publishes a `Cancel`, which every worker of the
pool sees, so the decode worker and any prefill worker holding blocks for it release them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from nats.aio.client import Client as NatsClient

from kvrail.keys import PoolKeys
from kvrail.messages import Cancel, GenerateRequest
from kvrail.outputs import TokenEvent, merged
from kvrail.router.policy import Decision
from kvrail.router.streams.attempts import Attempts
from kvrail.router.streams.inbox import NO_RESPONDERS, TICK, EventInbox, Mailbox
from kvrail.router.streams.job import AttemptFailed, CancelReason, DispatchError, Job, Workers

log = logging.getLogger(__name__)

# Worker errors that mean "not taken": nothing was generated, no block changed hands.
_NOT_TAKEN = {"shutting_down", "duplicate_request"}


@dataclass(slots=True)
class TokenStream:
    """One request's events; iterate it, then leave `Dispatcher.open`'s context."""

    nc: NatsClient
    keys: PoolKeys
    inbox: EventInbox
    workers: Workers
    job: Job
    first: Decision | None = None
    """The open-time choice (a kvrail worker), used for the first attempt."""
    worker_id: str = ""
    decision: Decision | None = None
    finished: bool = False
    attempts: Attempts = field(init=False)
    _queue: Mailbox | None = None
    _deadline_tick: asyncio.TimerHandle | None = None
    _counted: bool = False
    _incarnation: int = 0
    _seq: int = 0
    _held: DispatchError | None = None

    def __post_init__(self) -> None:
        self.attempts = Attempts(self.workers, self.job, "kvrail", self.first)

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        deadline = self.job.deadline_monotonic

        async def attempt(decision: Decision) -> TokenEvent:
            await self._send(decision)
            return await self._next(deadline)

        event = await self.attempts.first_event(attempt, self._release_attempt)
        while True:
            yield event
            if event.is_last:
                self.finished = True
                return
            event = self._with_queued(await self._next(deadline))

    async def _send(self, decision: Decision) -> None:
        self.decision = decision
        self.worker_id = decision.worker_id
        record = self.workers.record(self.worker_id)
        self._incarnation = record.incarnation if record else 0
        self._seq = 0
        rid = self.job.request_id
        if self._queue is None:
            await self.inbox.start()
            self._queue = self.inbox.open(rid)
            self._deadline_tick = asyncio.get_running_loop().call_later(
                max(0.0, self.job.deadline_monotonic - time.monotonic()),
                self._queue.put_nowait, TICK,
            )  # fmt: skip
        request = GenerateRequest(
            request_id=rid, token_ids=self.job.token_ids,
            stream_subject=self.inbox.events_subject, deadline_unix_s=self.job.deadline_unix_s,
            sampling=self.job.sampling, tenant_salt=self.job.tenant_salt,
            prefill_worker_id=self.workers.prefill_worker_for(self.job, decision),
        )  # fmt: skip
        self.workers.count_in_flight(self.worker_id, +1)
        self._counted = True
        await self.nc.publish(
            self.keys.decode_requests(self.worker_id), request.encode(),
            reply=self.inbox.reply_subject(rid),
        )  # fmt: skip

    async def _next(self, deadline: float) -> TokenEvent:
        """The next event in order; raises AttemptFailed (before the first), DispatchError.
        Waits without a timeout of its own: a `TICK` comes every `POLL_S` and at the deadline."""
        queue = self._queue
        assert queue is not None
        if self._held is not None:  # found behind the last event (`_with_queued`)
            raise self._held
        while True:
            if time.monotonic() >= deadline:
                raise DispatchError("deadline", "the request's deadline passed")
            event = self._accept(queue.get_nowait() if not queue.empty() else await queue.get())
            if event is not None:
                return event

    def _with_queued(self, event: TokenEvent) -> TokenEvent:
        """`event` and the events already queued behind it as one, their outputs `merged`: the
        tokens in order, the finish or error of the last. A stream that fell behind (a busy
        router) catches up in one chunk to its client instead of one per engine step, so its
        cost per token falls as the load rises. Never waits; a failure found behind `event` is
        held for the next `_next`, so that `event`'s tokens still reach the client first."""
        queue = self._queue
        assert queue is not None
        outputs = [event.output]
        while not outputs[-1].is_last and not queue.empty():
            try:
                queued = self._accept(queue.get_nowait())
            except DispatchError as err:
                self._held = err
                break
            if queued is not None:
                outputs.append(queued.output)
        if len(outputs) == 1:
            return event
        return event.with_output(merged(outputs))

    def _accept(self, item: TokenEvent | str) -> TokenEvent | None:
        """The queue's next item checked: the attempt's next event, or None for an item that
        carries none (a `TICK` with the worker alive, a late event of an earlier attempt)."""
        if item is TICK:  # the sentinels are these very strings
            if not self._worker_alive():
                if self._seq == 0:
                    raise AttemptFailed("worker_lost")
                raise DispatchError("worker_lost", "the decode worker went away")
            return None
        if item is NO_RESPONDERS:
            if self._seq == 0:
                raise AttemptFailed("no_responders")
            return None
        assert isinstance(item, TokenEvent)
        event = item
        if event.worker_id != self.worker_id:
            return None  # a late event of an earlier attempt
        if event.seq != self._seq:
            raise DispatchError("lost_events", f"expected event {self._seq}, got {event.seq}")
        error = event.output.error
        if self._seq == 0 and error in _NOT_TAKEN:
            raise AttemptFailed(error or "")
        self._seq += 1
        return event

    def _worker_alive(self) -> bool:
        record = self.workers.record(self.worker_id)
        return record is not None and record.incarnation == self._incarnation

    async def _release_attempt(self) -> None:
        """Undo a failed attempt's count (its queue stays: the next attempt reads it)."""
        if self._counted:
            self._counted = False
            self.workers.count_in_flight(self.worker_id, -1)

    async def cancel(self, reason: CancelReason) -> None:
        """Tell every worker to drop this request (idempotent; a no-op once it finished)."""
        if self.finished or not self.worker_id:
            return
        self.finished = True
        msg = Cancel(self.job.request_id, reason)
        with contextlib.suppress(Exception):
            await self.nc.publish(self.keys.cancel, msg.encode())

    async def close(self, reason: CancelReason = "client_disconnect") -> None:
        if self._deadline_tick is not None:
            self._deadline_tick.cancel()
        await self.cancel(reason)
        await self._release_attempt()
        self.inbox.close(self.job.request_id)
