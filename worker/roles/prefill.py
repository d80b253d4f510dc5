"""The prefill role: pull a job, compute its KV, write it into the decode worker, then ack.

Jobs are fetched while the prompts fetched and not computed yet fit in one engine step
(`max_num_batched_tokens`; one job at least), at most `_MAX_JOBS_IN_FLIGHT` computing or
writing: the next step is full, and no backlog waits here that another prefill worker could run.
For each `PrefillJob` from the pool's work queue (jobs addressed to this worker first):

- refuse it for good (`drop`, never redelivered) when it is past its deadline, when its
  destination worker id and incarnation are not registered now, when its fingerprint is not ours,
  when its block ranges do not match the prompt, or when it was cancelled or settled (its outcome
  already consumed by the decode worker, so a late redelivery never writes); the decode worker is
  told on `PoolKeys.prefill_refused` (nothing was written, so it may reuse its blocks at once);
- otherwise compute the prompt's KV and first token with the engine, retaining the blocks, ask
  the decode worker for a write grant (it grants only a job it waits for, with exactly these
  blocks and this prompt; a refusal drops the job), write blocks `[first_block_index:]` into
  `dest_block_ids` with one NIXL WRITE whose notification is the encoded `PrefillDone`, and ack
  only after the write completed. A failed write is handed over to another ready prefill worker
  (or nak'ed with a delay when there is none), bounded by max_deliver; a job still running when
  a drain times out is nak'ed for another worker at once; the retained blocks are released in
  every case. With `kv_transfer_layer_groups` the grant comes first and the KV goes in groups
  of layers while the prefill computes (`layerwise.py`, docs/layerwise.md), as many as the
  setting says or, with `auto`, as this worker's measured link and prefill call for
  (`group_choice.py`).

Decode and colocated workers run this role too, for the jobs addressed to them alone (never the
shared queue): a decode worker whose peer holds more of a prompt's prefix, in any KV tier, names
that peer for the job (the router's pick, `GenerateRequest.prefill_worker_id`), and the peer
prefills the continuation from its own cache and tiers and writes the whole prompt's KV over
NIXL, with the same grants, envelope checks and checksums as a prefill worker's.

A job with a request id in flight here, or completed here recently, never writes twice.
Decode workers' NIXL agents are loaded when they register and dropped at once when they go away
or restart (new incarnation); every NIXL call runs on one thread, in order (`nixl_peers.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvrail.bus import PrefillConsumer, QueuedJob, unsubscribe
from kvrail.codec import MessageError, decode
from kvrail.errors import DeadlineExceededError, InvalidRequestError, TransferError
from kvrail.messages import Cancel, PrefillDone, PrefillJob, PrefillSettled
from kvrail.worker import metrics
from kvrail.worker.roles.cancels import RecentCancels
from kvrail.worker.roles.context import WorkerContext
from kvrail.worker.roles.group_choice import GroupChoice
from kvrail.worker.roles.layerwise import LayeredWrite
from kvrail.worker.roles.nixl_peers import NixlPeers
from kvrail.worker.roles.prefill_replies import Refused, ask_grant, tell_refused
from kvrail.worker.transfer.faults import TransportFaults
from kvrail.worker.transfer.link_speed import WriteTiming

log = logging.getLogger(__name__)

_RECENT_LIMIT = 10_000  # completed job ids remembered (dedupe of late redeliveries)
_NAK_DELAY_S = 0.5
_MAX_JOBS_IN_FLIGHT = 64  # computing or writing: bounds the blocks retained for writes


class PrefillRole:
    def __init__(self, ctx: WorkerContext, *, shared_queue: bool = True) -> None:
        """`shared_queue`: also take jobs from the pool's shared queue (prefill workers); False:
        only those addressed to this worker (a decode worker's peer prefills)."""
        self.ctx = ctx
        self.shared_queue = shared_queue
        self.faults = TransportFaults.from_settings(ctx.settings)
        self._nixl = NixlPeers(ctx)  # the decode workers' agents, and the NIXL thread
        self._in_flight: dict[str, int] = {}  # job id -> stream sequence of that delivery
        self._recent: OrderedDict[str, None] = OrderedDict()  # completed or refused job ids
        # Kept for the request deadline horizon: a job cannot run past its request's deadline.
        self._cancelled = RecentCancels(ctx.settings.request_timeout_s)
        self._settled: OrderedDict[str, None] = OrderedDict()  # outcomes consumed by decode
        self._jobs: set[asyncio.Task[None]] = set()
        # Jobs are fetched while the prompts still to compute fit in one engine step: enough to
        # fill the next step, never a backlog that another prefill worker could be running.
        self._step_tokens = ctx.settings.max_num_batched_tokens
        self._tokens_to_compute = 0
        self._room = asyncio.Event()
        self._consumer: PrefillConsumer | None = None
        self._subs: list[Subscription] = []
        self._fetcher: asyncio.Task[None] | None = None
        self._stopping = False
        # Layer-wise writes (docs/layerwise.md): how many groups, and the writes under way.
        self._choice = GroupChoice(
            ctx.settings.kv_transfer_layer_groups, ctx.connector, ctx.block_size, self._step_tokens
        )
        self._layered: dict[str, LayeredWrite] = {}

    @property
    def num_pending(self) -> int:
        return len(self._in_flight)

    async def start(self) -> None:
        self._consumer = await self.ctx.prefill_queue.consumer(
            self.ctx.worker_id, shared=self.shared_queue
        )
        self._subs.append(await self.ctx.nc.subscribe(self.ctx.keys.cancel, cb=self._on_cancel))
        self._subs.append(
            await self.ctx.nc.subscribe(self.ctx.keys.prefill_settled, cb=self._on_settled)
        )
        self._fetcher = asyncio.create_task(self._fetch_loop(), name="prefill-fetch")

    async def drain(self, timeout_s: float) -> None:
        """Stop pulling, finish the jobs in flight (bounded), then close."""
        self._stopping = True
        if self._fetcher is not None:
            await asyncio.wait([self._fetcher], timeout=2.0)
            self._fetcher.cancel()
        if self._jobs:
            await asyncio.wait(list(self._jobs), timeout=timeout_s)
        for task in self._jobs:
            task.cancel()
        await asyncio.gather(*self._jobs, return_exceptions=True)
        for sub in self._subs:
            await unsubscribe(sub)
        if self._consumer is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._consumer.close()
        self._nixl.shutdown()

    # -- the queue ------------------------------------------------------------------------------

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = decode(msg.data, Cancel)
        except MessageError:
            return
        self._cancelled.add(cancel.request_id)
        for job_id, layered in self._layered.items():  # its groups left are never written
            if job_id.split("~", 1)[0] == cancel.request_id:
                layered.stop("cancelled")

    async def _on_settled(self, msg: Msg) -> None:
        try:
            settled = decode(msg.data, PrefillSettled)
        except MessageError:
            return
        _remember(self._settled, settled.request_id)
        if (layered := self._layered.get(settled.request_id)) is not None:
            layered.stop("settled")

    def _has_room(self) -> bool:
        """Whether to fetch another job: fewer than `_MAX_JOBS_IN_FLIGHT`, and the prompts of
        those not computed yet below one step's token budget (one job at least, however long)."""
        return len(self._jobs) < _MAX_JOBS_IN_FLIGHT and self._tokens_to_compute < self._step_tokens

    def _computing(self, num_tokens: int) -> Callable[[], None]:
        """Count a fetched job's prompt as still to compute; the callable (idempotent) says its
        compute ended, by success or not."""
        self._tokens_to_compute += num_tokens
        pending = [num_tokens]

        def computed() -> None:
            if pending:
                self._tokens_to_compute -= pending.pop()
                self._room.set()

        return computed

    def _job_ended(self, compute_done: Callable[[], None], _task: asyncio.Task[None]) -> None:
        compute_done()
        self._room.set()

    async def _fetch_loop(self) -> None:
        assert self._consumer is not None
        while not self._stopping:
            while not self._has_room():
                self._room.clear()
                await self._room.wait()
            try:
                queued = await self._consumer.fetch(timeout_s=0.5)
            except (nats.errors.Error, TimeoutError) as err:
                log.warning("prefill fetch failed error=%s", type(err).__name__)
                await asyncio.sleep(0.5)
                continue
            if queued is None or queued.job is None:
                if queued is not None:  # an invalid payload, terminated by the consumer
                    metrics.PREFILL_JOBS_REJECTED.labels("invalid").inc()
                continue
            compute_done = self._computing(len(queued.job.token_ids))
            task = asyncio.create_task(
                self._run(queued, queued.job, compute_done), name=queued.job.request_id
            )
            self._jobs.add(task)
            task.add_done_callback(self._jobs.discard)
            task.add_done_callback(_log_failure)
            task.add_done_callback(functools.partial(self._job_ended, compute_done))

    async def _run(
        self, queued: QueuedJob, job: PrefillJob, compute_done: Callable[[], None]
    ) -> None:
        job_id = job.request_id
        seq = int(queued.msg.metadata.sequence.stream)
        if job_id in self._in_flight:
            if self._in_flight[job_id] != seq:  # another message with this id: try it later
                await queued.nak(_NAK_DELAY_S)
            return  # else a redelivery while the first attempt runs: that attempt acks it
        if job_id in self._recent:
            log.info("duplicate prefill job acked without a write request_id=%s", job_id)
            metrics.PREFILL_JOBS_REJECTED.labels("duplicate").inc()
            await queued.ack()
            return
        self._in_flight[job_id] = seq
        try:
            async with queued.working(self.ctx.prefill_queue.ack_wait_s / 3):
                await self._prefill_and_write(queued, job, compute_done)
            _remember(self._recent, job_id)
            await queued.ack()
        except Refused as err:
            log.info("prefill job refused request_id=%s reason=%s", job_id, err.reason)
            metrics.PREFILL_JOBS_REJECTED.labels(err.reason).inc()
            await queued.drop()
            if not err.reason.startswith("not_granted"):
                _remember(self._recent, job_id)
                await tell_refused(self.ctx, job, err.reason)
            # Refused a grant: the decode worker knows, and this (maybe forged) message must not
            # mark the genuine job with its id as done here.
        except TransferError as err:
            final = queued.num_delivered >= self.ctx.prefill_queue.max_deliver
            others = [r.worker_id for r in self.ctx.peers.prefill_workers(self.ctx.fingerprint)]
            log.warning(
                "prefill write failed request_id=%s delivery=%d final=%s handed_to=%s error=%s",
                job_id, queued.num_delivered, final, "-" if final or not others else others[0],
                err,
            )  # fmt: skip
            metrics.KV_TRANSFER_FAILURES.labels("write").inc()
            if final:
                await queued.drop()
                await tell_refused(self.ctx, job, "transfer_failed")
            elif others:  # prefer a different worker for the next attempt
                await self.ctx.prefill_queue.hand_over(queued, others[0])
            else:
                await queued.nak(_NAK_DELAY_S)
        except asyncio.CancelledError:  # a drain timed out: another worker takes it now
            with contextlib.suppress(nats.errors.Error):
                await queued.nak(0.0)
            raise
        finally:
            self._in_flight.pop(job_id, None)

    async def _prefill_and_write(
        self, queued: QueuedJob, job: PrefillJob, compute_done: Callable[[], None]
    ) -> None:
        fetched = time.monotonic()
        published = queued.msg.metadata.timestamp
        queue_wait_s = max(0.0, (datetime.datetime.now(datetime.UTC) - published).total_seconds())
        self._check(job)
        deadline = fetched + (job.deadline_unix_s - time.time())
        groups = self._choice.plan(job)
        if not groups:
            return await self._compute_and_write(job, compute_done, queue_wait_s, deadline, None)
        layered = LayeredWrite(
            job, groups, self.ctx.connector, self.faults, self._nixl.submit, deadline,
            self.ctx.block_size,
        )  # fmt: skip
        self._layered[job.request_id] = layered
        sinks = self.ctx.service.engine.runner.layer_sinks
        try:  # granted before the compute: the groups are written while it runs
            await ask_grant(self.ctx, job)
            sinks.add(job.request_id, layered.sink)
            await self._compute_and_write(job, compute_done, queue_wait_s, deadline, layered)
        finally:  # nothing in flight before anything is told (docs/layerwise.md)
            sinks.discard(job.request_id)
            self._layered.pop(job.request_id, None)
            await layered.settle()

    async def _compute_and_write(
        self,
        job: PrefillJob,
        compute_done: Callable[[], None],
        queue_wait_s: float,
        deadline: float,
        layered: LayeredWrite | None,
    ) -> None:
        fetched = time.monotonic()
        # The first token only, sampled as the request's own sampler would (at most one token
        # of its `min_tokens` is due here).
        first = job.sampling
        params = replace(first, max_tokens=1, min_tokens=min(first.min_tokens, 1))
        try:
            result = await self.ctx.service.prefill(
                job.request_id, job.token_ids, params,
                deadline_monotonic=deadline, tenant_salt=job.tenant_salt,
            )  # fmt: skip
        except DeadlineExceededError as err:
            raise Refused("deadline") from err
        except InvalidRequestError as err:
            raise Refused("invalid_request") from err
        finally:
            compute_done()  # the next job may be fetched while this one writes
        sent = None  # a layer-wise write's LayeredStats
        try:
            computed = time.monotonic()
            num_computed = len(job.token_ids) - result.output.num_cached_tokens
            self._choice.computed(num_computed, computed - fetched)
            src = result.block_ids[job.first_block_index :]
            if len(src) != len(job.dest_block_ids):
                raise Refused("block_count")
            self._check(job)  # the destination may have gone while we computed

            def completion(sums: tuple[str, ...], groups: tuple[int, ...] = ()) -> PrefillDone:
                return PrefillDone(
                    request_id=job.request_id, fingerprint=self.ctx.fingerprint,
                    dest_incarnation=job.dest_incarnation, block_ids=job.dest_block_ids,
                    first_token_id=result.first_token_id, num_prompt_tokens=len(job.token_ids),
                    first_logprobs=result.output.logprobs,
                    prompt_logprobs=result.output.prompt_logprobs,
                    prefill_worker_id=self.ctx.worker_id,
                    prefill_incarnation=self.ctx.incarnation, block_checksums=sums,
                    transfer_bytes=len(src) * self.ctx.connector.block_bytes,
                    transport=self.ctx.connector.transport_to(job.dest_agent_name),
                    queue_wait_s=queue_wait_s, num_cached_tokens=result.output.num_cached_tokens,
                    prefill_compute_s=computed - fetched,
                    transfer_queue_s=time.monotonic() - computed, layer_groups=groups,
                )  # fmt: skip

            if layered is not None:
                groups = layered.groups
                sent = await layered.finish(src, lambda s: completion(s, groups).encode())
                if sent is None:  # no group handed over: the whole prompt in one write
                    log.warning("layer-wise write fell back request_id=%s", job.request_id)
            if sent is None:
                sums = (
                    await asyncio.to_thread(self.ctx.connector.block_checksums, src)
                    if job.with_checksums
                    else ()
                )
                if layered is None:
                    await ask_grant(self.ctx, job)
                write = functools.partial(
                    self.faults.write, self.ctx.connector, job.request_id, job.dest_agent_name,
                    src, job.dest_block_ids, completion(sums).encode(), deadline,
                )  # fmt: skip
                stats = await self._nixl.call(write)
            else:
                stats = sent.stats
        finally:
            if layered is not None:  # no group reads the source blocks once they are released
                await layered.settle()
            await self.ctx.service.release(job.request_id)
        whole = (WriteTiming.whole(stats, len(src)),)
        self._choice.wrote(job.dest_agent_name, sent.writes if sent else whole)
        metrics.KV_TRANSFER_BYTES.labels(stats.transport).inc(stats.num_bytes)
        metrics.KV_TRANSFER_SECONDS.labels(stats.transport).observe(stats.seconds)
        metrics.KV_TRANSPORT_BANDWIDTH.labels(stats.transport).set(stats.bytes_per_s)
        log.info(
            "prefill written request_id=%s dest=%s prompt_tokens=%d blocks=%d bytes=%d "
            "transfer_s=%.4f transport=%s compute_s=%.4f layer_groups=%d tail_s=%.4f overlap=%.2f",
            job.request_id, job.dest_worker_id, len(job.token_ids), len(src), stats.num_bytes,
            stats.seconds, stats.transport, computed - fetched, sent.num_groups if sent else 0,
            sent.tail_s if sent else 0.0, sent.overlap if sent else 0.0,
        )  # fmt: skip

    def _check(self, job: PrefillJob) -> None:
        """Raise Refused unless the job may run (or write) now."""
        if time.time() >= job.deadline_unix_s:
            raise Refused("deadline")
        if job.request_id.split("~", 1)[0] in self._cancelled:
            raise Refused("cancelled")
        if job.request_id in self._settled:
            raise Refused("settled")
        if job.fingerprint != self.ctx.fingerprint:
            raise Refused("fingerprint")
        dest = self.ctx.peers.records.get(job.dest_worker_id)
        if (
            dest is None
            or dest.incarnation != job.dest_incarnation
            or dest.nixl_agent_name != job.dest_agent_name
        ):
            raise Refused("stale_destination")
        num_prompt_blocks = -(-len(job.token_ids) // self.ctx.block_size)
        if len(job.dest_block_ids) != num_prompt_blocks - job.first_block_index:
            raise Refused("block_count")


def _remember(recent: OrderedDict[str, None], key: str) -> None:
    recent[key] = None
    recent.move_to_end(key)
    while len(recent) > _RECENT_LIMIT:
        recent.popitem(last=False)


def _log_failure(task: asyncio.Task[None]) -> None:
    """A job task that died of an unexpected error (a bug): log it, with its id only."""
    if not task.cancelled() and task.exception() is not None:
        log.error("prefill job failed request_id=%s", task.get_name(), exc_info=task.exception())
