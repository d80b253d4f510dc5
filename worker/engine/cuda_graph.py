"""CUDA graphs for decode-only steps.

A decode step of n requests replays the graph captured for the smallest captured batch size
>= n. Inputs live in static buffers; rows beyond n are padding that is harmless by construction:
slot -1 (its KV is never written), context length 1 over the null block 0 (never allocated, so
never written), position 0. Inputs are staged in pinned host buffers and copied without waiting
for the device; two sets take turns, and a set is refilled only once the copies from it ran, so
the engine can queue a replay while the previous one runs. Decodes whose token the previous step
sampled take it from the device (`staging.feed_tokens`) after the copies. The decode kernel
sizes its split-K grid from the table width, which is static per graph. The model's forward has
no host synchronisation on CUDA (the Triton launchers only read shapes), which is what makes it
capturable. Steps with prefill tokens, or more decodes than the largest graph, run eagerly.

Before capturing, `warm_eager_kernels` runs the eager forward once over each kind of step the
graphs do not cover (a chunk after a cached prefix, fresh and prefixed chunks together, decodes
of one and of every request beside them, short and full block tables), writing no KV: the Triton
kernels those steps launch are compiled at start. Otherwise the first request with a prefix
cache hit waited about 2 s on the H200 for the paged prefill kernel to compile, and every
request queued behind it.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvrail.worker.engine.staging import feed_tokens
from kvrail.worker.kv_cache import KVCache
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
        self._staging = (_Staging(n, max_blocks_per_seq), _Staging(n, max_blocks_per_seq))
        self._turn = 0
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
        max_blocks = self.block_tables.shape[1]
        warm_eager_kernels(self.model, self.kv_cache, self.max_batch_size, max_blocks)
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
        logger.info(
            "decode graphs captured batch_sizes=%d max=%d", len(self.graphs), self.max_batch_size
        )

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        fed: tuple[np.ndarray, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Queue a replay for n = len(input_ids) <= max_batch_size decodes; returns hidden
        [n, H]. The inputs are host arrays as `model_runner.prepare_decode` makes them
        (block_tables [n, width]); `fed` = (rows, sampled) as `staging.feed_tokens` takes them."""
        n = len(input_ids)
        bs = next(s for s in self.batch_sizes if s >= n)
        width = block_tables.shape[1]
        staging = self._staging[self._turn]
        self._turn ^= 1
        staging.copied.synchronize()  # the copies out of this set, two replays ago, have run
        host = staging.ids.numpy()
        host[0, :n] = input_ids
        host[1, :n] = positions
        host[2, :n] = slot_mapping
        host[2, n:bs] = -1  # padding rows: never write KV
        lens = staging.lens.numpy()
        lens[:n] = seq_lens
        lens[n:bs] = 1
        tables = staging.tables[: bs * width].view(bs, width)
        table_rows = tables.numpy()
        table_rows[:n] = block_tables
        table_rows[n:] = 0
        self.input_ids[:bs].copy_(staging.ids[0, :bs], non_blocking=True)
        self.positions[:bs].copy_(staging.ids[1, :bs], non_blocking=True)
        self.slot_mapping[:bs].copy_(staging.ids[2, :bs], non_blocking=True)
        self.seq_lens[:bs].copy_(staging.lens[:bs], non_blocking=True)
        self.block_tables[:bs, :width].copy_(tables, non_blocking=True)
        staging.copied.record()
        if fed is not None:
            feed_tokens(self.input_ids, *fed)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]


class _Staging:
    """Pinned host buffers for one replay's inputs, and an event recorded after their copies."""

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int) -> None:
        n = max_batch_size
        self.ids = torch.zeros(3, n, dtype=torch.int64, device="cpu", pin_memory=True)
        self.lens = torch.ones(n, dtype=torch.int32, device="cpu", pin_memory=True)
        self.tables = torch.zeros(
            n * max_blocks_per_seq, dtype=torch.int32, device="cpu", pin_memory=True
        )
        self.copied = torch.cuda.Event()
        self.copied.record()


@torch.inference_mode()
def warm_eager_kernels(
    model: LlamaForCausalLM, kv_cache: KVCache, max_num_seqs: int, max_blocks_per_seq: int
) -> None:
    """One eager forward per combination of decode rows (none, one or `max_num_seqs`, over one
    block or the widest table) and prefill chunks (after a one-block prefix, alone or beside a
    fresh chunk, of 16 and 64 tokens: both of the paged kernel's tile sizes). Every slot is -1
    and every table names the null block 0: nothing is written, nothing allocated is read."""
    device = kv_cache.tensor.device
    block_size = kv_cache.block_size
    decodes = {(0, 1), (1, 1), (1, max_blocks_per_seq), (max_num_seqs, 1)}
    decodes.add((max_num_seqs, max_blocks_per_seq))
    prefills = [(q, fresh) for q in (16, 64) for fresh in (False, True)]
    started = time.perf_counter()

    def ints(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    for num_decodes, width in sorted(decodes):
        for query_len, with_fresh in prefills:
            context = query_len + block_size  # a prefix of one block
            lens = [context, query_len] if with_fresh else [context]
            num_tokens = num_decodes + query_len * len(lens)
            table_width = max(width, -(-context // block_size))
            metadata = AttentionMetadata(
                slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
                num_decode_tokens=num_decodes,
                decode_block_tables=torch.zeros(
                    num_decodes, width, dtype=torch.int32, device=device
                ),
                decode_seq_lens=ints([width * block_size] * num_decodes),
                prefill_block_tables=torch.zeros(
                    len(lens), table_width, dtype=torch.int32, device=device
                ),
                prefill_query_start_loc=ints([0, query_len, 2 * query_len][: len(lens) + 1]),
                prefill_seq_lens=ints(lens),
                prefill_max_query_len=query_len,
                prefill_fresh_runs=((query_len, query_len, 1),) if with_fresh else (),
                prefill_has_prefix=True,
            )
            positions = [0] * num_decodes + list(range(block_size, context))
            if with_fresh:
                positions += list(range(query_len))
            model(
                torch.zeros(num_tokens, dtype=torch.int64, device=device),
                ints(positions, torch.int64),
                metadata,
                kv_cache,
            )
    if device.type == "cuda":
        torch.cuda.synchronize()
    logger.info("eager kernels warmed steps=%d seconds=%.1f", len(decodes) * len(prefills),
                time.perf_counter() - started)  # fmt: skip
