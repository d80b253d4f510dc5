"""Turns a SchedulerOutput into model inputs, runs the model and returns the logits to sample.

Decode and prefill inputs are prepared separately (`prepare_decode`, `prepare_prefill`) and packed
decode tokens first, matching `AttentionMetadata`. Block tables are padded with the null block 0.
Preparation walks the requests once in Python and computes every per-token value with numpy, so
a step's host work grows with its requests only by that walk. Inputs reach the device through
asynchronous copies (`staging`), and a decode whose token the previous step sampled takes it from
that step's tensor on the device: preparing and queueing a step never waits for the one running.

Preparing (`prepare_step`, host arrays only) and running (`ModelRunner.run`) are apart, so that
with tensor parallelism rank 0 prepares a step once and every rank runs the very same
`StepInputs`: rank 0 hands them to the other ranks (`RankPeers`) before running them itself. The
LM head's vocabulary shards are gathered on rank 0, which samples; the sampled tokens are then
broadcast (`share_tokens`) so every rank can feed them to the next step on its own device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import chain

import numpy as np
import torch

from kvrail.kernels.shared_prefix import SharedPrefixes
from kvrail.worker.engine.cuda_graph import StepGraphs
from kvrail.worker.engine.layer_sinks import LayerSinks
from kvrail.worker.engine.rank_commands import RankPeers
from kvrail.worker.engine.request import Request
from kvrail.worker.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from kvrail.worker.engine.scores import (
    SCORE_SLICE_ROWS,
    PromptScores,
    ScoredSpan,
    ScoreRows,
    score_rows,
    token_scores,
)
from kvrail.worker.engine.shared_prefix import PrefixGroups, find_shared_prefixes
from kvrail.worker.engine.staging import feed_tokens, to_device
from kvrail.worker.engine.step_inputs import GraphKind, PreparedInputs, StepInputs
from kvrail.worker.kv_cache import KVCache
from kvrail.worker.layers.attention import AttentionMetadata, fresh_runs
from kvrail.worker.models.llama import LlamaForCausalLM

__all__ = [
    "GraphLimits", "ModelRunner", "PreparedInputs", "SampledOnDevice", "StepInputs",
    "choose_graph", "prepare_step",
]  # fmt: skip


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


Scored = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""Prompt score rows' target entries [m], top-k ids [m, k] and log-probabilities [m, k]."""
GraphLimits = tuple[int, int, int]
"""(largest decode graph's batch, largest mixed graph's tokens, most requests in a mixed graph);
0 where there is none."""


def prepare_step(
    out: SchedulerOutput,
    block_size: int,
    previous: SampledOnDevice | None,
    graphs: GraphLimits = (0, 0, 0),
    shared_prefixes: bool = False,
) -> tuple[StepInputs, list[Request], list[ScoredSpan]]:
    """A scheduled step's inputs (host arrays), the requests its sampled rows belong to, in
    row order, and the requests its prompt score rows belong to (`scores.score_rows`).
    `graphs`: the largest captured decode batch, mixed step (tokens) and number of requests in a
    mixed step (0: none); see `choose_graph`. `shared_prefixes`: group the decode rows that share
    their first blocks (`kvrail.worker.engine.shared_prefix`), except in a mixed graph, whose
    tiled kernel attends decodes as one-token chunks."""
    dec = prepare_decode(out.decodes, block_size)
    fed = device_fed_rows(out.decodes, previous)
    pre = prepare_prefill(out.prefills, block_size)
    graph = choose_graph(len(out.decodes), len(out.prefills), dec.num_tokens + pre.num_tokens,
                         graphs)  # fmt: skip
    shared = None
    if shared_prefixes and graph != "mixed":
        shared = find_shared_prefixes(dec.block_tables, dec.seq_lens, block_size)
        if shared is not None and graph == "decode":
            graph = "shared"
    rows: list[int] = []
    requests: list[Request] = []
    for i, item in enumerate(out.decodes):
        if item.samples:
            rows.append(i)
            requests.append(item.request)
    query_start_loc = pre.query_start_loc.tolist()
    for j, item in enumerate(out.prefills):
        if item.samples:
            rows.append(dec.num_tokens + query_start_loc[j + 1] - 1)
            requests.append(item.request)
    prefix = rows == list(range(len(rows)))  # every decode samples: a view, no index tensor
    scores: ScoreRows | None = None
    spans: list[ScoredSpan] = []
    if out.scores_prompt:  # no walk over the step's requests for the steps of those that ask not
        chunks = [(r, i.num_computed_tokens, i.request, 1) for r, i in enumerate(out.decodes)]
        chunks += [
            (dec.num_tokens + query_start_loc[j], i.num_computed_tokens, i.request,
             i.num_new_tokens)
            for j, i in enumerate(out.prefills)
        ]  # fmt: skip
        scores, spans = score_rows(chunks)
    step = StepInputs(
        decode=dec, prefill=pre, fed=fed,
        logit_rows=None if prefix else np.array(rows, dtype=np.int64), num_sampled=len(rows),
        prefill_max_query_len=max((s.num_new_tokens for s in out.prefills), default=0),
        prefill_fresh_runs=fresh_runs(
            [s.num_new_tokens for s in out.prefills],
            [s.num_computed_tokens for s in out.prefills],
        ),
        prefill_has_prefix=any(s.num_computed_tokens for s in out.prefills),
        graph=graph, scores=scores, shared=shared,
    )  # fmt: skip
    return step, requests, spans


def choose_graph(
    num_decodes: int, num_prefills: int, num_tokens: int, limits: GraphLimits
) -> GraphKind:
    """The captured graph a step replays: "decode" for decodes only, up to the largest decode
    graph; "mixed" for a step with prefill chunks that fits the largest mixed graph; else ""
    (eager)."""
    max_batch, max_tokens, max_seqs = limits
    if not num_prefills:
        return "decode" if 0 < num_decodes <= max_batch else ""
    fits = num_tokens <= max_tokens and num_decodes + num_prefills <= max_seqs
    return "mixed" if fits else ""


class ModelRunner:
    """Runs steps on one rank's model shard and KV shard. With `peers` (rank 0 of several), a
    step is handed to the other ranks before it runs here; see the module docstring."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        device: torch.device,
        graphs: StepGraphs | None = None,
        peers: RankPeers | None = None,
        shared_prefixes: bool = False,
    ) -> None:
        self.model = model
        self.group = model.group
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        self.graphs = graphs
        self.peers = peers
        self.shared_prefixes = shared_prefixes  # see prepare_step
        self.layer_sinks = LayerSinks()  # layer-wise KV transfers (the prefill role's)
        if self.group.size > 1 and self.group.is_first and peers is None:
            raise ValueError("rank 0 of a tensor-parallel group needs its peers")

    @property
    def graph_limits(self) -> GraphLimits:
        g = self.graphs
        return (g.max_batch_size, g.max_mixed_tokens, g.max_num_seqs) if g else (0, 0, 0)

    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        return to_device(values, self.device)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, previous: SampledOnDevice | None = None
    ) -> tuple[torch.Tensor, list[Request], PromptScores | None]:
        """Queue one step (rank 0). Returns logits [n, vocab], the n requests that sample a
        token, and the prompt scores it computed (None: no request in it asked). `previous`: the
        tokens of the step before, for the decodes fed from the device."""
        step, requests, spans = prepare_step(
            out, self.block_size, previous, self.graph_limits, self.shared_prefixes
        )
        hook = (
            self.layer_sinks.hook_for(out, self.device.type == "cuda") if self.layer_sinks else None
        )
        if hook is not None:  # a sink hears each layer: no graph (docs/layerwise.md)
            step = replace(step, graph="")
        if self.peers is not None:
            self.peers.send(step)
        logits, scored = self.run(step, previous.tokens if previous is not None else None, hook)
        assert logits is not None, "rank 0 gets the logits"
        if scored is None:
            return logits, requests, None
        assert step.scores is not None
        return logits, requests, PromptScores(spans, step.scores.targets, *scored)

    @torch.inference_mode()
    def run(
        self,
        step: StepInputs,
        sampled: torch.Tensor | None,
        after_layer: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor | None, Scored | None]:
        """Run one step on this rank; `sampled`: the previous step's tokens on this device (for
        `step.fed`); `after_layer`: called after each layer of an eager step (`LayerSinks`).
        Returns the logits of the sampled rows [n, vocab] and the prompt scores of `step.scores`
        (`_score`) on rank 0, None on the others (their vocabulary shards went to rank 0)."""
        dec, pre = step.decode, step.prefill
        fed = step.fed
        feed = (fed, sampled) if sampled is not None else None
        graphs = self.graphs
        assert graphs is not None or not step.graph, "rank 0 decided on a graph this rank lacks"
        if step.graph in ("decode", "shared") and graphs is not None:
            hidden = graphs.run(
                dec.input_ids, dec.positions, dec.slot_mapping, dec.block_tables, dec.seq_lens,
                feed, step.shared,
            )  # fmt: skip
        elif step.graph == "mixed" and graphs is not None:
            hidden = graphs.run_mixed(dec, pre, feed)
        else:
            metadata = AttentionMetadata(
                slot_mapping=self._tensor(np.concatenate((dec.slot_mapping, pre.slot_mapping))),
                num_decode_tokens=dec.num_tokens,
                decode_block_tables=self._tensor(dec.block_tables),
                decode_seq_lens=self._tensor(dec.seq_lens),
                prefill_block_tables=self._tensor(pre.block_tables),
                prefill_query_start_loc=self._tensor(pre.query_start_loc),
                prefill_seq_lens=self._tensor(pre.seq_lens),
                prefill_max_query_len=step.prefill_max_query_len,
                prefill_fresh_runs=step.prefill_fresh_runs,
                prefill_has_prefix=step.prefill_has_prefix,
                decode_prefix=self._prefix(step.shared),
            )
            input_ids = self._tensor(np.concatenate((dec.input_ids, pre.input_ids)))
            if sampled is not None:
                feed_tokens(input_ids, fed, sampled)  # decode rows come first
            positions = self._tensor(np.concatenate((dec.positions, pre.positions)))
            hidden = self.model(input_ids, positions, metadata, self.kv_cache, after_layer)
        if step.logit_rows is None:
            rows = hidden[: step.num_sampled]
        else:
            rows = hidden[self._tensor(step.logit_rows)]
        logits = self._gather_logits(self.model.compute_logits(rows))
        return logits, self._score(hidden, step.scores) if step.scores is not None else None

    def _prefix(self, shared: PrefixGroups | None) -> SharedPrefixes | None:
        if shared is None:
            return None
        arrays = (shared.rows, shared.tokens, shared.starts)
        return SharedPrefixes(*(self._tensor(a) for a in arrays))

    def _score(self, hidden: torch.Tensor, scores: ScoreRows) -> Scored | None:
        """Each score row's target entry and top-k, from its logits `SCORE_SLICE_ROWS` rows at a
        time (every rank joins each slice's gather); on rank 0, None on the others."""
        parts = []
        for start in range(0, scores.rows.shape[0], SCORE_SLICE_ROWS):
            rows = hidden[self._tensor(scores.rows[start : start + SCORE_SLICE_ROWS])]
            logits = self._gather_logits(self.model.compute_logits(rows))
            if logits is not None:
                targets = self._tensor(scores.targets[start : start + SCORE_SLICE_ROWS])
                parts.append(token_scores(logits, targets, scores.k))
        if not parts:
            return None
        chosen, top_ids, top_logprobs = (torch.cat(p) for p in zip(*parts, strict=True))
        return chosen, top_ids, top_logprobs

    def _gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        if self.group.size == 1:
            return local
        vocab = self.model.shape.vocab_size
        if local.shape[0] == 0:  # nothing samples: no collective (every rank knows it)
            return local.new_empty((0, vocab)) if self.group.is_first else None
        full = self.group.gather_to_first(local)
        return None if full is None else full[:, :vocab]

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rank 0's sampled tokens [n] on every rank (rank 0 passes them, the others a buffer
        of the step's `num_sampled` int64 entries); no collective when n is 0."""
        if self.group.size == 1 or tokens.shape[0] == 0:
            return tokens
        return self.group.broadcast_from_first(tokens)
