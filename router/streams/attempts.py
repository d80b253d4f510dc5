"""The retry rule both stream kinds share: retry only while nothing changed hands.

An attempt sends the request to one worker and waits for its first event. If it fails before
that event (`AttemptFailed`: no responders, a worker shutting down, a worker gone, a refused
connection), nothing was generated and no block changed hands, so the next attempt goes to a
worker not tried yet, at most `Workers.max_attempts` in all. After the first event a failure is
the client's error (the stream raises `DispatchError`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvrail.outputs import TokenEvent
from kvrail.router.policy import Decision, NoWorkerError
from kvrail.router.streams.job import AttemptFailed, DispatchError, Engine, Job, Workers

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Attempts:
    """The attempts of one request on workers of one engine; `first` is the open-time choice."""

    workers: Workers
    job: Job
    engine: Engine
    first: Decision | None = None
    tried: set[str] = field(default_factory=set)
    count: int = 0

    def next(self) -> Decision:
        """The worker of the next attempt. Raises DispatchError(`no_worker`) when none is ready
        or every attempt is spent."""
        if self.count >= self.workers.max_attempts:
            raise DispatchError("no_worker", "no decode worker took the request")
        try:
            if self.count == 0 and self.first is not None:
                decision = self.first
            else:
                decision = self.workers.choose(self.job, self.tried, (self.engine,))
        except NoWorkerError as err:
            raise DispatchError("no_worker", f"no ready {self.engine} decode worker") from err
        self.tried.add(decision.worker_id)
        self.count += 1
        return decision

    async def first_event(
        self,
        attempt: Callable[[Decision], Awaitable[TokenEvent]],
        release: Callable[[], Awaitable[None]],
    ) -> TokenEvent:
        """Run `attempt` on one worker after another until one yields its first event;
        `release` undoes a failed attempt (its subscription, its connection, its counts)."""
        while True:
            decision = self.next()
            try:
                return await attempt(decision)
            except AttemptFailed as failed:
                log.info(
                    "request not taken, retrying request_id=%s worker=%s reason=%s",
                    self.job.request_id, decision.worker_id, failed.reason,
                )  # fmt: skip
                await release()
