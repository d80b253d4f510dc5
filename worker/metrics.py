"""A worker's Prometheus metrics (names from `kvrail.metrics`), served on `http_port` when the
settings set one (`kvrail.worker.health`). Labels are identifiers only: stage, transport,
reason, tier, and the served model name from the settings.

The worker's load is exported twice from one reading of the engine's counts (`report_load`): as
kvrail's gauges, and under the names and meanings of vLLM's, which GAIE's and llm-d's endpoint
pickers scrape by default, so a third-party EPP can score kvrail pods as it scores vLLM's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvrail import metrics

REGISTRY = CollectorRegistry()
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

TTFT_STAGE_SECONDS = Histogram(
    metrics.TTFT_STAGE_SECONDS,
    "Time to first token by stage: queue_wait, prefill_compute, transfer_queue, copy, "
    "validation, admission",
    ["stage"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
KV_TRANSFER_BYTES = Counter(
    metrics.KV_TRANSFER_BYTES_TOTAL, "KV bytes written to decode workers", ["transport"],
    registry=REGISTRY,
)  # fmt: skip
KV_TRANSFER_SECONDS = Histogram(
    metrics.KV_TRANSFER_SECONDS, "Duration of one KV write", ["transport"], buckets=_SECONDS,
    registry=REGISTRY,
)  # fmt: skip
KV_TRANSFER_FAILURES = Counter(
    metrics.KV_TRANSFER_FAILURES_TOTAL,
    "Remote prefills that did not deliver valid KV, by reason",
    ["reason"],
    registry=REGISTRY,
)
KV_TRANSPORT_BANDWIDTH = Gauge(
    metrics.KV_TRANSPORT_BANDWIDTH_BYTES_PER_SECOND,
    "Bandwidth of the last KV write, by transport",
    ["transport"],
    registry=REGISTRY,
)
PREFILL_JOBS_REJECTED = Counter(
    metrics.PREFILL_JOBS_REJECTED_TOTAL, "Prefill jobs dropped without running, by reason",
    ["reason"], registry=REGISTRY,
)  # fmt: skip
KV_WRITE_GRANTS_REFUSED = Counter(
    metrics.KV_WRITE_GRANTS_REFUSED_TOTAL,
    "KV writes a decode worker refused to grant (foreign blocks, a request not waiting, ...)",
    ["reason"], registry=REGISTRY,
)  # fmt: skip
GRAMMAR_MASK_FILL_SECONDS = Histogram(
    metrics.GRAMMAR_MASK_FILL_SECONDS,
    "Host time to fill one engine step's grammar masks (every constrained row), which runs "
    "while the device runs the step's forward pass",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.25, 1),
    registry=REGISTRY,
)
KV_TIER_BYTES = Gauge(
    metrics.KV_TIER_BYTES, "KV bytes a lower tier holds", ["tier"], registry=REGISTRY
)
KV_TIER_CAPACITY_BYTES = Gauge(
    metrics.KV_TIER_CAPACITY_BYTES, "KV bytes a lower tier may hold", ["tier"], registry=REGISTRY
)
KV_TIER_BLOCKS = Gauge(metrics.KV_TIER_BLOCKS, "KV blocks a lower tier holds", ["tier"],
                       registry=REGISTRY)  # fmt: skip
KV_TIER_HIT_BLOCKS = Counter(
    metrics.KV_TIER_HIT_BLOCKS_TOTAL, "Prompt blocks loaded from a lower tier instead of computed",
    ["tier"], registry=REGISTRY,
)  # fmt: skip
KV_TIER_LOADS = Counter(
    metrics.KV_TIER_LOADS_TOTAL, "Loads to the GPU, by the slowest tier each read", ["tier"],
    registry=REGISTRY,
)  # fmt: skip
KV_TIER_OFFLOADS = Counter(
    metrics.KV_TIER_OFFLOADS_TOTAL, "Blocks written behind to a lower tier", ["tier"],
    registry=REGISTRY,
)  # fmt: skip
KV_TIER_OFFLOADS_SKIPPED = Counter(
    metrics.KV_TIER_OFFLOADS_SKIPPED_TOTAL,
    "Blocks not written behind because the tier was busy (every slot in use, disk queue full)",
    ["tier"], registry=REGISTRY,
)  # fmt: skip
KV_TIER_CHECKSUM_FAILURES = Counter(
    metrics.KV_TIER_CHECKSUM_FAILURES_TOTAL,
    "Blocks loaded from a lower tier that failed their checksum (dropped and recomputed)",
    ["tier"], registry=REGISTRY,
)  # fmt: skip
KV_TIER_LOAD_SECONDS = Histogram(
    metrics.KV_TIER_LOAD_SECONDS,
    "From a prefix hit in a lower tier to its blocks resident on the GPU and checked",
    ["tier"], buckets=_SECONDS, registry=REGISTRY,
)  # fmt: skip
RUNNING_REQUESTS = Gauge(metrics.RUNNING_REQUESTS, "Requests running", registry=REGISTRY)
WAITING_REQUESTS = Gauge(metrics.WAITING_REQUESTS, "Requests waiting", registry=REGISTRY)
KV_CACHE_UTILIZATION = Gauge(
    metrics.KV_CACHE_UTILIZATION, "Fraction of KV blocks held by requests", registry=REGISTRY
)
VLLM_NUM_REQUESTS_RUNNING = Gauge(
    metrics.VLLM_NUM_REQUESTS_RUNNING, "Requests the engine schedules (vLLM's name)",
    ["model_name"], registry=REGISTRY,
)  # fmt: skip
VLLM_NUM_REQUESTS_WAITING = Gauge(
    metrics.VLLM_NUM_REQUESTS_WAITING, "Requests queued in the engine, not yet scheduled "
    "(vLLM's name)", ["model_name"], registry=REGISTRY,
)  # fmt: skip
VLLM_KV_CACHE_USAGE_PERC = Gauge(
    metrics.VLLM_KV_CACHE_USAGE_PERC,
    "Fraction (0 to 1) of the GPU KV blocks held by requests (vLLM's name)",
    ["model_name"], registry=REGISTRY,
)  # fmt: skip


def kv_cache_usage(num_free_blocks: int, num_blocks: int) -> float:
    """The fraction of the KV blocks requests hold, 0 to 1, as vLLM counts it: `num_blocks`
    excludes the null block, and cached blocks no request references count as free (an
    allocation may take them). The one formula for the etcd record and every gauge."""
    return 1.0 - num_free_blocks / max(num_blocks, 1)


def report_load(model_name: str, num_running: int, num_waiting: int, kv_usage: float) -> None:
    """Set the load gauges, kvrail's and vLLM's, from one reading of the engine's counts (the
    figures the worker writes into its etcd record at the same moment). `model_name` is the
    configured served model name, never a client's."""
    RUNNING_REQUESTS.set(num_running)
    WAITING_REQUESTS.set(num_waiting)
    KV_CACHE_UTILIZATION.set(kv_usage)
    VLLM_NUM_REQUESTS_RUNNING.labels(model_name).set(num_running)
    VLLM_NUM_REQUESTS_WAITING.labels(model_name).set(num_waiting)
    VLLM_KV_CACHE_USAGE_PERC.labels(model_name).set(kv_usage)
