"""Wire messages: frozen, versioned, validated on decode (the codec is `kvrail.codec`).

Every message crossing NATS or etcd is one of these dataclasses.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from dataclasses import dataclass
from typing import ClassVar, Literal

from kvrail.codec import Message
from kvrail.outputs import TokenLogprobs
from kvrail.sampling import MAX_LOGPROBS, SamplingParams


@dataclass(frozen=True, slots=True)
class PrefillJob(Message):
    """Decode worker -> prefill worker (JetStream): compute KV and write it into my blocks.

    `dest_block_ids[i]` receives the prompt's block `first_block_index + i`; blocks before it are
    already cached on the decode worker. A job past `deadline_unix_s`, or addressed to a
    destination incarnation that is no longer registered, is dropped, never run.
    """

    kind: ClassVar[str] = "prefill_job"
    request_id: str
    token_ids: tuple[int, ...]
    fingerprint: str
    dest_worker_id: str
    dest_incarnation: int
    dest_agent_name: str
    dest_block_ids: tuple[int, ...]
    first_block_index: int
    deadline_unix_s: float
    sampling: SamplingParams
    """The request's own: the prefill worker samples the first token with it."""
    tenant_salt: str = ""
    with_checksums: bool = False

    def __post_init__(self) -> None:
        if not self.request_id or len(self.request_id) > 128:
            raise ValueError("request_id must be 1-128 characters")
        if not self.token_ids:
            raise ValueError("token_ids is empty")
        if self.first_block_index < 0 or self.dest_incarnation < 0:
            raise ValueError("first_block_index and dest_incarnation must be >= 0")


@dataclass(frozen=True, slots=True)
class PrefillDone(Message):
    """Prefill worker -> decode worker: the KV of `block_ids` is written (or it failed).

    The decode worker validates it against its own reservation (request id, fingerprint, block
    ids, incarnation, checksums) before the sequence becomes runnable.
    """

    kind: ClassVar[str] = "prefill_done"
    request_id: str
    fingerprint: str
    dest_incarnation: int
    block_ids: tuple[int, ...]
    first_token_id: int
    num_prompt_tokens: int
    prefill_worker_id: str
    prefill_incarnation: int
    block_checksums: tuple[str, ...] = ()
    transfer_bytes: int = 0
    transfer_s: float = 0.0
    transport: str = ""
    error: str | None = None
    # Stage durations on the prefill worker's own clock (added in issue 4; optional on the wire).
    queue_wait_s: float = 0.0
    prefill_compute_s: float = 0.0
    transfer_queue_s: float = 0.0
    first_logprobs: tuple[TokenLogprobs, ...] = ()
    """The first token's log-probabilities, when the job's sampling asked (at most one entry,
    for `first_token_id`): what the decode worker's first output carries."""
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    """The prompt's scores, when the job's sampling asked (`SamplingParams.prompt_logprobs`):
    one per prompt token after the first."""
    num_cached_tokens: int = 0
    """Prompt tokens the prefill worker did not compute: its own prefix hits, in any KV tier."""
    layer_groups: tuple[int, ...] = ()
    """A layer-wise write (docs/layerwise.md): its groups' end layers; `block_checksums` then
    holds each group's checksums of every block, group-major. (): one write of every layer."""

    def __post_init__(self) -> None:
        if len(self.first_logprobs) > 1 or any(
            lp.token_id != self.first_token_id for lp in self.first_logprobs
        ):
            raise ValueError("first_logprobs must be the first token's, at most one entry")
        if self.prompt_logprobs and len(self.prompt_logprobs) != self.num_prompt_tokens - 1:
            raise ValueError("prompt_logprobs must score every prompt token after the first")
        if any(
            len(lp.top_token_ids) != len(lp.top_logprobs) or len(lp.top_token_ids) > MAX_LOGPROBS
            for lp in self.first_logprobs + self.prompt_logprobs
        ):
            raise ValueError(f"top log-probabilities must be pairs, at most {MAX_LOGPROBS}")


@dataclass(frozen=True, slots=True)
class PrefillSettled(Message):
    """Decode worker -> every prefill worker: the outcome of job `request_id` was consumed.

    A delivery of that job that arrives later (redelivered after its writer died before acking)
    must not run: the destination blocks may belong to another request by now.
    """

    kind: ClassVar[str] = "prefill_settled"
    request_id: str


@dataclass(frozen=True, slots=True)
class WriteGrantRequest(Message):
    """Prefill worker -> the job's decode worker (request/reply), right before the NIXL WRITE:
    may this job's KV go into `block_ids` now?

    The decode worker grants it only while it waits for exactly this job: same incarnation, the
    very blocks it reserved, the same prompt (`tokens_digest`, see `tokens_digest()`). So a
    malformed, forged or replayed job (foreign or out-of-range block ids, a request that ended,
    another prompt) never writes into blocks that another request may own.
    """

    kind: ClassVar[str] = "write_grant_request"
    request_id: str
    dest_incarnation: int
    block_ids: tuple[int, ...]
    tokens_digest: str


@dataclass(frozen=True, slots=True)
class WriteGrant(Message):
    """The decode worker's answer to a `WriteGrantRequest`; `reason` when refused."""

    kind: ClassVar[str] = "write_grant"
    granted: bool
    reason: str = ""


WRITE_GRANT_REFUSALS = ("invalid", "not_waiting", "stale_incarnation", "foreign_blocks",
                        "other_prompt")  # fmt: skip
"""The reasons a decode worker gives for refusing a write grant (metric-safe)."""


def tokens_digest(token_ids: tuple[int, ...]) -> str:
    """A short digest of a prompt's token ids (BLAKE2b-128, hex): the same prompt, or not."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class Cancel(Message):
    """Router -> every worker: stop this request and release all its blocks."""

    kind: ClassVar[str] = "cancel"
    request_id: str
    reason: Literal["client_disconnect", "deadline", "error", "stop"] = "client_disconnect"


KvTier = Literal["gpu", "host", "disk"]
"""Where a worker holds a cached KV block: GPU memory (what a step reads), the pinned host-memory
tier or the local disk tier (loaded back to the GPU before a step reads it)."""
KV_TIERS: tuple[KvTier, ...] = ("gpu", "host", "disk")
"""The tiers, fastest first."""


@dataclass(frozen=True, slots=True)
class KvTierState:
    """Every block hash one lower tier of a worker holds (part of a `kv_state` reply)."""

    tier: KvTier
    stored: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class KvEvent(Message):
    """Worker -> routers: blocks entered or left one tier of this worker's prefix cache.

    `seq` increases by one per event of an incarnation, over every tier (one sequence); a gap
    tells a router to rebuild its view of this worker. `tier` says which tier `stored`,
    `removed` and `cleared` are about ("gpu" when absent: a worker without tiers, or one from
    before them). A `kv_state` reply (`cleared=True`, `tier="gpu"`) carries the GPU's hashes in
    `stored` and each lower tier's in `lower_tiers` (one entry per tier holding any), all as of
    the same `seq`.
    """

    kind: ClassVar[str] = "kv_event"
    worker_id: str
    incarnation: int
    seq: int
    stored: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    cleared: bool = False
    tier: KvTier = "gpu"
    lower_tiers: tuple[KvTierState, ...] = ()

    def __post_init__(self) -> None:
        tiers = [t.tier for t in self.lower_tiers]
        if "gpu" in tiers or len(set(tiers)) != len(tiers):
            raise ValueError("lower_tiers names each lower tier at most once, never gpu")
        if self.lower_tiers and (not self.cleared or self.tier != "gpu"):
            raise ValueError("lower_tiers belong to a kv_state reply (cleared, tier gpu)")


WorkerRole = Literal["prefill", "decode", "colocated"]
"""What a worker does: `colocated` workers prefill and decode (a colocated pool's only role)."""
DECODE_ROLES: tuple[WorkerRole, ...] = ("decode", "colocated")
"""The roles that take generate requests."""


@dataclass(frozen=True, slots=True)
class KvTierUsage:
    """One lower KV tier of a worker as its record reports it (`kvrail status`): bytes held and
    the tier's capacity, blocks held, and since the worker started, the prompt blocks found in the
    tier and the loads from it back to the GPU. Counts, never contents."""

    tier: KvTier
    used_bytes: int
    capacity_bytes: int
    num_blocks: int
    num_hit_blocks: int = 0
    num_loads: int = 0

    def __post_init__(self) -> None:
        if self.tier == "gpu":
            raise ValueError("the GPU tier is the record's own num_blocks and kv_utilization")
        for name in ("used_bytes", "capacity_bytes", "num_blocks", "num_hit_blocks", "num_loads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")


@dataclass(frozen=True, slots=True)
class WorkerRecord(Message):
    """One worker's record in etcd, under its lease, refreshed about every second."""

    kind: ClassVar[str] = "worker"
    worker_id: str
    pod_uid: str
    incarnation: int
    role: WorkerRole
    fingerprint: str
    address: str = ""
    nixl_agent_name: str = ""
    nixl_metadata_b64: str = ""
    num_blocks: int = 0
    block_bytes: int = 0
    # Tokens per KV block, so a router hashes prompts the way this worker does (added with the
    # router; optional on the wire: 0 = unknown, from a worker that predates the field).
    block_size: int = 0
    max_model_len: int = 0  # the longest prompt + completion it serves (0 = unknown)
    transport: str = ""
    is_ready: bool = False
    num_running: int = 0
    num_waiting: int = 0
    kv_utilization: float = 0.0
    # Tensor parallelism (optional on the wire: absent means one device). The worker's KV pool is
    # sharded over `tensor_parallel_size` ranks by KV heads, each rank's shard its own NIXL agent
    # and region: rank 0's is `nixl_metadata_b64`, ranks 1..N-1's are listed here in rank order
    # (each framed with its region's address, block count and block bytes, like rank 0's).
    # `block_bytes` is one rank's block.
    tensor_parallel_size: int = 1
    rank_nixl_metadata_b64: tuple[str, ...] = ()
    # What serves behind this record (optional on the wire: a worker that predates the field is
    # kvrail's own). `vllm`: a `vllm serve` process whose kvrail agent registered it; `address`
    # is then its OpenAI API's base URL and the router speaks vLLM's protocol to it over HTTP.
    engine: Literal["kvrail", "vllm"] = "kvrail"
    # The worker's KV tiers below the GPU, fastest first, one entry per tier it has (optional on
    # the wire: absent means none, as from a worker that predates tiers).
    kv_tiers: tuple[KvTierUsage, ...] = ()
    # `ip:port` of the worker's HTTP front: a router pinned to this worker (`python -P -m
    # kvrail.router --pin-worker ID`), the endpoint a Gateway API endpoint picker names for it
    # (`kvrail.epp`). Optional on the wire: "" means none, and no endpoint picker picks it.
    http_front: str = ""


_SUBJECT = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")


@dataclass(frozen=True, slots=True)
class GenerateRequest(Message):
    """Router -> one decode worker (NATS): generate from `token_ids`, stream to `stream_subject`.

    The decode worker publishes the request's `TokenEvent`s, in `TokenEventBatch`es, to
    `stream_subject` (the router's events subject, shared by its requests) until one carries a
    `finish_reason` or an `error`. Past `deadline_unix_s` the request is aborted with an error
    event and every block it held is released.
    """

    kind: ClassVar[str] = "generate_request"
    request_id: str
    token_ids: tuple[int, ...]
    stream_subject: str
    deadline_unix_s: float
    sampling: SamplingParams
    tenant_salt: str = ""
    prefill_worker_id: str = ""
    """The prefill worker the router saw holding more of the prompt's prefix than this decode
    worker (in any KV tier), to send the remote prefill to; "" (and a worker no longer
    registered): whichever prefill worker takes it from the queue."""

    def __post_init__(self) -> None:
        if not self.request_id or len(self.request_id) > 128:
            raise ValueError("request_id must be 1-128 characters")
        if not self.token_ids:
            raise ValueError("token_ids is empty")
        if len(self.stream_subject) > 256 or not _SUBJECT.match(self.stream_subject):
            raise ValueError("stream_subject must be a literal NATS subject (no wildcards)")


@dataclass(frozen=True, slots=True)
class BlockCounts(Message):
    """A worker's answer on its debug subject: what its KV pool and its roles hold right now.

    `num_free_blocks` counts blocks an allocation could take (free or cached-unreferenced);
    `num_blocks` excludes the null block. After every request ended, the two are equal.
    """

    kind: ClassVar[str] = "block_counts"
    worker_id: str
    incarnation: int
    num_blocks: int
    num_free_blocks: int
    num_requests: int = 0
    num_retained: int = 0
    num_pending: int = 0
