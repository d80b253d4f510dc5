"""Pool status from observed children: pure functions, no API calls.

Three conditions, each with a CamelCase reason:

- `Ready`: every workload exists, has rolled out the current spec and has all its replicas ready,
  and at least one decode worker and one router replica serve. In GAIE mode the endpoint picker
  is one of the workloads (its replicas may be 0: then the gateway's `failureMode` answers).
- `Progressing`: a workload is missing or still rolling out the current spec.
- `Degraded`: the spec was refused (`InvalidSpec`), applying failed (`ApplyFailed`), GAIE mode is
  on without GAIE's CRD (`InferenceExtensionMissing`), or a rolled-out
  workload lacks ready replicas (`ReplicasUnavailable`).

`lastTransitionTime` changes only when a condition's status changes, so a status written twice
from the same observations is identical (level-based, idempotent).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvrail.crd.pool import InferencePool
from kvrail.crd.status import Condition, InferencePoolStatus, RoleStatus
from kvrail.operator.builders.gaie import inference_extension
from kvrail.operator.builders.meta import Component, model_hash, selector_labels
from kvrail.operator.builders.service import router_url

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"

ALL_REPLICAS_READY = "AllReplicasReady"
REPLICAS_NOT_READY = "ReplicasNotReady"
NO_SERVING_REPLICAS = "NoServingReplicas"
WORKLOADS_MISSING = "WorkloadsMissing"
ROLLOUT_IN_PROGRESS = "RolloutInProgress"
ROLLOUT_COMPLETE = "RolloutComplete"
REPLICAS_UNAVAILABLE = "ReplicasUnavailable"
AS_EXPECTED = "AsExpected"
INVALID_SPEC = "InvalidSpec"
APPLY_FAILED = "ApplyFailed"
INFERENCE_EXTENSION_MISSING = "InferenceExtensionMissing"

Status = Literal["True", "False", "Unknown"]


@dataclass(frozen=True, slots=True)
class Workload:
    """What the operator saw of one StatefulSet or Deployment."""

    desired: int
    ready: int
    updated: int
    rolled_out: bool
    """The controller saw the latest generation and every replica runs the current template."""


@dataclass(frozen=True, slots=True)
class Problem:
    """A reason to be Degraded that no workload shows: `INVALID_SPEC`, `APPLY_FAILED` or
    `INFERENCE_EXTENSION_MISSING`."""

    reason: str
    message: str


def observe(obj: Mapping[str, Any] | None) -> Workload | None:
    """A StatefulSet or Deployment as read from the API server (None when it does not exist)."""
    if obj is None:
        return None
    spec, status = obj.get("spec", {}), obj.get("status", {})
    desired = int(spec.get("replicas", 1))
    updated = int(status.get("updatedReplicas", 0))
    seen = int(status.get("observedGeneration", 0)) >= int(obj["metadata"].get("generation", 0))
    revisions_match = status.get("currentRevision") == status.get("updateRevision")
    rolled_out = seen and updated >= desired and (obj["kind"] != "StatefulSet" or revisions_match)
    return Workload(desired, int(status.get("readyReplicas", 0)), updated, rolled_out)


def compute_status(
    pool: InferencePool,
    workloads: Mapping[Component, Workload | None],
    now: str,
    problem: Problem | None = None,
) -> dict[str, Any]:
    """The `status` to write, camelCase, from the workloads observed for the pool's components.

    `now` is an RFC 3339 timestamp; it becomes `lastTransitionTime` of conditions that change.
    """
    expected: list[Component] = [r for r in ("prefill", "decode") if pool.role(r) is not None]
    expected.append("router")
    if inference_extension(pool) is not None:
        expected.append("epp")
    seen = {c: workloads.get(c) for c in expected}
    missing = [c for c, w in seen.items() if w is None]
    present = {c: w for c, w in seen.items() if w is not None}
    rolling = sorted(c for c, w in present.items() if not w.rolled_out)
    short = sorted(c for c, w in present.items() if w.ready < w.desired)
    serving = all((w := present.get(c)) is not None and w.ready > 0 for c in ("decode", "router"))
    generation = pool.metadata.generation

    def cond(kind: str, status: Status, reason: str, message: str) -> Condition:
        return Condition(
            type=kind,
            status=status,
            reason=reason,
            message=message,
            last_transition_time=now,
            observed_generation=generation,
        )

    if problem is not None:
        ready = cond(READY, "False", problem.reason, problem.message)
    elif missing:
        ready = cond(READY, "False", WORKLOADS_MISSING, f"not created yet: {', '.join(missing)}")
    elif short:
        ready = cond(READY, "False", REPLICAS_NOT_READY, f"replicas not ready: {', '.join(short)}")
    elif not serving:
        ready = cond(READY, "False", NO_SERVING_REPLICAS, "no decode or no router replica")
    else:
        ready = cond(READY, "True", ALL_REPLICAS_READY, "every replica is ready")

    if missing or rolling:
        waiting = ", ".join(missing + rolling)
        progressing = cond(PROGRESSING, "True", ROLLOUT_IN_PROGRESS, f"rolling out: {waiting}")
    else:
        progressing = cond(PROGRESSING, "False", ROLLOUT_COMPLETE, "the current spec is rolled out")

    settled_short = [c for c in short if c not in rolling]
    if problem is not None:
        degraded = cond(DEGRADED, "True", problem.reason, problem.message)
    elif settled_short:
        message = f"rolled out but replicas unavailable: {', '.join(settled_short)}"
        degraded = cond(DEGRADED, "True", REPLICAS_UNAVAILABLE, message)
    else:
        degraded = cond(DEGRADED, "False", AS_EXPECTED, "")

    roles = {c: _role_status(pool, c, w) for c, w in present.items()}
    status = InferencePoolStatus(
        observed_generation=generation,
        conditions=[ready, progressing, degraded],
        endpoint=endpoint(pool),
        model_hash=model_hash(pool),
        prefill=roles.get("prefill"),
        decode=roles.get("decode"),
        router=roles.get("router"),
        endpoint_picker=roles.get("epp"),
    )
    return status.model_dump(mode="json", exclude_none=True)


def keep_transition_times(
    new: Sequence[Mapping[str, Any]], previous: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """`new` conditions, with the previous `lastTransitionTime` wherever the status is unchanged."""
    before = {c["type"]: c for c in previous}
    out = []
    for condition in new:
        old = before.get(condition["type"])
        merged = dict(condition)
        if old is not None and old.get("status") == condition["status"]:
            merged["lastTransitionTime"] = old["lastTransitionTime"]
        out.append(merged)
    return out


def endpoint(pool: InferencePool) -> str:
    """The Gateway hostname when there is one, else the router Service's in-cluster URL."""
    gateway = pool.spec.router.gateway
    if gateway is not None and gateway.hostnames and not gateway.hostnames[0].startswith("*"):
        return f"http://{gateway.hostnames[0]}"
    return router_url(pool)


def _role_status(pool: InferencePool, component: Component, workload: Workload) -> RoleStatus:
    selector = ",".join(f"{k}={v}" for k, v in selector_labels(pool, component).items())
    return RoleStatus(
        replicas=workload.desired,
        ready_replicas=workload.ready,
        updated_replicas=workload.updated,
        selector=selector,
    )
