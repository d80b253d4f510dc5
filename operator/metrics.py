"""The operator's Prometheus metrics: the planner's desired and actual replicas per role and the
prefill backlog per pool (names from `kvrail.metrics`). Served on `operator_metrics_port` when
the settings set one (off by default, and in tests); KEDA or an HPA on the Prometheus adapter can
scale on them with the planner off.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from kvrail import metrics

REGISTRY = CollectorRegistry()
DESIRED_REPLICAS = Gauge(
    metrics.PLANNER_DESIRED_REPLICAS,
    "Replicas the planner wants for a worker pool",
    ["namespace", "pool", "role"],
    registry=REGISTRY,
)
ACTUAL_REPLICAS = Gauge(
    metrics.PLANNER_ACTUAL_REPLICAS,
    "Replicas of a worker pool's StatefulSet when the planner last decided",
    ["namespace", "pool", "role"],
    registry=REGISTRY,
)
BACKLOG_TOKENS = Gauge(
    metrics.PREFILL_QUEUE_BACKLOG_TOKENS,
    "Prompt tokens queued in a pool's prefill work queue",
    ["namespace", "pool"],
    registry=REGISTRY,
)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve /metrics from a daemon thread."""
    start_http_server(port, addr=addr, registry=REGISTRY)


def forget(namespace: str, pool: str) -> None:
    """Drop a deleted pool's series."""
    for role in ("prefill", "decode"):
        for gauge in (DESIRED_REPLICAS, ACTUAL_REPLICAS):
            try:
                gauge.remove(namespace, pool, role)
            except KeyError:
                pass
    try:
        BACKLOG_TOKENS.remove(namespace, pool)
    except KeyError:
        pass
