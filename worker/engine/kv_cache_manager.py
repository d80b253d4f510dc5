"""Block tables per request on top of the block pool.

Guarantees:
- `allocate_slots` is all-or-nothing: it returns the new blocks, or None with no effect at all.
- `get_computed_blocks` is side-effect free on the pool (it only extends the request's own cached
  block hashes) and never returns the block holding the last token: the engine must compute at
  least one token to get logits.
- A block enters the prefix cache only through `cache_blocks`, which the scheduler calls after the
  block's KV has been written (or, for remote KV, after it was fully installed), so a prefix hit
  never reads a half-written block.
- Block tables are append-only while a request holds them; `free` releases them tail first.
- A block pinned by a copy (`pin`, the KV tiers') holds one reference more until `unpin`.
- `take_kv_changes` returns the hashes that entered or left the prefix cache since its last call
  (a hash enters only through `cache_blocks`, so its block's KV is complete by then).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from kvrail.hashing import block_hashes
from kvrail.worker.engine.block_pool import BlockPool, KVBlock, KvChanges
from kvrail.worker.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps request ids to their blocks; prefix hits keyed by `kvrail.hashing` block hashes."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hash_root: bytes,
        enable_prefix_caching: bool = True,
        on_release: Callable[[list[int]], None] | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.hash_root = hash_root
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching, on_release)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # The same tables as block ids, kept beside them: every step asks for each running
        # request's table (rebuilding 256 tables of 70 blocks from the blocks took 1.7 ms of the
        # engine thread a step in the H200 profile, bench/serving/README.md).
        self._block_ids: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._pins: Counter[int] = Counter()  # references held by the KV tiers' copies
        self.newly_cached: list[tuple[int, bytes]] | None = None
        """When a list: (block id, hash) of the blocks `cache_blocks` published since its owner
        last emptied it (the scheduler, for the KV tiers' write-behind)."""

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_blocks - 1

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether `num_tokens` slots fit in the whole pool (ignoring other requests)."""
        return cdiv(num_tokens, self.block_size) <= self.num_usable_blocks

    def block_hashes_of(self, request: Request) -> list[bytes]:
        """The request's full-block hashes, extended incrementally as its tokens grow."""
        known = request.block_hashes
        if len(known) < request.num_tokens // self.block_size:
            parent = known[-1] if known else (request.hash_root or self.hash_root)
            known.extend(
                block_hashes(request.all_token_ids, self.block_size, parent, start=len(known))
            )
        return known

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest cached prefix of `request`, in full blocks, leaving >= 1 token to compute,
        and every prompt token it still has to score (`SamplingParams.prompt_logprobs`: a cached
        block has no logits)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[KVBlock] = []
        for block_hash in self.block_hashes_of(request)[: self.hit_limit(request)]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def hit_limit(self, request: Request) -> int:
        """How many of the request's first blocks a prefix hit may serve, in any tier: all but
        the one holding its last token, and none past a prompt token it has to score
        (`SamplingParams.prompt_logprobs`: a cached block has no logits)."""
        limit = (request.num_tokens - 1) // self.block_size
        if request.sampling_params.prompt_logprobs is not None:
            limit = min(limit, request.num_prompt_scored // self.block_size)
        return limit

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
    ) -> list[KVBlock] | None:
        """Grow the request's block table to cover its first `num_tokens` token slots.

        `computed_blocks` (prefix hits from `get_computed_blocks`) are only accepted for a request
        that holds no blocks yet; they become the head of its table. Returns the newly allocated
        blocks (possibly empty), or None with no partial effect when the pool is short.
        """
        table = self.req_to_blocks.get(request.request_id)
        if computed_blocks and table:
            raise ValueError(f"request {request.request_id} already holds blocks")
        num_held = len(table) if table else 0
        if not computed_blocks and table is not None and num_tokens <= num_held * self.block_size:
            return []  # the common decode step: its slot is in a block it already holds
        num_new = max(cdiv(num_tokens, self.block_size) - num_held - len(computed_blocks), 0)
        # A prefix hit on an unreferenced cached block takes it out of the free queue too.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new + num_revived > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(computed_blocks)
        new_blocks = self.block_pool.allocate(num_new)
        assert new_blocks is not None, "free count checked above"
        table = self.req_to_blocks.setdefault(request.request_id, [])
        table.extend(computed_blocks)
        table.extend(new_blocks)
        ids = self._block_ids.setdefault(request.request_id, [])
        ids.extend(b.block_id for b in computed_blocks)
        ids.extend(b.block_id for b in new_blocks)
        if computed_blocks:
            self._num_cached_blocks[request.request_id] = len(computed_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks within its first `num_computed_tokens` tokens (whose
        KV is written) to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_computed_tokens // self.block_size <= start:
            return  # no block filled up since the last call (most decode steps)
        table = self.req_to_blocks.get(request.request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(table))
        if num_full <= start:
            return
        hashes = self.block_hashes_of(request)
        for i in range(start, num_full):
            cached = self.block_pool.cache_block(table[i], hashes[i])
            if cached and self.newly_cached is not None:
                self.newly_cached.append((table[i].block_id, hashes[i]))
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block the request holds (tail first, so its tail is evicted first)."""
        table = self.req_to_blocks.pop(request.request_id, [])
        self._block_ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free(reversed(table))

    def pin(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each block for a copy that reads or writes it (a KV tier's), so
        it is neither reallocated nor zeroed under the copy."""
        self.block_pool.touch(self.block_pool.blocks[i] for i in block_ids)
        self._pins.update(block_ids)

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Drop `pin`'s references (tail first, as `free`)."""
        self._pins.subtract(block_ids)
        self.block_pool.free(self.block_pool.blocks[i] for i in reversed(block_ids))

    def take_kv_changes(self) -> KvChanges:
        """Net prefix-cache changes since the last call (see `BlockPool.take_changes`)."""
        return self.block_pool.take_changes()

    def cached_block_hashes(self) -> list[bytes]:
        """Every block hash in the prefix cache now."""
        return self.block_pool.cached_hashes()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (a copy)."""
        ids = self._block_ids.get(request_id)
        return ids.copy() if ids is not None else []

    def check_invariants(self) -> None:
        """The pool's invariants, and: no table holds the null block or a block twice, and each
        block's ref_cnt equals the number of tables holding it (no block owned unaccounted)."""
        self.block_pool.check_invariants()
        owners = [0] * self.block_pool.num_blocks
        for request_id, table in self.req_to_blocks.items():
            ids = [b.block_id for b in table]
            assert self._block_ids.get(request_id) == ids, f"request {request_id}'s ids differ"
            assert 0 not in ids, f"request {request_id} holds the null block"
            assert len(set(ids)) == len(ids), f"request {request_id} holds a block twice"
            for block_id in ids:
                owners[block_id] += 1
        assert self._block_ids.keys() == self.req_to_blocks.keys(), "id tables of freed requests"
        for block in self.block_pool.blocks:
            held = owners[block.block_id] + self._pins[block.block_id]
            assert held == block.ref_cnt, (block.block_id, block.ref_cnt)
