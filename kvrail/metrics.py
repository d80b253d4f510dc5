"""Metric names: the one place they are spelled.

Prometheus base units (`_seconds`, `_bytes`, `_total`), except the `vllm:` names, which are
vLLM's. Label values are identifiers (pool, role, worker, transport, outcome, the configured
served model name), never prompt text, token ids or KV bytes. Components create the collectors;
the Grafana dashboard and its test read these names.
"""

from __future__ import annotations

PREFIX = "kvrail_"

# router
REQUESTS_TOTAL = PREFIX + "requests_total"
TIME_TO_FIRST_TOKEN_SECONDS = PREFIX + "time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS = PREFIX + "inter_token_latency_seconds"
REQUEST_DURATION_SECONDS = PREFIX + "request_duration_seconds"
ROUTING_DECISIONS_TOTAL = PREFIX + "routing_decisions_total"
# TTFT stages, labelled stage=queue_wait|prefill_compute|transfer_queue|copy|validation|admission
TTFT_STAGE_SECONDS = PREFIX + "ttft_stage_seconds"
PROMPT_TOKENS_TOTAL = PREFIX + "prompt_tokens_total"
GENERATION_TOKENS_TOTAL = PREFIX + "generation_tokens_total"
REQUESTS_IN_FLIGHT = PREFIX + "requests_in_flight"
REQUESTS_REJECTED_TOTAL = PREFIX + "requests_rejected_total"
# the router's view of each decode worker, labelled worker=<id>
ROUTER_WORKER_REQUESTS = PREFIX + "router_worker_requests"
ROUTER_WORKER_KV_UTILIZATION = PREFIX + "router_worker_kv_utilization_ratio"
ROUTER_WORKER_CACHED_BLOCKS = PREFIX + "router_worker_cached_blocks"

# workers
KV_CACHE_UTILIZATION = PREFIX + "kv_cache_utilization_ratio"
RUNNING_REQUESTS = PREFIX + "running_requests"
WAITING_REQUESTS = PREFIX + "waiting_requests"
KV_TRANSFER_BYTES_TOTAL = PREFIX + "kv_transfer_bytes_total"
KV_TRANSFER_SECONDS = PREFIX + "kv_transfer_seconds"
KV_TRANSFER_FAILURES_TOTAL = PREFIX + "kv_transfer_failures_total"
KV_TRANSPORT_BANDWIDTH_BYTES_PER_SECOND = PREFIX + "kv_transport_bandwidth_bytes_per_second"
PREFILL_JOBS_REJECTED_TOTAL = PREFIX + "prefill_jobs_rejected_total"
KV_WRITE_GRANTS_REFUSED_TOTAL = PREFIX + "kv_write_grants_refused_total"
# host time to fill one engine step's grammar masks (structured outputs), no labels
GRAMMAR_MASK_FILL_SECONDS = PREFIX + "grammar_mask_fill_seconds"
KV_TIER_BYTES = PREFIX + "kv_tier_bytes"
KV_TIER_CAPACITY_BYTES = PREFIX + "kv_tier_capacity_bytes"
KV_TIER_BLOCKS = PREFIX + "kv_tier_blocks"
KV_TIER_HIT_BLOCKS_TOTAL = PREFIX + "kv_tier_hit_blocks_total"
KV_TIER_LOADS_TOTAL = PREFIX + "kv_tier_loads_total"
KV_TIER_OFFLOADS_TOTAL = PREFIX + "kv_tier_offloads_total"
KV_TIER_OFFLOADS_SKIPPED_TOTAL = PREFIX + "kv_tier_offloads_skipped_total"
KV_TIER_CHECKSUM_FAILURES_TOTAL = PREFIX + "kv_tier_checksum_failures_total"
KV_TIER_LOAD_SECONDS = PREFIX + "kv_tier_load_seconds"
# vLLM's names and meanings for a worker's load, the ones GAIE's and llm-d's endpoint pickers
# read by default; each twins a kvrail gauge above, from the same reading, labelled model_name
VLLM_NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
VLLM_KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"  # a fraction, 0 to 1, despite its name

# the endpoint picker (kvrail.epp), labelled result=routed|<the HTTP status it answered>|
# protocol_error|abandoned (a stream that ended before its request was whole)
EPP_REQUESTS_TOTAL = PREFIX + "epp_requests_total"
EPP_PICK_SECONDS = PREFIX + "epp_pick_seconds"
EPP_STREAMS = PREFIX + "epp_streams"
EPP_DETACHED_STREAMS_TOTAL = PREFIX + "epp_detached_streams_total"

# operator and planner
PLANNER_DESIRED_REPLICAS = PREFIX + "planner_desired_replicas"
PLANNER_ACTUAL_REPLICAS = PREFIX + "planner_actual_replicas"
PREFILL_QUEUE_BACKLOG_TOKENS = PREFIX + "prefill_queue_backlog_tokens"

ALL = tuple(v for k, v in sorted(globals().items()) if k.isupper() and k != "PREFIX")
