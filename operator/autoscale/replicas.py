"""Who sets a worker StatefulSet's replicas: the spec or the planner. Pure.

The reconcile handler server-side applies every StatefulSet with the operator's field manager; the
planner changes replicas through the StatefulSet's scale subresource. If the reconcile applied
`spec.<role>.replicas` while the planner is in charge, every spec edit (or operator restart) would
undo the planner's last decision. So while the planner owns a role's size (autoscaling enabled and
not in dry-run), the reconcile applies the size the StatefulSet has now, clamped into the
planner's [min, max] bounds; a StatefulSet created under autoscaling starts at `replicas`,
clamped the same way. Otherwise the spec decides, exactly as written.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvrail.crd.pool import InferencePool, Role
from kvrail.operator.autoscale.planner import bounds


def planner_owns_replicas(pool: InferencePool) -> bool:
    """The planner changes the worker StatefulSets' replicas (not off, not dry-run)."""
    autoscaling = pool.spec.autoscaling
    return autoscaling.enabled and not autoscaling.dry_run


def worker_replicas(pool: InferencePool, live: Mapping[Role, int | None]) -> dict[Role, int]:
    """The replicas to apply per worker role, given the StatefulSets' current replicas (None
    where one does not exist yet)."""
    out: dict[Role, int] = {}
    for role in ("prefill", "decode"):
        spec = pool.role(role)
        if spec is None:
            continue
        if not planner_owns_replicas(pool):
            out[role] = spec.replicas
            continue
        current = live.get(role)
        out[role] = bounds(pool, role).clamp(spec.replicas if current is None else current)
    return out
