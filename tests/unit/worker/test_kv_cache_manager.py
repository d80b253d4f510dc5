"""KV cache manager: all-or-nothing slots, prefix hits only after KV is written, free."""

from __future__ import annotations

from kvrail.worker.engine.kv_cache_manager import KVCacheManager
from kvrail.worker.testing import TEST_HASH_ROOT, make_request


def manager(num_blocks: int = 9, block_size: int = 4) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, TEST_HASH_ROOT)


def test_allocate_slots_returns_none_without_partial_effect() -> None:
    kv = manager(num_blocks=5)
    first, second = make_request(8), make_request(12)
    assert kv.allocate_slots(first, 8) is not None
    assert kv.allocate_slots(second, 12) is None
    assert kv.get_block_ids(second.request_id) == []
    assert kv.block_pool.num_free_blocks == 2
    kv.check_invariants()


def test_allocate_slots_only_adds_blocks_the_new_tokens_need() -> None:
    kv = manager()
    request = make_request(5)
    assert len(kv.allocate_slots(request, 5) or []) == 2
    assert kv.allocate_slots(request, 8) == []
    assert len(kv.allocate_slots(request, 9) or []) == 1
    kv.free(request)
    kv.check_invariants()


def test_prefix_hit_needs_the_blocks_cached_after_their_kv_is_written() -> None:
    kv = manager()
    prompt = list(range(100, 110))
    first = make_request(prompt_token_ids=prompt)
    kv.allocate_slots(first, 10)
    second = make_request(prompt_token_ids=prompt)
    assert kv.get_computed_blocks(second) == []  # allocated but not yet written
    kv.cache_blocks(first, 10)
    hits = kv.get_computed_blocks(second)
    assert [b.block_id for b in hits] == kv.get_block_ids(first.request_id)[:2]
    kv.allocate_slots(second, 10, hits)
    assert [b.ref_cnt for b in hits] == [2, 2]
    kv.free(first)
    kv.free(second)
    kv.check_invariants()
    assert kv.block_pool.counts() == (0, 2, 6)


def test_full_prompt_hit_still_leaves_the_last_token_to_compute() -> None:
    kv = manager()
    prompt = list(range(200, 208))
    first = make_request(prompt_token_ids=prompt)
    kv.allocate_slots(first, 8)
    kv.cache_blocks(first, 8)
    kv.free(first)
    hits = kv.get_computed_blocks(make_request(prompt_token_ids=prompt))
    assert len(hits) == 1


def test_hit_on_unreferenced_cached_blocks_counts_them_against_free_space() -> None:
    kv = manager(num_blocks=4)
    prompt = list(range(300, 309))
    first = make_request(prompt_token_ids=prompt)
    kv.allocate_slots(first, 9)
    kv.cache_blocks(first, 9)
    kv.free(first)
    second = make_request(prompt_token_ids=prompt)
    hits = kv.get_computed_blocks(second)
    assert len(hits) == 2
    # 2 revived + 2 new > 3 usable: refused, nothing changed.
    assert kv.allocate_slots(second, 13, hits) is None
    assert kv.block_pool.counts() == (0, 2, 1)
    assert kv.allocate_slots(second, 12, hits) == [
        kv.block_pool.blocks[kv.get_block_ids(second.request_id)[2]]
    ]
    kv.free(second)
    kv.check_invariants()


def test_different_hash_roots_never_share_prefix_blocks() -> None:
    kv = manager()
    other = KVCacheManager(9, 4, b"another-root-----")
    prompt = list(range(400, 409))
    assert kv.block_hashes_of(make_request(prompt_token_ids=prompt)) != other.block_hashes_of(
        make_request(prompt_token_ids=prompt)
    )
