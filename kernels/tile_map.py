"""Tile maps for `kvrail.kernels.prefill_attention.tiled_prefill_attention` (host side, numpy).

A tile map lists, for each program of one launch, the sequence it attends for (-1: none) and
which of that sequence's query tiles it takes. The launch's grid is the map's capacity, fixed
when a CUDA graph is captured; a step fills the map and pads it with -1, so chunks of any sizes
run in the same graph. A tile's rows are query tokens times the `group` query heads of one KV
head (they share its K and V loads): a short tile has `SHORT_BLOCK_M` rows, a long one
`LONG_BLOCK_M`, so `tile_tokens` tokens each. Chunks shorter than a long tile (decode tokens are
one-token chunks) take short tiles: with Llama-3-8B's 4 query heads per KV head a decode token
fills 4 of a short tile's 16 rows.
"""

from __future__ import annotations

import numpy as np

SHORT_BLOCK_M = 16
LONG_BLOCK_M = 64


def tile_rows(group: int) -> tuple[int, int]:
    """Rows of a short and of a long tile for `group` query heads per KV head (at least one
    token's worth: a power of two >= group)."""
    least = 1 << (group - 1).bit_length()
    return max(SHORT_BLOCK_M, least), max(LONG_BLOCK_M, least)


def tile_tokens(group: int) -> tuple[int, int]:
    """Query tokens of a short and of a long tile."""
    short, long = tile_rows(group)
    return short // group, long // group


def tile_capacities(max_num_tokens: int, max_num_seqs: int, group: int) -> tuple[int, int]:
    """Entries the short and the long map need at most for a step of `max_num_tokens` tokens in
    at most `max_num_seqs` chunks: every chunk wastes at most one partial tile."""
    short_q, long_q = tile_tokens(group)
    short = min(max_num_seqs, max_num_tokens) + max_num_tokens // short_q
    long = 2 * (max_num_tokens // long_q)
    return short, long


def fill_tile_maps(query_lens: np.ndarray, short: np.ndarray, long: np.ndarray, group: int) -> None:
    """Fill `short` and `long` ([2, capacity] int32) for chunks of `query_lens` tokens, in
    sequence order, padding with -1. Raises ValueError if a map is too small (a bug)."""
    short_q, long_q = tile_tokens(group)
    for out, block_q, chosen in (
        (short, short_q, (query_lens > 0) & (query_lens < long_q)),
        (long, long_q, query_lens >= long_q),
    ):
        seqs = np.flatnonzero(chosen)
        counts = -(-query_lens[seqs] // block_q)
        total = int(counts.sum())
        if total > out.shape[1]:
            raise ValueError(f"{total} tiles of {block_q} tokens overflow a map of {out.shape[1]}")
        out[0, :total] = np.repeat(seqs, counts)
        # each tile's index within its sequence: 0..count-1 per sequence
        firsts = np.cumsum(counts) - counts
        out[1, :total] = np.arange(total) - np.repeat(firsts, counts)
        out[:, total:] = -1
