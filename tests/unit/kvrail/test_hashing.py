from __future__ import annotations

import pytest

from kvrail.hashing import block_hashes, root_hash

FP = "f" * 64


def test_only_full_blocks_are_hashed() -> None:
    root = root_hash(FP)
    assert len(block_hashes(list(range(47)), 16, root)) == 2
    assert len(block_hashes(list(range(48)), 16, root)) == 3
    assert block_hashes(list(range(15)), 16, root) == []


def test_equal_prefixes_give_equal_hashes_and_a_change_breaks_the_chain_after_it() -> None:
    root = root_hash(FP)
    a = list(range(64))
    b = a[:20] + [999] + a[21:]
    ha, hb = block_hashes(a, 16, root), block_hashes(b, 16, root)
    assert ha[0] == hb[0]
    assert all(x != y for x, y in zip(ha[1:], hb[1:], strict=True))


def test_a_block_hash_depends_on_its_parent_not_only_its_tokens() -> None:
    root = root_hash(FP)
    block = list(range(16))
    h = block_hashes(block + block, 16, root)
    assert h[0] != h[1]


def test_tenant_salt_changes_every_hash() -> None:
    tokens = list(range(64))
    plain = block_hashes(tokens, 16, root_hash(FP))
    salted = block_hashes(tokens, 16, root_hash(FP, tenant_salt="tenant-a"))
    other = block_hashes(tokens, 16, root_hash(FP, tenant_salt="tenant-b"))
    assert not set(plain) & set(salted)
    assert not set(salted) & set(other)


def test_fingerprint_changes_every_hash() -> None:
    tokens = list(range(32))
    assert not set(block_hashes(tokens, 16, root_hash("a" * 64))) & set(
        block_hashes(tokens, 16, root_hash("b" * 64))
    )


def test_incremental_extension_matches_a_full_recompute() -> None:
    root = root_hash(FP)
    tokens = list(range(100))
    full = block_hashes(tokens, 16, root)
    head = block_hashes(tokens[:40], 16, root)
    tail = block_hashes(tokens, 16, head[-1], start=len(head))
    assert head + tail == full


def test_hashes_match_recorded_values() -> None:
    # Recorded once: a change here breaks every cache across a rolling upgrade, so it must come
    # with a HASH_VERSION bump (router and workers of different versions must not match).
    assert root_hash(FP).hex() == "1ce33f32e43824f3dbcb19a954d339d9"
    assert block_hashes(list(range(16)), 16, root_hash(FP))[0].hex() == (
        "177dce53f0d9bee22f7b56be789fed71"
    )


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0, root_hash(FP))
    with pytest.raises(ValueError, match="fingerprint"):
        root_hash("")
