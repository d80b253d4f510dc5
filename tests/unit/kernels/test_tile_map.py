"""Tile maps of the tiled paged prefill kernel: every query row in exactly one tile, of the right
size, padded with -1; capacities hold the worst step; an overflow is refused."""

from __future__ import annotations

import numpy as np
import pytest

from kvrail.kernels.tile_map import fill_tile_maps, tile_capacities, tile_rows, tile_tokens


def test_a_tile_holds_whole_tokens_of_every_query_head_of_its_kv_head() -> None:
    assert tile_tokens(4) == (4, 16)  # Llama-3-8B: a decode token fills 4 of 16 rows
    assert tile_tokens(1) == (16, 64)
    assert tile_tokens(3) == (5, 21)  # 15 of 16 rows, 63 of 64
    assert tile_rows(32) == (32, 64) and tile_tokens(32) == (1, 2)


def _covered(
    query_lens: list[int], short: np.ndarray, long: np.ndarray, group: int
) -> list[list[int]]:
    """For each sequence, how many times each of its query tokens is covered by a tile."""
    hits = [[0] * q for q in query_lens]
    short_q, long_q = tile_tokens(group)
    for tiles, block_q in ((short, short_q), (long, long_q)):
        for seq, tile in tiles.T:
            if seq < 0:
                assert tile < 0, "a padding entry names a tile"
                continue
            assert (query_lens[seq] >= long_q) == (block_q == long_q)
            rows = range(tile * block_q, min((tile + 1) * block_q, query_lens[seq]))
            assert rows, "a tile past its sequence's queries"
            for row in rows:
                hits[seq][row] += 1
    return hits


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize(
    "query_lens",
    [[1] * 5 + [600], [0, 1, 63, 64, 65, 200], [2048], [1] * 256, [15, 16, 17, 0]],
)
def test_every_query_token_is_in_exactly_one_tile(query_lens: list[int], group: int) -> None:
    tokens = max(sum(query_lens), 1)
    short_cap, long_cap = tile_capacities(tokens, len(query_lens), group)
    short = np.zeros((2, short_cap), np.int32)
    long = np.zeros((2, long_cap), np.int32)
    fill_tile_maps(np.array(query_lens), short, long, group)
    assert all(hits == 1 for seq in _covered(query_lens, short, long, group) for hits in seq)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_the_capacities_hold_the_worst_step_of_their_size(group: int) -> None:
    rng = np.random.default_rng(group)
    for _ in range(200):
        seqs = int(rng.integers(1, 40))
        lens = rng.multinomial(int(rng.integers(seqs, 600)), np.ones(seqs) / seqs)
        short_cap, long_cap = tile_capacities(int(lens.sum()), seqs, group)
        short, long = np.zeros((2, short_cap), np.int32), np.zeros((2, long_cap), np.int32)
        fill_tile_maps(lens, short, long, group)


def test_a_map_too_small_is_refused() -> None:
    with pytest.raises(ValueError, match="overflow"):
        fill_tile_maps(
            np.array([40, 40]), np.zeros((2, 4), np.int32), np.zeros((2, 4), np.int32), 1
        )
