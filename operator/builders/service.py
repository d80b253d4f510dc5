"""Services: a headless one per worker StatefulSet, and the router's."""

from __future__ import annotations

from typing import Any

from kvrail.crd.pool import InferencePool, Role
from kvrail.operator.builders.meta import (
    ROUTER_PORT,
    WORKER_PORT,
    child_name,
    object_meta,
    selector_labels,
)
from kvrail.vllm.serve import VLLM_PORT


def worker_http_port(pool: InferencePool) -> int:
    """The port of a worker pod's `http` container port: kvrail's health and metrics, or vLLM's
    API (the router's requests go there)."""
    return VLLM_PORT if pool.spec.engine.kind == "vllm" else WORKER_PORT


def build_worker_service(pool: InferencePool, role: Role) -> dict[str, Any]:
    """Headless, and publishing pods before they are Ready: it gives each worker a stable DNS
    name while it loads; discovery itself goes through etcd."""
    port = worker_http_port(pool)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(pool, child_name(pool, role), role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(pool, role),
            "ports": [{"name": "http", "port": port, "targetPort": "http"}],
        },
    }


def build_router_service(pool: InferencePool) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(pool, child_name(pool, "router"), "router"),
        "spec": {
            "type": pool.spec.router.service_type,
            "selector": selector_labels(pool, "router"),
            "ports": [{"name": "http", "port": ROUTER_PORT, "targetPort": "http"}],
        },
    }


def router_url(pool: InferencePool) -> str:
    """The in-cluster URL of the OpenAI API."""
    name = child_name(pool, "router")
    return f"http://{name}.{pool.metadata.namespace}.svc:{ROUTER_PORT}"
