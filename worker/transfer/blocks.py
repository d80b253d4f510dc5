"""Pure helpers of a transfer: what one moved (`TransferStats`) and block runs (`coalesce`,
`kvrail.worker.kv_cache`'s: a run of blocks contiguous on both sides is one descriptor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvrail.errors import TransferError
from kvrail.worker.kv_cache import coalesce, count_runs, run_starts, runs_at

__all__ = ["TransferStats", "checked_ids", "coalesce", "count_runs", "run_starts", "runs_at"]


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one transfer moved, how long it took and over which path."""

    num_bytes: int
    seconds: float
    transport: str

    @property
    def bytes_per_s(self) -> float:
        return self.num_bytes / self.seconds if self.seconds > 0 else 0.0


def checked_ids(block_ids: Sequence[int], num_blocks: int, side: str) -> Any:
    """The ids as an int64 array, once each is in [0, num_blocks) and none repeats."""
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or not ids.size:
        raise TransferError("a transfer needs at least one block")
    if ids.dtype.kind not in "iu":
        raise TransferError(f"{side} block ids are {ids.dtype}, not integers")
    ids = ids.astype(np.int64, copy=False)
    # one sort gives the bounds and the repeats (np.unique took 30 us of 512 ids, a handoff
    # checks two lists: bench/studies/handoff/id_checks.py)
    ordered = np.sort(ids)
    low, high = int(ordered[0]), int(ordered[-1])
    if low < 0 or high >= num_blocks:
        raise TransferError(f"{side} block {low if low < 0 else high} outside [0, {num_blocks})")
    if bool((ordered[1:] == ordered[:-1]).any()):
        raise TransferError(f"{side} block ids repeat")
    return ids
