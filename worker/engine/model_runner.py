"""Turns a SchedulerOutput into model inputs, runs the model and returns the logits to sample.

Decode and prefill inputs are prepared separately (`prepare_decode`, `prepare_prefill`) and packed
decode tokens first, matching `AttentionMetadata`. Block tables are padded with the null block 0.
Preparation walks the requests once in Python and computes every per-token value with numpy, so
a step's host work grows with its requests only by that walk. Inputs reach the device through
asynchronous copies (`staging`), and a decode whose token the previous step sampled takes it from
that step's tensor on the device: preparing and queueing a step never waits for the one running.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from kvrail.worker.engine.cuda_graph import DecodeGraphs
from kvrail.worker.engine.request import Request
from kvrail.worker.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from kvrail.worker.engine.staging import feed_tokens, to_device
from kvrail.worker.kv_cache import KVCache
from kvrail.worker.layers.attention import AttentionMetadata, fresh_runs
from kvrail.worker.models.llama import LlamaForCausalLM


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


def _prepare(items: Sequence[ScheduledRequest], block_size: int) -> PreparedInputs:
    """One Python pass over the requests to gather their numbers; every per-token value (and
    the padded block table) is then computed by whole-array numpy operations."""
    num_requests = len(items)
    starts = np.fromiter((i.num_computed_tokens for i in items), np.int64, num_requests)
    query_lens = np.fromiter((len(i.token_ids) for i in items), np.int64, num_requests)
    table_lens = np.fromiter((len(i.block_ids) for i in items), np.int64, num_requests)
    query_start_loc = np.zeros(num_requests + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    input_ids = np.fromiter(chain.from_iterable(i.token_ids for i in items), np.int64, num_tokens)
    # Row (request) of every token, and its position: the row's start plus its offset in the row.
    rows = np.repeat(np.arange(num_requests), query_lens)
    positions = starts[rows] + np.arange(num_tokens) - query_start_loc[rows]
    width = int(table_lens.max()) if num_requests else 1
    block_tables = np.zeros((num_requests, width), dtype=np.int32)
    held = np.arange(width) < table_lens[:, None]  # row-major order, as the ids are chained
    block_tables[held] = np.fromiter(
        chain.from_iterable(i.block_ids for i in items), np.int32, int(table_lens.sum())
    )
    blocks = block_tables[rows, positions // block_size].astype(np.int64)
    slot_mapping = blocks * block_size + positions % block_size
    seq_lens = (starts + query_lens).astype(np.int32)
    return PreparedInputs(
        input_ids, positions, slot_mapping, block_tables, seq_lens,
        query_start_loc.astype(np.int32),
    )  # fmt: skip


def prepare_decode(items: Sequence[ScheduledRequest], block_size: int) -> PreparedInputs:
    """One token per request at position num_computed_tokens."""
    assert all(len(i.token_ids) == 1 for i in items), "decode items feed exactly one token"
    return _prepare(items, block_size)


def prepare_prefill(items: Sequence[ScheduledRequest], block_size: int) -> PreparedInputs:
    """Each request's chunk, packed, with query_start_loc delimiting the chunks."""
    return _prepare(items, block_size)


@dataclass(frozen=True, slots=True)
class SampledOnDevice:
    """The tokens a step sampled, still on the device: `tokens[rows[request_id]]`."""

    tokens: torch.Tensor
    rows: dict[str, int]


def device_fed_rows(
    decodes: Sequence[ScheduledRequest], previous: SampledOnDevice | None
) -> np.ndarray:
    """[2, k] int64: the decode rows fed from the device, and their rows in `previous`."""
    fed = [(i, item.request.request_id) for i, item in enumerate(decodes) if item.token_on_device]
    if fed and previous is None:
        raise RuntimeError("a decode feeds a device token, but no step sampled it")
    pairs = [(i, previous.rows[rid]) for i, rid in fed] if previous is not None else []
    return np.array(pairs, dtype=np.int64).reshape(-1, 2).T.copy()


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

    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        return to_device(values, self.device)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, previous: SampledOnDevice | None = None
    ) -> tuple[torch.Tensor, list[Request]]:
        """Queue one step. Returns logits [n, vocab] and the n requests that sample a token.
        `previous`: the tokens of the step before, for the decodes fed from the device."""
        dec = prepare_decode(out.decodes, self.block_size)
        fed = device_fed_rows(out.decodes, previous)
        sampled = previous.tokens if previous is not None else None
        graphs = self.decode_graphs
        if graphs is not None and not out.prefills and len(out.decodes) <= graphs.max_batch_size:
            hidden = graphs.run(
                dec.input_ids, dec.positions, dec.slot_mapping, dec.block_tables, dec.seq_lens,
                (fed, sampled) if sampled is not None else None,
            )  # fmt: skip
            return self._logits(hidden, out, 0, [])
        pre = prepare_prefill(out.prefills, self.block_size)
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(np.concatenate((dec.slot_mapping, pre.slot_mapping))),
            num_decode_tokens=dec.num_tokens,
            decode_block_tables=self._tensor(dec.block_tables),
            decode_seq_lens=self._tensor(dec.seq_lens),
            prefill_block_tables=self._tensor(pre.block_tables),
            prefill_query_start_loc=self._tensor(pre.query_start_loc),
            prefill_seq_lens=self._tensor(pre.seq_lens),
            prefill_max_query_len=max((s.num_new_tokens for s in out.prefills), default=0),
            prefill_fresh_runs=fresh_runs(
                [s.num_new_tokens for s in out.prefills],
                [s.num_computed_tokens for s in out.prefills],
            ),
            prefill_has_prefix=any(s.num_computed_tokens for s in out.prefills),
        )
        input_ids = self._tensor(np.concatenate((dec.input_ids, pre.input_ids)))
        if sampled is not None:
            feed_tokens(input_ids, fed, sampled)  # decode rows come first
        positions = self._tensor(np.concatenate((dec.positions, pre.positions)))
        hidden = self.model(input_ids, positions, metadata, self.kv_cache)
        return self._logits(hidden, out, dec.num_tokens, pre.query_start_loc.tolist())

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
        index = self._tensor(np.array(rows, dtype=np.int64))
        logits = self.model.compute_logits(hidden[index])
        return logits, requests
