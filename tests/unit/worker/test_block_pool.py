"""Block pool: allocation, reference counts, prefix cache and LRU eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrail.worker.engine.block_pool import BlockPool


def test_allocate_returns_none_without_partial_effect_when_short() -> None:
    pool = BlockPool(5)
    assert pool.allocate(4) is not None
    assert pool.allocate(1) is None
    assert pool.num_free_blocks == 0
    pool.check_invariants()


def test_null_block_is_never_allocated() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert blocks is not None
    assert sorted(b.block_id for b in blocks) == [1, 2, 3]


def test_cached_block_survives_free_and_is_found_by_hash() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1) or []
    pool.cache_block(block, b"h1")
    pool.free([block])
    assert pool.get_cached_block(b"h1") is block
    assert pool.counts() == (0, 1, 2)
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.check_invariants()


def test_eviction_takes_least_recently_freed_cached_block_first() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2) or []
    pool.cache_block(a, b"a")
    pool.cache_block(b, b"b")
    pool.free([b, a])
    (reused,) = pool.allocate(1) or []
    assert reused is b
    assert pool.get_cached_block(b"b") is None
    assert pool.get_cached_block(b"a") is a
    pool.check_invariants()


def test_second_block_with_a_known_hash_stays_uncached() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2) or []
    pool.cache_block(a, b"same")
    pool.cache_block(b, b"same")
    assert pool.get_cached_block(b"same") is a and b.block_hash is None
    pool.free([a, b])
    pool.check_invariants()


OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "cache", "touch"]), st.integers(0, 6)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(2, 12), ops=OPS)
def test_random_operations_keep_the_pool_partitioned(num_blocks: int, ops: list) -> None:
    """used + cached + free == total - 1 and no block is owned beyond its ref count, always."""
    pool = BlockPool(num_blocks)
    owned: list[list] = []  # each entry: the blocks one owner holds
    for op, n in ops:
        if op == "alloc":
            blocks = pool.allocate(n)
            if blocks is None:
                assert n > pool.num_free_blocks
            else:
                owned.append(blocks)
        elif op == "free" and owned:
            pool.free(owned.pop(n % len(owned)))
        elif op == "cache" and owned:
            blocks = owned[n % len(owned)]
            for i, block in enumerate(blocks):
                pool.cache_block(block, bytes([n, i]))
        elif op == "touch" and owned:
            hits = [b for b in owned[n % len(owned)] if b.block_hash is not None]
            pool.touch(hits)
            owned.append(hits)
        pool.check_invariants()
        references: dict[int, int] = {}
        for blocks in owned:
            assert len({b.block_id for b in blocks}) == len(blocks), "a block owned twice"
            for block in blocks:
                references[block.block_id] = references.get(block.block_id, 0) + 1
        for block in pool.blocks:
            assert block.ref_cnt == references.get(block.block_id, 0)
    for blocks in owned:
        pool.free(blocks)
    used, cached, free = pool.counts()
    assert used == 0 and cached + free == num_blocks - 1
