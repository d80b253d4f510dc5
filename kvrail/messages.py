"""Wire messages: frozen, versioned, validated on decode.

Every message crossing NATS or etcd is one of these dataclasses, encoded as JSON with integer
arrays packed as base64 little-endian int32/int64 (a 32k-token prompt is 128 KiB, not 200 KiB of
decimal text). `decode()` never trusts its input: a wrong version, a missing or mistyped field, a
negative id or an oversized payload raises `MessageError` and nothing else, so a hostile job on
the queue is rejected and counted without touching any request's blocks.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import types
import typing
from array import array
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any, ClassVar, Literal, TypeVar

from kvrail.errors import KvrailError

WIRE_VERSION = 1
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
MAX_TOKENS = 1_048_576
MAX_BLOCKS = 65_536


class MessageError(KvrailError):
    """A message could not be decoded or failed validation. The text holds no payload bytes."""


def _pack(values: tuple[int, ...], code: str) -> str:
    return base64.b64encode(array(code, values).tobytes()).decode()


def _unpack(text: object, code: str, name: str, limit: int) -> tuple[int, ...]:
    if not isinstance(text, str):
        raise MessageError(f"field {name} must be a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise MessageError(f"field {name} is not valid base64") from err
    itemsize = array(code).itemsize
    if len(raw) % itemsize:
        raise MessageError(f"field {name} is truncated ({len(raw)} bytes)")
    if len(raw) // itemsize > limit:
        raise MessageError(f"field {name} has more than {limit} entries")
    values = tuple(array(code, raw))
    if any(v < 0 for v in values):
        raise MessageError(f"field {name} holds a negative id")
    return values


# Fields holding id arrays: name -> (array type code, limit).
_PACKED: dict[str, tuple[str, int]] = {
    "token_ids": ("q", MAX_TOKENS),
    "dest_block_ids": ("q", MAX_BLOCKS),
    "block_ids": ("q", MAX_BLOCKS),
}


@dataclass(frozen=True, slots=True)
class Message:
    kind: ClassVar[str] = ""

    def encode(self) -> bytes:
        body: dict[str, Any] = {"v": WIRE_VERSION, "kind": self.kind}
        # Every field is flat (ints, floats, strings, tuples of them), so they are read as they
        # are: `asdict`'s recursive copy made encoding a TokenEvent take 34 us on the 2-vCPU
        # machine, against 13 us now, and a decode worker encodes one per running request per
        # step.
        for name in _info(type(self)).names:
            value = getattr(self, name)
            if name in _PACKED:
                body[name] = _pack(tuple(value), _PACKED[name][0])
            else:
                body[name] = list(value) if isinstance(value, tuple) else value
        data = json.dumps(body, separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE_BYTES:
            raise MessageError(f"{self.kind} message of {len(data)} bytes exceeds the limit")
        return data


# Per message class, computed once: `typing.get_type_hints` evaluates every annotation's string
# (`from __future__ import annotations`) and took 200 of the 216 us that decoding a TokenEvent
# cost on the 2-vCPU machine, where a router decodes one per token it streams.
@dataclass(frozen=True, slots=True)
class _ClassInfo:
    fields: tuple[Field[Any], ...]
    names: tuple[str, ...]
    hints: dict[str, Any]


_CLASS_INFO: dict[type[Message], _ClassInfo] = {}


def _info(cls: type[Message]) -> _ClassInfo:
    info = _CLASS_INFO.get(cls)
    if info is None:
        found = fields(cls)
        info = _ClassInfo(found, tuple(f.name for f in found), typing.get_type_hints(cls))
        _CLASS_INFO[cls] = info
    return info


M = TypeVar("M", bound=Message)


def decode(data: bytes, cls: type[M]) -> M:
    """Decode and validate one message of type `cls`; raises MessageError."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes exceeds the limit")
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MessageError("message is not valid JSON") from err
    if not isinstance(body, dict):
        raise MessageError("message is not a JSON object")
    if body.get("v") != WIRE_VERSION:
        raise MessageError(f"unsupported wire version (want {WIRE_VERSION})")
    if body.get("kind") != cls.kind:
        raise MessageError(f"expected a {cls.kind} message, got another kind")
    info = _info(cls)
    hints = info.hints
    values: dict[str, Any] = {}
    for f in info.fields:
        if f.name not in body:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue  # optional field: its default applies
            raise MessageError(f"{cls.kind} message lacks field {f.name}")
        raw = body[f.name]
        if f.name in _PACKED:
            code, limit = _PACKED[f.name]
            values[f.name] = _unpack(raw, code, f.name, limit)
        else:
            values[f.name] = _check(raw, hints[f.name], f.name)
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        raise MessageError(f"invalid {cls.kind} message: {err}") from err


def _check(value: Any, hint: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        for option in typing.get_args(hint):
            try:
                return _check(value, option, name)
            except MessageError:
                continue
        raise MessageError(f"field {name} has the wrong type")
    if hint is type(None):
        if value is None:
            return None
        raise MessageError(f"field {name} must be null")
    if origin is Literal:
        if value in typing.get_args(hint):
            return value
        raise MessageError(f"field {name} is not one of {typing.get_args(hint)}")
    if origin is tuple:
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        if not isinstance(value, list) or len(value) > MAX_BLOCKS:
            raise MessageError(f"field {name} must be a list of at most {MAX_BLOCKS}")
        return tuple(_check(v, item, name) for v in value)
    expected = {float: (int, float)}.get(hint, hint)
    if not isinstance(value, expected) or (hint is not bool and isinstance(value, bool)):
        raise MessageError(f"field {name} must be {getattr(hint, '__name__', hint)}")
    return float(value) if hint is float else value


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
    tenant_salt: str = ""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
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


@dataclass(frozen=True, slots=True)
class WorkerRecord(Message):
    """One worker's record in etcd, under its lease, refreshed about every second."""

    kind: ClassVar[str] = "worker"
    worker_id: str
    pod_uid: str
    incarnation: int
    role: Literal["prefill", "decode", "both"]
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
    bandwidth_bytes_per_s: float = 0.0
    is_ready: bool = False
    num_running: int = 0
    num_waiting: int = 0
    kv_utilization: float = 0.0
    # What serves behind this record (optional on the wire: a worker that predates the field is
    # kvrail's own). `vllm`: a `vllm serve` process whose kvrail agent registered it; `address`
    # is then its OpenAI API's base URL and the router speaks vLLM's protocol to it over HTTP.
    engine: Literal["kvrail", "vllm"] = "kvrail"


_SUBJECT = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")


@dataclass(frozen=True, slots=True)
class GenerateRequest(Message):
    """Router -> one decode worker (NATS): generate from `token_ids`, stream to `stream_subject`.

    The decode worker publishes `TokenEvent`s to `stream_subject` until one carries a
    `finish_reason` or an `error`. Past `deadline_unix_s` the request is aborted with an error
    event and every block it held is released.
    """

    kind: ClassVar[str] = "generate_request"
    request_id: str
    token_ids: tuple[int, ...]
    stream_subject: str
    deadline_unix_s: float
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    tenant_salt: str = ""

    def __post_init__(self) -> None:
        if not self.request_id or len(self.request_id) > 128:
            raise ValueError("request_id must be 1-128 characters")
        if not self.token_ids:
            raise ValueError("token_ids is empty")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if len(self.stream_subject) > 256 or not _SUBJECT.match(self.stream_subject):
            raise ValueError("stream_subject must be a literal NATS subject (no wildcards)")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")


PrefillMode = Literal["", "local", "remote", "recompute"]


@dataclass(frozen=True, slots=True)
class TokenEvent(Message):
    """Decode worker -> the request's stream subject: the tokens sampled since the last event.

    `seq` counts from 0 per request, so a gap is visible. The last event has a `finish_reason`
    (`stop`, `length`, `abort`) or an `error` (a metric-safe code, never prompt text). The first
    event says how the prompt was prefilled and how long each stage of the first token took.
    """

    kind: ClassVar[str] = "token_event"
    request_id: str
    seq: int
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    worker_id: str = ""
    prefill_mode: PrefillMode = ""
    queue_wait_s: float = 0.0
    prefill_compute_s: float = 0.0
    transfer_queue_s: float = 0.0
    copy_s: float = 0.0
    validation_s: float = 0.0
    admission_s: float = 0.0

    def __post_init__(self) -> None:
        if self.seq < 0:
            raise ValueError("seq must be >= 0")

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


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
