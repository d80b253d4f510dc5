"""Pod pieces shared by workers and the router: hardening, image, probes and volumes."""

from __future__ import annotations

from typing import Any, NamedTuple

from kvrail.crd.pool import InferencePool, Role
from kvrail.crd.spec import RoleSpec
from kvrail.messages import WorkerRole
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.env import CACHE_DIR, infrastructure
from kvrail.operator.builders.tiers import tier_volumes

SHM_SIZE = "1Gi"
MODELS_DIR = "/models"


def process_role(pool: InferencePool, role: Role) -> WorkerRole:
    """What a worker process of the role's pool does: in colocated mode the decode pool is the
    only one and runs both phases."""
    return "colocated" if pool.spec.disaggregation.mode == "colocated" else role


def image(pool: InferencePool, ctx: BuildContext) -> str:
    return pool.spec.image or ctx.image


def pod_security_context(pool: InferencePool) -> dict[str, Any]:
    uid = pool.spec.security.run_as_user
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context(add: list[str]) -> dict[str, Any]:
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if add:
        caps["add"] = list(add)
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": caps,
    }


def http_probe(path: str, port: str, period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period_s,
        "failureThreshold": failures,
        "timeoutSeconds": 2,
    }


def probes(slow_start: bool, ready_path: str, live_path: str) -> dict[str, Any]:
    """Readiness and liveness, and with `slow_start` a startup probe that allows 10 min before
    liveness counts: workers load (and at first start convert) a model, the router its
    tokenizer (converted from the GGUF file on an empty cache: half a minute on a busy core).
    The paths are the component's own (`meta.WORKER_*_PATH`, `meta.ROUTER_*_PATH`)."""
    out = {
        "readinessProbe": http_probe(ready_path, "http", 5, 3),
        "livenessProbe": http_probe(live_path, "http", 10, 3),
    }
    if slow_start:
        out["startupProbe"] = http_probe(live_path, "http", 10, 60)
    return out


def scratch_volumes(shm: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Writable cache and /tmp on a read-only root, and /dev/shm for UCX when `shm`."""
    volumes: list[dict[str, Any]] = [
        {"name": "cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if shm:
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return volumes, mounts


def pod_common(pool: InferencePool) -> dict[str, Any]:
    """Pod spec fields every child pod has."""
    security = pool.spec.security
    out: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(pool),
    }
    if security.service_account_name:
        out["serviceAccountName"] = security.service_account_name
    if security.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": n} for n in security.image_pull_secrets]
    return out


class WorkerVolumes(NamedTuple):
    """A worker pod's volumes, and their mounts by purpose, so each container mounts only what
    it needs (the vLLM engine gets no etcd or NATS credentials)."""

    volumes: list[dict[str, Any]]
    scratch_mounts: list[dict[str, Any]]
    """Cache, /tmp and /dev/shm."""
    secret_mounts: list[dict[str, Any]]
    """etcd and NATS credentials and CAs."""
    model_mounts: list[dict[str, Any]]
    """The weights' claim at `/models`, when the pool names one."""
    tier_mounts: list[dict[str, Any]]
    """The role's disk KV tier, when it has one (`builders.tiers`)."""


def worker_volumes(pool: InferencePool, ctx: BuildContext, spec: RoleSpec) -> WorkerVolumes:
    _, secret_volumes, secret_mounts = infrastructure(pool, ctx)
    volumes, scratch_mounts = scratch_volumes(shm=True)
    volumes += secret_volumes
    disk_volumes, tier_mounts = tier_volumes(spec)
    volumes += disk_volumes
    model_mounts: list[dict[str, Any]] = []
    if pool.spec.model.volume_claim:
        claim = {"claimName": pool.spec.model.volume_claim, "readOnly": True}
        volumes.append({"name": "models", "persistentVolumeClaim": claim})
        model_mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
    return WorkerVolumes(volumes, scratch_mounts, secret_mounts, model_mounts, tier_mounts)
