"""The way back: what the engine outputs for a request, and the messages that carry it from a
decode worker to its router (`TokenEvent`, batched per step in a `TokenEventBatch`).

The chain, one record end to end: `LLMEngine.step` makes a `RequestOutput` per request that got
tokens; `EngineService` hands it to the decode role unchanged; the role numbers it in a
`TokenEvent` and its outbox publishes a step's events as one `TokenEventBatch` per router
(binary: `kvrail.binary_codec`); the router's stream checks their order, merges what queued up
(`merged`), and its renderer (`kvrail.router.api.streaming`) turns each into a chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from kvrail import codec
from kvrail.binary_codec import EventLayout
from kvrail.codec import Message

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
class TokenLogprobs:
    """A token's log-probability (a sampled token's, or a prompt token's given the tokens
    before it), and the most likely tokens at its position with theirs (as many as its request's
    `SamplingParams.logprobs` or `prompt_logprobs`, most likely first): the model's log-softmax
    over the vocabulary, before the request's sampling parameters."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one engine step did to one request: the one output record, from the engine that
    samples the tokens to the router that renders them.

    The engine makes it (`LLMEngine.step`, `install_remote`), the engine service hands it to the
    role as it is, the decode role sends it inside a `TokenEvent`, and the router's stream merges
    those that queued up (`merged`) and renders them. `token_ids` are only the tokens sampled
    since the request's last output: its whole output is their concatenation. The last output
    has a `finish_reason` (`stop`, `length`, `abort`) or an `error` (a metric-safe code, never
    prompt text); `stop_reason` is the stop token id that ended it, if one did.

    To add a field, add it here with a default: both wire forms carry it (the JSON codec and the
    binary `TokenEventBatch` derive their fields from this type), `merged` concatenates a tuple
    field and keeps the latest value of any other, and the router's renderer reads it from
    `streaming.Piece.output`.
    """

    request_id: str
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (vLLM's `cached_tokens`): set on a
    request's first output only."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per token of `token_ids`, when the request asked (`SamplingParams.logprobs`)."""
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    """The prompt's scores, when the request asked (`SamplingParams.prompt_logprobs`): one per
    prompt token after the first, in order, each that token's log-probability given the tokens
    before it; on the request's first output only."""

    def __post_init__(self) -> None:
        if self.num_cached_tokens < 0:
            raise ValueError("num_cached_tokens must be >= 0")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def _merger() -> Callable[[Sequence[RequestOutput]], RequestOutput]:
    """`merged`'s body, written out for `RequestOutput`'s fields (as `dataclasses` writes
    `__init__`): a router merges the outputs queued behind a busy stream on every turn, and a
    loop over the fields with `getattr` cost three times as much. Tuple fields (the tokens, their
    logprobs) are concatenated in order; every other field keeps the latest value that is not
    its default. The result's slots are set directly (what `__post_init__` checks holds for
    values taken from valid outputs)."""
    scope: dict[str, Any] = {"new": object.__new__, "R": RequestOutput}
    body = ["def merged(outputs):", " if len(outputs) == 1:", "  return outputs[0]"]
    sets = [" m = new(R)"]
    for f in fields(RequestOutput):
        name = f.name
        scope[f"set_{name}"], scope[f"d_{name}"] = RequestOutput.__dict__[name].__set__, f.default
        if isinstance(f.default, tuple):
            body.append(f" {name} = []")
            sets.append(f" set_{name}(m, tuple({name}))")
        else:
            body.append(f" {name} = d_{name}")
            sets.append(f" set_{name}(m, {name})")
    body.append(" for o in outputs:")
    for f in fields(RequestOutput):
        name = f.name
        if isinstance(f.default, tuple):
            body.append(f"  {name} += o.{name}")
        else:
            body.append(f"  if o.{name} != d_{name}:")
            body.append(f"   {name} = o.{name}")
    exec("\n".join([*body, *sets, " return m"]), scope)
    function: Callable[[Sequence[RequestOutput]], RequestOutput] = scope["merged"]
    return function


merged = _merger()
"""Consecutive outputs of one request as one (see `_merger`): the tokens (and any tuple
field) concatenated in order, every other field the latest value that is not its default."""


@dataclass(frozen=True, slots=True)
class TokenEvent(Message):
    """Decode worker -> the request's stream subject: one `RequestOutput`, numbered.

    `seq` counts from 0 per request, so a gap is visible; `worker_id` names the worker that sent
    it (a late event of an earlier attempt is told apart). The first event also says how the
    prompt was prefilled and how long each stage of the first token took.
    """

    kind: ClassVar[str] = "token_event"
    output: RequestOutput
    seq: int
    worker_id: str = ""
    prefill_mode: PrefillMode = ""
    stages: FirstTokenStages | None = None

    def __post_init__(self) -> None:
        if self.seq < 0:
            raise ValueError("seq must be >= 0")

    @property
    def request_id(self) -> str:
        return self.output.request_id

    def with_output(self, output: RequestOutput) -> TokenEvent:
        """This event carrying `output` instead (a merged one): its other fields copied slot by
        slot, at a third of `dataclasses.replace`'s cost, on the router's catch-up path."""
        event = object.__new__(TokenEvent)
        for name, setter in _EVENT_SLOTS:
            setter(event, output if name == "output" else getattr(self, name))
        return event

    @property
    def is_last(self) -> bool:
        return self.output.is_last


_EVENT_SLOTS = tuple((f.name, TokenEvent.__dict__[f.name].__set__) for f in fields(TokenEvent))

MAX_EVENTS_PER_BATCH = 4096


@dataclass(frozen=True, slots=True)
class TokenEventBatch(Message):
    """Decode worker -> one router's events subject: the `TokenEvent`s of one engine step (or of
    one turn of the worker's event loop) for every request of that router, in order.

    A step of N running requests is one message per router instead of N: the worker's publish,
    the NATS server's routing and the router's wake-up are paid once per step. Each event keeps
    its request id, its `seq` and the worker it came from.

    The only message with a binary form (`encode`, `decode_binary`; `kvrail.codec.EventLayout`
    says how it is laid out), which a router decodes for every token it streams; `decode` reads
    the JSON form too.
    """

    kind: ClassVar[str] = "token_events"
    events: tuple[TokenEvent, ...]

    def __post_init__(self) -> None:
        if not 0 < len(self.events) <= MAX_EVENTS_PER_BATCH:
            raise ValueError(f"a batch holds 1 to {MAX_EVENTS_PER_BATCH} events")

    def encode(self) -> bytes:
        return _LAYOUT.encode(self.events)

    @classmethod
    def decode_binary(cls, data: bytes) -> TokenEventBatch:
        """The batch `encode` wrote; raises MessageError for anything else."""
        try:
            return cls(_LAYOUT.decode(data, MAX_EVENTS_PER_BATCH))
        except ValueError as err:
            raise codec.MessageError(f"invalid token event batch: {err}") from err


_LAYOUT = EventLayout(TokenEvent, RequestOutput)
