"""A request's first-token stages as the decode role collects them (`FirstTokenStages` on the
wire): each stage is unset until timed, so only what happened is counted and logged."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvrail.outputs import FirstTokenStages


@dataclass(slots=True)
class StageTimes:
    """The mutable twin of `FirstTokenStages`; None: not timed (the stage did not happen)."""

    queue_wait_s: float | None = None
    prefill_compute_s: float | None = None
    transfer_queue_s: float | None = None
    copy_s: float | None = None
    validation_s: float | None = None
    admission_s: float | None = None

    def timed(self) -> dict[str, float]:
        """The stages that were timed, by name (`queue_wait_s`, ...)."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    def message(self) -> FirstTokenStages:
        return FirstTokenStages(**self.timed())
