"""Send one request to a decode worker and follow its token stream.

`Dispatcher.open(job)` picks a decode worker (the `Chooser` over the `WorkerView`'s ready decode
workers, each scored by the prompt blocks it already caches) and opens a stream to it: a
`TokenStream` (`token_stream.py`, NATS) for a kvrail worker. The stream yields the worker's
`TokenEvent`s in order and guarantees three things:

- **Retry only while nothing changed hands**: no responders, a worker shutting down, or a worker
  whose lease vanished before its first event: the request goes to another worker (at most
  `max_attempts` in all). After the first event a failure is the client's error.
- **Every wait has a deadline**: the request's own, and a worker whose etcd record disappears
  (lease expired: killed, partitioned) fails the request within about a second.
- **Nothing outlives the client**: leaving the stream before its last event (client disconnect,
  stop string, deadline, error) publishes a `Cancel`, which every worker of the pool sees, so the
  decode worker and any prefill worker holding blocks for it release them.

Workers registered with `engine="vllm"` are vLLM servers: when the chooser picks one, `open` returns
a `VllmStream` (`kvrail.router.streams.vllm_stream`) instead, which keeps the same interface and
guarantees over HTTP.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from nats.aio.client import Client as NatsClient

from kvrail.keys import PoolKeys
from kvrail.messages import WorkerRecord
from kvrail.router.discovery.index import prompt_hashes
from kvrail.router.discovery.view import WorkerView
from kvrail.router.policy import Candidate, Chooser, Decision, NoWorkerError, holding_peer
from kvrail.router.streams.inbox import EventInbox
from kvrail.router.streams.job import CancelReason, DispatchError, Engine, EventStream, Job
from kvrail.router.streams.token_stream import TokenStream
from kvrail.router.streams.vllm_options import VllmOptions
from kvrail.router.streams.vllm_stream import VllmStream

__all__ = ["CancelReason", "DispatchError", "Dispatcher", "EventStream", "Job", "TokenStream"]

REPORT_LAG_S = 0.1
"""How long after one of this router's requests ended a worker's record may still count it:
the record was written before the end, and etcd delivered it after (milliseconds, usually)."""


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
    pin_worker: str = ""
    """Send every request to this decode worker and no other (a pod's HTTP front, which a
    Gateway API gateway reaches when kvrail's endpoint picker chose that worker); "": choose."""
    inbox: EventInbox = field(init=False)
    _ended: dict[str, collections.deque[float]] = field(init=False, default_factory=dict)
    """When this router's requests on each worker ended, the last `REPORT_LAG_S` of them."""

    def __post_init__(self) -> None:
        self.inbox = EventInbox(self.nc)
        self.view.track_load(self.ours_in_report)

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
        workers = [r for r in self.decode_workers() if r.engine in engines]
        block_sizes = {r.fingerprint: r.block_size or self.block_size for r in workers}
        out: list[Candidate] = []
        num_blocks = len(job.token_ids) // self.block_size
        for fingerprint, block_size in sorted(block_sizes.items()):
            hashes = prompt_hashes(job.token_ids, block_size, fingerprint, job.tenant_salt)
            found = self.view.candidates(hashes, self.in_flight, fingerprint, engines)
            out += [c for c in found if not self.pin_worker or c.worker_id == self.pin_worker]
            num_blocks = len(job.token_ids) // block_size
        return out, num_blocks

    def decode_workers(self) -> Sequence[WorkerRecord]:
        """The ready decode workers this dispatcher sends to: the pinned one alone, if any."""
        workers = self.view.decode_workers()
        if self.pin_worker:
            return [r for r in workers if r.worker_id == self.pin_worker]
        return workers

    def count_in_flight(self, worker_id: str, delta: int, *, ended: bool = True) -> None:
        """This router's requests in flight on `worker_id` (load-based choice and the per-worker
        metrics read them); a worker with none leaves the table. `ended=False`: the requests
        taken off did not end, the worker's record counts them now (an endpoint picker's handed
        over bookings), so they are not among `ours_in_report`'s recent ends."""
        left = self.in_flight.get(worker_id, 0) + delta
        if left > 0:
            self.in_flight[worker_id] = left
        else:
            self.in_flight.pop(worker_id, None)
        if delta < 0 and ended:
            ends = self._ended.setdefault(worker_id, collections.deque())
            ends.extend([time.monotonic()] * -delta)
            self._forget_ended(worker_id)

    def ours_in_report(self, worker_id: str) -> int:
        """How many of this router's requests a record of `worker_id` arriving now may count:
        those in flight, and those that ended within `REPORT_LAG_S` (a record the worker wrote
        before one ended can arrive after it)."""
        return self.in_flight.get(worker_id, 0) + self._forget_ended(worker_id)

    def _forget_ended(self, worker_id: str) -> int:
        """Drop the ends older than `REPORT_LAG_S`; the number left."""
        ended = self._ended.get(worker_id)
        if ended is None:
            return 0
        horizon = time.monotonic() - REPORT_LAG_S
        while ended and ended[0] < horizon:
            ended.popleft()
        if not ended:
            del self._ended[worker_id]
            return 0
        return len(ended)

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
            decision = self.choose(job, set())
        except NoWorkerError:
            return TokenStream(self.nc, self.keys, self.inbox, self, job)
        record = self.view.record(decision.worker_id)
        if record is not None and record.engine == "vllm":
            assert self.vllm is not None  # candidates() offers vLLM workers only with options
            return VllmStream(self, self.vllm, job, first=decision)
        return TokenStream(self.nc, self.keys, self.inbox, self, job, first=decision)

    # The `Workers` protocol (what a stream may ask of its dispatcher) ---------------------------

    def record(self, worker_id: str) -> WorkerRecord | None:
        return self.view.record(worker_id)

    def prefill_candidates(self, fingerprint: str, engines: tuple[Engine, ...]) -> list[Candidate]:
        return self.view.prefill_candidates(self.in_flight, fingerprint, engines)

    def prefill_worker_for(self, job: Job, decision: Decision) -> str:
        """The worker to prefill `job` for the kvrail decode worker of `decision`, when one holds
        more of the prompt's prefix (in any KV tier) than that worker, whose own blocks a remote
        prefill skips: the ready kvrail prefill worker of its fingerprint that the chooser
        prefers (its cached prefix priced as for decode workers, against its load), or a decode
        peer holding more still when `holding_peer` says the move is most of the work; ""
        otherwise, or under a policy that does not weigh cached blocks (the prefill queue
        balances the load by itself)."""
        record = self.view.record(decision.worker_id)
        if record is None or record.engine != "kvrail" or self.chooser.policy != "kv-aware":
            return ""
        fingerprint = record.fingerprint
        workers = (*self.view.prefill_workers(), *self.view.decode_workers())
        if not any(
            r.worker_id != decision.worker_id and r.fingerprint == fingerprint for r in workers
        ):
            return ""  # nobody else could hold more: no need to hash the prompt again
        block_size = record.block_size or self.block_size
        hashes = prompt_hashes(job.token_ids, block_size, fingerprint, job.tenant_salt)
        peers, candidates = self.view.holders(hashes, self.in_flight, fingerprint, ("kvrail",))
        named, held = "", decision.matched_blocks
        if any(c.matched_blocks > held for c in candidates):
            chosen = self.chooser.choose(candidates, len(hashes))
            if chosen.matched_blocks > held:
                named, held = chosen.worker_id, chosen.matched_blocks
        others = [c for c in peers if c.worker_id != decision.worker_id]
        peer = holding_peer(others, held, len(hashes))
        return peer.worker_id if peer is not None else named

    def choose(
        self, job: Job, exclude: set[str], engines: tuple[Engine, ...] | None = None
    ) -> Decision:
        return self.rank(job, exclude, 1, engines)[0]

    def rank(
        self, job: Job, exclude: set[str], n: int, engines: tuple[Engine, ...] | None = None
    ) -> list[Decision]:
        """`choose`'s decision for `job` first, then up to `n - 1` fallbacks, cheapest first
        (`Chooser.ranked`; kvrail's endpoint picker names them to the gateway). Raises
        NoWorkerError when no worker is left."""
        candidates, num_blocks = self.candidates(job, engines)
        candidates = [c for c in candidates if c.worker_id not in exclude]
        if job.prefer:
            candidates = [c for c in candidates if c.worker_id == job.prefer] or candidates
        decisions = self.chooser.ranked(candidates, num_blocks, n)
        if self.on_decision is not None:
            self.on_decision(decisions[0])
        return decisions
