"""CUDA graphs for decode steps and for mixed (prefill, or prefill and decode) steps.

A decode step of n requests replays the decode graph captured for the smallest captured batch
size >= n; a step with prefill tokens, T tokens in all (at most the engine's
`max_mixed_graph_tokens`), replays the mixed graph of the smallest captured token count >= T.
Eagerly, a step of 64 decodes and one 600-token prompt spent 35 ms on the H200 launching kernels
that ran 17 ms, and every decode beside it waited; its graph costs the host a few copies and one
launch.

Inputs live in static buffers; padding is harmless by construction. Decode rows beyond n: slot
-1 (its KV is never written), context length 1 over the null block 0 (never allocated, so never
written), position 0. A mixed graph packs its decode tokens as one-token chunks before the
prefill chunks and attends with the tiled paged kernel (`kvrail.kernels.tile_map`): its grid is
fixed, and tile maps padded with -1 say which programs have work, so one graph serves any mix
of chunks; tokens beyond T have slot -1 and no tile. Inputs are staged in pinned host buffers and
copied without waiting for the device; two sets take turns, and a set is refilled only once the
copies from it ran, so the engine can queue a replay while the previous one runs. Decodes whose
token the previous step sampled take it from the device (`staging.feed_tokens`) after the copies.
The decode kernel sizes its split-K grid from the table width, which is static per graph. The
model's forward has no host synchronisation on CUDA (the Triton launchers only read shapes),
which is what makes it capturable. Larger steps, and steps of more requests than
`max_num_seqs`, run eagerly.

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

from kvrail.kernels.shared_prefix import SharedPrefixes
from kvrail.kernels.tile_map import fill_tile_maps, tile_capacities
from kvrail.worker.engine.graph_inputs import GraphInputs
from kvrail.worker.engine.shared_prefix import PrefixGroups
from kvrail.worker.engine.staging import feed_tokens
from kvrail.worker.engine.step_inputs import PreparedInputs
from kvrail.worker.kv_cache import KVCache
from kvrail.worker.layers.attention import AttentionMetadata
from kvrail.worker.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to max_num_seqs (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


def mixed_token_sizes(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, 256, then multiples of 256, up to `max_tokens` (always included); none
    for 0. Larger steps keep the GPU busy longer than the host takes to launch them eagerly (2,048
    tokens of an 8B model: about 40 ms), and run eagerly, with SDPA for fresh chunks."""
    if max_tokens == 0:
        return []
    top = max_tokens
    sizes = [s for s in (16, 32, 64, 128) if s < top]
    sizes += list(range(256, top, 256))
    return [*sizes, top]


class StepGraphs:
    """The decode graphs and the mixed graphs of one model and KV cache, in one memory pool."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_mixed_tokens: int,
        shared_prefixes: bool = False,
    ) -> None:
        device = kv_cache.tensor.device
        if device.type != "cuda":
            raise ValueError("CUDA graphs need the model and KV cache on a CUDA device")
        self.model = model
        self.kv_cache = kv_cache
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        # a "shared" decode graph of each batch size that can hold a group (two rows at least)
        self.shared_sizes = [b for b in self.batch_sizes if b >= 2] if shared_prefixes else []
        self.token_sizes = mixed_token_sizes(max_mixed_tokens)
        self.max_num_seqs = max_num_seqs
        self.group = model.layout.num_local_heads // model.layout.num_local_kv_heads
        tokens = max(max_num_seqs, max_mixed_tokens)
        self.short_capacity, self.long_capacity = tile_capacities(
            max_mixed_tokens, max_num_seqs, self.group
        )
        self.inputs = GraphInputs(tokens, max_num_seqs, max_blocks_per_seq,
                              self.short_capacity + self.long_capacity, device)  # fmt: skip
        self._no_prefill = (
            torch.zeros((0, 1), dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.zeros(0, dtype=torch.int32, device=device),
        )
        self._no_decode = (
            torch.zeros((0, 1), dtype=torch.int32, device=device),
            torch.zeros(0, dtype=torch.int32, device=device),
        )
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    @property
    def max_mixed_tokens(self) -> int:
        return self.token_sizes[-1] if self.token_sizes else 0

    def _tiles(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The short and long tile maps of the mixed graph of `num_tokens` (views)."""
        short, long = tile_capacities(num_tokens, self.max_num_seqs, self.group)
        tiles = self.inputs.tiles
        return tiles[:, :short], tiles[:, self.short_capacity : self.short_capacity + long]

    def _metadata(self, kind: str, size: int) -> AttentionMetadata:
        ins = self.inputs
        if kind in ("decode", "shared"):
            tables, start_loc, lens = self._no_prefill
            prefix = ins.prefix
            return AttentionMetadata(
                slot_mapping=ins.slot_mapping[:size],
                num_decode_tokens=size,
                decode_block_tables=ins.block_tables[:size],
                decode_seq_lens=ins.seq_lens[:size],
                prefill_block_tables=tables,
                prefill_query_start_loc=start_loc,
                prefill_seq_lens=lens,
                prefill_max_query_len=0,
                decode_prefix=SharedPrefixes(
                    prefix.rows[: size // 2], prefix.tokens[: size // 2], prefix.starts[:size]
                )
                if kind == "shared"
                else None,
            )
        decode_tables, decode_lens = self._no_decode
        return AttentionMetadata(
            slot_mapping=ins.slot_mapping[:size],
            num_decode_tokens=0,
            decode_block_tables=decode_tables,
            decode_seq_lens=decode_lens,
            prefill_block_tables=ins.block_tables,
            prefill_query_start_loc=ins.query_start_loc,
            prefill_seq_lens=ins.seq_lens,
            prefill_max_query_len=size,
            prefill_has_prefix=True,
            prefill_tiles=self._tiles(size),
        )

    def _forward(self, kind: str, size: int) -> torch.Tensor:
        ins = self.inputs
        hidden: torch.Tensor = self.model(
            ins.input_ids[:size], ins.positions[:size], self._metadata(kind, size), self.kv_cache
        )
        return hidden

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph, largest first so the smaller ones reuse its memory pool."""
        max_blocks = self.inputs.block_tables.shape[1]
        warm_eager_kernels(self.model, self.kv_cache, self.max_batch_size, max_blocks)
        started = time.perf_counter()
        pool = None
        keys = [("mixed", t) for t in reversed(self.token_sizes)]
        keys += [("decode", b) for b in reversed(self.batch_sizes)]
        keys += [("shared", b) for b in reversed(self.shared_sizes)]
        for key in keys:
            self._forward(*key)  # warm-up: compiles the kernels for this shape
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self._forward(*key)
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()
        logger.info(
            "cuda graphs captured decode=%d max_batch=%d shared=%d mixed=%d max_tokens=%d "
            "seconds=%.1f", len(self.batch_sizes), self.max_batch_size, len(self.shared_sizes),
            len(self.token_sizes), self.max_mixed_tokens, time.perf_counter() - started,
        )  # fmt: skip

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        fed: tuple[np.ndarray, torch.Tensor] | None = None,
        shared: PrefixGroups | None = None,
    ) -> torch.Tensor:
        """Queue a decode replay for n = len(input_ids) <= max_batch_size decodes; returns hidden
        [n, H]. The inputs are host arrays as `model_runner.prepare_decode` makes them
        (block_tables [n, width]); `fed` = (rows, sampled) as `staging.feed_tokens` takes them;
        `shared`: the rows' shared prefixes, for the "shared" graph (captured with
        `shared_prefixes`)."""
        n = len(input_ids)
        bs = next(s for s in self.batch_sizes if s >= n)
        staging = self.inputs.stage()
        staging.fill_tokens(n, bs, input_ids, positions, slot_mapping)
        staging.fill_sequences(n, bs, seq_lens, [block_tables])
        if shared is not None:
            if bs not in self.shared_sizes:
                raise RuntimeError(f"no shared-prefix decode graph of batch {bs} was captured")
            staging.fill_prefix(n, bs, shared)
        self.inputs.copy(staging, bs, bs, block_tables.shape[1], with_tiles=False,
                         with_prefix=shared is not None)  # fmt: skip
        return self._replay(("shared" if shared is not None else "decode", bs), n, fed)

    def run_mixed(
        self,
        decode: PreparedInputs,
        prefill: PreparedInputs,
        fed: tuple[np.ndarray, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Queue a mixed replay for the decode tokens, then the prefill chunks, T tokens in all
        (<= max_mixed_tokens) of at most max_num_seqs requests; returns hidden [T, H]."""
        nd, n = decode.num_tokens, decode.num_tokens + prefill.num_tokens
        size = next(t for t in self.token_sizes if t >= n)
        num_seqs = nd + len(prefill.seq_lens)
        staging = self.inputs.stage()
        staging.fill_tokens(
            n, size,
            np.concatenate((decode.input_ids, prefill.input_ids)),
            np.concatenate((decode.positions, prefill.positions)),
            np.concatenate((decode.slot_mapping, prefill.slot_mapping)),
        )  # fmt: skip
        tables = [decode.block_tables, prefill.block_tables] if nd else [prefill.block_tables]
        staging.fill_sequences(
            num_seqs, num_seqs, np.concatenate((decode.seq_lens, prefill.seq_lens)), tables
        )
        start_loc = staging.start_loc.numpy()
        start_loc[: nd + 1] = np.arange(nd + 1)
        start_loc[nd + 1 : num_seqs + 1] = nd + prefill.query_start_loc[1:]
        short, long = self._tiles(size)
        host_tiles = staging.tiles.numpy()
        fill_tile_maps(
            np.diff(start_loc[: num_seqs + 1]),
            host_tiles[:, : short.shape[1]],
            host_tiles[:, self.short_capacity : self.short_capacity + long.shape[1]],
            self.group,
        )
        width = max(t.shape[1] for t in tables)
        self.inputs.copy(staging, size, num_seqs, width, with_tiles=True)
        return self._replay(("mixed", size), n, fed)

    def _replay(
        self, key: tuple[str, int], n: int, fed: tuple[np.ndarray, torch.Tensor] | None
    ) -> torch.Tensor:
        if fed is not None:
            feed_tokens(self.inputs.input_ids, *fed)
        self.graphs[key].replay()
        return self.outputs[key][:n]


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
