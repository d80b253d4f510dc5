"""The EPP's Prometheus metrics (names in ``kvrail.metrics``), served over HTTP on their own port.

One registry per ``ExtProc`` (tests run several in one process). Label values are the EPP's own
outcomes, never anything a client sent: ``result`` is ``routed``, the status of the
ImmediateResponse it answered (kvrail's own refusals: 400, 401, 404, 413, 429, 503),
``protocol_error`` or ``abandoned`` (the stream ended before the request was whole: the
client left, or the gateway gave up). Following a kvrail pool, the router's own metrics (its
routing decisions and its view of each worker) are served beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric

from kvrail import metrics

_PICK_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
"""Seconds; the decision's target is 1 ms p50, 3 ms p99 (docs/epp.md)."""


class EppMetrics:
    """The EPP's collectors, in their own registry."""

    def __init__(self, open_streams: Callable[[], int]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            metrics.EPP_REQUESTS_TOTAL, "ext_proc streams (one a request), by result",
            ["result"], registry=r,
        )  # fmt: skip
        self.pick = Histogram(
            metrics.EPP_PICK_SECONDS, "The picker's decision, from the whole request to its pick",
            buckets=_PICK_BUCKETS, registry=r,
        )  # fmt: skip
        self.streams = Gauge(metrics.EPP_STREAMS, "ext_proc streams open", registry=r)
        self.streams.set_function(open_streams)
        self.detached = Counter(
            metrics.EPP_DETACHED_STREAMS_TOTAL,
            "Streams ended once routed (the gateway serves the response without the EPP)",
            registry=r,
        )  # fmt: skip

    def also(self, registry: CollectorRegistry) -> None:
        """Serve ``registry``'s metrics beside these (the followed pool's router metrics)."""
        self.registry.register(_Alongside(registry))

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` over HTTP on ``host:port`` (a thread of its own, off the event
        loop); returns the port bound (``port=0``: a free one). Raises ``RuntimeError`` naming
        the address when it cannot be bound."""
        try:
            server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise RuntimeError(f"cannot serve metrics on {host}:{port}: {e}") from None
        return int(server.server_port)


class _Alongside:
    """A collector that yields another registry's metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        yield from self._registry.collect()
