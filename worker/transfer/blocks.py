"""Pure helpers of a transfer: what one moved (`TransferStats`) and block runs (`coalesce`,
`kvrail.worker.kv_cache`'s: a run of blocks contiguous on both sides is one descriptor).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrail.worker.kv_cache import coalesce, count_runs, run_starts, runs_at

__all__ = ["TransferStats", "coalesce", "count_runs", "run_starts", "runs_at"]


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one transfer moved, how long it took and over which path."""

    num_bytes: int
    seconds: float
    transport: str

    @property
    def bytes_per_s(self) -> float:
        return self.num_bytes / self.seconds if self.seconds > 0 else 0.0
