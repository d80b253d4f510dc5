"""The decode side of a remote prefill: reserve, publish the job, wait, validate, install.

`KvReceiver.prefill()` reserves the prompt's blocks first (reusing cached prefix blocks),
publishes a `PrefillJob` naming them, waits (bounded by the deadline) for the prefill worker's
NIXL notification carrying a `PrefillDone` (a refusal comes over NATS instead, as nothing was
written), validates it against the reservation (checksums when asked) and only then installs the
request, so a half-written block table never runs. Before writing, the prefill worker asks for a
write grant (`write_grants.py`). A failure follows `kv_load_failure_policy`: `recompute` (the
caller prefills locally), `fail` (an error), `reroute` (one more attempt on another prefill
worker within the deadline, then an error). A first job goes to `request.prefill_worker_id`: a
prefill worker, or a decode peer holding more of the prefix (then in any pool, colocated too).

Blocks handed to a remote writer are never reused while a write may still land: a remote prefill
abandoned after a write was granted is quarantined (`quarantine.py`); one never granted cannot
write (no more grants once it is abandoned), so its blocks are free at once. Every completion
consumed, and every abandoned job, is announced as `PrefillSettled`, so a later redelivery of
the job never writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvrail.bus import unsubscribe
from kvrail.codec import MessageError, decode
from kvrail.errors import TransferError
from kvrail.messages import (
    GenerateRequest,
    PrefillDone,
    PrefillJob,
    PrefillSettled,
    WorkerRecord,
    WriteGrant,
    WriteGrantRequest,
    tokens_digest,
)
from kvrail.outputs import RequestOutput
from kvrail.sampling import SamplingParams
from kvrail.worker import metrics
from kvrail.worker.engine.fence import DeviceFence
from kvrail.worker.roles import write_grants
from kvrail.worker.roles.context import WorkerContext
from kvrail.worker.roles.handoff import Handoff, RequestFailed
from kvrail.worker.roles.quarantine import Quarantine
from kvrail.worker.roles.stages import StageTimes
from kvrail.worker.roles.write_grants import AwaitedJob
from kvrail.worker.transfer.envelope import Reservation, checksums_of, validate

log = logging.getLogger(__name__)

# NIXL notifications are polled (NIXL has no wait): every _WRITE_POLL_S while a granted write may
# land (1 ms off the handoff's copy stage against _POLL_S, bench/sweep/README.md), _POLL_S while a
# remote prefill is computed, _IDLE_POLL_S otherwise (late completions only lift quarantines).
# Not below 1 ms: uvloop's timers count whole milliseconds (a shorter sleep would busy-loop).
_WRITE_POLL_S = 0.001
_POLL_S = 0.002
_IDLE_POLL_S = 0.05
_QUARANTINE_MARGIN_S = 1.0


class KvReceiver:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self._pending: dict[str, AwaitedJob] = {}  # by job id
        self._granted: set[str] = set()  # job ids granted a write, whose outcome is unknown
        self._quarantine = Quarantine()
        self._settling: set[asyncio.Task[None]] = set()
        self._subs: list[Subscription] = []
        self._poller: asyncio.Task[None] | None = None
        ctx.peers.listen(self._on_peer_change)

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantine.engine_ids())

    async def start(self) -> None:
        nc, keys, worker_id = self.ctx.nc, self.ctx.keys, self.ctx.worker_id
        self._subs = [
            await nc.subscribe(keys.prefill_refused(worker_id), cb=self._on_refused),
            await nc.subscribe(keys.write_grant(worker_id), cb=self._on_grant),
        ]
        self._poller = asyncio.create_task(self._poll_notifications(), name="decode-notify")

    async def stop(self) -> None:
        """Stop listening and free every quarantined reservation (the process is leaving)."""
        for sub in self._subs:
            await unsubscribe(sub)
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        for engine_id in self._quarantine.clear():
            await self.ctx.service.abort(engine_id)
        self._granted.clear()

    async def _on_refused(self, msg: Msg) -> None:
        self._on_notification(msg.data)

    async def _on_grant(self, msg: Msg) -> None:
        try:
            ask = decode(msg.data, WriteGrantRequest)
            reason = self._grant_refusal(ask)
        except MessageError:
            reason = "invalid"
        if not reason:  # the device must be done with the blocks before anyone writes them
            fence = self._pending[ask.request_id].fence
            # Polled: a CUDA event cannot be awaited. Bounded: the job's outcome has a deadline.
            while not fence.passed() and not (reason := self._grant_refusal(ask)):  # noqa: ASYNC110
                await asyncio.sleep(_POLL_S)
            reason = reason or self._grant_refusal(ask)  # it may have ended meanwhile
        if reason:
            metrics.KV_WRITE_GRANTS_REFUSED.labels(reason).inc()
            log.warning("kv write not granted reason=%s", reason)
        else:
            self._granted.add(ask.request_id)
        with contextlib.suppress(nats.errors.Error):
            await msg.respond(WriteGrant(granted=not reason, reason=reason).encode())

    def _grant_refusal(self, ask: WriteGrantRequest) -> str:
        """Why this write may not happen now ("" when it may); see `write_grants.refusal`."""
        return write_grants.refusal(ask, self._pending.get(ask.request_id), self.ctx.incarnation)

    def wants(self, request: GenerateRequest) -> bool:
        """Whether to try a remote prefill: a long prompt, and a decode peer named as holding
        more of its prefix (any pool) or, disaggregated, a prefill worker ready."""
        settings, peers, fingerprint = self.ctx.settings, self.ctx.peers, self.ctx.fingerprint
        return len(request.token_ids) >= settings.min_remote_prefill_tokens and (
            bool(peers.decode_peer(request, fingerprint))
            or (
                settings.disaggregation_mode == "disaggregated"
                and bool(peers.prefill_workers(fingerprint))
            )
        )

    async def prefill(
        self,
        request: GenerateRequest,
        params: SamplingParams,
        on_output: Callable[[RequestOutput], None],
        stages: StageTimes,
        arrived: float,
        deadline: float,
    ) -> Handoff:
        """Prefill on a prefill worker into reserved blocks. `installed`: the request runs, its
        tokens flow to `on_output`; `local`: nothing was tried, prefill locally; `recompute`: the
        remote prefill failed, prefill locally (under another engine id if `is_quarantined`).
        Raises RequestFailed under the `fail` and `reroute` policies. TTFT stages go to `stages`."""
        rid = request.request_id
        reservation = await self.ctx.service.reserve(
            rid, request.token_ids, params, tenant_salt=request.tenant_salt
        )
        if reservation is None:
            return Handoff("local")  # the pool is short now: queue it locally, to wait for blocks
        first_block = reservation.num_cached_tokens // self.ctx.block_size
        dest = tuple(reservation.block_ids[first_block:])
        # What a prefill here would compute (its lower tiers' hits would load instead).
        held = reservation.num_cached_tokens + reservation.num_lower_tier_tokens
        uncached = len(request.token_ids) - held
        # `wants` again: the named peer, or every prefill worker, may have gone while we
        # reserved, and a job nobody takes would wait out the remote-prefill timeout.
        if (
            not dest
            or uncached < self.ctx.settings.min_remote_prefill_tokens
            or not self.wants(request)
        ):
            await self.ctx.service.abort(rid)
            return Handoff("local")
        policy = self.ctx.settings.kv_load_failure_policy
        job_ids: list[str] = []
        failed_worker = ""
        reason = "kv_load_failed"
        try:
            for attempt in range(2 if policy == "reroute" else 1):
                target = self.ctx.peers.prefill_worker(request, self.ctx.fingerprint)
                if attempt > 0:
                    others = [
                        r.worker_id
                        for r in self.ctx.peers.prefill_workers(self.ctx.fingerprint)
                        if r.worker_id != failed_worker
                    ]
                    if not others or time.monotonic() >= deadline:
                        break
                    target = others[0]
                job = PrefillJob(
                    request_id=rid if attempt == 0 else f"{rid}~r{attempt}",
                    token_ids=request.token_ids, fingerprint=self.ctx.fingerprint,
                    dest_worker_id=self.ctx.worker_id, dest_incarnation=self.ctx.incarnation,
                    dest_agent_name=self.ctx.agent_name, dest_block_ids=dest,
                    first_block_index=first_block, deadline_unix_s=request.deadline_unix_s,
                    sampling=request.sampling, tenant_salt=request.tenant_salt,
                    with_checksums=self.ctx.settings.transfer_checksums,
                )  # fmt: skip
                job_ids.append(job.request_id)
                try:
                    done = await self._run_job(
                        job, reservation.fence, target, stages, arrived, deadline
                    )
                except RequestFailed as err:
                    reason = err.reason
                    continue
                if done.error is None:
                    job_ids.remove(job.request_id)  # its write completed: nothing outstanding
                    if await self._validate(done, job, request, stages):
                        installed_at = time.monotonic()
                        await self.ctx.service.install(
                            rid, done.first_token_id, on_output, deadline_monotonic=deadline,
                            logprobs=next(iter(done.first_logprobs), None),
                            prompt_logprobs=done.prompt_logprobs,
                        )  # fmt: skip
                        stages.admission_s = (stages.admission_s or 0.0) + (
                            time.monotonic() - installed_at
                        )
                        for outstanding in job_ids:  # an earlier attempt must never write now
                            self._settle_soon(outstanding)  # (same blocks, same prompt if it did)
                            self._granted.discard(outstanding)
                        return Handoff("installed", max(reservation.num_cached_tokens,
                                                        done.num_cached_tokens))  # fmt: skip
                    reason = "kv_invalid"
                else:
                    job_ids.remove(job.request_id)  # the prefill worker refused it for good
                    reason = "prefill_refused"
                failed_worker = done.prefill_worker_id
        except BaseException:
            await asyncio.shield(self._quarantine_or_release(rid, job_ids, request.deadline_unix_s))
            raise
        await self._quarantine_or_release(rid, job_ids, request.deadline_unix_s)
        metrics.KV_TRANSFER_FAILURES.labels(reason).inc()
        log.warning("remote prefill failed request_id=%s reason=%s policy=%s", rid, reason, policy)
        if policy == "recompute":
            return Handoff("recompute")
        raise RequestFailed(reason)

    async def _run_job(
        self,
        job: PrefillJob,
        fence: DeviceFence,
        target: str | None,
        stages: StageTimes,
        arrived: float,
        deadline: float,
    ) -> PrefillDone:
        future: asyncio.Future[tuple[PrefillDone, float]] = (
            asyncio.get_running_loop().create_future()
        )
        writer = self.ctx.peers.records.get(target) if target else None
        peer = writer.worker_id if writer is not None and writer.role != "prefill" else ""
        self._pending[job.request_id] = AwaitedJob(
            job, tokens_digest(job.token_ids), future, fence, peer
        )
        try:
            published = time.monotonic()
            stages.admission_s = published - arrived
            if not await self.ctx.prefill_queue.publish(job, to_worker=target):
                raise RequestFailed("duplicate_job")
            wait_until = min(deadline, published + self.ctx.settings.remote_prefill_timeout_s)
            remaining = wait_until - time.monotonic()
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result when a
            # cancel (the client's) arrives as the completion lands, and the cancel is lost.
            try:
                async with asyncio.timeout(max(remaining, 0.0)):
                    done, landed = await asyncio.shield(future)
            except TimeoutError as err:  # the job's deadline, or our patience with it
                raise RequestFailed("deadline" if wait_until == deadline else "kv_timeout") from err
        finally:
            self._pending.pop(job.request_id, None)
        if done.error is None:
            known = done.queue_wait_s + done.prefill_compute_s + done.transfer_queue_s
            stages.queue_wait_s = done.queue_wait_s
            stages.prefill_compute_s = done.prefill_compute_s
            stages.transfer_queue_s = done.transfer_queue_s
            stages.copy_s = max(0.0, landed - published - known)
        return done

    async def _validate(
        self, done: PrefillDone, job: PrefillJob, request: GenerateRequest, stages: StageTimes
    ) -> bool:
        reservation = Reservation(
            job.request_id, self.ctx.fingerprint, self.ctx.incarnation, job.dest_block_ids,
            len(request.token_ids), request.deadline_unix_s,
        )  # fmt: skip
        checksums = checksums_of(done, self.ctx.connector) if job.with_checksums else None
        fault = self.ctx.settings.fault_corrupt_kv_transfers
        if fault and random.random() < fault and done.block_ids:
            # Fault injection (tests): a block corrupted in flight, as the checksum sees it.
            log.warning("fault injection: corrupting a received block request_id=%s",
                        request.request_id)  # fmt: skip
            self.ctx.connector.region.block_bytes_view(done.block_ids[0])[0] ^= 0xFF
        started = time.monotonic()
        try:
            await asyncio.to_thread(validate, done, reservation, time.time(), checksums)
        except TransferError as err:  # an EnvelopeError, or a rank's checksums out of reach
            log.warning(
                "completion refused request_id=%s reason=%s blocks=%d detail=%s",
                request.request_id, getattr(err, "reason", "checksums_unavailable"),
                len(job.dest_block_ids), err,
            )  # fmt: skip
            return False
        stages.validation_s = time.monotonic() - started
        return True

    async def _quarantine_or_release(
        self, engine_id: str, job_ids: list[str], deadline: float
    ) -> None:
        """Free the reservation now when no write can land in it any more, else later."""
        job_ids = [job_id for job_id in job_ids if job_id in self._granted]
        if not job_ids:
            await self.ctx.service.abort(engine_id)
            return
        release_at = time.monotonic() + (deadline - time.time()) + _QUARANTINE_MARGIN_S
        self._quarantine.hold(engine_id, job_ids, release_at)
        for job_id in job_ids:
            self._settle_soon(job_id)  # later deliveries never run; a write under way may land
        log.info(
            "reservation quarantined request_id=%s jobs=%d release_in_s=%.1f",
            engine_id, len(job_ids), release_at - time.monotonic(),
        )  # fmt: skip

    def is_quarantined(self, engine_id: str) -> bool:
        return engine_id in self._quarantine

    async def _poll_notifications(self) -> None:
        next_sweep = 0.0
        while True:
            for _peer, payload in self.ctx.connector.notifications():
                self._on_notification(payload)
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + 0.1
                await self._sweep_quarantine(now)
            await asyncio.sleep(self._poll_interval())

    def _poll_interval(self) -> float:
        if not self._pending:
            return _IDLE_POLL_S
        if any(job_id in self._pending for job_id in self._granted):
            return _WRITE_POLL_S
        return _POLL_S

    def _on_notification(self, payload: bytes) -> None:
        try:
            done = decode(payload, PrefillDone)
        except MessageError as err:
            log.warning("ignoring an invalid completion error=%s", err)
            return
        self._settle_soon(done.request_id)
        self._granted.discard(done.request_id)
        pending = self._pending.get(done.request_id)
        if pending is not None and not pending.outcome.done():
            pending.outcome.set_result((done, time.monotonic()))
            return
        if self._quarantine.report(done.request_id):
            log.info("quarantined writer reported request_id=%s", done.request_id)

    def _settle_soon(self, job_id: str) -> None:
        task = asyncio.create_task(self._settle(job_id))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, job_id: str) -> None:
        """Tell prefill workers never to run this job again (best effort, core NATS)."""
        with contextlib.suppress(nats.errors.Error):
            await self.ctx.nc.publish(
                self.ctx.keys.prefill_settled, PrefillSettled(job_id).encode()
            )

    async def _sweep_quarantine(self, now: float) -> None:
        released, expired_job_ids = self._quarantine.take_releasable(now)
        self._granted -= expired_job_ids
        for engine_id in released:
            await self.ctx.service.abort(engine_id)

    def _on_peer_change(
        self, worker_id: str, old: WorkerRecord | None, new: WorkerRecord | None
    ) -> None:
        """A writer left, died or restarted: the jobs it may have held and will never complete
        give up now (`write_grants.lost_with`)."""
        if old is None or (new is not None and new.incarnation == old.incarnation):
            return
        drained = new is None and not old.is_ready  # not ready, then gone: it drained and left
        for job_id, pending in list(self._pending.items()):
            if write_grants.lost_with(pending, worker_id, old.role, drained=drained):
                log.info("prefill worker lost request_id=%s worker=%s", job_id, worker_id)
                pending.outcome.set_exception(RequestFailed("prefill_worker_lost"))
