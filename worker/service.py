"""The engine behind one thread, for asyncio code.

`LLMEngine` is synchronous and not thread-safe, so exactly one thread (the engine thread) ever
touches it. Asyncio code calls the `EngineService` coroutines (`submit`, `reserve`, `install`,
`prefill`, `abort`, `release`, `counts`): each queues a command, the engine thread runs it, and
the coroutine gets its result. The engine thread runs commands between two steps and also while
a step runs on the device: it hands the step's CUDA event to a waiter thread and runs commands
until the waiter says the event has passed (`StepPipeline.step_waiter`). A command thus waits for
the engine thread's host work, not for the device's step (about half a decode step, for each
reservation and install of a remote prefill). The engine's `RequestOutput`s go, as it made them,
to each request's callback, called on the event loop in order: a step's are handed over together
(one `loop.call_soon_threadsafe` per step, so the engine thread and the loop do not trade the GIL
and a wake-up per token), and a callback that raises is logged without costing the others their
outputs. Prefix-cache changes go the same way to `on_kv_changes` (if given): the engine's net
`KvChanges` at the end of each loop iteration (its commands and its step), the GPU cache's first
and then each lower tier's (`KvChanges.tier`), in order and never empty, so a subscriber that
applies them in order holds exactly the engine's cached hashes of every tier as of the last batch
delivered; a request's prompt blocks are delivered before its first token.

Guarantees:
- a request with a deadline is aborted by the engine thread once the deadline passes, and its
  callback gets one final output with `error="deadline"`; no request outlives its deadline;
- after a callback saw `finished` (or an error) it is never called again, and the engine holds
  none of the request's blocks (except a `prefill` request's retained blocks, until `release`);
- `close()` aborts whatever is left (reservations and retained blocks too), so the engine
  ends empty.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvrail.errors import InvalidRequestError
from kvrail.outputs import RequestOutput, TokenLogprobs
from kvrail.sampling import SamplingParams
from kvrail.worker.commands import CommandQueue
from kvrail.worker.engine.block_pool import KvChanges
from kvrail.worker.engine.engine import Counts, LLMEngine
from kvrail.worker.engine.grammar import GRAMMAR_ERROR
from kvrail.worker.engine.scheduler_output import RemoteReservation

log = logging.getLogger(__name__)

T = TypeVar("T")
_IDLE_WAIT_S = 0.02  # how long an idle engine thread sleeps between deadline checks
_BUSY_WAIT_S = 0.002  # after a step that produced nothing (e.g. only reserved requests)


OnOutput = Callable[[RequestOutput], None]
OnKvChanges = Callable[[KvChanges], None]


def _deliver_each(on_kv_changes: OnKvChanges, batches: list[KvChanges]) -> None:
    for changes in batches:
        on_kv_changes(changes)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """A finished prefill whose blocks are retained until `EngineService.release`: its first
    output (the first token) and its KV's blocks, in table order."""

    output: RequestOutput
    block_ids: tuple[int, ...]

    @property
    def first_token_id(self) -> int:
        return self.output.token_ids[0]


@dataclass(slots=True)
class _Tracked:
    on_output: OnOutput
    deadline_monotonic: float | None
    retains_blocks: bool = False
    """A `prefill` request: when it finishes, the engine thread reads its retained blocks into
    `retained_block_ids` before its last output is handed over."""
    retained_block_ids: tuple[int, ...] = ()


class EngineService:
    """Owns the engine thread. Start with `start()`, stop with `close()`."""

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        *,
        on_kv_changes: OnKvChanges | None = None,
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._on_kv_changes = on_kv_changes
        self._commands = CommandQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only: requests with a callback
        self._held: set[str] = set()  # engine thread only: reservations and retained prefills
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        engine.pipeline.step_waiter = self._commands.serve_while_waiting

    def start(self) -> EngineService:
        self._commands.start()
        self._thread.start()
        return self

    async def close(self, timeout_s: float = 10.0) -> None:
        """Abort every request still tracked, then stop the engine thread."""
        if not self._thread.is_alive():
            return
        await self._call(self._abort_all)
        self._stopping.set()
        await asyncio.to_thread(self._thread.join, timeout_s)

    # -- the API (coroutines, called on the event loop) -----------------------------------------

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        on_output: OnOutput,
        *,
        deadline_monotonic: float | None = None,
        tenant_salt: str = "",
    ) -> None:
        """Queue a request for local prefill and decode; raises InvalidRequestError (nothing
        kept) when the engine refuses it."""

        def run() -> None:
            self.engine.add_request(request_id, prompt_token_ids, params, tenant_salt=tenant_salt)
            self._tracked[request_id] = _Tracked(on_output, deadline_monotonic)

        await self._compile(params)
        await self._call(run)

    async def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        tenant_salt: str = "",
    ) -> RemoteReservation | None:
        """Reserve blocks for a prompt whose KV is written from elsewhere; None when short.
        The caller must `install` or `abort` it."""

        def run() -> RemoteReservation | None:
            reservation = self.engine.reserve_remote(
                request_id, prompt_token_ids, params, tenant_salt=tenant_salt
            )
            if reservation is not None:
                self._held.add(request_id)
            return reservation

        await self._compile(params)
        return await self._call(run)

    async def install(
        self,
        request_id: str,
        first_token_id: int,
        on_output: OnOutput,
        *,
        deadline_monotonic: float | None = None,
        logprobs: TokenLogprobs | None = None,
        prompt_logprobs: Sequence[TokenLogprobs] = (),
    ) -> None:
        """Make a reserved request runnable (its KV landed and was validated; the prefill worker
        sampled `first_token_id`, with `logprobs` and the prompt's scores if the request asked).
        The callback gets its first output at once. Raises KeyError when it is not reserved."""

        def run() -> None:
            output = self.engine.install_remote(
                request_id, first_token_id, logprobs, prompt_logprobs
            )
            self._held.discard(request_id)
            tracked = _Tracked(on_output, deadline_monotonic)
            if not output.is_last:
                self._tracked[request_id] = tracked
            self._deliver_kv_changes()  # its prompt blocks are reported before its first token
            self._deliver_all([(on_output, output)])

        await self._call(run)

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        deadline_monotonic: float | None = None,
        tenant_salt: str = "",
    ) -> PrefillResult:
        """Compute a prompt's KV and its first token, retaining the blocks; the caller must
        `release(request_id)` in a finally. Raises DeadlineExceededError or InvalidRequestError
        (a grammar that does not compile, or that its first token broke; nothing retained
        then)."""
        from kvrail.errors import DeadlineExceededError

        done: asyncio.Future[RequestOutput] = self._loop.create_future()

        def on_output(output: RequestOutput) -> None:
            if output.is_last and not done.done():
                done.set_result(output)

        tracked = _Tracked(on_output, deadline_monotonic, retains_blocks=True)

        def run() -> None:
            self.engine.add_request(
                request_id, prompt_token_ids, params, retain_blocks=True, tenant_salt=tenant_salt
            )
            self._tracked[request_id] = tracked
            self._held.add(request_id)

        await self._compile(params)
        await self._call(run)
        try:
            output = await asyncio.shield(done)
        except asyncio.CancelledError:
            await self.abort(request_id)
            raise
        if output.error == GRAMMAR_ERROR:  # its first token broke its grammar (a bug)
            await self.abort(request_id)
            raise InvalidRequestError(f"prefill of {request_id} broke its grammar", "grammar")
        if output.error is not None or not output.token_ids:
            await self.abort(request_id)
            raise DeadlineExceededError(f"prefill of {request_id} ended: {output.error}")
        # The engine thread read the block ids as the request finished, before handing its
        # output over: asking for them with another command would wait for the step after.
        if not tracked.retained_block_ids:
            await self.abort(request_id)
            raise RuntimeError(f"prefill of {request_id} finished without its blocks")
        return PrefillResult(output, tracked.retained_block_ids)

    async def abort(self, request_id: str) -> bool:
        """Abort a request in any state (reserved, running, retained); its callback is dropped.
        False if the engine did not know it."""

        def run() -> bool:
            self._tracked.pop(request_id, None)
            self._held.discard(request_id)
            return self.engine.abort(request_id)

        return await self._call(run)

    async def release(self, request_id: str) -> None:
        """Free a finished prefill's retained blocks (idempotent)."""
        await self.abort(request_id)

    async def counts(self) -> Counts:
        return await self._call(self.engine.counts)

    async def _compile(self, params: SamplingParams) -> None:
        """Compile the request's grammar (if any) into the engine's cache on a thread of its
        own (llguidance releases the GIL), so the engine thread only finds it there; whether it
        compiled is the engine's to say when the request is added."""
        if params.grammar is not None:
            await asyncio.to_thread(self.engine.grammars.compile, params.grammar)

    # -- the engine thread ----------------------------------------------------------------------

    async def _call(self, fn: Callable[[], T]) -> T:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as err:  # handed to the awaiting coroutine, not swallowed
                future.set_exception(err)

        if self._stopping.is_set() or not self._thread.is_alive():
            raise RuntimeError("the engine service is stopped")
        self._commands.put(run)
        return await asyncio.wrap_future(future)

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self._commands.stop_waiter()

    def _serve(self) -> None:
        wait_s = _IDLE_WAIT_S
        while not self._stopping.is_set():
            try:
                command = self._commands.get(wait_s)
            except queue.Empty:
                pass
            else:
                command()
                self._commands.run_queued()  # every queued command before the next step
            self._expire_deadlines()
            if not self.engine.has_unfinished_requests():
                self._deliver_kv_changes()
                wait_s = _IDLE_WAIT_S
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # an engine bug: fail every request rather than hang them
                log.exception("engine step failed; aborting every request")
                self._abort_all(error="engine_error", include_held=False)
                self._deliver_kv_changes()
                continue
            self._deliver_kv_changes()
            self._deliver_all([u for u in map(self._take_output, outputs) if u is not None])
            wait_s = 0.0 if outputs else _BUSY_WAIT_S
        self._commands.run_queued()  # fail commands that raced with the stop
        self._deliver_kv_changes()

    def _deliver_kv_changes(self) -> None:
        """Hand the GPU cache's net changes, then each lower tier's, to the loop (one wake-up)."""
        if self._on_kv_changes is None:
            return  # nobody listens: the engine's journals stay bounded on their own
        batches = [
            c
            for c in (self.engine.take_kv_events(), *self.engine.take_tier_events())
            if not c.is_empty
        ]
        if not batches:
            return
        try:
            self._loop.call_soon_threadsafe(_deliver_each, self._on_kv_changes, batches)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _take_output(self, output: RequestOutput) -> tuple[OnOutput, RequestOutput] | None:
        """The callback for a step's output, or None when nobody tracks its request."""
        tracked = self._tracked.get(output.request_id)
        if tracked is None:
            return None
        if output.is_last:
            del self._tracked[output.request_id]
            if tracked.retains_blocks and output.finished:
                try:
                    ids = self.engine.retained_block_ids(output.request_id)
                    tracked.retained_block_ids = tuple(ids)
                except KeyError:  # a bug; `prefill` fails the request on the empty tuple
                    log.error("finished prefill retains no blocks request_id=%s",
                              output.request_id)  # fmt: skip
        return tracked.on_output, output

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        expired = [rid for rid, t in self._tracked.items()
                   if t.deadline_monotonic is not None and now > t.deadline_monotonic]  # fmt: skip
        outputs = []
        for request_id in expired:
            tracked = self._tracked.pop(request_id)
            self.engine.abort(request_id)
            log.info("request aborted at its deadline request_id=%s", request_id)
            outputs.append((tracked.on_output, RequestOutput(request_id, error="deadline")))
        self._deliver_all(outputs)

    def _abort_all(self, error: str = "shutdown", include_held: bool = True) -> None:
        """Abort every request with a callback; with `include_held`, reservations and retained
        prefills too (their writers may still be busy, so only when shutting down)."""
        for request_id in self._tracked:
            self.engine.abort(request_id)
        self._deliver_all(
            [(t.on_output, RequestOutput(rid, error=error)) for rid, t in self._tracked.items()]
        )
        self._tracked.clear()
        if not include_held:
            return
        for request_id in self._held:
            self.engine.abort(request_id)
        self._held.clear()

    def _deliver_all(self, outputs: list[tuple[OnOutput, RequestOutput]]) -> None:
        """Hand `outputs` to the event loop at once; their callbacks run there in this order."""
        if not outputs:
            return
        try:
            self._loop.call_soon_threadsafe(_run_callbacks, outputs)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _run_callbacks(outputs: list[tuple[OnOutput, RequestOutput]]) -> None:
    for on_output, output in outputs:
        try:
            on_output(output)
        except Exception:  # one subscriber's bug must not cost the others their tokens
            log.exception("output callback failed request_id=%s", output.request_id)
