"""The scheduler's side of the KV tiers: prefix hits below the GPU, loads, write-behind.

A waiting request whose prefix continues, past its GPU hits, in a lower tier is admitted with
blocks for all its tokens but waits (`WAITING_FOR_TIER_KV`) while those blocks load; admission
goes on with the requests behind it. Each schedule first takes the loads that finished: such a
request runs from the first block that did not load (a block that failed its checksum is
computed again, see `kv_tiers`). Every block that joins the GPU prefix cache is handed to the
tiers' write-behind.

Time to first token. A request joins a step only once its load is done and checked (the step
never waits for it, and no token is computed over a block that may fail its checksum), so what
counts is how soon the load runs and how soon a schedule sees it done:
- where its copies start. With scheduling ahead, the step scheduled before the admission is
  still queued on the device; a load ordered after it would start only when that step ends, and
  miss the schedule right after it. But device work touches a released block only if it was
  queued before the release (steps scheduled while a request held it, the zeroing of
  `zeroKVOnRelease`). So each schedule advances the block pool's epoch, which each release
  stamps on the block, and marks the engine's stream with it (`Copier.mark`); a load waits only
  for the first mark after its blocks' latest release. Blocks released before the schedule of
  the step in flight (usually so: allocation takes the longest-free blocks) load beside that
  step, and the request joins the step after it;
- a load already done when it is started (on a CPU device, from host memory: the copies ran as
  they were queued) joins the very step being scheduled (`take`).
"""

from __future__ import annotations

from kvrail.worker.engine.block_pool import KVBlock
from kvrail.worker.engine.kv_cache_manager import KVCacheManager
from kvrail.worker.engine.kv_tiers.tiers import KvTiers
from kvrail.worker.engine.request import Request, RequestStatus


class TierLoads:
    def __init__(self, tiers: KvTiers, manager: KVCacheManager) -> None:
        self.tiers = tiers
        self.manager = manager
        self.loading: dict[str, Request] = {}
        manager.newly_cached = []

    def hits(self, request: Request, num_gpu_hits: int) -> int:
        """How many blocks after its GPU hits the lower tiers hold for `request`, in a row."""
        if not self.manager.enable_prefix_caching:
            return 0
        limit = self.manager.hit_limit(request)
        return self.tiers.lookup(self.manager.block_hashes_of(request)[num_gpu_hits:limit])

    def begin_schedule(self) -> None:
        """A schedule starts: a new epoch, marked on the engine's stream (see above)."""
        pool = self.manager.block_pool
        pool.epoch += 1
        self.tiers.copier.mark(pool.epoch)

    def start(self, request: Request, num_gpu_hits: int, blocks: list[KVBlock]) -> bool:
        """Queue loading the request's blocks after its GPU hits into `blocks` (newly allocated
        for it); False when none could be (it then computes them)."""
        hashes = self.manager.block_hashes_of(request)[num_gpu_hits:]
        ids = [b.block_id for b in blocks]
        released_at = max(b.released_at for b in blocks)
        if not self.tiers.start_load(request.request_id, hashes[: len(ids)], ids, released_at):
            return False
        request.num_computed_tokens = num_gpu_hits * self.manager.block_size
        request.status = RequestStatus.WAITING_FOR_TIER_KV
        self.loading[request.request_id] = request
        return True

    def take_finished(self) -> list[Request]:
        """The requests whose loads finished, made ready to run from their first block not
        loaded (their loaded blocks join the GPU prefix cache); then hands the blocks cached
        since the last call to the write-behind."""
        ready = []
        for request_id, num_loaded in self.tiers.poll():
            request = self.loading.pop(request_id, None)
            if request is None:
                continue  # finished (aborted) while loading: the tiers unpinned its blocks
            self._loaded(request, num_loaded)
            ready.append(request)
        self.offload_new_blocks()
        return ready

    def take(self, request: Request) -> bool:
        """Whether the load `start` just queued for `request` is already done; if so the request
        is ready, as `take_finished` makes it."""
        num_loaded = self.tiers.poll_load(request.request_id)
        if num_loaded is None:
            return False
        del self.loading[request.request_id]
        self._loaded(request, num_loaded)
        return True

    def _loaded(self, request: Request, num_loaded: int) -> None:
        request.num_computed_tokens += num_loaded * self.manager.block_size
        request.num_cached_tokens = max(request.num_cached_tokens, request.num_computed_tokens)
        self.manager.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.RUNNING

    def offload_new_blocks(self) -> None:
        """Hand the blocks that joined the GPU prefix cache since the last call to the tiers."""
        newly = self.manager.newly_cached
        if newly:
            self.tiers.offload(newly)
            newly.clear()

    def forget(self, request_id: str) -> bool:
        """Drop a request that finished while loading (its blocks stay pinned by the load until
        it is done); whether it was loading."""
        return self.loading.pop(request_id, None) is not None
