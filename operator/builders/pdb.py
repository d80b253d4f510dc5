"""PodDisruptionBudgets: voluntary evictions (node drains) take one pod of a role at a time (the
workers', the router's and, in GAIE mode with more than one replica, the endpoint picker's)."""

from __future__ import annotations

from typing import Any

from kvrail.crd.pool import InferencePool
from kvrail.operator.builders.meta import Component, child_name, object_meta, selector_labels


def build_pdb(pool: InferencePool, component: Component) -> dict[str, Any]:
    """`maxUnavailable: 1`, so a one-replica pool never blocks a drain; pods that are not Ready
    (crash looping) may always be evicted."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(pool, child_name(pool, component), component),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(pool, component)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
