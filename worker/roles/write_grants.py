"""Write grants: which prefill job may write its KV into this decode worker's blocks, and when.

Right before its NIXL WRITE a prefill worker asks the job's decode worker for a grant
(`WriteGrantRequest`). The decode worker grants it only while it waits for exactly that job:
this incarnation, the very blocks it reserved and the same prompt (`tokens_digest`). So a
malformed, forged, stale or replayed job never writes into blocks another request may own. A
grant is answered once the reservation's device fence has passed (the device no longer touches
the blocks); a prefill worker asks only after its compute, so it rarely waits for that.
Pure: the decode side (`kv_receiver.py`) keeps what it waits for and answers over NATS.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvrail.messages import PrefillDone, PrefillJob, WorkerRole, WriteGrantRequest
from kvrail.worker.engine.fence import DeviceFence


@dataclass(frozen=True, slots=True)
class AwaitedJob:
    """A published job the decode worker waits for: what a grant must match, its outcome (the
    completion and when it landed, or an exception), and the fence of its reservation, which
    must have passed before the write is granted."""

    job: PrefillJob
    tokens_digest: str
    outcome: asyncio.Future[tuple[PrefillDone, float]]
    fence: DeviceFence
    peer: str = ""
    """The decode peer the job was addressed to (`PeerTable.decode_peer`); "": a prefill worker,
    named or from the queue."""


def lost_with(awaited: AwaitedJob, worker_id: str, role: WorkerRole, *, drained: bool) -> bool:
    """Whether `awaited` can no longer complete now that `worker_id` (of `role`) left, died or
    restarted. A job addressed to a decode peer waits for that peer alone, and nobody else takes
    the jobs queued for it, so it gives up however the peer went. Any other job waits for every
    prefill worker (one of them holds it, named or not, and a failed write moves it to another):
    it gives up when one dies or restarts, but not when one `drained` (not ready, then gone),
    which finished or handed back every job it held first."""
    if awaited.outcome.done():
        return False
    if awaited.peer:
        return awaited.peer == worker_id
    return role == "prefill" and not drained


def refusal(ask: WriteGrantRequest, awaited: AwaitedJob | None, incarnation: int) -> str:
    """Why the write `ask` names may not happen now ("" when it may). `awaited` is the job of
    that id this worker waits for, if any; a job whose outcome is known is no longer waited for.
    Every reason is one of `kvrail.messages.WRITE_GRANT_REFUSALS`."""
    if awaited is None or awaited.outcome.done():
        return "not_waiting"
    if ask.dest_incarnation != incarnation:
        return "stale_incarnation"
    if ask.block_ids != awaited.job.dest_block_ids:
        return "foreign_blocks"
    if ask.tokens_digest != awaited.tokens_digest:
        return "other_prompt"
    return ""
