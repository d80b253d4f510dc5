"""The prefill and decode worker StatefulSets.

One StatefulSet per role, pods started in parallel (workers are independent peers found through
etcd, so ordered start buys nothing). The pod template carries the model hash as a label: a model
change changes every worker template, so both pools roll. In colocated mode the decode
StatefulSet runs both phases (`--role both`) and there is no prefill StatefulSet.
"""

from __future__ import annotations

from typing import Any

from kvrail.crd import InferencePool, Role
from kvrail.operator import placement
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.env import infrastructure, worker_env
from kvrail.operator.builders.meta import (
    MODEL_HASH_LABEL,
    WORKER_PORT,
    child_name,
    labels,
    model_hash,
    object_meta,
    selector_labels,
)
from kvrail.operator.builders.pod import (
    container_security_context,
    image,
    pod_common,
    probes,
    scratch_volumes,
)

MODELS_DIR = "/models"


def worker_command(pool: InferencePool, role: Role) -> list[str]:
    """`python -P -m kvrail.worker --role prefill|decode|both` (the worker CLI contract)."""
    colocated = pool.spec.disaggregation.mode == "colocated"
    return ["python", "-P", "-m", "kvrail.worker", "--role", "both" if colocated else role]


def build_statefulset(
    pool: InferencePool, role: Role, ctx: BuildContext, replicas: int | None = None
) -> dict[str, Any]:
    """The role's StatefulSet with `replicas` (default: the spec's; the planner's size when it is
    in charge, see `kvrail.operator.replicas`)."""
    spec = pool.role(role)
    if spec is None:
        raise ValueError(f"pool {pool.metadata.name} has no {role} pool")
    _, secret_volumes, secret_mounts = infrastructure(pool, ctx)
    volumes, mounts = scratch_volumes(shm=True)
    volumes += secret_volumes
    mounts += secret_mounts
    if pool.spec.model.volume_claim:
        claim = {"claimName": pool.spec.model.volume_claim, "readOnly": True}
        volumes.append({"name": "models", "persistentVolumeClaim": claim})
        mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
    container = {
        "name": "worker",
        "image": image(pool, ctx),
        "imagePullPolicy": pool.spec.image_pull_policy,
        "command": worker_command(pool, role),
        "ports": [{"name": "http", "containerPort": WORKER_PORT, "protocol": "TCP"}],
        "env": worker_env(pool, spec, ctx),
        "resources": placement.resources(pool, spec),
        "securityContext": container_security_context(placement.capabilities(pool)),
        "volumeMounts": mounts,
        **probes(slow_start=True),
    }
    pod_spec: dict[str, Any] = {
        **pod_common(pool),
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
        "containers": [container],
        "volumes": volumes,
        "topologySpreadConstraints": placement.topology_spread(pool, role),
    }
    affinity = placement.affinity(pool, role)
    if affinity:
        pod_spec["affinity"] = affinity
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    tolerations = placement.tolerations(spec)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    name = child_name(pool, role)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": object_meta(pool, name, role),
        "spec": {
            "serviceName": name,
            "replicas": spec.replicas if replicas is None else replicas,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector_labels(pool, role)},
            "template": {
                "metadata": {"labels": {**labels(pool, role), MODEL_HASH_LABEL: model_hash(pool)}},
                "spec": pod_spec,
            },
        },
    }
