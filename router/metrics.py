"""The router's Prometheus metrics (names from `kvrail.metrics`), served on its own `/metrics`.

Labels are identifiers only: endpoint, status code, reason, policy, stage, tenant and worker ids;
never prompt text or token ids. Per-worker gauges are refreshed from the router's `WorkerView`
when `/metrics` is scraped, so they show what the router routes by.
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from kvrail import metrics
from kvrail.outputs import TokenEvent
from kvrail.router.discovery.view import WorkerView
from kvrail.router.policy import Decision

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_DURATION = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
STAGES = ("queue_wait", "prefill_compute", "transfer_queue", "copy", "validation", "admission")


class RouterMetrics:
    """One registry per router (tests run several routers in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            metrics.REQUESTS_TOTAL, "Requests answered, by endpoint and HTTP status",
            ["endpoint", "status"], registry=r,
        )  # fmt: skip
        self.rejected = Counter(
            metrics.REQUESTS_REJECTED_TOTAL, "Requests refused before routing, by reason",
            ["reason"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(metrics.REQUESTS_IN_FLIGHT, "Requests in flight", registry=r)
        self.ttft = Histogram(
            metrics.TIME_TO_FIRST_TOKEN_SECONDS, "Arrival to first token, seen by the router",
            ["prefill_mode"], buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.itl = LoopHistogram(
            metrics.INTER_TOKEN_LATENCY_SECONDS, "Time between tokens after the first", _ITL
        )
        r.register(self.itl)
        self.duration = Histogram(
            metrics.REQUEST_DURATION_SECONDS, "Arrival to last token, by outcome",
            ["outcome"], buckets=_DURATION, registry=r,
        )  # fmt: skip
        self.stages = Histogram(
            metrics.TTFT_STAGE_SECONDS, "Time to first token by stage (the workers' clocks)",
            ["stage"], buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            metrics.ROUTING_DECISIONS_TOTAL,
            "Routing decisions by policy and prefix cache outcome (hit: >= 1 cached block)",
            ["policy", "cache"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            metrics.PROMPT_TOKENS_TOTAL, "Prompt tokens routed", ["tenant"], registry=r
        )
        self.generation_tokens = Counter(
            metrics.GENERATION_TOKENS_TOTAL, "Tokens generated", ["tenant"], registry=r
        )
        self.prefill_failures = Counter(
            metrics.KV_TRANSFER_FAILURES_TOTAL,
            "Remote prefills on vLLM prefill servers that failed, by reason (the router drives "
            "them; kvrail's own workers count theirs)", ["reason"], registry=r,
        )  # fmt: skip
        self.worker_requests = Gauge(
            metrics.ROUTER_WORKER_REQUESTS,
            "A decode worker's requests: running, waiting (its record) and in_flight (ours)",
            ["worker", "state"], registry=r,
        )  # fmt: skip
        self.worker_kv = Gauge(
            metrics.ROUTER_WORKER_KV_UTILIZATION, "A decode worker's KV utilization",
            ["worker"], registry=r,
        )  # fmt: skip
        self.worker_cached = Gauge(
            metrics.ROUTER_WORKER_CACHED_BLOCKS,
            "Blocks the router's KV index holds per worker in GPU memory",
            ["worker"], registry=r,
        )  # fmt: skip

        # prometheus-client's `labels()` checks and joins the values on every call (0.75 us on
        # the 2-vCPU VM), and a request asks for six children of these, from small fixed sets:
        # each is looked up once. (The per-worker gauges are cleared at every scrape: not these.)
        for metric in (
            self.requests, self.rejected, self.ttft, self.duration, self.stages, self.decisions,
            self.prompt_tokens, self.generation_tokens, self.prefill_failures,
        ):  # fmt: skip
            metric.labels = functools.lru_cache(maxsize=256)(metric.labels)  # type: ignore[method-assign,assignment]

    def decision(self, decision: Decision) -> None:
        cache = "hit" if decision.matched_blocks > 0 else "miss"
        self.decisions.labels(decision.policy, cache).inc()

    def prefill_failure(self, reason: str) -> None:
        self.prefill_failures.labels(reason).inc()

    def first_event(self, event: TokenEvent, ttft_s: float) -> None:
        self.ttft.labels(event.prefill_mode or "unknown").observe(ttft_s)
        if event.stages is None:
            return
        for stage in STAGES:
            seconds = getattr(event.stages, stage + "_s")
            if seconds > 0:
                self.stages.labels(stage).observe(seconds)

    def render(self, view: WorkerView, in_flight: dict[str, int]) -> bytes:
        self.refresh(view, in_flight)
        return generate_latest(self.registry)

    def refresh(self, view: WorkerView, in_flight: dict[str, int]) -> None:
        """Set the per-worker gauges from the view (on the event loop's thread)."""
        self.worker_requests.clear()
        self.worker_kv.clear()
        self.worker_cached.clear()
        for record in view.decode_workers():
            w = record.worker_id
            self.worker_requests.labels(w, "running").set(record.num_running)
            self.worker_requests.labels(w, "waiting").set(record.num_waiting)
            self.worker_requests.labels(w, "in_flight").set(in_flight.get(w, 0))
            self.worker_kv.labels(w).set(record.kv_utilization)
            self.worker_cached.labels(w).set(view.index.num_hashes(w, "gpu"))


class LoopHistogram:
    """A Prometheus histogram observed from the event loop only, `times` equal values at once.

    The inter-token latency is observed per token: a stream that catches up gets several tokens
    in one event, each `gap / n` after the one before. prometheus-client's `Histogram` takes a
    lock per bucket and per sum and observes one value per call (0.8 us each on the 2-vCPU
    development machine, against 0.2: `bench/studies/router/loop_parts.txt`); this one is a bucket
    search and two additions per event. Not thread-safe: the router observes and renders `/metrics`
    on its one event loop. Exposed like a `Histogram` without labels (`_bucket`, `_count`,
    `_sum`, `_created`), registered as a collector.
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = (*buckets, float("inf"))
        # `le` as prometheus-client writes it ("0.001", "+Inf").
        self._les = [floatToGoString(b) for b in self._bounds]  # type: ignore[no-untyped-call]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._created = time.time()

    def observe(self, value: float, times: int = 1) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += times
        self._sum += value * times

    def describe(self) -> list[HistogramMetricFamily]:
        """The family without samples: how a registry learns the names it exposes."""
        return [HistogramMetricFamily(self._name, self._documentation)]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative, total = [], 0
        for le, count in zip(self._les, self._counts, strict=True):
            total += count
            cumulative.append((le, total))
        family = HistogramMetricFamily(
            self._name, self._documentation, buckets=cumulative, sum_value=self._sum
        )
        family.add_sample(self._name + "_created", {}, self._created)
        yield family
