"""What ranks 1..N-1 of a tensor-parallel worker run: rank 0's commands, in order, until `Stop`.

Each `StepInputs` runs exactly as on rank 0 (`ModelRunner.run`: the same forward with the same
collectives, then this rank's vocabulary shard of the logits goes to rank 0), and then this rank
takes part in the broadcast of the sampled tokens, which it keeps on its device to feed the
next step's decodes (async scheduling: the next step may arrive before this one has run on the
device; device work is ordered, so it reads them once they exist). `ZeroBlocks` zeroes blocks of
this rank's KV shard; `CaptureGraphs` captures the CUDA graphs together with rank 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from kvrail.worker.engine.cuda_graph import StepGraphs
from kvrail.worker.engine.model_runner import ModelRunner
from kvrail.worker.engine.rank_commands import CaptureGraphs, RankCommand, Stop, ZeroBlocks
from kvrail.worker.engine.staging import to_device
from kvrail.worker.engine.step_inputs import StepInputs

log = logging.getLogger(__name__)


def serve(next_command: Callable[[], RankCommand], runner: ModelRunner) -> int:
    """Run commands from `next_command()` (which blocks; raises when rank 0 is gone) until
    `Stop`; returns the number of steps run. Any error propagates: the rank process exits and
    rank 0 fails the worker."""
    if runner.group.is_first:
        raise ValueError("rank 0 schedules; only ranks 1..N-1 serve its commands")
    sampled: torch.Tensor | None = None
    num_steps = 0
    while True:
        command = next_command()
        if isinstance(command, StepInputs):
            runner.run(command, sampled)
            tokens = torch.empty(command.num_sampled, dtype=torch.int64, device=runner.device)
            sampled = runner.share_tokens(tokens)
            num_steps += 1
        elif isinstance(command, ZeroBlocks):
            index = to_device(np.asarray(command.block_ids, dtype=np.int64), runner.device)
            runner.kv_cache.zero_blocks(index)
        elif isinstance(command, CaptureGraphs):
            graphs = StepGraphs(runner.model, runner.kv_cache, *command.sizes)
            graphs.capture()
            runner.graphs = graphs
        elif isinstance(command, Stop):
            log.info("rank stopping rank=%d steps=%d", runner.group.rank, num_steps)
            return num_steps
        else:
            raise TypeError(f"unknown rank command {type(command).__name__}")
