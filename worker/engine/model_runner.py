"""Turns a SchedulerOutput into model inputs, runs the model and returns the logits to sample.

Decode and prefill inputs are prepared separately (`prepare_decode`, `prepare_prefill`) and packed
decode tokens first, matching `AttentionMetadata`. Block tables are padded with the null block 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvrail.worker.engine.cuda_graph import DecodeGraphs
from kvrail.worker.engine.kv_cache import KVCache
from kvrail.worker.engine.request import Request
from kvrail.worker.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from kvrail.worker.layers.attention import AttentionMetadata, fresh_runs
from kvrail.worker.models.llama import LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class PreparedInputs:
    """Host-side inputs of one kind (decode or prefill), before packing."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    seq_lens: list[int]
    query_start_loc: list[int]


def _prepare(items: Sequence[ScheduledRequest], block_size: int) -> PreparedInputs:
    """Vectorised per request (numpy), so a long prompt costs no per-token Python."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    for item in items:
        start = item.num_computed_tokens
        input_ids.extend(item.token_ids)
        if item.num_new_tokens == 1:  # the decode case: plain ints are cheaper than arrays
            positions.append(start)
            slots.append(item.block_ids[start // block_size] * block_size + start % block_size)
        else:
            pos = np.arange(start, start + item.num_new_tokens, dtype=np.int64)
            table = np.asarray(item.block_ids, dtype=np.int64)
            positions.extend(pos.tolist())
            slots.extend((table[pos // block_size] * block_size + pos % block_size).tolist())
        query_start_loc.append(len(input_ids))
    width = max((len(i.block_ids) for i in items), default=0)
    tables = [i.block_ids + [0] * (width - len(i.block_ids)) for i in items]
    seq_lens = [i.num_computed_tokens + i.num_new_tokens for i in items]
    return PreparedInputs(input_ids, positions, slots, tables, seq_lens, query_start_loc)


def prepare_decode(items: Sequence[ScheduledRequest], block_size: int) -> PreparedInputs:
    """One token per request at position num_computed_tokens."""
    assert all(i.num_new_tokens == 1 for i in items), "decode items feed exactly one token"
    return _prepare(items, block_size)


def prepare_prefill(items: Sequence[ScheduledRequest], block_size: int) -> PreparedInputs:
    """Each request's chunk, packed, with query_start_loc delimiting the chunks."""
    return _prepare(items, block_size)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        device: torch.device,
        decode_graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        self.decode_graphs = decode_graphs

    def _tensor(self, values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _table(self, tables: list[list[int]]) -> torch.Tensor:
        if not tables:
            return torch.zeros((0, 1), dtype=torch.int32, device=self.device)
        return self._tensor(tables, torch.int32)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        """Run one step. Returns logits [n, vocab] and the n requests that sample a token."""
        dec = prepare_decode(out.decodes, self.block_size)
        graphs = self.decode_graphs
        if graphs is not None and not out.prefills and len(out.decodes) <= graphs.max_batch_size:
            hidden = graphs.run(
                dec.input_ids, dec.positions, dec.slot_mapping, dec.block_tables, dec.seq_lens
            )
            return self._logits(hidden, out, 0, [])
        pre = prepare_prefill(out.prefills, self.block_size)
        i32, i64 = torch.int32, torch.int64
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(dec.slot_mapping + pre.slot_mapping, i64),
            num_decode_tokens=len(dec.input_ids),
            decode_block_tables=self._table(dec.block_tables),
            decode_seq_lens=self._tensor(dec.seq_lens, i32),
            prefill_block_tables=self._table(pre.block_tables),
            prefill_query_start_loc=self._tensor(pre.query_start_loc, i32),
            prefill_seq_lens=self._tensor(pre.seq_lens, i32),
            prefill_max_query_len=max((s.num_new_tokens for s in out.prefills), default=0),
            prefill_fresh_runs=fresh_runs(
                [s.num_new_tokens for s in out.prefills],
                [s.num_computed_tokens for s in out.prefills],
            ),
            prefill_has_prefix=any(s.num_computed_tokens for s in out.prefills),
        )
        input_ids = self._tensor(dec.input_ids + pre.input_ids, i64)
        positions = self._tensor(dec.positions + pre.positions, i64)
        hidden = self.model(input_ids, positions, metadata, self.kv_cache)
        return self._logits(hidden, out, len(dec.input_ids), pre.query_start_loc)

    def _logits(
        self,
        hidden: torch.Tensor,
        out: SchedulerOutput,
        num_decode_tokens: int,
        query_start_loc: list[int],
    ) -> tuple[torch.Tensor, list[Request]]:
        rows: list[int] = []
        requests: list[Request] = []
        for i, item in enumerate(out.decodes):
            if item.samples:
                rows.append(i)
                requests.append(item.request)
        for j, item in enumerate(out.prefills):
            if item.samples:
                rows.append(num_decode_tokens + query_start_loc[j + 1] - 1)
                requests.append(item.request)
        if rows == list(range(len(rows))):  # every decode samples: a view, no index tensor
            return self.model.compute_logits(hidden[: len(rows)]), requests
        logits = self.model.compute_logits(hidden[self._tensor(rows, torch.int64)])
        return logits, requests
