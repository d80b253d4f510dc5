"""`kvrail status`: pools, workers and prefill queues as one readable table.

`collect()` reads the discovery plane (every worker record under the root prefix, or one pool's)
and each pool's JetStream prefill stream; `render()` is pure and turns that into text. A worker
that should be there (one the local stack started) but has no record is shown as lost: its lease
expired, so it died or cannot reach etcd. A worker with KV tiers below the GPU gets a line per
tier under its row: bytes used of the tier's capacity, blocks held, and since it started, prompt
blocks found there and loads back to the GPU.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import aetcd
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from kvrail.codec import MessageError, decode
from kvrail.keys import ROOT_PREFIX, PoolKeys, parse_worker_key
from kvrail.messages import KvTierUsage, WorkerRecord


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


def _bytes(num_bytes: int) -> str:
    """Bytes for people: `512 B`, `1.5 KiB`, `64.0 GiB`."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{num_bytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _tier(t: KvTierUsage) -> str:
    """`host 12.0 GiB of 64.0 GiB (19%), 768 blocks, 4096 hit blocks, 310 loads`."""
    share = f" ({t.used_bytes / t.capacity_bytes:.0%})" if t.capacity_bytes else ""
    return (
        f"{t.tier} {_bytes(t.used_bytes)} of {_bytes(t.capacity_bytes)}{share}, "
        f"{t.num_blocks} blocks, {t.num_hit_blocks} hit blocks, {t.num_loads} loads"
    )


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
        workers = sorted(p.workers, key=lambda w: (w.role, w.worker_id))
        rows = [COLUMNS] + [
            (
                w.worker_id, w.role, str(w.incarnation), "yes" if w.is_ready else "no",
                w.transport or "-", str(w.num_running), str(w.num_waiting), _kv(w),
            )
            for w in workers
        ]  # fmt: skip
        tiers = {i + 1: [_tier(t) for t in w.kv_tiers] for i, w in enumerate(workers)}
        present = {w.worker_id for w in p.workers}
        if p is pools[0]:
            rows += [(w, "-", "-", "lost", "-", "-", "-", "-")
                     for w in expected_workers if w not in present]  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
        if len(rows) > 1:
            for i, r in enumerate(rows):
                out.append("  " + "  ".join(c.ljust(wd) for c, wd in zip(r, widths, strict=True))
                           .rstrip())  # fmt: skip
                out.extend(f"    {line}" for line in tiers.get(i, ()))
    return "\n".join(out) + "\n"
