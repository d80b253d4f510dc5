"""Requests: the engine's mutable record of one generation.

A `Request` holds its tokens, how many of them have KV in the cache (`num_computed_tokens`), its
`RequestStatus` and its `kvrail.sampling.SamplingParams` (validated when built, so the engine
trusts them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvrail.outputs import RequestOutput, TokenLogprobs
from kvrail.sampling import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher


class RequestStatus(enum.Enum):
    """Lifecycle of a request. Finished states are terminal."""

    WAITING = enum.auto()
    """Queued for admission; holds no blocks."""
    WAITING_FOR_REMOTE_KV = enum.auto()
    """Blocks reserved; its prompt KV is being written from elsewhere. Never scheduled."""
    WAITING_FOR_TIER_KV = enum.auto()
    """Blocks allocated; part of its prompt KV is being loaded from a lower tier (host memory,
    disk). Never scheduled until the load is done."""
    RUNNING = enum.auto()
    """Holds blocks for every token it has computed or will compute this step."""
    PREEMPTED = enum.auto()
    """Lost its blocks to a higher-priority request; waits to recompute its tokens."""
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()
    """Failed on its own (`Request.error` says why); no finish reason."""

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI `finish_reason` of a finished status, else None."""
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


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
    `prompt_logprobs` collects the prompt's scores (`SamplingParams.prompt_logprobs`) as its
    chunks are computed, until its first output takes them; `num_prompt_scored` counts the
    prompt tokens scored so far (a recompute after preemption scores none twice).
    `grammar_matcher`: its grammar's state after its output tokens (`SamplingParams.grammar`;
    made, or remade by replaying them, where it is None: see `kvrail.worker.engine.grammar`);
    `grammar_group` names the compiled start it was copied from (rows of a group share a lexer).
    `error`: why a FINISHED_ERROR request failed (a metric-safe code, `RequestOutput.error`).
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
    stop_reason: int | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    retain_blocks: bool = False
    hash_root: bytes | None = None
    num_in_flight: int = 0
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_scored: int = 0
    grammar_matcher: LLMatcher | None = None
    grammar_group: int = 0
    error: str | None = None

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


def request_output(request: Request, logprobs: TokenLogprobs | None = None) -> RequestOutput:
    """The output of the step that just gave `request` its last token, with that token's
    `logprobs` if it asked (the first output also says how many prompt tokens the prefix cache
    served, and takes the prompt's scores); for a request that token failed, only its `error`."""
    if request.error is not None:  # failed on its own (its grammar): no token, the reason
        return RequestOutput(request.request_id, error=request.error)
    first = request.num_output_tokens == 1
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    if first and request.prompt_logprobs:
        prompt_logprobs = tuple(request.prompt_logprobs)
        request.prompt_logprobs.clear()
    return RequestOutput(
        request.request_id,
        (request.output_token_ids[-1],),
        request.status.finish_reason,
        request.stop_reason,
        None,
        request.num_cached_tokens if first else 0,
        (logprobs,) if logprobs is not None else (),
        prompt_logprobs,
    )
