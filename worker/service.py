"""The engine behind one thread, for asyncio code.

`LLMEngine` is synchronous and not thread-safe, so exactly one thread (the engine thread) ever
touches it. Asyncio code calls the `EngineService` coroutines (`submit`, `reserve`, `install`,
`prefill`, `abort`, `release`, `counts`): each queues a command, the engine thread runs it, and
the coroutine gets its result. The engine thread runs commands between two steps and also while
a step runs on the device: it hands the step's CUDA event to a waiter thread and runs commands
until the waiter says the event has passed (`LLMEngine.step_waiter`). A command thus waits for
the engine thread's host work, not for the device's step (about half a decode step, for each
reservation and install of a remote prefill). Outputs go back through each request's callback,
called on the event loop, in order: a step's updates are handed over together (one
`loop.call_soon_threadsafe` per step, not one per request, so the engine thread and the loop
do not trade the GIL and a wake-up for every token), and a callback that raises is logged
without keeping the others from their updates. Prefix-cache changes go the
same way to `on_kv_changes` (if given): the engine's net `KvChanges` at the end of each loop
iteration (its commands and its step), in order and never empty, so a subscriber that applies
them in order holds exactly the engine's cached hashes as of the last batch delivered. A
request's computed (or installed) prompt blocks are delivered before its first token.

Guarantees:
- a request with a deadline is aborted by the engine thread once the deadline passes, and its
  callback gets one final `Update` with `error="deadline"`; no request outlives its deadline;
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
from typing import Any, TypeVar

from kvrail.sampling import SamplingParams
from kvrail.worker.engine.block_pool import KvChanges
from kvrail.worker.engine.engine import LLMEngine, RequestOutput
from kvrail.worker.engine.scheduler_output import RemoteReservation

log = logging.getLogger(__name__)

T = TypeVar("T")
_IDLE_WAIT_S = 0.02  # how long an idle engine thread sleeps between deadline checks
_BUSY_WAIT_S = 0.002  # after a step that produced nothing (e.g. only reserved requests)


@dataclass(frozen=True, slots=True)
class Update:
    """What a step added to a request: its new tokens (only those), and why it ended (if so)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (a locally prefilled request's)."""
    retained_block_ids: tuple[int, ...] = ()
    """A finished `prefill` request's retained blocks (its KV, in table order)."""

    @property
    def is_last(self) -> bool:
        return self.finished or self.error is not None


OnUpdate = Callable[[Update], None]
OnKvChanges = Callable[[KvChanges], None]


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """A finished prefill whose blocks are retained until `EngineService.release`."""

    first_token_id: int
    block_ids: tuple[int, ...]


@dataclass(slots=True)
class _Tracked:
    on_update: OnUpdate
    deadline_monotonic: float | None
    retains_blocks: bool = False
    """A `prefill` request: its last update carries its retained block ids."""


@dataclass(frozen=True, slots=True)
class Counts:
    """Blocks (null block excluded) and requests the engine holds right now."""

    num_blocks: int
    num_free_blocks: int
    num_requests: int
    num_retained: int
    num_running: int
    num_waiting: int


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
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only: requests with a callback
        self._held: set[str] = set()  # engine thread only: reservations and retained prefills
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._steps: queue.SimpleQueue[Any] = queue.SimpleQueue()  # CUDA events; None: stop
        self._waiter = threading.Thread(target=self._wait_for_steps, name="engine-waiter",
                                        daemon=True)  # fmt: skip
        self._wait_error: BaseException | None = None
        engine.step_waiter = self._serve_while_waiting

    def start(self) -> EngineService:
        self._waiter.start()
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
        on_update: OnUpdate,
        *,
        deadline_monotonic: float | None = None,
        tenant_salt: str = "",
    ) -> None:
        """Queue a request for local prefill and decode; raises InvalidRequestError (nothing
        kept) when the engine refuses it."""

        def run() -> None:
            self.engine.add_request(request_id, prompt_token_ids, params, tenant_salt=tenant_salt)
            self._tracked[request_id] = _Tracked(on_update, deadline_monotonic)

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

        return await self._call(run)

    async def install(
        self,
        request_id: str,
        first_token_id: int,
        on_update: OnUpdate,
        *,
        deadline_monotonic: float | None = None,
    ) -> None:
        """Make a reserved request runnable (its KV landed and was validated). The callback gets
        the first token at once."""

        def run() -> None:
            # NOTE(adapter): LLMEngine.install_remote returns nothing, so the request is read
            # from the scheduler to report the first token and a finish on it.
            request = self.engine.scheduler.requests.get(request_id)
            self.engine.install_remote(request_id, first_token_id)
            self._held.discard(request_id)
            if request is None:  # pragma: no cover - install_remote raised KeyError already
                return
            tracked = _Tracked(on_update, deadline_monotonic)
            if not request.is_finished:
                self._tracked[request_id] = tracked
            self._deliver_kv_changes()  # its prompt blocks are reported before its first token
            self._deliver(
                tracked,
                Update(
                    request_id,
                    (first_token_id,),
                    request.is_finished,
                    request.status.finish_reason,
                ),
            )

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
        (nothing retained then)."""
        from kvrail.errors import DeadlineExceededError

        done: asyncio.Future[Update] = self._loop.create_future()

        def on_update(update: Update) -> None:
            if update.is_last and not done.done():
                done.set_result(update)

        def run() -> None:
            self.engine.add_request(
                request_id, prompt_token_ids, params, retain_blocks=True, tenant_salt=tenant_salt
            )
            self._tracked[request_id] = _Tracked(on_update, deadline_monotonic, True)
            self._held.add(request_id)

        await self._call(run)
        try:
            update = await asyncio.shield(done)
        except asyncio.CancelledError:
            await self.abort(request_id)
            raise
        if update.error is not None or not update.new_token_ids:
            await self.abort(request_id)
            raise DeadlineExceededError(f"prefill of {request_id} ended: {update.error}")
        # The block ids came with the update, read by the engine thread as the request finished:
        # asking for them with another command would wait for the step after.
        if not update.retained_block_ids:
            await self.abort(request_id)
            raise RuntimeError(f"prefill of {request_id} finished without its blocks")
        return PrefillResult(update.new_token_ids[0], update.retained_block_ids)

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
        return await self._call(lambda: block_counts(self.engine))

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
            self._steps.put(None)  # the waiter thread ends too

    def _serve(self) -> None:
        wait_s = _IDLE_WAIT_S
        while not self._stopping.is_set():
            try:
                command = self._commands.get(timeout=wait_s)
            except queue.Empty:
                pass
            else:
                command()
                self._run_queued()  # every queued command before the next step
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
            self._deliver_all([u for u in map(self._take_update, outputs) if u is not None])
            wait_s = 0.0 if outputs else _BUSY_WAIT_S
        self._run_queued()  # fail commands that raced with the stop
        self._deliver_kv_changes()

    def _run_queued(self) -> None:
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _serve_while_waiting(self, done: Any) -> None:
        """The engine's `step_waiter`: run commands as they come until the step's event `done`
        has passed (the waiter thread's `_step_done` says so). On the CPU (`done` is None) the
        step has already run: the commands queued by now run, so that the CPU's tests take the
        path a GPU takes."""
        if done is None:
            self._run_queued()
            return
        self._steps.put(done)
        while (command := self._commands.get()) is not _step_done:
            command()
        error, self._wait_error = self._wait_error, None
        if error is not None:
            raise error  # the step failed: `_serve` fails its requests
        done.synchronize()  # has passed: a no-op that makes sure, whatever the queue held

    def _wait_for_steps(self) -> None:
        """The waiter thread: wait for each step event it is given, then wake the engine
        thread with `_step_done` (also when the wait failed, with the error kept for it)."""
        while (done := self._steps.get()) is not None:
            try:
                done.synchronize()
            except BaseException as err:  # raised again on the engine thread
                self._wait_error = err
            self._commands.put(_step_done)

    def _deliver_kv_changes(self) -> None:
        if self._on_kv_changes is None:
            return  # nobody listens: the engine's journal stays bounded on its own
        changes = self.engine.take_kv_events()
        if changes.is_empty:
            return
        try:
            self._loop.call_soon_threadsafe(self._on_kv_changes, changes)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _take_update(self, output: RequestOutput) -> tuple[OnUpdate, Update] | None:
        """The callback and update for a step's output, or None when nobody tracks it."""
        tracked = self._tracked.get(output.request_id)
        if tracked is None:
            return None
        retained: tuple[int, ...] = ()
        if output.finished:
            del self._tracked[output.request_id]
            if tracked.retains_blocks:
                try:
                    retained = tuple(self.engine.retained_block_ids(output.request_id))
                except KeyError:  # a bug; `prefill` fails the request on the empty tuple
                    log.error("finished prefill retains no blocks request_id=%s",
                              output.request_id)  # fmt: skip
        update = Update(
            output.request_id, output.new_token_ids, output.finished, output.finish_reason,
            num_cached_tokens=output.num_cached_tokens, retained_block_ids=retained,
        )  # fmt: skip
        return tracked.on_update, update

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        expired = [
            rid
            for rid, t in self._tracked.items()
            if t.deadline_monotonic is not None and now > t.deadline_monotonic
        ]
        updates = []
        for request_id in expired:
            tracked = self._tracked.pop(request_id)
            self.engine.abort(request_id)
            log.info("request aborted at its deadline request_id=%s", request_id)
            updates.append((tracked.on_update, Update(request_id, (), error="deadline")))
        self._deliver_all(updates)

    def _abort_all(self, error: str = "shutdown", include_held: bool = True) -> None:
        """Abort every request with a callback; with `include_held`, reservations and retained
        prefills too (their writers may still be busy, so only when shutting down)."""
        for request_id in self._tracked:
            self.engine.abort(request_id)
        self._deliver_all(
            [(t.on_update, Update(rid, (), error=error)) for rid, t in self._tracked.items()]
        )
        self._tracked.clear()
        if not include_held:
            return
        for request_id in self._held:
            self.engine.abort(request_id)
        self._held.clear()

    def _deliver(self, tracked: _Tracked, update: Update) -> None:
        self._deliver_all([(tracked.on_update, update)])

    def _deliver_all(self, updates: list[tuple[OnUpdate, Update]]) -> None:
        """Hand `updates` to the event loop at once; their callbacks run there in this order."""
        if not updates:
            return
        try:
            self._loop.call_soon_threadsafe(_run_callbacks, updates)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _step_done() -> None:
    """The waiter thread's word that the step the engine thread waits for has finished (a
    command that does nothing, should one ever be run as a command)."""


def _run_callbacks(updates: list[tuple[OnUpdate, Update]]) -> None:
    for on_update, update in updates:
        try:
            on_update(update)
        except Exception:  # one subscriber's bug must not cost the others their tokens
            log.exception("update callback failed request_id=%s", update.request_id)


def block_counts(engine: LLMEngine) -> Counts:
    """Block and request counts of an engine (call on the engine thread).

    NOTE(adapter): reads the scheduler and block pool directly; the engine exposes no counts.
    """
    scheduler: Any = engine.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    _used, cached, free = pool.counts()
    return Counts(
        num_blocks=pool.num_blocks - 1,
        num_free_blocks=cached + free,
        num_requests=len(scheduler.requests),
        num_retained=len(scheduler.retained),
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
    )
