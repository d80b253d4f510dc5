"""Send one request to a decode worker and follow its token stream (DESIGN.md, steps 2-3 and 7).

`Dispatcher.open(job)` picks a decode worker (the `Chooser` over the `WorkerView`'s ready decode
workers, each scored by the prompt blocks it already caches), subscribes a fresh inbox, and
publishes a `GenerateRequest` whose reply subject is that inbox, so NATS answers "no responders"
at once when the worker is gone. The returned `TokenStream` yields the worker's `TokenEvent`s in
order and guarantees three things:

- **Retry only while nothing changed hands**: no responders, a worker shutting down, or a worker
  whose lease vanished before its first event: the request goes to another worker (at most
  `max_attempts` in all). After the first event a failure is the client's error.
- **Every wait has a deadline**: the request's own, and a worker whose etcd record disappears
  (lease expired: killed, partitioned) fails the request within about a second.
- **Nothing outlives the client**: leaving the stream before its last event (client disconnect,
  stop string, deadline, error) publishes a `Cancel`, which every worker of the pool sees, so the
  decode worker and any prefill worker holding blocks for it release them.

Workers registered with `engine="vllm"` are vLLM servers: when the chooser picks one, `open`
returns a `VllmStream` (`kvrail.router.vllm_stream`) instead, which keeps the same interface and
guarantees over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeoutError

from kvrail.codec import MessageError, decode
from kvrail.keys import PoolKeys
from kvrail.messages import Cancel, GenerateRequest, TokenEvent
from kvrail.router.discovery import WorkerView
from kvrail.router.index import prompt_hashes
from kvrail.router.job import AttemptFailed, CancelReason, DispatchError, EventStream, Job
from kvrail.router.policy import Candidate, Chooser, Decision, NoWorkerError
from kvrail.router.vllm_options import VllmOptions
from kvrail.router.vllm_stream import VllmStream

__all__ = ["CancelReason", "DispatchError", "Dispatcher", "EventStream", "Job", "TokenStream"]

log = logging.getLogger(__name__)

_NO_RESPONDERS = "503"
_POLL_S = 0.5  # how often a silent worker's lease is checked
# Worker errors that mean "not taken": nothing was generated, no block changed hands.
_NOT_TAKEN = {"shutting_down", "duplicate_request"}

Engine = Literal["kvrail", "vllm"]


@dataclass(slots=True)
class Dispatcher:
    """Opens request streams over the pool's ready decode workers.

    A pool runs one engine, but during a change it may hold both: `open` lets the chooser pick
    among every ready decode worker this dispatcher can speak to (vLLM ones only with `vllm`
    options), and the engine of the worker it picks decides the stream: a `TokenStream` over NATS
    or a `VllmStream` over HTTP. Retries stay with that engine, so a vLLM server is never sent a
    NATS `GenerateRequest` and a kvrail worker never an HTTP request. (vLLM servers publish no KV
    events, so the kv-aware policy sees no cached blocks on them and weighs their load alone.)
    """

    nc: NatsClient
    keys: PoolKeys
    view: WorkerView
    chooser: Chooser
    block_size: int
    max_attempts: int = 3
    on_decision: Callable[[Decision], None] | None = None
    in_flight: dict[str, int] = field(default_factory=dict)
    vllm: VllmOptions | None = None
    """How to reach vLLM servers; None: vLLM workers are never chosen."""

    @property
    def engines(self) -> tuple[Engine, ...]:
        return ("kvrail", "vllm") if self.vllm is not None else ("kvrail",)

    def candidates(
        self, job: Job, engines: tuple[Engine, ...] | None = None
    ) -> tuple[list[Candidate], int]:
        """Ready decode workers (of `engines`, default: every engine this dispatcher speaks)
        scored for `job`, and the prompt's number of full blocks. The prompt is hashed once per
        model fingerprint (which covers the block size)."""
        engines = engines or self.engines
        workers = [r for r in self.view.decode_workers() if r.engine in engines]
        block_sizes = {r.fingerprint: r.block_size or self.block_size for r in workers}
        out: list[Candidate] = []
        num_blocks = len(job.token_ids) // self.block_size
        for fingerprint, block_size in sorted(block_sizes.items()):
            hashes = prompt_hashes(job.token_ids, block_size, fingerprint, job.tenant_salt)
            out += self.view.candidates(hashes, self.in_flight, fingerprint, engines)
            num_blocks = len(job.token_ids) // block_size
        return out, num_blocks

    def count_in_flight(self, worker_id: str, delta: int) -> None:
        """This router's requests in flight on `worker_id` (load-based choice and the per-worker
        metrics read them); a worker with none leaves the table."""
        left = self.in_flight.get(worker_id, 0) + delta
        if left > 0:
            self.in_flight[worker_id] = left
        else:
            self.in_flight.pop(worker_id, None)

    @contextlib.asynccontextmanager
    async def open(self, job: Job) -> AsyncIterator[EventStream]:
        stream = self._stream_for(job)
        try:
            yield stream
        finally:
            await asyncio.shield(stream.close())

    def _stream_for(self, job: Job) -> TokenStream | VllmStream:
        """The stream kind of the worker the chooser picks now (that pick is the first attempt);
        with no worker at all, a `TokenStream` that fails with `no_worker` when iterated."""
        try:
            decision = self._choose(job, set())
        except NoWorkerError:
            return TokenStream(self, job)
        record = self.view.records().get(decision.worker_id)
        if record is not None and record.engine == "vllm":
            assert self.vllm is not None  # candidates() offers vLLM workers only with options
            return VllmStream(self, self.vllm, job, first=decision)
        return TokenStream(self, job, first=decision)

    def _choose(
        self, job: Job, exclude: set[str], engines: tuple[Engine, ...] | None = None
    ) -> Decision:
        candidates, num_blocks = self.candidates(job, engines)
        candidates = [c for c in candidates if c.worker_id not in exclude]
        decision = self.chooser.choose(candidates, num_blocks)
        if self.on_decision is not None:
            self.on_decision(decision)
        return decision


@dataclass(slots=True)
class TokenStream:
    """One request's events; iterate it, then leave `Dispatcher.open`'s context."""

    dispatcher: Dispatcher
    job: Job
    first: Decision | None = None
    """The open-time choice (a kvrail worker), used for the first attempt."""
    worker_id: str = ""
    decision: Decision | None = None
    attempts: int = 0
    finished: bool = False
    _sub: Subscription | None = None
    _incarnation: int = 0
    _seq: int = 0
    _tried: set[str] = field(default_factory=set)

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        deadline = self.job.deadline_monotonic
        while True:
            await self._send()
            try:
                first = await self._next(deadline)
            except AttemptFailed as retry:
                log.info(
                    "request not taken, retrying request_id=%s worker=%s reason=%s",
                    self.job.request_id, self.worker_id, retry.reason,
                )  # fmt: skip
                await self._unsubscribe()
                if self.attempts >= self.dispatcher.max_attempts:
                    raise DispatchError("no_worker", "no decode worker took the request") from None
                continue
            break
        event = first
        while True:
            yield event
            if event.is_last:
                self.finished = True
                return
            event = await self._next(deadline)

    async def _send(self) -> None:
        d = self.dispatcher
        try:
            if self.attempts == 0 and self.first is not None:
                self.decision = self.first
            else:
                self.decision = d._choose(self.job, self._tried, ("kvrail",))
        except NoWorkerError as err:
            raise DispatchError("no_worker", "no ready decode worker") from err
        self.worker_id = self.decision.worker_id
        self._tried.add(self.worker_id)
        self.attempts += 1
        record = d.view.records().get(self.worker_id)
        self._incarnation = record.incarnation if record else 0
        self._seq = 0
        inbox = d.nc.new_inbox()
        self._sub = await d.nc.subscribe(inbox)
        request = GenerateRequest(
            request_id=self.job.request_id, token_ids=self.job.token_ids, stream_subject=inbox,
            deadline_unix_s=self.job.deadline_unix_s, max_tokens=self.job.max_tokens,
            temperature=self.job.temperature, top_p=self.job.top_p, seed=self.job.seed,
            tenant_salt=self.job.tenant_salt,
        )  # fmt: skip
        d.count_in_flight(self.worker_id, +1)
        await d.nc.publish(d.keys.decode_requests(self.worker_id), request.encode(), reply=inbox)

    async def _next(self, deadline: float) -> TokenEvent:
        """The next event in order; raises AttemptFailed (before the first), DispatchError."""
        assert self._sub is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DispatchError("deadline", "the request's deadline passed")
            try:
                msg = await self._sub.next_msg(timeout=min(remaining, _POLL_S))
            except NatsTimeoutError:
                if not self._worker_alive():
                    if self._seq == 0:
                        raise AttemptFailed("worker_lost") from None
                    raise DispatchError("worker_lost", "the decode worker went away") from None
                continue
            event = self._parse(msg)
            if event is None:
                continue
            if event.seq != self._seq:
                raise DispatchError("lost_events", f"expected event {self._seq}, got {event.seq}")
            if self._seq == 0 and event.error in _NOT_TAKEN:
                raise AttemptFailed(event.error or "")
            self._seq += 1
            return event

    def _parse(self, msg: Msg) -> TokenEvent | None:
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            if self._seq == 0:
                raise AttemptFailed("no_responders")
            return None
        try:
            event = decode(msg.data, TokenEvent)
        except MessageError as err:
            log.warning("ignoring an invalid token event request_id=%s error=%s",
                        self.job.request_id, err)  # fmt: skip
            return None
        if event.request_id != self.job.request_id:
            return None
        return event

    def _worker_alive(self) -> bool:
        record = self.dispatcher.view.records().get(self.worker_id)
        return record is not None and record.incarnation == self._incarnation

    async def _unsubscribe(self) -> None:
        d = self.dispatcher
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
            d.count_in_flight(self.worker_id, -1)

    async def cancel(self, reason: CancelReason) -> None:
        """Tell every worker to drop this request (idempotent; a no-op once it finished)."""
        if self.finished or not self.worker_id:
            return
        self.finished = True
        msg = Cancel(self.job.request_id, reason)
        with contextlib.suppress(Exception):
            await self.dispatcher.nc.publish(self.dispatcher.keys.cancel, msg.encode())

    async def close(self, reason: CancelReason = "client_disconnect") -> None:
        await self.cancel(reason)
        await self._unsubscribe()
