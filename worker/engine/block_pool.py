"""The pool of KV blocks: free list, reference counts and the prefix cache.

Block 0 is the null block: never handed out, it pads block tables. Every other block is in exactly
one of three sets:

- used: `ref_cnt > 0`, owned by that many requests;
- cached: `ref_cnt == 0` with a block hash, reusable by a prefix hit until evicted;
- free: `ref_cnt == 0` without a hash.

Cached and free blocks share one queue in LRU order (least recently freed first). Allocation takes
from its head and evicts a cached block's hash when it reuses it, so the prefix cache never costs
capacity. `check_invariants()` proves the three sets partition the pool.

Every hash entering or leaving the prefix cache is journaled; `take_changes()` returns the net
changes since its last call (the source of the worker's KV events, see
`kvrail.worker.roles.kv_events`). The journal holds at most one entry per hash, so it stays bounded
even if nobody takes it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvrail.messages import KvTier


@dataclass(frozen=True, slots=True)
class KvChanges:
    """Net prefix-cache changes over some interval: hashes that entered (`stored`) and left
    (`removed`) it, each list in the order the changes happened. No hash is in both lists (one
    stored and removed again within the interval appears in neither), so applying the lists in
    either order to the cache's state at the interval's start gives its state at the end."""

    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    tier: KvTier = "gpu"
    """The tier the changes are of (the GPU's prefix cache, or a lower tier, see
    `kvrail.worker.engine.kv_tiers`)."""

    @property
    def is_empty(self) -> bool:
        return not self.stored and not self.removed


class ChangeJournal:
    """The net changes of one tier's set of hashes since the last `take`: at most one entry per
    hash (True = stored, absent at the interval's start; False = removed, present at its start),
    so it stays bounded by the hashes the tier can hold even if nobody takes it."""

    def __init__(self, tier: KvTier) -> None:
        self.tier: KvTier = tier
        self._changes: dict[bytes, bool] = {}

    def record(self, block_hash: bytes, *, stored: bool) -> None:
        if self._changes.get(block_hash) is (not stored):
            del self._changes[block_hash]  # the opposite change in this interval: net nothing
        else:
            self._changes[block_hash] = stored

    def take(self) -> KvChanges:
        """The net changes since the last call (see `KvChanges`); resets the journal."""
        if not self._changes:
            return KvChanges(tier=self.tier)
        changes = KvChanges(
            stored=tuple(h for h, is_stored in self._changes.items() if is_stored),
            removed=tuple(h for h, is_stored in self._changes.items() if not is_stored),
            tier=self.tier,
        )
        self._changes = {}
        return changes


@dataclass(eq=False, slots=True)
class KVBlock:
    """One block of `block_size` token slots in the KV cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    released_at: int = 0
    """The pool's `epoch` when its last reference went (see `BlockPool.epoch`)."""


class BlockPool:
    """Blocks 1..num_blocks-1 for requests; block 0 is the null block."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        on_release: Callable[[list[int]], None] | None = None,
    ) -> None:
        """`on_release`, when given, is called with the ids of the blocks each `free()` released
        (their last reference gone), at once, and such blocks leave the prefix cache: the
        owner zeroes them (`security.zeroKVOnRelease`), so nothing of a finished request stays
        readable. Prefix reuse then happens only between requests that overlap in time."""
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (1 null + 1), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.on_release = on_release
        self.epoch = 0
        """Stamped on each block as it is released; the KV tiers advance it once per schedule
        (`TierLoads.begin_schedule`), to tell how long ago a block a load writes was last used."""
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[bytes, KVBlock] = {}
        self._changes = ChangeJournal("gpu")

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus cached-unreferenced ones."""
        return len(self._free)

    def usage(self) -> float:
        """Fraction of allocatable blocks referenced by requests."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        """The block holding `block_hash`'s KV, if cached. Side-effect free."""
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVBlock] | None:
        """Take `num_blocks` blocks with ref_cnt 1, or return None with no effect."""
        if num_blocks > len(self._free):
            return None
        taken = []
        for _ in range(num_blocks):
            block_id, _none = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._uncache(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each block (a prefix hit); unreferenced ones leave the free queue."""
        for block in blocks:
            assert block.block_id != 0, "the null block is never referenced"
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in order; blocks reaching zero join the queue's
        tail (so pass a request's blocks tail first to evict its last blocks first)."""
        released = []
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than referenced"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                block.released_at = self.epoch
                released.append(block.block_id)
                if self.on_release is not None and block.block_hash is not None:
                    self._uncache(block)
        if self.on_release is not None and released:
            self.on_release(released)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> bool:
        """Record that `block` (full, its KV written) holds `block_hash`; whether it did. If
        another block already holds that hash, this one stays uncached (it is freed as a plain
        block later)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        assert block.ref_cnt > 0, "only a referenced, just-written block can be cached"
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self._record(block_hash, stored=True)
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached hash (referenced blocks keep theirs, so this is
        journaled as individual removals, not as a clear)."""
        for block in list(self._cached.values()):
            if block.ref_cnt == 0:
                self._uncache(block)

    def _uncache(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        del self._cached[block_hash]
        block.block_hash = None
        self._record(block_hash, stored=False)

    def _record(self, block_hash: bytes, *, stored: bool) -> None:
        self._changes.record(block_hash, stored=stored)

    def take_changes(self) -> KvChanges:
        """The net prefix-cache changes since the last call (see `KvChanges`); resets the
        journal."""
        return self._changes.take()

    def cached_hashes(self) -> list[bytes]:
        """Every hash in the prefix cache now (referenced blocks included)."""
        return list(self._cached)

    def counts(self) -> tuple[int, int, int]:
        """(used, cached-unreferenced, free) block counts, excluding the null block."""
        used = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        cached = sum(1 for b in self._cached.values() if b.ref_cnt == 0)
        return used, cached, len(self._free) - cached

    def check_invariants(self) -> None:
        """Raise AssertionError unless used + cached + free == total - 1 and the sets agree."""
        used, cached, free = self.counts()
        assert used + cached + free == self.num_blocks - 1, (used, cached, free)
        assert self.null_block.ref_cnt == 0 and 0 not in self._free
        assert self.null_block.block_hash is None
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in self._free), block.block_id
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, block.block_id
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash
