"""The host work of a CUDA IPC handoff before its copy is launched, on the CPU: both block-id lists
checked (`blocks.checked_ids`: integers, in range, no repeats), their runs found or
counted, and the ids staged in one buffer, for an 8k prompt's 512 scattered blocks of a
30,720-block pool. Three versions alternating in one run: the repeat check with `np.unique`
and the runs' starts listed (`blocks.run_starts`: before the eighth session), one sort that
also gives the bounds (eighth session), and the runs only counted (`blocks.count_runs`: a
write copies block by block only when there are few); microseconds per handoff, the median
of 9 rounds of 2,000.

    .venv/bin/python -P bench/studies/handoff/id_checks.py   # output: id_checks.txt
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvrail.errors import TransferError
from kvrail.worker.transfer.blocks import checked_ids as _checked_ids
from kvrail.worker.transfer.blocks import count_runs, run_starts

NUM_BLOCKS, N = 30720, 512


def checked_with_unique(block_ids: Sequence[int], num_blocks: int, side: str) -> Any:
    """The check before this change (np.unique for the repeats, a mask for the bounds)."""
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or not ids.size:
        raise TransferError("a transfer needs at least one block")
    if ids.dtype.kind not in "iu":
        raise TransferError(f"{side} block ids are {ids.dtype}, not integers")
    ids = ids.astype(np.int64, copy=False)
    outside = ids[(ids < 0) | (ids >= num_blocks)]
    if outside.size:
        raise TransferError(f"{side} block {int(outside[0])} outside [0, {num_blocks})")
    if np.unique(ids).size != ids.size:
        raise TransferError(f"{side} block ids repeat")
    return ids


def handoff_host_work(
    check: Callable[..., Any], runs: Callable[[Any, Any], Any]
) -> Callable[[], None]:
    rng = random.Random(0)
    src = tuple(rng.sample(range(NUM_BLOCKS), N))
    dst = tuple(rng.sample(range(NUM_BLOCKS), N))
    staging = np.empty(2 * N, dtype=np.int64)

    def once() -> None:
        s = check(src, NUM_BLOCKS, "source")
        d = check(dst, NUM_BLOCKS, "destination")
        runs(s, d)
        staging[:N] = s
        staging[N:] = d

    return once


def per_call_us(fn: Callable[[], None], calls: int = 2000) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> int:
    cases = {
        "np.unique, run starts": (checked_with_unique, run_starts),
        "one sort, run starts": (_checked_ids, run_starts),
        "one sort, runs counted": (_checked_ids, count_runs),
    }
    work = {name: handoff_host_work(*parts) for name, parts in cases.items()}
    for fn in work.values():
        per_call_us(fn, 200)
    rounds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(9):
        for name, fn in work.items():
            rounds[name].append(per_call_us(fn))
    print(
        f"# {N} scattered blocks of {NUM_BLOCKS}: both lists checked, runs found or counted, "
        "ids staged"
    )
    for name, values in rounds.items():
        spread = f"{min(values):.1f}-{max(values):.1f}"
        print(f"{name:24s} {statistics.median(values):6.1f} us per handoff (rounds {spread})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
