"""The observed state of an `InferencePool`, written by the operator (`kvrail.operator.status`)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from kvrail.crd.base import CrdModel


class Condition(CrdModel):
    """One aspect of the pool's state: `Ready`, `Progressing` or `Degraded`."""

    type: str = Field(max_length=316)
    """`Ready`, `Progressing` or `Degraded`."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = Field(max_length=1024)
    """A CamelCase reason, one of the constants in `kvrail.operator.status`."""
    message: str = Field("", max_length=32768)
    """A human-readable explanation."""
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    """When `status` last changed."""
    observed_generation: int = Field(0, ge=0)
    """The `metadata.generation` this condition was computed from."""


class RoleStatus(CrdModel):
    """Replica counts of one workload (a worker StatefulSet, the router's or the endpoint
    picker's Deployment)."""

    replicas: int = Field(0, ge=0)
    """Desired replicas of the workload."""
    ready_replicas: int = Field(0, ge=0)
    """Replicas whose pods are Ready."""
    updated_replicas: int = Field(0, ge=0)
    """Replicas running the current pod template."""
    selector: str = ""
    """The label selector of the workload's pods (for the scale subresource)."""


class PlannerDecision(CrdModel):
    """The planner's last recorded decision for one worker pool, with the inputs it saw."""

    current_replicas: int = Field(0, ge=0)
    """Replicas of the StatefulSet when the planner decided."""
    desired_replicas: int = Field(0, ge=0)
    """Replicas the planner wants."""
    reason: str = Field("", max_length=1024)
    """A CamelCase reason, one of the constants in `kvrail.operator.autoscale.planner`."""
    message: str = Field("", max_length=32768)
    """The recommendation and how stabilization, cooldown or bounds shaped it."""
    dry_run: bool = False
    """True when the planner only records (autoscaling.dryRun): replicas are left alone."""
    backlog_jobs: int | None = Field(None, ge=0)
    """Prefill: jobs queued in the pool's JetStream stream."""
    backlog_tokens: int | None = Field(None, ge=0)
    """Prefill: prompt tokens queued in the stream."""
    reporting_workers: int | None = Field(None, ge=0)
    """Decode: ready workers whose records in etcd were read."""
    kv_utilization_percent: int | None = Field(None, ge=0, le=100)
    """Decode: mean KV-cache utilization of the reporting workers."""
    running_requests: int | None = Field(None, ge=0)
    """Decode: requests running on the reporting workers."""
    waiting_requests: int | None = Field(None, ge=0)
    """Decode: requests waiting on the reporting workers."""
    time: str = Field(json_schema_extra={"format": "date-time"})
    """When this decision was recorded."""
    last_scale_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    """When the planner last changed this pool's replicas."""


class AutoscalingStatus(CrdModel):
    """The planner's last decision per worker pool (absent while autoscaling is off)."""

    prefill: PlannerDecision | None = None
    """The prefill pool."""
    decode: PlannerDecision | None = None
    """The decode pool."""


class InferencePoolStatus(CrdModel):
    """What the operator observed, at `observedGeneration`."""

    model_config = ConfigDict(extra="ignore")
    observed_generation: int = Field(0, ge=0)
    """The `metadata.generation` the operator last reconciled."""
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """`Ready`, `Progressing` and `Degraded`."""
    prefill: RoleStatus | None = None
    """The prefill pool; absent in colocated mode."""
    decode: RoleStatus | None = None
    """The decode pool."""
    router: RoleStatus | None = None
    """The router."""
    endpoint_picker: RoleStatus | None = None
    """GAIE mode's endpoint picker (`<pool>-epp`); absent unless the mode is on."""
    endpoint: str = ""
    """Where clients reach the OpenAI API: the Gateway hostname, else the router Service."""
    model_hash: str = ""
    """A short hash of the fingerprint-relevant spec (pod label `kvrail.dev/model-hash`)."""
    autoscaling: AutoscalingStatus | None = None
    """The planner's decisions, written by the planner's timer."""
