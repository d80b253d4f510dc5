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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvrail.outputs import TokenLogprobs
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
        self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler, async_scheduling: bool
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.async_scheduling = async_scheduling
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
        self._in_flight = self._launch(ahead, running.sampled)
        return self._resolve(running)

    def _launch(
        self, out: SchedulerOutput, previous: SampledOnDevice | None = None
    ) -> _Launched | None:
        """Queue a scheduled step on the device (on the CPU it runs now); None if it is empty."""
        if out.is_empty:
            return None
        logits, requests, scores = self.runner.execute(out, previous)
        tokens = (
            self.sampler.sample(logits, requests)
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
