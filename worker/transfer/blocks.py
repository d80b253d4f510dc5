"""Pure helpers of a transfer: what one moved (`TransferStats`) and block runs (`coalesce`).

A worker's KV cache is one contiguous region of `num_blocks` blocks of `block_bytes` each
(`kvrail.worker.kv_cache`), so a run of blocks contiguous on both sides is one descriptor.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one transfer moved, how long it took and over which path."""

    num_bytes: int
    seconds: float
    transport: str

    @property
    def bytes_per_s(self) -> float:
        return self.num_bytes / self.seconds if self.seconds > 0 else 0.0


def coalesce(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge block pairs into runs `(src_start, dst_start, length)` that are contiguous on both
    sides, so a transport issues one descriptor per run instead of one per block."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    src, dst = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    return runs_at(src, dst, run_starts(src, dst))


def run_starts(src_ids: Any, dst_ids: Any) -> list[int]:
    """The indices where the runs of `coalesce` start, for two int64 arrays of equal length
    (vectorized: a handoff of an 8k prompt has 512 blocks)."""
    return [0, *(np.flatnonzero(_breaks(src_ids, dst_ids)) + 1).tolist()] if src_ids.size else []


def count_runs(src_ids: Any, dst_ids: Any) -> int:
    """How many runs `coalesce` would find, without listing them (for 512 scattered blocks
    about half of `run_starts`'s 15 us on the VM: bench/studies/handoff/id_checks.py)."""
    return int(np.count_nonzero(_breaks(src_ids, dst_ids))) + 1 if src_ids.size else 0


def _breaks(src_ids: Any, dst_ids: Any) -> Any:
    """Whether block i + 1 starts a new run, for each i."""
    return (np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)


def runs_at(src_ids: Any, dst_ids: Any, starts: list[int]) -> list[tuple[int, int, int]]:
    """The runs `(src_start, dst_start, length)` that begin at `starts` (`run_starts`)."""
    bounds = itertools.pairwise([*starts, src_ids.size])
    return [(int(src_ids[a]), int(dst_ids[a]), b - a) for a, b in bounds]
