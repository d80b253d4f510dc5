"""The planner's signals, read from the pool's servers: a thin shell around `kvrail.bus` and
`kvrail.registry`. Tested against real NATS and etcd (`tests/e2e/test_planner_cluster.py`).

- prefill backlog: the messages in the pool's JetStream work-queue stream (a work queue keeps only
  unacked jobs) and their prompt tokens. Tokens are summed from the `Kvrail-Tokens` header the
  publisher sets (decoding the payload where a message lacks it). A work-queue stream allows no
  second consumer over the same subjects, so the messages are read one by one by sequence, and
  at most `MAX_SAMPLED` of them: past that, the token count is extrapolated from the sampled mean.
- decode load: the ready decode workers' records in etcd (`WorkerRecord.kv_utilization`,
  `num_running`, `num_waiting`); a record is under its worker's lease, so a dead worker is gone.

Nothing here raises for an unreachable or failing server: the signal is None and the error text
says why, so the planner holds with a reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

from nats.js.errors import NotFoundError

from kvrail.bus import TOKENS_HEADER, PrefillQueue
from kvrail.codec import MessageError, decode
from kvrail.messages import DECODE_ROLES, PrefillJob
from kvrail.operator.autoscale.planner import DecodeLoad, PrefillLoad, Signals
from kvrail.operator.planes import UNREACHABLE, PlaneError, Planes
from kvrail.registry import Registry
from kvrail.settings import Settings

MAX_SAMPLED = 64
T = TypeVar("T")


async def collect(planes: Planes, settings: Settings, prefill: bool = True) -> Signals:
    """Both signals of one pool (the prefill one only when the pool has a prefill role), read
    concurrently, each within the planes' deadline."""
    decode_part = _guard(_decode(planes, settings), planes.timeout_s)
    if not prefill:
        load, error = await decode_part
        return Signals(decode=load, decode_error=error)
    (backlog, prefill_error), (load, decode_error) = await asyncio.gather(
        _guard(_prefill(planes, settings), planes.timeout_s), decode_part
    )
    return Signals(backlog, load, prefill_error, decode_error)


async def prefill_load(queue: PrefillQueue, max_sampled: int = MAX_SAMPLED) -> PrefillLoad:
    """The stream's backlog: jobs, and prompt tokens (exact up to `max_sampled` jobs)."""
    js, stream = queue.js, queue.keys.prefill_stream
    info = await js.stream_info(stream)
    num_jobs = int(info.state.messages)
    observed_at_s = time.time()
    num_tokens = num_sampled = 0
    seq = int(info.state.first_seq)
    subjects = f"{queue.keys.prefill_any.rsplit('.', 1)[0]}.>"
    while num_sampled < min(num_jobs, max_sampled):
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subjects, next=True)
        except NotFoundError:
            break  # acked meanwhile: nothing left at or after `seq`
        num_tokens += _tokens(msg.headers, msg.data)
        num_sampled += 1
        seq = int(msg.seq or seq) + 1
    if num_sampled and num_sampled < num_jobs:
        num_tokens = round(num_tokens * num_jobs / num_sampled)
    return PrefillLoad(num_jobs, num_tokens, observed_at_s)


async def decode_load(registry: Registry) -> DecodeLoad:
    """The load the ready decode workers report (colocated workers included)."""
    records, _ = await registry.workers()
    observed_at_s = time.time()
    ready = [r for r in records.values() if r.is_ready and r.role in DECODE_ROLES]
    return DecodeLoad(
        num_workers=len(ready),
        kv_utilization_sum=sum(min(max(r.kv_utilization, 0.0), 1.0) for r in ready),
        num_running=sum(r.num_running for r in ready),
        num_waiting=sum(r.num_waiting for r in ready),
        observed_at_s=observed_at_s,
    )


def _tokens(headers: dict[str, str] | None, data: bytes | None) -> int:
    value = (headers or {}).get(TOKENS_HEADER)
    if value is not None and value.isdigit():
        return int(value)
    try:
        return len(decode(data or b"", PrefillJob).token_ids)
    except MessageError:
        return 0


async def _prefill(planes: Planes, settings: Settings) -> PrefillLoad:
    queue = await planes.queue(settings)
    try:
        return await prefill_load(queue)
    except NotFoundError as err:
        raise PlaneError(f"stream {queue.keys.prefill_stream} does not exist") from err


async def _decode(planes: Planes, settings: Settings) -> DecodeLoad:
    return await decode_load(await planes.registry(settings))


async def _guard(reading: Awaitable[T], timeout_s: float) -> tuple[T | None, str]:
    """(value, "") or (None, why)."""
    try:
        return await asyncio.wait_for(reading, timeout_s), ""
    except PlaneError as err:
        return None, str(err)
    except UNREACHABLE as err:
        return None, f"{type(err).__name__}: {err}"[:300]
