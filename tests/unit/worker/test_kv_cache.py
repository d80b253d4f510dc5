"""The KV region layout: one tensor, and block b is exactly bytes [b, b+1) * block_bytes."""

from __future__ import annotations

import pytest
import torch

from kvrail.kernels import reference
from kvrail.worker.kv_cache import KVCache


def test_a_block_written_through_layer_views_changes_only_its_byte_range() -> None:
    cache = KVCache.allocate(
        6, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32
    )
    assert cache.block_bytes == 2 * 3 * 4 * 2 * 8 * 4
    for layer in range(3):
        k_cache, v_cache = cache.layer(layer)
        slots = torch.tensor([4 * 4 + 1, 4 * 4 + 3])  # block 4, offsets 1 and 3
        reference.write_kv(torch.ones(2, 2, 8), torch.ones(2, 2, 8), k_cache, v_cache, slots)
    raw = cache.tensor.view(torch.uint8).reshape(-1)
    start, end = cache.block_byte_range(4)
    assert raw[:start].eq(0).all() and raw[end:].eq(0).all()
    assert (
        raw[start:end].view(torch.float32).ne(0).sum() == 3 * 2 * 2 * 2 * 8
    )  # layers,K/V,tok,heads,D
    packed = reference.gather_blocks(cache.tensor, torch.tensor([4]))
    assert torch.equal(packed.view(torch.uint8).reshape(-1), raw[start:end])


def test_block_byte_range_rejects_a_block_outside_the_region() -> None:
    cache = KVCache.allocate(2, 1, 4, 1, 8, torch.float32)
    with pytest.raises(IndexError):
        cache.block_byte_range(2)


def test_num_blocks_for_bytes_is_the_floor_of_the_budget() -> None:
    per_block = 2 * 32 * 16 * 8 * 128 * 2
    assert KVCache.num_blocks_for_bytes(10 * per_block + 1, 32, 16, 8, 128, torch.bfloat16) == 10
