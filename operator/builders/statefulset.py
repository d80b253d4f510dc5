"""The prefill and decode worker StatefulSets.

One StatefulSet per role, pods started in parallel (workers are independent peers found through
etcd, so ordered start buys nothing). The pod template carries the model hash as a label: a model
change changes every worker template, so both pools roll. In colocated mode the decode
StatefulSet runs both phases (`--role colocated`) and there is no prefill StatefulSet. In GAIE
mode each decode pod also runs its HTTP front (`builders.gaie`).

The engine decides only the pod's containers: kvrail's `worker`, or vLLM's `engine` and the
kvrail `agent` (`builders.vllm`). Volumes, resources, placement and identity are the same for
both, built here once.
"""

from __future__ import annotations

from typing import Any

from kvrail.crd.pool import InferencePool, Role
from kvrail.crd.spec import RoleSpec
from kvrail.operator.builders import placement
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.env import worker_env
from kvrail.operator.builders.gaie import front_args, front_container, inference_extension
from kvrail.operator.builders.meta import (
    MODEL_HASH_LABEL,
    WORKER_LIVE_PATH,
    WORKER_PORT,
    WORKER_READY_PATH,
    child_name,
    labels,
    model_hash,
    object_meta,
    selector_labels,
)
from kvrail.operator.builders.pod import (
    WorkerVolumes,
    container_security_context,
    image,
    pod_common,
    probes,
    process_role,
    worker_volumes,
)
from kvrail.operator.builders.vllm import vllm_containers


def worker_command(pool: InferencePool, role: Role) -> list[str]:
    """`python -P -m kvrail.worker --role prefill|decode|both` (the worker CLI contract)."""
    return ["python", "-P", "-m", "kvrail.worker", "--role", process_role(pool, role)]


def worker_container(
    pool: InferencePool, role: Role, spec: RoleSpec, ctx: BuildContext, volumes: WorkerVolumes
) -> dict[str, Any]:
    """kvrail's own worker: one container with every volume."""
    return {
        "name": "worker",
        "image": image(pool, ctx),
        "imagePullPolicy": pool.spec.image_pull_policy,
        "command": worker_command(pool, role),
        "ports": [{"name": "http", "containerPort": WORKER_PORT, "protocol": "TCP"}],
        "env": worker_env(pool, spec, ctx),
        "resources": placement.resources(pool, spec),
        "securityContext": container_security_context(placement.capabilities(pool)),
        "volumeMounts": [
            *volumes.scratch_mounts,
            *volumes.secret_mounts,
            *volumes.model_mounts,
            *volumes.tier_mounts,
        ],
        **probes(slow_start=True, ready_path=WORKER_READY_PATH, live_path=WORKER_LIVE_PATH),
    }


def build_statefulset(
    pool: InferencePool, role: Role, ctx: BuildContext, replicas: int | None = None
) -> dict[str, Any]:
    """The role's StatefulSet with `replicas` (default: the spec's; the planner's size when it is
    in charge, see `kvrail.operator.autoscale.replicas`)."""
    spec = pool.role(role)
    if spec is None:
        raise ValueError(f"pool {pool.metadata.name} has no {role} pool")
    volumes = worker_volumes(pool, ctx, spec)
    pod_volumes = list(volumes.volumes)
    if pool.spec.engine.kind == "vllm":
        containers = vllm_containers(pool, role, spec, ctx, volumes)
    else:
        containers = [worker_container(pool, role, spec, ctx, volumes)]
        if role == "decode" and inference_extension(pool) is not None:
            containers[0]["command"] += front_args()
            front, front_volumes = front_container(pool, ctx)
            containers.append(front)
            pod_volumes += front_volumes
    pod_spec: dict[str, Any] = {
        **pod_common(pool),
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
        "containers": containers,
        "volumes": pod_volumes,
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
