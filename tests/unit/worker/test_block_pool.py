"""Block pool: allocation, reference counts, prefix cache and LRU eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrail.worker.engine.block_pool import BlockPool, KVBlock


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
def test_random_operations_keep_the_pool_partitioned(
    num_blocks: int, ops: list[tuple[str, int]]
) -> None:
    """used + cached + free == total - 1 and no block is owned beyond its ref count, always."""
    pool = BlockPool(num_blocks)
    owned: list[list[KVBlock]] = []  # each entry: the blocks one owner holds
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


def test_cached_hashes_are_journaled_as_stored_in_order_and_taken_once() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(3) or []
    for block, block_hash in zip(blocks, [b"h1", b"h2", b"h3"], strict=True):
        pool.cache_block(block, block_hash)
    changes = pool.take_changes()
    assert changes.stored == (b"h1", b"h2", b"h3") and changes.removed == ()
    assert pool.take_changes().is_empty
    pool.free(blocks)  # freeing keeps the hashes cached: no change
    assert pool.take_changes().is_empty
    assert sorted(pool.cached_hashes()) == [b"h1", b"h2", b"h3"]


def test_a_duplicate_hash_is_not_journaled_twice() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2) or []
    pool.cache_block(a, b"same")
    pool.cache_block(b, b"same")
    assert pool.take_changes().stored == (b"same",)
    pool.free([a, b])


def test_eviction_on_reuse_is_journaled_as_removed() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2) or []
    pool.cache_block(a, b"a")
    pool.cache_block(b, b"b")
    pool.free([b, a])
    pool.take_changes()
    assert pool.allocate(1) is not None  # evicts b, the least recently freed
    changes = pool.take_changes()
    assert changes.stored == () and changes.removed == (b"b",)
    assert pool.cached_hashes() == [b"a"]


def test_reset_journals_only_the_unreferenced_hashes_as_removed() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2) or []
    pool.cache_block(a, b"a")
    pool.cache_block(b, b"b")
    pool.free([a])
    pool.take_changes()
    pool.reset_prefix_cache()
    changes = pool.take_changes()
    assert changes.removed == (b"a",) and changes.stored == ()
    assert pool.cached_hashes() == [b"b"]  # still referenced, still cached
    pool.free([b])
    pool.check_invariants()


def test_a_hash_stored_and_evicted_within_one_interval_cancels_out() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1) or []
    pool.cache_block(a, b"a")
    pool.free([a])
    (again,) = pool.allocate(1) or []  # the only block: evicts b"a"
    pool.cache_block(again, b"b")
    changes = pool.take_changes()
    assert changes.stored == (b"b",) and changes.removed == ()


def test_a_hash_evicted_and_stored_again_within_one_interval_is_no_change() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1) or []
    pool.cache_block(a, b"a")
    pool.free([a])
    pool.take_changes()
    (again,) = pool.allocate(1) or []  # evicts b"a"
    pool.cache_block(again, b"a")  # ... and the same prefix is computed again
    assert pool.take_changes().is_empty
    assert pool.cached_hashes() == [b"a"]


def test_a_disabled_prefix_cache_journals_nothing() -> None:
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.allocate(1) or []
    pool.cache_block(a, b"a")
    assert pool.take_changes().is_empty


JOURNAL_OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "free", "cache", "touch", "reset", "take"]), st.integers(0, 6)
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(2, 10), ops=JOURNAL_OPS)
def test_a_mirror_fed_by_the_journal_always_equals_the_cached_hashes(
    num_blocks: int, ops: list[tuple[str, int]]
) -> None:
    """Applying every batch of net changes to a mirror reproduces the prefix cache exactly, and a
    batch never holds a hash in both lists, a stored hash already cached or a removed one absent."""
    pool = BlockPool(num_blocks)
    mirror: set[bytes] = set()
    owned: list[list[KVBlock]] = []

    def take() -> None:
        changes = pool.take_changes()
        assert not set(changes.stored) & set(changes.removed)
        assert len(set(changes.stored)) == len(changes.stored)
        assert not set(changes.stored) & mirror and set(changes.removed) <= mirror
        mirror.difference_update(changes.removed)
        mirror.update(changes.stored)
        assert mirror == set(pool.cached_hashes())

    for op, n in ops:
        if op == "alloc":
            blocks = pool.allocate(n)
            if blocks is not None:
                owned.append(blocks)
        elif op == "free" and owned:
            pool.free(owned.pop(n % len(owned)))
        elif op == "cache" and owned:
            for i, block in enumerate(owned[n % len(owned)]):
                pool.cache_block(block, bytes([n % 3, i]))  # few hashes: many collisions
        elif op == "touch" and owned:
            hits = [b for b in owned[n % len(owned)] if b.block_hash is not None]
            pool.touch(hits)
            owned.append(hits)
        elif op == "reset":
            pool.reset_prefix_cache()
        elif op == "take":
            take()
        pool.check_invariants()
    take()
