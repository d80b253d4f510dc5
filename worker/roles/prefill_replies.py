"""What a prefill worker asks of and tells a job's decode worker over NATS: the write grant
before it writes (`ask_grant`), and that nothing will be written (`tell_refused`). Apart from
`prefill.py` so each stays short."""

from __future__ import annotations

import contextlib

import nats.errors

from kvrail.codec import MessageError, decode
from kvrail.errors import TransferError
from kvrail.messages import (
    WRITE_GRANT_REFUSALS,
    PrefillDone,
    PrefillJob,
    WriteGrant,
    WriteGrantRequest,
    tokens_digest,
)
from kvrail.worker.roles.context import WorkerContext

_GRANT_TIMEOUT_S = 2.0


class Refused(Exception):
    """The job is dropped for good; `reason` is a metric-safe code."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def ask_grant(ctx: WorkerContext, job: PrefillJob) -> None:
    """Raise Refused unless the decode worker lets this job write into its blocks now
    (TransferError when it did not answer)."""
    ask = WriteGrantRequest(
        request_id=job.request_id, dest_incarnation=job.dest_incarnation,
        block_ids=job.dest_block_ids, tokens_digest=tokens_digest(job.token_ids),
    )  # fmt: skip
    subject = ctx.keys.write_grant(job.dest_worker_id)
    try:
        reply = await ctx.nc.request(subject, ask.encode(), timeout=_GRANT_TIMEOUT_S)
        grant = decode(reply.data, WriteGrant)
    except nats.errors.NoRespondersError as err:
        raise Refused("stale_destination") from err
    except (nats.errors.Error, MessageError) as err:
        raise TransferError(f"no write grant from {job.dest_worker_id}: {err!r}") from err
    if not grant.granted:
        known = grant.reason in WRITE_GRANT_REFUSALS
        raise Refused(f"not_granted_{grant.reason}" if known else "not_granted")


async def tell_refused(ctx: WorkerContext, job: PrefillJob, reason: str) -> None:
    """Tell the decode worker nothing more will be written for this job (best effort)."""
    if reason in ("stale_destination", "settled"):
        return  # nobody waits for the answer (and a settled job was never granted here)
    done = PrefillDone(
        request_id=job.request_id, fingerprint=ctx.fingerprint,
        dest_incarnation=job.dest_incarnation, block_ids=job.dest_block_ids,
        first_token_id=0, num_prompt_tokens=len(job.token_ids), error=reason,
        prefill_worker_id=ctx.worker_id, prefill_incarnation=ctx.incarnation,
    )  # fmt: skip
    with contextlib.suppress(nats.errors.Error):
        await ctx.nc.publish(ctx.keys.prefill_refused(job.dest_worker_id), done.encode())
