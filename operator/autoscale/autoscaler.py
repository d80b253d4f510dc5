"""One planner tick for one pool: read the signals, decide, scale, record. The I/O shell around
`kvrail.operator.autoscale.planner`; the plan timer in `kvrail.operator.handlers` calls `tick()`.

- current sizes are the worker StatefulSets' `spec.replicas` (a role whose StatefulSet does not
  exist yet is not planned);
- an applied decision sets the StatefulSet's replicas through its scale subresource (never the
  pool's spec, so the reconcile handler and the planner do not fight: see
  `kvrail.operator.autoscale.replicas`);
- the decision per role goes into `status.autoscaling.<role>` with its inputs, whenever it differs
  from the recorded one (size, reason, dry-run) or the record is `RECORD_EVERY_S` old, and a
  Kubernetes Event is posted for each change (in dry-run, for each new would-be change);
- the gauges of `kvrail.operator.metrics` follow every tick.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from kvrail.crd.pool import InferencePool
from kvrail.crd.status import PlannerDecision
from kvrail.operator import metrics
from kvrail.operator.apply import live_replicas
from kvrail.operator.autoscale.planner import Decision, PlannerState, has_prefill_queue, plan
from kvrail.operator.autoscale.signals import collect
from kvrail.operator.builders.meta import child_name
from kvrail.operator.planes import Planes, pool_settings
from kvrail.settings import Settings

RECORD_EVERY_S = 60.0


class Scaler(Protocol):
    """What a tick needs from the API (implemented by `kvrail.operator.k8s.Kube`)."""

    def get(
        self, api_version: str, kind: str, name: str, namespace: str
    ) -> dict[str, Any] | None: ...
    def scale(
        self, api_version: str, kind: str, name: str, namespace: str, replicas: int
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class TickResult:
    decisions: tuple[Decision, ...]
    state: PlannerState
    status: dict[str, Any] | None
    """`status.autoscaling` to patch, or None when the recorded decisions still hold."""
    events: tuple[tuple[str, str], ...]
    """(reason, message) of the Events to post."""


async def tick(
    cluster: Scaler,
    planes: Planes,
    base: Settings,
    pool: InferencePool,
    state: PlannerState,
    recorded: Mapping[str, Any],
    now_s: float,
) -> TickResult:
    """Read, decide, and apply the decisions that change a size; `recorded` is the pool's current
    `status.autoscaling`."""
    current = {
        r: n
        for r, n in (await asyncio.to_thread(live_replicas, cluster, pool)).items()
        if n is not None
    }
    settings = pool_settings(
        base, pool.metadata.namespace, pool.metadata.name, pool.spec.infrastructure
    )
    queued = pool.role("prefill") is not None and has_prefill_queue(pool)
    signals = await collect(planes, settings, prefill=queued)
    result = plan(pool, signals, current, state, now_s)
    namespace, name = pool.metadata.namespace, pool.metadata.name
    for d in result.decisions:
        if d.is_applied:
            sts = child_name(pool, d.role)
            await asyncio.to_thread(
                cluster.scale, "apps/v1", "StatefulSet", sts, namespace, d.desired
            )
        metrics.DESIRED_REPLICAS.labels(namespace, name, d.role).set(d.desired)
        metrics.ACTUAL_REPLICAS.labels(namespace, name, d.role).set(d.current)
    if signals.prefill is not None:
        metrics.BACKLOG_TOKENS.labels(namespace, name).set(signals.prefill.num_tokens)
    status, events = record(result.decisions, result.state, recorded, now_s)
    return TickResult(result.decisions, result.state, status, events)


def record(
    decisions: tuple[Decision, ...],
    state: PlannerState,
    recorded: Mapping[str, Any],
    now_s: float,
) -> tuple[dict[str, Any] | None, tuple[tuple[str, str], ...]]:
    """The `status.autoscaling` patch (None when nothing is worth writing) and the Events. Pure."""
    out: dict[str, Any] = {}
    events = []
    for d in decisions:
        before = recorded.get(d.role) or {}
        entry = decision_status(d, state.role(d.role).last_scale_s, now_s)
        same = all(
            before.get(k) == entry.get(k)
            for k in ("currentReplicas", "desiredReplicas", "reason", "dryRun")
        )
        if same and now_s - _unix(before.get("time")) < RECORD_EVERY_S:
            continue
        out[d.role] = entry
        if d.is_change and not same:
            verb = "would scale" if d.dry_run else "scaled"
            events.append(
                (f"Planner{d.reason}", f"{d.role} {verb} {d.current} -> {d.desired}: {d.message}")
            )
    return (out or None), tuple(events)


def decision_status(d: Decision, last_scale_s: float | None, now_s: float) -> dict[str, Any]:
    """One role's `status.autoscaling.<role>`, camelCase. Pure."""
    decision = PlannerDecision(
        current_replicas=d.current,
        desired_replicas=d.desired,
        reason=d.reason,
        message=d.message[:1024],
        dry_run=d.dry_run,
        backlog_jobs=d.prefill.num_jobs if d.prefill else None,
        backlog_tokens=d.prefill.num_tokens if d.prefill else None,
        reporting_workers=d.decode.num_workers if d.decode else None,
        kv_utilization_percent=d.decode.kv_utilization_percent if d.decode else None,
        running_requests=d.decode.num_running if d.decode else None,
        waiting_requests=d.decode.num_waiting if d.decode else None,
        time=rfc3339(now_s),
        last_scale_time=None if last_scale_s is None else rfc3339(last_scale_s),
    )
    return decision.model_dump(mode="json", exclude_none=True)


def rfc3339(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _unix(text: object) -> float:
    if not isinstance(text, str):
        return 0.0
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return 0.0
