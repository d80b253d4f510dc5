"""The HTTPRoute that attaches the pool to the configured Gateway (Gateway API v1): its backend
is the router Service, or in GAIE mode the pool's GAIE InferencePool (`builders.gaie`)."""

from __future__ import annotations

from typing import Any

from kvrail.crd.pool import InferencePool
from kvrail.operator.builders.gaie import GAIE_GROUP, GAIE_KIND, gaie_pool_name, inference_extension
from kvrail.operator.builders.meta import ROUTER_PORT, Component, child_name, object_meta

GATEWAY_GROUP = "gateway.networking.k8s.io"


def build_httproute(pool: InferencePool) -> dict[str, Any] | None:
    """None when the pool names no Gateway. `<pool>-router` to the router Service, or in GAIE
    mode `<pool>-gaie` to the GAIE InferencePool (no port: the pool's `targetPorts` say it)."""
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
    backend: dict[str, Any]
    component: Component | None
    if inference_extension(pool) is None:
        name, component = child_name(pool, "router"), "router"
        backend = {"name": name, "port": ROUTER_PORT}
    else:
        name, component = gaie_pool_name(pool), None
        backend = {"group": GAIE_GROUP, "kind": GAIE_KIND, "name": name}
    spec: dict[str, Any] = {
        "parentRefs": [parent],
        "rules": [
            {
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [backend],
            }
        ],
    }
    if gateway.hostnames:
        spec["hostnames"] = list(gateway.hostnames)
    return {
        "apiVersion": f"{GATEWAY_GROUP}/v1",
        "kind": "HTTPRoute",
        "metadata": object_meta(pool, name, component),
        "spec": spec,
    }
