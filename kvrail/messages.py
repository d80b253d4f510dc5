"""Wire messages: frozen, versioned, validated on decode (the codec is `kvrail.codec`).

Every message crossing NATS or etcd is one of these dataclasses.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from kvrail import codec
from kvrail.codec import Message
from kvrail.sampling import SamplingParams


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


@dataclass(frozen=True, slots=True)
class KvEvent(Message):
    """Worker -> routers: blocks entered or left this worker's prefix cache.

    `seq` increases by one per event of an incarnation; a gap tells a router to rebuild its view
    of this worker.
    """

    kind: ClassVar[str] = "kv_event"
    worker_id: str
    incarnation: int
    seq: int
    stored: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    cleared: bool = False


WorkerRole = Literal["prefill", "decode", "colocated"]
"""What a worker does: `colocated` workers prefill and decode (a colocated pool's only role)."""
DECODE_ROLES: tuple[WorkerRole, ...] = ("decode", "colocated")
"""The roles that take generate requests."""


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

    def __post_init__(self) -> None:
        if not self.request_id or len(self.request_id) > 128:
            raise ValueError("request_id must be 1-128 characters")
        if not self.token_ids:
            raise ValueError("token_ids is empty")
        if len(self.stream_subject) > 256 or not _SUBJECT.match(self.stream_subject):
            raise ValueError("stream_subject must be a literal NATS subject (no wildcards)")


PrefillMode = Literal["", "local", "remote", "recompute"]


@dataclass(frozen=True, slots=True)
class FirstTokenStages:
    """Where a request's time to its first token went, in seconds, each stage on the clock of
    the worker that timed it: the prefill job's wait in the queue, the prefill's compute, the
    wait for the transfer thread, the KV copy, its validation, and the decode worker's own
    admission (reserving, publishing, installing)."""

    queue_wait_s: float = 0.0
    prefill_compute_s: float = 0.0
    transfer_queue_s: float = 0.0
    copy_s: float = 0.0
    validation_s: float = 0.0
    admission_s: float = 0.0


@dataclass(frozen=True, slots=True)
class TokenEvent(Message):
    """Decode worker -> the request's stream subject: the tokens sampled since the last event.

    `seq` counts from 0 per request, so a gap is visible. The last event has a `finish_reason`
    (`stop`, `length`, `abort`) or an `error` (a metric-safe code, never prompt text). The first
    event says how the prompt was prefilled, how many of its tokens were already cached, and how
    long each stage of the first token took.
    """

    kind: ClassVar[str] = "token_event"
    request_id: str
    seq: int
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    worker_id: str = ""
    prefill_mode: PrefillMode = ""
    num_cached_tokens: int = 0
    stages: FirstTokenStages | None = None

    def __post_init__(self) -> None:
        if self.seq < 0 or self.num_cached_tokens < 0:
            raise ValueError("seq and num_cached_tokens must be >= 0")

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


MAX_EVENTS_PER_BATCH = 4096


@dataclass(frozen=True, slots=True)
class TokenEventBatch(Message):
    """Decode worker -> one router's events subject: the `TokenEvent`s of one engine step (or of
    one turn of the worker's event loop) for every request of that router, in order.

    A step of N running requests is one message per router instead of N: the worker's publish,
    the NATS server's routing and the router's wake-up are paid once per step. Each event keeps
    its request id, its `seq` and the worker it came from.

    The only message with a binary form (`encode`; `decode` reads it, and the JSON form too):
    `codec.BINARY_MAGIC`, the wire version (u8) and the number of events (u32), then per event a
    header of five little-endian fields (u16 length of the request id, u16 length of the worker
    id, u32 seq, u32 number of tokens, u32 length of the rest), the two ids in UTF-8, the token
    ids as u32, and "the rest": empty, or a JSON object of the fields that differ from their
    defaults (finish reason, error, prefill mode, cached tokens, stages: the first and the last
    event), each checked as the JSON codec checks it. A batch of 256 one-token events encodes
    and decodes several times faster than as JSON (`bench/router/codec.py`).
    """

    kind: ClassVar[str] = "token_events"
    events: tuple[TokenEvent, ...]

    def __post_init__(self) -> None:
        if not 0 < len(self.events) <= MAX_EVENTS_PER_BATCH:
            raise ValueError(f"a batch holds 1 to {MAX_EVENTS_PER_BATCH} events")

    def encode(self) -> bytes:
        parts = [_BATCH_HEAD.pack(codec.BINARY_MAGIC, codec.WIRE_VERSION, len(self.events))]
        for event in self.events:
            rid, wid = event.request_id.encode(), event.worker_id.encode()
            rest = _event_rest(event)
            try:
                tokens = array("I", event.token_ids)
            except OverflowError as err:
                raise codec.MessageError("a token id is negative or above 2**32 - 1") from err
            if _LITTLE_ENDIAN is False:
                tokens.byteswap()
            if len(rid) > _MAX_ID_BYTES or len(wid) > _MAX_ID_BYTES:
                raise codec.MessageError(f"an id is longer than {_MAX_ID_BYTES} bytes")
            head = _EVENT_HEAD.pack(len(rid), len(wid), event.seq, len(tokens), len(rest))
            parts += (head, rid, wid, tokens.tobytes(), rest)
        data = b"".join(parts)
        if len(data) > codec.MAX_MESSAGE_BYTES:
            raise codec.MessageError(f"{self.kind} message of {len(data)} bytes exceeds the limit")
        return data

    @classmethod
    def decode_binary(cls, data: bytes) -> TokenEventBatch:
        """The batch `encode` wrote; raises MessageError for anything else."""
        try:
            _magic, version, count = _BATCH_HEAD.unpack_from(data, 0)
            if version != codec.WIRE_VERSION:
                raise codec.MessageError(f"unsupported wire version (want {codec.WIRE_VERSION})")
            if not 0 < count <= MAX_EVENTS_PER_BATCH:
                raise codec.MessageError(f"a batch holds 1 to {MAX_EVENTS_PER_BATCH} events")
            at, end = _BATCH_HEAD.size, len(data)
            events = []
            head, head_size = _EVENT_HEAD.unpack_from, _EVENT_HEAD.size
            for _ in range(count):
                rid_len, wid_len, seq, num_tokens, rest_len = head(data, at)
                at += head_size
                tokens_at = at + rid_len + wid_len
                rest_at = tokens_at + 4 * num_tokens
                after = rest_at + rest_len
                if after > end or num_tokens > codec.MAX_TOKENS:
                    raise codec.MessageError("token event batch is truncated")
                tokens = struct.unpack_from(f"<{num_tokens}I", data, tokens_at)
                request_id = data[at : at + rid_len].decode()
                worker_id = data[at + rid_len : tokens_at].decode()
                if rest_len:  # the first or the last event: every field checked
                    rest = _event_fields(data[rest_at:after])
                    events.append(TokenEvent(request_id, seq, tokens, worker_id=worker_id, **rest))
                else:
                    events.append(_plain_event(request_id, seq, tokens, worker_id))
                at = after
            if at != end:
                raise codec.MessageError("token event batch has bytes after its last event")
            return cls(tuple(events))
        except (struct.error, UnicodeDecodeError, TypeError, ValueError) as err:
            raise codec.MessageError(f"invalid token event batch: {type(err).__name__}") from err


_BATCH_HEAD = struct.Struct(f"<{len(codec.BINARY_MAGIC)}sBI")
_EVENT_HEAD = struct.Struct("<HHIII")
_MAX_ID_BYTES = 65_535
_LITTLE_ENDIAN = sys.byteorder == "little"
# TokenEvent's fields carried in "the rest" of the binary form, with their defaults.
_REST_DEFAULTS = {
    "finish_reason": None, "error": None, "prefill_mode": "", "num_cached_tokens": 0,
    "stages": None,
}  # fmt: skip


def _event_rest(event: TokenEvent) -> bytes:
    rest = {}
    for name, default in _REST_DEFAULTS.items():
        value = getattr(event, name)
        if value != default:
            rest[name] = codec.encode_value(value)
    return codec.compact_json(rest).encode() if rest else b""


def _plain_event(
    request_id: str, seq: int, token_ids: tuple[int, ...], worker_id: str
) -> TokenEvent:
    """A decoded event whose other fields are their defaults, its slots set directly. A frozen
    dataclass's `__init__` sets each of its nine fields through `object.__setattr__` and then
    runs `__post_init__`: 1.1 us an event, against 0.5 here (2-vCPU VM), and a router decodes
    one per streamed token. What `__post_init__` checks holds already: `seq` was a u32."""
    event = _new_event(TokenEvent)
    _set_request_id(event, request_id)
    _set_seq(event, seq)
    _set_token_ids(event, token_ids)
    _set_worker_id(event, worker_id)
    for set_default, default in _DEFAULT_SLOTS:
        set_default(event, default)
    return event


_new_event = object.__new__
_set_request_id = TokenEvent.__dict__["request_id"].__set__
_set_seq = TokenEvent.__dict__["seq"].__set__
_set_token_ids = TokenEvent.__dict__["token_ids"].__set__
_set_worker_id = TokenEvent.__dict__["worker_id"].__set__
_DEFAULT_SLOTS = tuple(
    (TokenEvent.__dict__[name].__set__, default) for name, default in _REST_DEFAULTS.items()
)


def _event_fields(raw: bytes) -> dict[str, Any]:
    """The rest of one event, each field checked as the JSON codec checks it."""
    try:
        body = json.loads(raw)
    except ValueError as err:
        raise codec.MessageError("a token event's fields are not valid JSON") from err
    if not isinstance(body, dict) or not body.keys() <= _REST_DEFAULTS.keys():
        raise codec.MessageError("a token event's fields are not an object of known fields")
    checkers = codec.field_checkers(TokenEvent)
    return {name: checkers[name](value, name) for name, value in body.items()}


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
