"""The decode worker's write grant: which prefill jobs may write into its reserved blocks.

`KvReceiver._grant_refusal` is pure logic over what the decode worker waits for; the whole
exchange (a prefill worker asking over NATS before every NIXL write) runs in
tests/integration/test_worker_disaggregated.py, with hostile jobs on a real queue.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest
from nats.aio.msg import Msg

from kvrail.codec import decode
from kvrail.messages import (
    WRITE_GRANT_REFUSALS,
    PrefillDone,
    PrefillJob,
    WorkerRecord,
    WriteGrant,
    WriteGrantRequest,
    tokens_digest,
)
from kvrail.sampling import SamplingParams
from kvrail.settings import Settings
from kvrail.worker.engine.fence import PASSED, DeviceFence
from kvrail.worker.roles import kv_receiver
from kvrail.worker.roles.context import WorkerContext
from kvrail.worker.roles.handoff import RequestFailed
from kvrail.worker.roles.kv_receiver import KvReceiver
from kvrail.worker.roles.stages import StageTimes
from kvrail.worker.roles.write_grants import AwaitedJob, lost_with

JOB = PrefillJob(
    request_id="r-1", token_ids=(5, 6, 7, 8, 9), fingerprint="f" * 64, dest_worker_id="decode-0",
    dest_incarnation=7, dest_agent_name="decode-0-7", dest_block_ids=(3, 4), first_block_index=0,
    deadline_unix_s=2e9, sampling=SamplingParams(max_tokens=1),
)  # fmt: skip


def remote_prefill(service: Any = None, prefill_queue: Any = None) -> KvReceiver:
    ctx = SimpleNamespace(
        settings=Settings(), keys=None, worker_id="decode-0", incarnation=7,
        agent_name="decode-0-7", fingerprint="f" * 64, block_size=16, nc=None,
        prefill_queue=prefill_queue, service=service,
        connector=SimpleNamespace(region=None, notifications=list),
        peers=SimpleNamespace(listen=lambda _callback: None),
    )  # fmt: skip
    return KvReceiver(cast(WorkerContext, ctx))


def remote_prefill_recording_aborts() -> tuple[KvReceiver, list[str]]:
    """A KvReceiver whose engine aborts are recorded (and settles go nowhere)."""
    aborted: list[str] = []

    async def abort(engine_id: str) -> None:
        aborted.append(engine_id)

    rp = remote_prefill(service=SimpleNamespace(abort=abort))
    rp._settle_soon = lambda _job_id: None  # type: ignore[method-assign]
    return rp, aborted


def wait_for(
    rp: KvReceiver, job: PrefillJob, fence: DeviceFence = PASSED
) -> asyncio.Future[tuple[PrefillDone, float]]:
    """Make `rp` wait for `job` as `_run_job` does; returns the future of its outcome."""
    future: asyncio.Future[tuple[PrefillDone, float]] = asyncio.get_running_loop().create_future()
    rp._pending[job.request_id] = AwaitedJob(job, tokens_digest(job.token_ids), future, fence)
    return future


class CountdownFence(DeviceFence):
    """A fence that passes at its `polls`-th look (never, with None)."""

    def __init__(self, polls: int | None) -> None:
        super().__init__()
        self.polls = polls
        self.looks = 0

    def passed(self) -> bool:
        self.looks += 1
        return self.polls is not None and self.looks >= self.polls


async def grant(rp: KvReceiver, request: WriteGrantRequest) -> WriteGrant:
    """Ask `rp` for a grant as a prefill worker does over NATS; returns its answer."""
    answers: list[bytes] = []

    async def respond(data: bytes) -> None:
        answers.append(data)

    await rp._on_grant(cast(Msg, SimpleNamespace(data=request.encode(), respond=respond)))
    [answer] = answers
    return decode(answer, WriteGrant)


def ask(**changes: Any) -> WriteGrantRequest:
    base = WriteGrantRequest(
        request_id=JOB.request_id, dest_incarnation=7, block_ids=JOB.dest_block_ids,
        tokens_digest=tokens_digest(JOB.token_ids),
    )  # fmt: skip
    return replace(base, **changes)


async def test_only_the_job_waited_for_with_its_blocks_and_prompt_is_granted() -> None:
    rp = remote_prefill()
    assert rp._grant_refusal(ask()) == "not_waiting"  # nothing pending yet
    future = wait_for(rp, JOB)
    assert rp._grant_refusal(ask()) == ""
    assert rp._grant_refusal(ask(block_ids=(3, 5))) == "foreign_blocks"
    assert rp._grant_refusal(ask(block_ids=(3, 4, 5))) == "foreign_blocks"
    assert rp._grant_refusal(ask(block_ids=(90_000, 90_001))) == "foreign_blocks"
    assert rp._grant_refusal(ask(dest_incarnation=6)) == "stale_incarnation"
    assert rp._grant_refusal(ask(tokens_digest=tokens_digest((5, 6, 7, 8)))) == "other_prompt"
    assert rp._grant_refusal(ask(request_id="r-2")) == "not_waiting"
    future.cancel()  # abandoned (deadline, cancel): no grant any more
    assert rp._grant_refusal(ask()) == "not_waiting"
    reasons = {"foreign_blocks", "stale_incarnation", "other_prompt", "not_waiting", "invalid"}
    assert reasons == set(WRITE_GRANT_REFUSALS)


async def test_a_write_is_granted_only_once_the_reservations_device_fence_has_passed() -> None:
    """The device may still write a reserved block (a step in flight when it was reserved): the
    grant waits for the reservation's fence, then answers; a job that ends meanwhile is refused."""
    rp = remote_prefill()
    fence = CountdownFence(polls=3)
    wait_for(rp, JOB, fence)
    answer = await grant(rp, ask())
    assert answer.granted and fence.looks == 3 and JOB.request_id in rp._granted
    rp._granted.clear()
    never = CountdownFence(polls=None)
    future = wait_for(rp, JOB, never)
    asking = asyncio.create_task(grant(rp, ask()))
    while never.looks < 2:  # noqa: ASYNC110 (the grant is polling the fence)
        await asyncio.sleep(0.001)
    future.set_exception(RequestFailed("kv_timeout"))  # the decode worker gave up on it
    answer = await asyncio.wait_for(asking, 5)
    assert not answer.granted and answer.reason == "not_waiting" and not rp._granted
    future.exception()  # retrieved


async def test_an_abandoned_job_never_granted_frees_its_blocks_at_once() -> None:
    """Quarantine waits only for writers that were granted: a job nobody was granted cannot
    write, so its reservation is released immediately."""
    rp, aborted = remote_prefill_recording_aborts()
    await rp._quarantine_or_release("r-1", ["r-1"], deadline=2e9)
    assert aborted == ["r-1"] and not rp.is_quarantined("r-1")
    rp._granted.add("r-2")
    await rp._quarantine_or_release("r-2", ["r-2"], deadline=2e9)
    assert aborted == ["r-1"] and rp.is_quarantined("r-2")


async def test_completions_are_polled_fastest_while_a_granted_write_may_land() -> None:
    """Idle, then pending (the prefill computes), then granted (the copy may land any moment),
    then pending again once that write reported; a granted job no longer waited for (it was
    abandoned, its reservation quarantined) does not keep the polling fast."""
    rp, _ = remote_prefill_recording_aborts()
    assert rp._poll_interval() == kv_receiver._IDLE_POLL_S
    wait_for(rp, JOB)
    assert rp._poll_interval() == kv_receiver._POLL_S
    rp._granted.add(JOB.request_id)
    assert rp._poll_interval() == kv_receiver._WRITE_POLL_S < kv_receiver._POLL_S
    wait_for(rp, replace(JOB, request_id="r-2"))
    rp._granted.discard(JOB.request_id)  # as its completion does
    assert rp._poll_interval() == kv_receiver._POLL_S
    rp._pending.clear()
    rp._granted.add("r-3")
    assert rp._poll_interval() == kv_receiver._IDLE_POLL_S
    assert kv_receiver._WRITE_POLL_S >= 0.001  # uvloop's timers: a shorter sleep busy-loops


def test_digests_tell_prompts_apart() -> None:
    assert tokens_digest((1, 2, 3)) == tokens_digest((1, 2, 3))
    assert tokens_digest((1, 2, 3)) != tokens_digest((1, 2, 4))
    assert tokens_digest((1, 2)) != tokens_digest((1, 2, 0))
    assert len(tokens_digest(())) == 32


async def test_duplicate_late_and_invalid_completions_are_harmless() -> None:
    """The first completion of a pending job resolves it; a duplicate changes nothing; a late
    one (after the job was abandoned while its writer held a grant) lifts the quarantine; an
    undecodable one is ignored."""
    rp, aborted = remote_prefill_recording_aborts()
    done = PrefillDone(
        request_id=JOB.request_id, fingerprint=JOB.fingerprint, dest_incarnation=7,
        block_ids=JOB.dest_block_ids, first_token_id=42, num_prompt_tokens=5,
        prefill_worker_id="prefill-0", prefill_incarnation=1,
    )  # fmt: skip
    future = wait_for(rp, JOB)
    rp._on_notification(done.encode())
    rp._on_notification(done.encode())  # a duplicate
    assert future.done() and future.result()[0] == done
    rp._on_notification(b"\x00 not a completion")
    # Abandoned with a granted writer: quarantined until it reports, then freed.
    rp._pending.clear()
    rp._granted.add("r-2")
    await rp._quarantine_or_release("engine-2", ["r-2"], deadline=2e9)
    assert rp.is_quarantined("engine-2")
    rp._on_notification(replace(done, request_id="r-2").encode())  # late
    await rp._sweep_quarantine(0.0)
    assert not rp.is_quarantined("engine-2") and aborted == ["engine-2"]


async def test_a_restarted_prefill_worker_fails_pending_jobs_a_drained_one_does_not() -> None:
    """A new incarnation under the same name (kill -9 and restart, or a crash) means the jobs
    the old one held will never complete: every pending remote prefill gives up at once (and its
    policy decides). A worker that drained (not ready, then gone) held nothing any more."""
    rp = remote_prefill()
    old = WorkerRecord(worker_id="prefill-0", pod_uid="u", incarnation=1, role="prefill",
                       fingerprint="f" * 64, is_ready=True)  # fmt: skip
    pending = wait_for(rp, JOB)
    rp._on_peer_change("prefill-0", replace(old, is_ready=False), None)  # drained, then gone
    assert not pending.done()
    rp._on_peer_change("prefill-0", old, replace(old, incarnation=2))  # restarted
    error = pending.exception()
    assert isinstance(error, RequestFailed) and error.reason == "prefill_worker_lost"


async def test_a_cancel_that_comes_with_the_completion_is_not_lost() -> None:
    """The client's cancel and the prefill worker's completion reach the decode worker in the
    same turn of its event loop: the wait ends cancelled, never with the completion (Python
    3.11's asyncio.wait_for returned the result there, and the request then ran to its end)."""

    async def publish(_job: PrefillJob, to_worker: str | None = None) -> bool:
        return True

    rp = remote_prefill(prefill_queue=SimpleNamespace(publish=publish))
    rp._settle_soon = lambda _job_id: None  # type: ignore[method-assign]
    now = time.monotonic()
    waiting = asyncio.create_task(rp._run_job(JOB, PASSED, None, StageTimes(), now, now + 60))
    while JOB.request_id not in rp._pending:  # noqa: ASYNC110 (the job is being published)
        await asyncio.sleep(0)
    done = PrefillDone(
        request_id=JOB.request_id, fingerprint=JOB.fingerprint, dest_incarnation=7,
        block_ids=JOB.dest_block_ids, first_token_id=42, num_prompt_tokens=5,
        prefill_worker_id="prefill-0", prefill_incarnation=1,
    )  # fmt: skip
    rp._on_notification(done.encode())
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert JOB.request_id not in rp._pending


async def test_a_job_for_a_decode_peer_gives_up_with_that_peer_alone_however_it_went() -> None:
    loop = asyncio.get_running_loop()
    queued = AwaitedJob(JOB, "d", loop.create_future(), PASSED)
    peer = AwaitedJob(JOB, "d", loop.create_future(), PASSED, peer="decode-1")
    for drained in (False, True):
        assert lost_with(peer, "decode-1", "decode", drained=drained)
        assert not lost_with(peer, "decode-2", "decode", drained=drained)
        assert not lost_with(peer, "prefill-0", "prefill", drained=drained)
        assert not lost_with(queued, "decode-1", "decode", drained=drained)
    assert lost_with(queued, "prefill-0", "prefill", drained=False)
    assert not lost_with(queued, "prefill-0", "prefill", drained=True)  # it handed its jobs back
    peer.outcome.set_result((cast(Any, None), 0.0))
    assert not lost_with(peer, "decode-1", "decode", drained=False)  # it completed first
