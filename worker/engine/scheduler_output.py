"""What one scheduling step decided, and what a remote reservation holds (plain values)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrail.worker.engine.fence import PASSED, DeviceFence
from kvrail.worker.engine.request import Request


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request in a step: feed `token_ids` at positions from `num_computed_tokens` on.

    `samples` says whether they end with the request's last token, so that a token is sampled
    from this step's logits (a non-final prefill chunk samples nothing). `token_on_device`: a
    decode whose one token was sampled by the step still running; `token_ids` holds a
    placeholder and the model runner feeds the sampled token from the device.
    """

    request: Request
    num_computed_tokens: int
    token_ids: list[int]
    block_ids: list[int]
    samples: bool
    token_on_device: bool = False

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[ScheduledRequest] = field(default_factory=list)
    prefills: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    scores_prompt: bool = False
    """Some request's chunk in the step has prompt tokens to score
    (`SamplingParams.prompt_logprobs`); a step without any prepares no score rows."""
    has_grammar: bool = False
    """Some request in the step samples under a grammar (`SamplingParams.grammar`); a step
    without any does no grammar work at all."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.decodes + self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


@dataclass(frozen=True, slots=True)
class RemoteReservation:
    """Blocks reserved for a request whose prompt KV is written from elsewhere.

    The writer fills tokens [num_cached_tokens, num_prompt_tokens) of `block_ids`; the head of
    the table is a local prefix hit and already holds valid KV. It may write only once `fence`
    has passed (the device work queued before the reservation, which may still touch the
    blocks, has finished; see `kvrail.worker.engine.fence`).
    """

    request_id: str
    block_ids: list[int]
    num_cached_tokens: int
    fence: DeviceFence = PASSED
    num_lower_tier_tokens: int = 0
    """Prompt tokens after the local hit that this worker's lower KV tiers hold: a prefill here
    would load them instead of computing them (the caller may prefer that to the remote one)."""
