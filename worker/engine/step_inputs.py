"""One step's model inputs as host arrays: what rank 0 prepares and every rank runs.

`model_runner.prepare_step` builds it from a `SchedulerOutput` (on rank 0: only it schedules);
`ModelRunner.run` runs it (on every rank, with tensor parallelism on the very same arrays). Plain
numpy values, so it crosses to another rank's process by pickling, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvrail.worker.engine.scores import ScoreRows
from kvrail.worker.engine.shared_prefix import PrefixGroups

GraphKind = Literal["decode", "shared", "mixed", ""]


@dataclass(frozen=True, slots=True)
class PreparedInputs:
    """Host-side inputs of one kind (decode or prefill), before packing: numpy arrays over the
    T tokens of S requests. Block tables are padded with the null block 0 (at least 1 wide)."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    block_tables: np.ndarray  # int32 [S, max blocks]
    seq_lens: np.ndarray  # int32 [S]
    query_start_loc: np.ndarray  # int32 [S + 1]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Decode inputs, prefill inputs, the decode rows fed from the previous step's tokens on the
    device (`fed`: [2, k] rows here and there), the rows of the hidden states that sample
    (`logit_rows`; None: the first `num_sampled` rows, a view without an index), and how to run:
    `graph` names the CUDA graph it replays, "" for an eager step (decided on rank 0, so every
    rank agrees: `model_runner.choose_graph`; "shared" is the decode graph that reads `shared`'s
    groups once). `scores`: the rows that score prompt tokens (`kvrail.worker.engine.scores`),
    None when no request in the step asks. `shared`: decode rows that share their first blocks
    (`kvrail.worker.engine.shared_prefix`), None when the step has none worth grouping."""

    decode: PreparedInputs
    prefill: PreparedInputs
    fed: np.ndarray  # int64 [2, k]
    logit_rows: np.ndarray | None  # int64 [n]
    num_sampled: int
    prefill_max_query_len: int
    prefill_fresh_runs: tuple[tuple[int, int, int], ...]
    prefill_has_prefix: bool
    graph: GraphKind
    scores: ScoreRows | None = None
    shared: PrefixGroups | None = None
