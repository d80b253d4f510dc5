"""The decode role: admit requests, prefill them locally or remotely, stream their tokens.

For each `GenerateRequest` on `PoolKeys.decode_requests(worker_id)`: prefill remotely (see
`kv_receiver.py`) when the pool is disaggregated, a ready prefill worker with our fingerprint
is registered and at least `min_remote_prefill_tokens` prompt tokens are not cached here;
otherwise (and after a failed remote prefill under the `recompute` policy) prefill locally.
Tokens go to the request's stream subject as `TokenEvent`s, the first with the TTFT stages; the
deadline aborts the request with an error event; a `Cancel` releases everything. A `Cancel`
that overtakes its request (the client left at once) is remembered (`RecentCancels`, for the
pool's request deadline horizon), and the request then ends as cancelled on arrival, before it
reserves a block or publishes a prefill job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field, replace

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvrail.codec import MessageError, decode
from kvrail.errors import InvalidRequestError
from kvrail.messages import Cancel, GenerateRequest
from kvrail.outputs import PrefillMode, RequestOutput, TokenEvent
from kvrail.worker import metrics
from kvrail.worker.roles.cancels import RecentCancels
from kvrail.worker.roles.context import WorkerContext
from kvrail.worker.roles.handoff import Outcome, RequestFailed
from kvrail.worker.roles.kv_receiver import KvReceiver
from kvrail.worker.roles.outbox import TokenOutbox
from kvrail.worker.roles.stages import StageTimes

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    """Publishes one request's outputs in order, each in a numbered `TokenEvent` (through the
    role's outbox, which batches a step's events per router); the first carries the TTFT stages.

    `on_output` is the engine service's callback, on the event loop: once `start`ed, it sends an
    output at once, in the callback that delivers the whole step, so no per-request task wakes up
    per token. Before `start` (while the request's task still sets the first event's fields,
    e.g. after a remote prefill installed it) outputs are held, in order. `done` resolves with
    the last event.
    """

    outbox: TokenOutbox
    request: GenerateRequest
    worker_id: str
    mode: PrefillMode = ""
    stages: StageTimes = field(default_factory=StageTimes)
    num_cached_tokens: int = 0
    seq: int = 0
    closed: bool = False
    submitted: float | None = None
    """When a local prefill was submitted; its first output times `prefill_compute_s`."""
    arrived: float | None = None
    """When the request reached this worker: the first token's log line says how long it spent
    here in all (`in_worker_s`), which the stages only partly cover."""
    first_output_at: float | None = None
    held: list[RequestOutput] | None = field(default_factory=list)
    """Outputs that came before `start` (None once started)."""
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def on_output(self, output: RequestOutput) -> None:
        if self.first_output_at is None:
            self.first_output_at = time.monotonic()
        if self.held is not None:
            self.held.append(output)
        elif not self.closed:
            self._send(output)

    def start(self) -> None:
        """Publish the held outputs, then every later one as it comes."""
        held, self.held = self.held or [], None
        for output in held:
            if not self.closed:
                self._send(output)

    def fail(self, reason: str) -> None:
        if not self.closed:
            self._publish(RequestOutput(self.request.request_id, error=reason))

    def _send(self, output: RequestOutput) -> None:
        try:
            if output.request_id != self.request.request_id:
                # A local recompute beside a quarantined reservation runs under another engine
                # id (`~local`); its router knows the request by its own.
                output = replace(output, request_id=self.request.request_id)
            if self.seq == 0:
                output = self._first_token(output)
            self._publish(output)
        except Exception as err:  # a bug: the request's task fails with it, the others go on
            if not self.done.done():
                self.done.set_exception(err)

    def _first_token(self, output: RequestOutput) -> RequestOutput:
        """Times and logs the first token; its output, with the prompt tokens that were cached
        (a local prefill's own count, or what a remote handoff found cached here)."""
        if self.submitted is not None and self.first_output_at is not None:
            self.stages.prefill_compute_s = self.first_output_at - self.submitted
            self.num_cached_tokens = output.num_cached_tokens
        timed = self.stages.timed()
        for stage, seconds in timed.items():
            metrics.TTFT_STAGE_SECONDS.labels(stage.removesuffix("_s")).observe(seconds)
        logged = dict(timed)
        if self.arrived is not None:  # not a stage: it spans them (and what none of them times)
            logged["in_worker_s"] = time.monotonic() - self.arrived
        log.info(
            "first token request_id=%s mode=%s prompt_tokens=%d cached_tokens=%d %s",
            self.request.request_id, self.mode, len(self.request.token_ids),
            self.num_cached_tokens, " ".join(f"{k}={v:.4f}" for k, v in sorted(logged.items())),
        )  # fmt: skip
        if output.num_cached_tokens == self.num_cached_tokens:
            return output
        return replace(output, num_cached_tokens=self.num_cached_tokens)

    def _publish(self, output: RequestOutput) -> None:
        first = self.seq == 0
        event = TokenEvent(
            output, self.seq, self.worker_id, prefill_mode=self.mode if first else "",
            stages=self.stages.message() if first else None,
        )  # fmt: skip
        self.seq += 1
        self.closed = event.is_last
        self.outbox.add(self.request.stream_subject, event)
        if self.closed and not self.done.done():
            self.done.set_result(None)


class DecodeRole:
    def __init__(self, ctx: WorkerContext) -> None:
        self.keys = ctx.keys
        self.worker_id = ctx.worker_id
        self.nc = ctx.nc
        self.outbox = TokenOutbox(ctx.nc)
        self.service = ctx.service
        self.receiver = KvReceiver(ctx)
        self._active: dict[str, asyncio.Task[None]] = {}
        # A cancel older than every request's deadline can only name a request past it.
        self._cancelled = RecentCancels(ctx.settings.request_timeout_s)
        self._requests: Subscription | None = None
        self._cancels: Subscription | None = None
        self._draining = False

    @property
    def num_pending(self) -> int:
        """Requests in flight plus quarantined reservations (debug counts)."""
        return len(self._active) + self.receiver.num_quarantined

    async def start(self) -> None:
        subject = self.keys.decode_requests(self.worker_id)
        self._requests = await self.nc.subscribe(subject, cb=self._on_request)
        self._cancels = await self.nc.subscribe(self.keys.cancel, cb=self._on_cancel)
        await self.receiver.start()

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests, let those in flight finish (bounded), then stop. A request
        still running at the timeout fails with `shutting_down` (its router retries it only if
        no token was sent yet).

        Every request already on its way here is answered: the subscription is drained (NATS
        stops sending, then what it sent is handled, with `shutting_down`), not unsubscribed,
        which drops what arrived but was not handled yet, and whose router then waited for
        this worker's record to leave etcd. Cancels are heard until the last request ends."""
        self._draining = True
        await _drain(self._requests)
        if self._active:
            await asyncio.wait(list(self._active.values()), timeout=timeout_s)
        for task in self._active.values():
            task.cancel()
        await asyncio.gather(*self._active.values(), return_exceptions=True)
        await _drain(self._cancels)
        await self.outbox.flush()  # the last events (shutting_down included) leave before we do
        await self.receiver.stop()

    # -- request plane --------------------------------------------------------------------------

    async def _on_request(self, msg: Msg) -> None:
        try:
            request = decode(msg.data, GenerateRequest)
        except MessageError as err:
            log.warning("dropping an invalid generate request error=%s", err)
            return
        stream = _Stream(self.outbox, request, self.worker_id)
        if request.request_id in self._cancelled:  # the cancel overtook the request
            log.info("request cancelled before it arrived request_id=%s", request.request_id)
            stream.fail("cancelled")
            return
        if self._draining or request.request_id in self._active:
            stream.fail("shutting_down" if self._draining else "duplicate_request")
            return
        task = asyncio.create_task(self._serve(request, stream), name=request.request_id)
        self._active[request.request_id] = task
        task.add_done_callback(lambda _: self._active.pop(request.request_id, None))
        task.add_done_callback(_log_failure)

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = decode(msg.data, Cancel)
        except MessageError as err:
            log.warning("dropping an invalid cancel error=%s", err)
            return
        self._cancelled.add(cancel.request_id)
        task = self._active.get(cancel.request_id)
        if task is not None:
            log.info("request cancelled request_id=%s reason=%s", cancel.request_id, cancel.reason)
            task.cancel()

    async def _serve(self, request: GenerateRequest, stream: _Stream) -> None:
        arrived = stream.arrived = time.monotonic()
        deadline = arrived + (request.deadline_unix_s - time.time())
        engine_id = request.request_id
        try:
            if time.monotonic() >= deadline:
                raise RequestFailed("deadline")
            params = request.sampling  # validated when the message was decoded
            outcome: Outcome = "local"
            if self.receiver.wants(request):
                stream.mode = "remote"
                handoff = await self.receiver.prefill(
                    request, params, stream.on_output, stream.stages, arrived, deadline
                )
                outcome, stream.num_cached_tokens = handoff.outcome, handoff.num_cached_tokens
                if self.receiver.is_quarantined(engine_id):
                    engine_id = request.request_id + "~local"
            if outcome != "installed":
                stream.mode = "recompute" if outcome == "recompute" else "local"
                stream.submitted = time.monotonic()
                stream.stages.admission_s = stream.submitted - arrived
                await self.service.submit(
                    engine_id, request.token_ids, params, stream.on_output,
                    deadline_monotonic=deadline, tenant_salt=request.tenant_salt,
                )  # fmt: skip
            await self._stream(stream, deadline)
        except RequestFailed as err:
            log.info("request failed request_id=%s reason=%s", request.request_id, err.reason)
            stream.fail(err.reason)
        except InvalidRequestError as err:  # the engine refused it (reserve or submit)
            log.info("request refused request_id=%s param=%s", request.request_id, err.param)
            stream.fail("invalid_request")
        except (KeyError, RuntimeError) as err:  # the service stopped, or a reservation vanished
            log.warning("request failed request_id=%s error=%s", request.request_id, err)
            stream.fail("internal_error")
        except Exception:  # a bug (logged with the task): the client still gets an end
            with contextlib.suppress(Exception):
                stream.fail("internal_error")
            raise
        except asyncio.CancelledError:
            # Cancelled by the client, or by a drain that ran out of time.
            with contextlib.suppress(Exception):  # the cancellation is what goes on
                stream.fail("shutting_down" if self._draining else "cancelled")
            raise
        finally:
            if not self.receiver.is_quarantined(engine_id):
                await asyncio.shield(self.service.abort(engine_id))

    async def _stream(self, stream: _Stream, deadline: float) -> None:
        """Let the stream publish its outputs (held ones first) until its last."""
        stream.start()
        # The service aborts at the deadline; this is the backstop should no output come.
        remaining = deadline - time.monotonic() + 1.0
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                await stream.done
        except TimeoutError as err:
            raise RequestFailed("deadline") from err


async def _drain(sub: Subscription | None) -> None:
    """Stop `sub`'s messages and handle those already sent to it (a plain unsubscribe drops
    them); bounded by the connection's flush timeout."""
    if sub is not None:
        with contextlib.suppress(Exception):  # the connection is gone: nothing more can come
            await sub.drain()


def _log_failure(task: asyncio.Task[None]) -> None:
    """A request task that died of an unexpected error (a bug): log it, with its id only."""
    if not task.cancelled() and task.exception() is not None:
        log.error("request task failed request_id=%s", task.get_name(), exc_info=task.exception())
