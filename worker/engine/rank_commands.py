"""What rank 0's engine tells the other ranks of its worker, and the Protocol that carries it.

Rank 0 owns the scheduler, the block manager and the sampler; ranks 1..N-1 own only their model
shard and KV shard and run what they are told, in order (`rank_loop.serve`): every step with the
very inputs rank 0 runs (`StepInputs`), the zeroing of released blocks, the capture of the decode
CUDA graphs (their collectives must be captured on every rank together), and the stop. Plain
values, so a command crosses a process boundary as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvrail.worker.engine.step_inputs import StepInputs


@dataclass(frozen=True, slots=True)
class ZeroBlocks:
    """Zero these blocks of the KV shard (every layer, K and V): `zero_kv_on_release`."""

    block_ids: np.ndarray  # int64


@dataclass(frozen=True, slots=True)
class CaptureGraphs:
    """Capture the CUDA graphs (`cuda_graph.StepGraphs`) with these sizes, now."""

    max_num_seqs: int
    max_blocks_per_seq: int
    max_mixed_tokens: int
    shared_prefixes: bool = False

    @property
    def sizes(self) -> tuple[int, int, int, bool]:
        """`StepGraphs`' arguments after the model and KV cache."""
        return (self.max_num_seqs, self.max_blocks_per_seq, self.max_mixed_tokens,
                self.shared_prefixes)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Stop:
    """Leave the loop: the worker is closing."""


RankCommand = StepInputs | ZeroBlocks | CaptureGraphs | Stop


class RankPeers(Protocol):
    """Ranks 1..N-1 of this worker, as rank 0's engine drives them.

    Guarantees: `send` hands `command` to every rank, after every command sent before, or raises
    `kvrail.errors.RankLostError` when a rank is gone (then no later command reaches any rank:
    the group is broken for good). It never waits for a rank to run the command.
    """

    @property
    def size(self) -> int:
        """The number of ranks, rank 0 included."""
        ...

    def send(self, command: RankCommand) -> None: ...
