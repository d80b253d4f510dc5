"""The workers' NetworkPolicy: a pool's worker pods take traffic only from its own workers.

Workers exchange KV over NIXL/UCX on their pod IPs, on ports UCX picks at run time, so the
policy allows every port from the pool's prefill and decode pods rather than a port list. The
router never connects to a worker (requests, KV events and state fetches go through NATS), so
router pods are not among the peers; they are not selected either: the router's port is the
public API (the Gateway, any namespace) and stays open. The one exception is the workers' HTTP
port (`/metrics`, `/readyz`, `/livez`; no KV, no control), open to any source so that Prometheus
scrapes it wherever it runs. Enforcement needs a CNI that implements NetworkPolicy; the API
server stores the object either way.

A vLLM pool (`engine.kind: vllm`) is the other exception: its router sends requests to vLLM's
HTTP API on the workers, so the pool's own router pods (and nothing else) may reach that one port.
In GAIE mode the decode pods' HTTP fronts are the gateway's endpoints: their port is open to any
source, like the router's (API keys, when the pool has them, apply there).
"""

from __future__ import annotations

from typing import Any

from kvrail.crd.pool import InferencePool
from kvrail.operator.builders.gaie import FRONT_PORT, inference_extension
from kvrail.operator.builders.meta import (
    POOL_LABEL,
    ROLE_LABEL,
    WORKER_PORT,
    object_meta,
    selector_labels,
)
from kvrail.vllm.serve import VLLM_PORT

WORKER_ROLES = ("prefill", "decode")
"""Role labels of worker pods; a colocated pool's `--role colocated` workers are labelled decode."""


def network_policy_name(pool: InferencePool) -> str:
    return f"{pool.metadata.name}-workers"


def worker_selector(pool: InferencePool) -> dict[str, Any]:
    """Every worker pod of the pool, whichever roles it has, and no router pod."""
    return {
        "matchLabels": {POOL_LABEL: pool.metadata.name},
        "matchExpressions": [
            {"key": ROLE_LABEL, "operator": "In", "values": list(WORKER_ROLES)},
        ],
    }


def build_network_policy(pool: InferencePool) -> dict[str, Any]:
    """Ingress to the pool's workers: any port from its workers (same namespace), the HTTP port
    (and in GAIE mode the fronts' port) from anywhere, and for vLLM its API port from the pool's
    routers. Egress is not restricted
    (workers reach etcd, NATS and each other)."""
    selector = worker_selector(pool)
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": selector}]},
        {"ports": [{"protocol": "TCP", "port": WORKER_PORT}]},
    ]
    if inference_extension(pool) is not None:  # the gateway's proxies, wherever they run
        ingress.append({"ports": [{"protocol": "TCP", "port": FRONT_PORT}]})
    if pool.spec.engine.kind == "vllm":
        routers = {"matchLabels": selector_labels(pool, "router")}
        ingress.append(
            {"from": [{"podSelector": routers}], "ports": [{"protocol": "TCP", "port": VLLM_PORT}]}
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(pool, network_policy_name(pool), None),
        "spec": {
            "podSelector": selector,
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
