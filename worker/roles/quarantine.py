"""Quarantine: reserved blocks a granted KV write may still land in are not reused meanwhile.

When a remote prefill is abandoned without its completion (deadline, lost prefill worker,
cancel) after some attempt was granted a write, its reservation is held until the job's deadline
(a prefill worker never writes past it, plus a margin) or until every granted attempt reported
(completion or refusal), whichever comes first. Pure bookkeeping: the caller gives the clock and
frees what `take_releasable` returns.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class _Held:
    engine_id: str
    release_at_monotonic: float
    outstanding_job_ids: set[str]


class Quarantine:
    """Held reservations by engine request id, each waiting for its granted jobs."""

    def __init__(self) -> None:
        self._by_job: dict[str, _Held] = {}  # every outstanding job id of every held request
        self._lifted: list[str] = []  # engine ids whose writers all reported

    def hold(self, engine_id: str, job_ids: Iterable[str], release_at_monotonic: float) -> None:
        """Hold `engine_id`'s blocks until `release_at_monotonic` or until every one of
        `job_ids` (granted writes of unknown outcome) reported."""
        entry = _Held(engine_id, release_at_monotonic, set(job_ids))
        for job_id in entry.outstanding_job_ids:
            self._by_job[job_id] = entry

    def report(self, job_id: str) -> bool:
        """A writer of `job_id` reported (its write landed or never will); True when that job
        was held. The last report of a request lifts it (see `take_releasable`)."""
        entry = self._by_job.pop(job_id, None)
        if entry is None:
            return False
        entry.outstanding_job_ids.discard(job_id)
        if not entry.outstanding_job_ids:
            self._lifted.append(entry.engine_id)
        return True

    def take_releasable(self, now_monotonic: float) -> tuple[set[str], set[str]]:
        """What may be freed now: the engine ids no write can land in any more (their deadline
        passed or every writer reported), and the job ids whose wait expired (their grants will
        never report). Both leave the quarantine."""
        expired = {
            job_id: e
            for job_id, e in self._by_job.items()
            if now_monotonic >= e.release_at_monotonic
        }
        for job_id in expired:
            del self._by_job[job_id]
        released = {e.engine_id for e in expired.values()} | set(self._lifted)
        self._lifted.clear()
        return released - self.engine_ids(), set(expired)

    def engine_ids(self) -> set[str]:
        """Engine ids held now."""
        return {e.engine_id for e in self._by_job.values()}

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self.engine_ids()

    def clear(self) -> set[str]:
        """Forget everything (the process is leaving); returns every engine id still to free
        (held, or lifted and not yet taken)."""
        held = self.engine_ids() | set(self._lifted)
        self._by_job.clear()
        self._lifted.clear()
        return held
