"""The HTTPRoute that attaches the router Service to the configured Gateway (Gateway API v1)."""

from __future__ import annotations

from typing import Any

from kvrail.crd.pool import InferencePool
from kvrail.operator.builders.meta import ROUTER_PORT, child_name, object_meta

GATEWAY_GROUP = "gateway.networking.k8s.io"


def build_httproute(pool: InferencePool) -> dict[str, Any] | None:
    """None when the pool names no Gateway."""
    gateway = pool.spec.router.gateway
    if gateway is None:
        return None
    parent: dict[str, Any] = {
        "group": GATEWAY_GROUP,
        "kind": "Gateway",
        "name": gateway.parent_ref.name,
    }
    if gateway.parent_ref.namespace:
        parent["namespace"] = gateway.parent_ref.namespace
    if gateway.parent_ref.section_name:
        parent["sectionName"] = gateway.parent_ref.section_name
    spec: dict[str, Any] = {
        "parentRefs": [parent],
        "rules": [
            {
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"name": child_name(pool, "router"), "port": ROUTER_PORT}],
            }
        ],
    }
    if gateway.hostnames:
        spec["hostnames"] = list(gateway.hostnames)
    name = child_name(pool, "router")
    return {
        "apiVersion": f"{GATEWAY_GROUP}/v1",
        "kind": "HTTPRoute",
        "metadata": object_meta(pool, name, "router"),
        "spec": spec,
    }
