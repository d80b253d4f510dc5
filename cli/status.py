"""`kvrail status`: pools, workers and prefill queues as one readable table.

`collect()` reads the discovery plane (every worker record under the root prefix, or one pool's)
and each pool's JetStream prefill stream; `render()` is pure and turns that into text. A worker
that should be there (one the local stack started) but has no record is shown as lost: its lease
expired, so it died or cannot reach etcd.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import aetcd
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from kvrail.codec import MessageError, decode
from kvrail.keys import ROOT_PREFIX, PoolKeys, parse_worker_key
from kvrail.messages import WorkerRecord


@dataclass
class PoolStatus:
    namespace: str
    pool: str
    workers: list[WorkerRecord] = field(default_factory=list)
    queued_jobs: int | None = None  # None: the pool has no prefill stream
    invalid_records: int = 0


async def collect(
    etcd: aetcd.Client, js: JetStreamContext, pool: PoolKeys | None = None
) -> list[PoolStatus]:
    prefix = pool.workers_prefix if pool else ROOT_PREFIX
    pools: dict[tuple[str, str], PoolStatus] = {}
    if pool:
        pools[(pool.namespace, pool.pool)] = PoolStatus(pool.namespace, pool.pool)
    for kv in await etcd.get_prefix(prefix.encode()):
        parsed = parse_worker_key(kv.key.decode(errors="replace"))
        if parsed is None:
            continue
        keys, _ = parsed
        status = pools.setdefault(
            (keys.namespace, keys.pool), PoolStatus(keys.namespace, keys.pool)
        )
        try:
            status.workers.append(decode(kv.value, WorkerRecord))
        except MessageError:
            status.invalid_records += 1
    for status in pools.values():
        try:
            info = await js.stream_info(PoolKeys(status.namespace, status.pool).prefill_stream)
            status.queued_jobs = int(info.state.messages)
        except NotFoundError:
            status.queued_jobs = None
    return sorted(pools.values(), key=lambda s: (s.namespace, s.pool))


COLUMNS = ("WORKER", "ROLE", "INCARNATION", "READY", "TRANSPORT", "RUNNING", "WAITING", "KV")


def _kv(w: WorkerRecord) -> str:
    """KV use as a share and as blocks (of the blocks that hold tokens)."""
    if not w.num_blocks:
        return f"{w.kv_utilization:.0%}"
    used = round(w.kv_utilization * w.num_blocks)
    return f"{w.kv_utilization:.0%} ({used}/{w.num_blocks} blocks)"


def render(pools: list[PoolStatus], expected_workers: tuple[str, ...] = ()) -> str:
    """The status table, one block per pool. Identifiers and numbers only. `expected_workers`
    that have no record in a pool are listed there as lost (the first pool, when none has any
    worker)."""
    if expected_workers and not pools:
        return "no pools have registered workers; lost: " + ", ".join(expected_workers) + "\n"
    if not pools:
        return "no pools have registered workers\n"
    out: list[str] = []
    for p in pools:
        queue = "no prefill queue" if p.queued_jobs is None else f"{p.queued_jobs} queued jobs"
        by_role: dict[str, int] = defaultdict(int)
        for w in p.workers:
            by_role[w.role] += 1
        roles = ", ".join(f"{n} {role}" for role, n in sorted(by_role.items())) or "no workers"
        out.append(f"pool {p.namespace}/{p.pool}: {roles}; {queue}")
        if p.invalid_records:
            out.append(f"  ({p.invalid_records} invalid worker records ignored)")
        rows = [COLUMNS] + [
            (
                w.worker_id, w.role, str(w.incarnation), "yes" if w.is_ready else "no",
                w.transport or "-", str(w.num_running), str(w.num_waiting), _kv(w),
            )
            for w in sorted(p.workers, key=lambda w: (w.role, w.worker_id))
        ]  # fmt: skip
        present = {w.worker_id for w in p.workers}
        if p is pools[0]:
            rows += [(w, "-", "-", "lost", "-", "-", "-", "-")
                     for w in expected_workers if w not in present]  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
        if len(rows) > 1:
            out.extend("  " + "  ".join(c.ljust(wd) for c, wd in zip(r, widths, strict=True))
                       .rstrip() for r in rows)  # fmt: skip
    return "\n".join(out) + "\n"
