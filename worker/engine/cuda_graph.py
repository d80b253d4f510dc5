"""CUDA graphs for decode-only steps.

A decode step of n requests replays the graph captured for the smallest captured batch size
>= n. Inputs live in static buffers; rows beyond n are padding that is harmless by construction:
slot -1 (its KV is never written), context length 1 over the null block 0 (never allocated, so
never written), position 0. The model's forward has no host synchronisation on CUDA (the Triton
launchers only read shapes), which is what makes it capturable. Steps with prefill tokens, or
more decodes than the largest graph, run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvrail.worker.engine.kv_cache import KVCache
from kvrail.worker.layers.attention import AttentionMetadata
from kvrail.worker.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to max_num_seqs (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        max_num_seqs: int,
        max_blocks_per_seq: int,
    ) -> None:
        device = kv_cache.tensor.device
        if device.type != "cuda":
            raise ValueError("CUDA graphs need the model and KV cache on a CUDA device")
        self.model = model
        self.kv_cache = kv_cache
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        n = self.batch_sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self._no_prefill = (
            torch.zeros((0, 1), dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.zeros(0, dtype=torch.int32, device=device),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _metadata(self, bs: int) -> AttentionMetadata:
        tables, start_loc, lens = self._no_prefill
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            num_decode_tokens=bs,
            decode_block_tables=self.block_tables[:bs],
            decode_seq_lens=self.seq_lens[:bs],
            prefill_block_tables=tables,
            prefill_query_start_loc=start_loc,
            prefill_seq_lens=lens,
            prefill_max_query_len=0,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        hidden: torch.Tensor = self.model(
            self.input_ids[:bs], self.positions[:bs], self._metadata(bs), self.kv_cache
        )
        return hidden

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first so smaller graphs reuse its memory pool."""
        pool = None
        for bs in reversed(self.batch_sizes):
            self._forward(bs)  # warm-up: compiles the kernels for this shape
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("decode graphs captured batch_sizes=%d max=%d", len(self.graphs), bs)

    def run(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slot_mapping: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
    ) -> torch.Tensor:
        """Replay for n = len(input_ids) <= max_batch_size decodes; returns hidden [n, H]."""
        n = len(input_ids)
        bs = next(s for s in self.batch_sizes if s >= n)
        device = self.input_ids.device
        width = len(block_tables[0])
        self.input_ids[:n].copy_(torch.tensor(input_ids, dtype=torch.int64), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions, dtype=torch.int64), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.tensor(slot_mapping, dtype=torch.int64))
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(torch.tensor(seq_lens, dtype=torch.int32))
        self.seq_lens[n:bs].fill_(1)
        tables = torch.tensor(block_tables, dtype=torch.int32).to(device, non_blocking=True)
        self.block_tables[:n, :width].copy_(tables)
        self.block_tables[n:bs].zero_()
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
