"""One request served by vLLM servers over HTTP, with `TokenStream`'s interface and guarantees.

The router still tokenizes and detokenizes (stop strings, usage and chat templates behave as
with kvrail's engine) and speaks vLLM's disaggregated protocol with token ids
(`kvrail.vllm.protocol`):

1. Remote prefill when the prompt has at least `min_remote_prefill_tokens` tokens (the router
   cannot see vLLM's prefix cache, so every prompt token counts) and a ready vLLM prefill server
   of the decode server's fingerprint exists: a non-streaming completion whose answer carries
   `kv_transfer_params`. Otherwise the decode server prefills locally.
2. Decode: a streaming completion with those params; its chunks become `RequestOutput`s, each
   in a `TokenEvent`. The first
   says `prefill_mode` (`remote`, `local`, or `recompute` after failed prefills).

Guarantees:
- **Retry only while nothing changed hands.** A prefill that fails (connect error, timeout, 5xx,
  an answer without params) is tried on another prefill server, at most `max_attempts` of them;
  when none works `kv_load_failure_policy` decides: `recompute` prefills on the decode server
  (logged, counted by `on_prefill_failure` and `prefill_mode`), `fail` (and `reroute`, whose
  re-run on other prefill servers those attempts were) fails the request with `prefill_failed`.
  A decode server that fails before the first event (connect error, non-2xx, a dropped
  connection, its record gone) gives the request to another one, at most `max_attempts` in all;
  after it, `worker_lost`. A 400/413/422 is `invalid_request`; vLLM's message is never repeated
  (it may quote the input), only the status is logged.
- **KV is read once.** One prefill's `kv_transfer_params` go to one decode request: once a decode
  server was sent them it may have read the KV, after which the prefill server frees those
  blocks for reuse, so a retry runs a fresh prefill. Only a decode server that refused the
  connection passes them on to the next one (of the same fingerprint).
- **Every wait has a deadline**: the job's bounds both steps (`deadline`); a prefill also gives
  up after `prefill_timeout_s` and counts as failed.
- **Nothing is dropped silently.** Every sampling parameter reaches vLLM with kvrail's meaning
  (`protocol.CARRIED`); a request that sets one vLLM is not sent fails with
  `unsupported_parameter` naming it, before any server is sent anything. Logprobs come from the
  decode server with the tokens they belong to (the first token's too, whichever way the prompt
  was prefilled), in the same `RequestOutput.logprobs` as kvrail's engine fills.
- **Nothing outlives the client.** Leaving the stream early (disconnect, stop string, deadline,
  error) closes the HTTP response, and vLLM aborts a request whose client disconnected; a
  prefill in flight is cancelled with the task that awaits it, which closes its connection too.

The settings named here are `VllmOptions` (`vllm_options`); an attempt's outcomes are in
`vllm_attempt`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from kvrail.messages import WorkerRecord
from kvrail.outputs import FirstTokenStages, RequestOutput, TokenEvent
from kvrail.router.policy import Decision
from kvrail.router.streams.attempts import Attempts
from kvrail.router.streams.job import AttemptFailed, CancelReason, DispatchError, Job, Workers
from kvrail.router.streams.vllm_attempt import Prefilled, PrefillFailed, Retry
from kvrail.router.streams.vllm_options import CONNECT_TIMEOUT_S, VllmOptions
from kvrail.vllm import protocol
from kvrail.vllm.protocol import Completion, Delta, Done, VllmProtocolError

log = logging.getLogger(__name__)
T = TypeVar("T")

_POLL_S = 0.5  # how often a silent decode server's record is checked


_API_NAMES = {"prompt_logprobs": "echo", "grammar": "response_format"}
"""The request field that sets a `SamplingParams` field of another name."""


@dataclass(slots=True)
class VllmStream:
    """One request's events from vLLM; iterate it, then leave `Dispatcher.open`'s context."""

    workers: Workers
    options: VllmOptions
    job: Job
    first: Decision | None = None
    """The open-time choice (a vLLM decode server), used for the first attempt."""
    worker_id: str = ""
    decision: Decision | None = None
    finished: bool = False
    attempts: Attempts = field(init=False)
    _incarnation: int = 0
    _seq: int = 0
    _prefilled: Prefilled | None = None
    _reusable: Prefilled | None = None
    _response: httpx.Response | None = None
    _lines: AsyncIterator[str] | None = None
    _pending: asyncio.Future[Any] | None = None
    _counted: list[str] = field(default_factory=list)
    _failed_prefill: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.attempts = Attempts(self.workers, self.job, "vllm", self.first)

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        unsent = protocol.uncarried(self.job.sampling)
        if unsent is not None:  # named as the client asked for it
            param = _API_NAMES.get(unsent, unsent)
            raise DispatchError("unsupported_parameter", "vLLM is not sent it", param=param)
        deadline = self.job.deadline_monotonic

        async def attempt(decision: Decision) -> TokenEvent:
            return await self._attempt(decision, deadline)

        event = await self.attempts.first_event(attempt, self._release)
        while True:
            yield event
            if event.is_last:
                self.finished = True
                await self._release()
                return
            event = await self._next_event(deadline)

    # Attempts -----------------------------------------------------------------------------------
    async def _attempt(self, decision: Decision, deadline: float) -> TokenEvent:
        """Prefill (maybe) and decode on `decision`'s server until its first event. Raises
        AttemptFailed (another server may take it), DispatchError."""
        self.decision, self.worker_id = decision, decision.worker_id
        record = self.workers.record(decision.worker_id)
        if record is None:  # it left between the choice and now
            raise AttemptFailed("worker_gone")
        self._incarnation = record.incarnation
        reuse, self._reusable = self._reusable, None
        if reuse is not None and reuse.fingerprint == record.fingerprint:
            self._prefilled = reuse
        else:
            self._prefilled = await self._prefill(record, deadline)
        try:
            await self._send_decode(record, deadline)
            return await self._next_event(deadline)
        except Retry as retry:
            if retry.reusable:  # it never connected: the prefill's KV was not read
                self._reusable = self._prefilled
            raise

    def _completion(self) -> Completion:
        job = self.job
        return Completion(self.options.served_name, job.token_ids, job.sampling)

    # Step 1: prefill ----------------------------------------------------------------------------
    async def _prefill(self, decode: WorkerRecord, deadline: float) -> Prefilled:
        """Remote prefill on a prefill server of `decode`'s fingerprint, or the reason why not."""
        opts, workers = self.options, self.workers
        if len(self.job.token_ids) < opts.min_remote_prefill_tokens:
            return Prefilled("local")
        for _ in range(workers.max_attempts):
            candidates = [
                c
                for c in workers.prefill_candidates(decode.fingerprint, ("vllm",))
                if c.worker_id not in self._failed_prefill
            ]
            if not candidates:
                break
            chosen = opts.prefill_chooser.choose(candidates, 0)
            record = workers.record(chosen.worker_id)  # candidates come from the records
            assert record is not None
            started = time.monotonic()
            try:
                params = await self._post_prefill(record, deadline)
            except PrefillFailed as failure:
                self._failed_prefill.add(record.worker_id)
                log.warning(
                    "vllm prefill failed request_id=%s prefill=%s reason=%s",
                    self.job.request_id, record.worker_id, failure.reason,
                )  # fmt: skip
                if opts.on_prefill_failure is not None:
                    opts.on_prefill_failure(failure.reason)
                continue
            return Prefilled("remote", params, decode.fingerprint, time.monotonic() - started)
        if not self._failed_prefill:
            return Prefilled("local")  # no ready prefill server of this fingerprint
        if opts.kv_load_failure_policy == "recompute":
            log.info(
                "no vllm prefill succeeded, prefilling on the decode server request_id=%s "
                "decode=%s num_failed=%d", self.job.request_id, decode.worker_id,
                len(self._failed_prefill),
            )  # fmt: skip
            return Prefilled("recompute")
        raise DispatchError("prefill_failed", "no prefill server prefilled the prompt")

    async def _post_prefill(self, record: WorkerRecord, deadline: float) -> dict[str, Any]:
        """Step 1 on one server: its `kv_transfer_params`. Raises PrefillFailed (this server
        failed), DispatchError (deadline, or the input is invalid)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DispatchError("deadline", "the request's deadline passed")
        budget = min(remaining, self.options.prefill_timeout_s)
        body = protocol.prefill_body(self._completion())
        self._count(record.worker_id, +1)
        try:
            async with asyncio.timeout(budget):
                response = await self.options.http.post(
                    record.address + protocol.COMPLETIONS_PATH, json=body,
                    headers={protocol.REQUEST_ID_HEADER: self.job.request_id},
                    timeout=_timeout(budget),
                )  # fmt: skip
        except (TimeoutError, httpx.TimeoutException) as err:
            if time.monotonic() >= deadline:
                raise DispatchError("deadline", "the request's deadline passed") from err
            raise PrefillFailed("timeout") from err
        except httpx.ConnectError as err:
            raise PrefillFailed("connect") from err
        except httpx.TransportError as err:
            raise PrefillFailed("transport") from err
        finally:
            self._count(record.worker_id, -1)
        status = response.status_code
        if status >= 300:
            self._refuse_invalid(status, "prefill", record.worker_id)
            raise PrefillFailed(f"status_{status // 100}xx")
        try:
            return protocol.kv_transfer_params_of(json.loads(response.content))
        except (ValueError, VllmProtocolError) as err:  # JSONDecodeError is a ValueError
            raise PrefillFailed("bad_response") from err

    def _refuse_invalid(self, status: int, step: str, worker_id: str) -> None:
        """Fail the request when vLLM refused its input (400/413/422); only the status is logged,
        never vLLM's message, which may quote the input."""
        if protocol.failure_of_status(status) == "invalid_request":
            log.info("vllm refused the request request_id=%s %s=%s status=%d",
                     self.job.request_id, step, worker_id, status)  # fmt: skip
            raise DispatchError("invalid_request", f"vLLM answered HTTP {status}")

    # Step 2: decode -----------------------------------------------------------------------------
    async def _send_decode(self, record: WorkerRecord, deadline: float) -> None:
        """Open the decode stream on `record`'s server. Raises Retry, DispatchError."""
        assert self._prefilled is not None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DispatchError("deadline", "the request's deadline passed")
        self._seq = 0
        http = self.options.http
        request = http.build_request(
            "POST", record.address + protocol.COMPLETIONS_PATH,
            json=protocol.decode_body(self._completion(), self._prefilled.params),
            headers={protocol.REQUEST_ID_HEADER: self.job.request_id},
            timeout=_timeout(remaining),
        )  # fmt: skip
        self._count(record.worker_id, +1)
        try:
            response = await self._polled(http.send(request, stream=True), deadline)
        except (httpx.ConnectError, httpx.ConnectTimeout) as err:
            raise Retry("connect", reusable=True) from err
        except httpx.TransportError as err:
            raise self._failure("timeout" if _is_timeout(err) else "transport", deadline) from err
        self._response = response
        status = response.status_code
        if status >= 300:
            self._refuse_invalid(status, "worker", record.worker_id)
            raise Retry(f"status_{status}")
        self._lines = response.aiter_lines()

    async def _next_event(self, deadline: float) -> TokenEvent:
        """The next chunk that carries tokens or a finish reason, as a `TokenEvent`."""
        while True:
            item = await self._next_item(deadline)
            if isinstance(item, Done):
                raise self._failure("ended", deadline)  # [DONE] before a finish reason
            if item.token_ids or item.finish_reason is not None:
                return self._event(item)

    def _event(self, delta: Delta) -> TokenEvent:
        first = self._seq == 0
        prefilled = self._prefilled
        assert prefilled is not None
        output = RequestOutput(
            self.job.request_id, delta.token_ids, delta.finish_reason, logprobs=delta.logprobs
        )
        event = TokenEvent(
            output, self._seq, self.worker_id, prefill_mode=prefilled.mode if first else "",
            # NOTE: measured at the router (the whole prefill request, network included), not on
            # the prefill server's clock like kvrail's own stage durations.
            stages=FirstTokenStages(prefill_compute_s=prefilled.seconds) if first else None,
        )  # fmt: skip
        self._seq += 1
        return event

    async def _next_item(self, deadline: float) -> Delta | Done:
        """The next meaningful stream line. Raises Retry (before the first event),
        DispatchError."""
        assert self._lines is not None
        while True:
            try:
                line = await self._polled(_next_line(self._lines), deadline)
            except (httpx.RequestError, httpx.StreamError) as err:
                raise self._failure("timeout" if _is_timeout(err) else "transport",
                                    deadline) from err  # fmt: skip
            if line is None:
                raise self._failure("ended", deadline)
            try:
                item = protocol.parse_sse_line(line, self.job.sampling.logprobs)
            except VllmProtocolError as err:
                if err.code == "engine_error":
                    raise self._failure("engine_error", deadline) from err
                log.warning("vllm stream malformed request_id=%s worker=%s error=%s",
                            self.job.request_id, self.worker_id, err)  # fmt: skip
                raise DispatchError("protocol_error", str(err)) from err
            if item is not None:
                return item

    async def _polled(self, step: Awaitable[T], deadline: float) -> T:
        """Await one step of the decode attempt (its response, its next line) in a task of its
        own, checking every `_POLL_S` that the decode server is still registered: a server that
        vanished, or the deadline, ends the wait (`_release` cancels the step)."""
        assert self._pending is None
        task = self._pending = asyncio.ensure_future(step)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DispatchError("deadline", "the request's deadline passed")
            done, _ = await asyncio.wait({task}, timeout=min(remaining, _POLL_S))
            if done:
                self._pending = None
                return task.result()  # type: ignore[no-any-return]
            if not self._worker_alive():
                raise self._failure("worker_gone", deadline)

    def _failure(self, reason: str, deadline: float) -> Exception:
        """A decode failure: retryable before the first event, `worker_lost` after it."""
        if time.monotonic() >= deadline:
            return DispatchError("deadline", "the request's deadline passed")
        if self._seq == 0:
            return Retry(reason)
        log.info("vllm decode server lost request_id=%s worker=%s reason=%s",
                 self.job.request_id, self.worker_id, reason)  # fmt: skip
        return DispatchError("worker_lost", "the decode server went away")

    def _worker_alive(self) -> bool:
        record = self.workers.record(self.worker_id)
        return record is not None and record.incarnation == self._incarnation

    # Bookkeeping --------------------------------------------------------------------------------
    def _count(self, worker_id: str, delta: int) -> None:
        """Count this stream's requests in flight per worker (decode and prefill servers alike);
        a decrement without a matching increment is ignored, so releasing twice is harmless."""
        if delta > 0:
            self._counted.append(worker_id)
        elif worker_id in self._counted:
            self._counted.remove(worker_id)
        else:
            return
        self.workers.count_in_flight(worker_id, delta)

    async def _release(self) -> None:
        """Close the decode response (vLLM aborts the request if it still runs) and drop the
        in-flight count of the decode attempt."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()
            await asyncio.wait({pending})
            if not pending.cancelled() and pending.exception() is None:
                late = pending.result()  # it finished before the cancel landed
                if isinstance(late, httpx.Response):
                    await late.aclose()
        response, self._response, self._lines = self._response, None, None
        if response is not None:
            await response.aclose()
        if self.worker_id in self._counted:
            self._count(self.worker_id, -1)

    async def cancel(self, reason: CancelReason) -> None:
        """Stop the request on vLLM: close its HTTP response. Idempotent; `reason` only logs."""
        if self.finished or not self.worker_id:
            return
        self.finished = True
        log.debug("vllm request cancelled request_id=%s worker=%s reason=%s",
                  self.job.request_id, self.worker_id, reason)  # fmt: skip
        await self._release()

    async def close(self, reason: CancelReason = "client_disconnect") -> None:
        await self.cancel(reason)
        await self._release()


async def _next_line(lines: AsyncIterator[str]) -> str | None:
    """The next line of a response, None at its end (a task's result, so a poll can wait)."""
    try:
        return await lines.__anext__()
    except StopAsyncIteration:
        return None


def _timeout(budget_s: float) -> httpx.Timeout:
    """httpx's own timeouts, from what is left of the request's budget (the caller also bounds
    the whole step with `asyncio.timeout`, as httpx's read timeout is per read)."""
    return httpx.Timeout(budget_s, connect=min(budget_s, CONNECT_TIMEOUT_S))


def _is_timeout(err: Exception) -> bool:
    return isinstance(err, httpx.TimeoutException)
