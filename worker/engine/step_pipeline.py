"""How the engine's steps are queued on the device and their tokens applied (`StepPipeline`).

With `async_scheduling` (the default on CUDA) a step is queued on the device before the previous
one has finished: `step()` schedules the next step ahead (`Scheduler.schedule_ahead`) and queues
it, then waits for the running step's tokens and returns the requests that step advanced. The
host's work for a step (scheduling, input preparation, the graph launch, stop checks) thus
overlaps the device's. Each `step()` still applies one step's tokens, and every request gets the
tokens it would get without it; only the batches can differ (scheduling ahead cannot yet see
which requests finish or free blocks in the running step). At most one step is in flight
between calls. Its writes land in the blocks of the requests it was queued for, which stay valid
on the device even if the host frees them meanwhile (device work is ordered); the one writer
outside that order, a remote KV transfer, gets blocks only through `LLMEngine.reserve_remote`,
whose reservation carries a fence behind the step in flight (`DeviceFence`): the writer starts
only once it has passed.

Grammars (`SamplingParams.grammar`): a step with constrained rows (`SchedulerOutput
.has_grammar`) needs each such row's mask before its sampling is queued, and the mask of a
request scheduled ahead depends on the token the running step is still sampling. So such a step
is launched in two halves: its forward pass is queued first (graph replay; its decodes fed from
the device, as any), then the running step is resolved (its tokens join their requests and
advance their grammars' matchers), then the masks are filled on the CPU (`MaskFiller`) while the
device runs the forward, and last the sampling is queued with them. The step still runs one
token ahead: a constrained request decodes every step, and the fill is hidden behind the forward
as long as it takes less time. On the host everything runs in order, so `step()`'s contract is
unchanged. A step without constrained rows is launched whole and does no grammar work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvrail.outputs import TokenLogprobs
from kvrail.worker.engine.grammar_masks import MaskFiller
from kvrail.worker.engine.model_runner import ModelRunner, SampledOnDevice
from kvrail.worker.engine.request import Request
from kvrail.worker.engine.sampler import Sampler, StepLogprobs
from kvrail.worker.engine.scheduler import Scheduler
from kvrail.worker.engine.scheduler_output import SchedulerOutput
from kvrail.worker.engine.scores import PromptScores
from kvrail.worker.engine.staging import to_host


@dataclass(slots=True)
class _Launched:
    """A step queued on the device: what was scheduled, the requests its rows sample for, and
    its tokens (on the device, and in host memory once `done` has passed)."""

    out: SchedulerOutput
    requests: list[Request]
    sampled: SampledOnDevice
    host_tokens: torch.Tensor
    done: torch.cuda.Event | None
    logprobs: StepLogprobs | None = None
    """The asking rows' log-probabilities (in host memory once `done` has passed)."""
    scores: PromptScores | None = None
    """The prompt scores the step computed (in host memory once `done` has passed)."""


class _Forward(NamedTuple):
    """A step whose forward pass is queued and whose sampling is not yet: the logits of its
    sampled rows, the requests they sample for, and its prompt scores."""

    out: SchedulerOutput
    logits: torch.Tensor
    requests: list[Request]
    scores: PromptScores | None


StepWaiter = Callable[[torch.cuda.Event | None], None]
"""How `step` waits for a launched step's tokens: called with the step's CUDA event (None on
the CPU, where the step has already run), it returns once the event has passed. Whatever it
does meanwhile runs with the step (and, with async scheduling, the step after it) queued on
the device and that step's outputs not yet applied, the state any caller between two `step`s
sees, but with one more step in flight: a request aborted now is skipped when the step's
outputs are applied, and a `reserve_remote` fence records behind both steps."""


def synchronize(done: torch.cuda.Event | None) -> None:
    """The default `StepWaiter`: block until the step's tokens are on the host."""
    if done is not None:
        done.synchronize()


class StepPipeline:
    """The scheduler, the model runner and the sampler, one step at a time or one ahead."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        sampler: Sampler,
        async_scheduling: bool,
        masks: MaskFiller | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.async_scheduling = async_scheduling
        self.masks = masks or MaskFiller(scheduler.grammars, runner.device)
        self.step_waiter: StepWaiter = synchronize
        """Replaced by `EngineService`, which runs its commands while a step runs."""
        self._in_flight: _Launched | None = None

    def step(self) -> tuple[list[Request], dict[str, TokenLogprobs]]:
        """Run one iteration; returns the requests that got a token (each once), and the
        log-probabilities of those that asked, by request id. With `async_scheduling` it leaves
        the next step queued on the device."""
        try:
            return self._step()
        except BaseException:
            self._in_flight = None  # its requests are failed by the caller
            raise

    def _step(self) -> tuple[list[Request], dict[str, TokenLogprobs]]:
        running = self._in_flight
        self._in_flight = None
        if running is None:
            running = self._launch(self.scheduler.schedule())
            if running is None:
                return [], {}
        if not self.async_scheduling:
            return self._resolve(running)
        ahead = self.scheduler.schedule_ahead()
        if ahead is None:  # it would preempt: only with the running step's tokens known
            advanced = self._resolve(running)
            self._in_flight = self._launch(self.scheduler.schedule())
            return advanced
        if not ahead.has_grammar:
            self._in_flight = self._launch(ahead, running.sampled)
            return self._resolve(running)
        # Its masks need the running step's tokens: queue its forward, resolve, fill, sample.
        forward = self._forward(ahead, running.sampled)
        advanced = self._resolve(running)
        self._in_flight = self._sample(forward)
        return advanced

    def _launch(
        self, out: SchedulerOutput, previous: SampledOnDevice | None = None
    ) -> _Launched | None:
        """Queue a scheduled step on the device (on the CPU it runs now); None if it is empty."""
        if out.is_empty:
            return None
        return self._sample(self._forward(out, previous))

    def _forward(self, out: SchedulerOutput, previous: SampledOnDevice | None) -> _Forward:
        """Queue a step's forward pass (its decodes fed from `previous` on the device)."""
        logits, requests, scores = self.runner.execute(out, previous)
        return _Forward(out, logits, requests, scores)

    def _sample(self, forward: _Forward) -> _Launched:
        """Queue a step's sampling after its forward, under its grammar masks if it has
        constrained rows (filled now, from every token resolved so far), and the copies of its
        tokens (and logprobs, prompt scores) to the host."""
        out, logits, requests, scores = forward
        masks = self.masks.fill(requests) if out.has_grammar else None
        tokens = (
            self.sampler.sample(logits, requests, masks)
            if requests
            else logits.new_empty(0, dtype=torch.int64)
        )
        tokens = self.runner.share_tokens(tokens)  # every rank feeds them to the next step
        logprobs = self.sampler.logprobs(logits, requests, tokens) if requests else None
        sampled = SampledOnDevice(tokens, {r.request_id: i for i, r in enumerate(requests)})
        if tokens.device.type != "cuda":
            return _Launched(out, requests, sampled, tokens, None, logprobs, scores)
        host = to_host(tokens)
        if logprobs is not None:
            logprobs = logprobs.to_host()
        if scores is not None:
            scores = scores.to_host()
        done = torch.cuda.Event()
        done.record()
        return _Launched(out, requests, sampled, host, done, logprobs, scores)

    def _resolve(self, launched: _Launched) -> tuple[list[Request], dict[str, TokenLogprobs]]:
        """Wait for a launched step's tokens and apply them (and its prompt scores, first) to its
        requests."""
        self.step_waiter(launched.done)
        if launched.scores is not None:
            launched.scores.apply()
        token_ids = launched.host_tokens.tolist()
        sampled = {r.request_id: t for r, t in zip(launched.requests, token_ids, strict=True)}
        logprobs = (
            launched.logprobs.for_rows(launched.requests, token_ids)
            if launched.logprobs is not None
            else {}
        )
        return self.scheduler.update_from_output(launched.out, sampled), logprobs
