"""Requests and their sampling parameters.

`SamplingParams` is validated when built: an invalid value raises `InvalidRequestError` naming the
field, so nothing downstream ever sees a bad parameter. A `Request` is the engine's mutable record
of one generation: its tokens, how many of them have KV in the cache (`num_computed_tokens`) and
its `RequestStatus`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrail.errors import InvalidRequestError


class RequestStatus(enum.Enum):
    """Lifecycle of a request. Finished states are terminal."""

    WAITING = enum.auto()
    """Queued for admission; holds no blocks."""
    WAITING_FOR_REMOTE_KV = enum.auto()
    """Blocks reserved; its prompt KV is being written from elsewhere. Never scheduled."""
    RUNNING = enum.auto()
    """Holds blocks for every token it has computed or will compute this step."""
    PREEMPTED = enum.auto()
    """Lost its blocks to a higher-priority request; waits to recompute its tokens."""
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI `finish_reason` of a finished status, else None."""
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def _fail(name: str, value: object, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"sampling parameter {name}={value!r} is invalid: {why}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Defaults: greedy, 16 tokens, stop at EOS.

    `temperature == 0` means greedy (top_p, top_k and seed are then irrelevant). `top_k == 0`
    disables top-k. `stop` strings end generation when they appear in the decoded output (the
    caller trims the text at `Request.stop_reason`); `stop_token_ids` end it when sampled.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __init__(
        self,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
    ) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise _fail("max_tokens", max_tokens, "must be an integer of at least 1")
        if not isinstance(temperature, int | float) or not 0.0 <= temperature < float("inf"):
            raise _fail("temperature", temperature, "must be a finite number >= 0")
        if not isinstance(top_p, int | float) or not 0.0 < top_p <= 1.0:
            raise _fail("top_p", top_p, "must be in (0, 1]")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise _fail("top_k", top_k, "must be an integer >= 0 (0 disables it)")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise _fail("seed", seed, "must be an integer or None")
        stops = _stop_strings(stop)
        stop_ids = _stop_token_ids(stop_token_ids)
        setter = object.__setattr__
        setter(self, "max_tokens", max_tokens)
        setter(self, "temperature", float(temperature))
        setter(self, "top_p", float(top_p))
        setter(self, "top_k", top_k)
        setter(self, "seed", seed)
        setter(self, "stop", stops)
        setter(self, "stop_token_ids", stop_ids)
        setter(self, "ignore_eos", bool(ignore_eos))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        raise _fail("stop", stop, "must be a string or a list of strings")
    if any(not s for s in stop):
        raise _fail("stop", stop, "stop strings must not be empty")
    return tuple(stop)


def _stop_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    ok = isinstance(ids, list | tuple) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    )
    if not ok:
        raise _fail("stop_token_ids", ids, "must be a list of non-negative integers")
    return tuple(ids)  # type: ignore[arg-type]


@dataclass(eq=False, slots=True)
class Request:
    """One generation. The engine owns it; callers read it only through engine outputs.

    `all_token_ids` is prompt + output; KV exists for the first `num_computed_tokens` of them.
    `block_hashes` caches the chained hashes of its full blocks (extended as it grows).
    `retain_blocks`: when it finishes (other than by abort) its blocks stay held, KV intact, until
    the scheduler's `release` (a prefill worker sends them to a decode worker first).
    `hash_root` seeds its block hashes instead of the engine's (a tenant's own root).
    `num_in_flight` counts tokens sampled by a step still running on the device, not yet
    appended (see `Scheduler.schedule_ahead`).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    generator: Any = None
    retain_blocks: bool = False
    hash_root: bytes | None = None
    num_in_flight: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
