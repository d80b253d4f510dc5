"""The KV index: which worker caches which prompt blocks, in which tier (pure, no I/O).

Fed by the workers' `KvEvent`s (`kvrail.keys.PoolKeys.kv_events`) and rebuilt from their
`kv_state` replies. Per worker it keeps the incarnation and the last event seq it applied, and per
tier (`kvrail.messages.KV_TIERS`: GPU, host memory, disk) the set of block hashes (hex strings of
`kvrail.hashing` hashes) the worker holds there; a reverse map per tier, hash -> worker ids, makes
a lookup cost O(prompt blocks x matching workers), not O(workers). A worker without lower tiers
only ever fills the GPU's.

Guarantees:
- `apply()` has no partial effect: it applies the whole event or nothing. It applies an event
  only when it is the next one of the incarnation whose state was loaded (`seq == last_seq + 1`,
  one sequence over every tier); a duplicate (`seq <= last_seq`) is ignored; anything else
  (unknown worker, gap, another incarnation) returns False, telling the caller to fetch the
  worker's state.
- Within one event, `cleared` is applied first, then `removed`, then `stored`, all to the event's
  `tier` alone. A hash both removed and stored in one event therefore stays: a stale hit costs
  the worker a recompute, never a wrong answer.
- `load_state()` replaces every tier of the worker; `forget()` drops every tier at once (a worker
  whose record disappeared, restarted, or whose stream broke).
- Memory is bounded: a worker holds at most `max_hashes_per_worker` hashes, over all its tiers
  (default `MAX_HASHES_PER_WORKER`). Hashes stored beyond the cap are not indexed and are counted
  in `num_dropped_hashes`; the only cost is a missed cache hit (a request routed as if those
  blocks were not cached). An indexed hash costs about 380 bytes (measured with tracemalloc: the
  32-char string, its slot in the worker's set, and its reverse-map entry with a set of holders),
  so the default cap bounds one worker at about 380 MB. That is a worst case: an H200 caching a
  Llama-3-8B shape holds about 1M tokens, i.e. 64k blocks of 16 tokens (about 25 MB here); a
  256 GiB host tier of the same shape holds 128k blocks of 2 MiB more (about 50 MB).

`match_tiers()` relies on the chained hash: block i's hash covers every token before it, so a hit
on block i after a miss on an earlier block can never be used, and only leading runs count. It
counts what the worker's engine would use (`kvrail.worker.engine.kv_tiers`): the prompt's leading
run in GPU memory, then the run that continues in the lower tiers, each block from the fastest
lower tier holding it (host memory, else disk), loaded back. A block in GPU memory after that
point is not a GPU hit: the engine loads it from a lower tier too, or ends the run there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrail.hashing import block_hashes, root_hash
from kvrail.messages import KV_TIERS, KvEvent, KvTier

MAX_HASHES_PER_WORKER = 1_000_000
_NONE: frozenset[str] = frozenset()


def prompt_hashes(
    token_ids: Sequence[int], block_size: int, fingerprint: str, tenant_salt: str = ""
) -> list[str]:
    """The hex hashes of a prompt's full blocks, as the workers of `fingerprint` compute them."""
    return [
        h.hex() for h in block_hashes(token_ids, block_size, root_hash(fingerprint, tenant_salt))
    ]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a prompt's prefix one worker can use: `num_blocks` leading blocks, the first
    `num_gpu_blocks` in GPU memory, then `num_host_blocks` to load from host memory and
    `num_disk_blocks` from disk (in prompt order, each from the faster tier holding it)."""

    num_blocks: int
    num_host_blocks: int = 0
    num_disk_blocks: int = 0

    @property
    def num_gpu_blocks(self) -> int:
        return self.num_blocks - self.num_host_blocks - self.num_disk_blocks


@dataclass(slots=True)
class _WorkerState:
    incarnation: int
    last_seq: int
    hashes: dict[KvTier, set[str]] = field(default_factory=lambda: {t: set() for t in KV_TIERS})

    @property
    def num_hashes(self) -> int:
        return sum(len(h) for h in self.hashes.values())


class KvIndex:
    """Per worker and tier, the block hashes it holds; see the module docstring for guarantees."""

    def __init__(self, max_hashes_per_worker: int = MAX_HASHES_PER_WORKER) -> None:
        if max_hashes_per_worker < 1:
            raise ValueError("max_hashes_per_worker must be at least 1")
        self.max_hashes_per_worker = max_hashes_per_worker
        self.num_dropped_hashes = 0
        """Hashes not indexed because their worker was at the cap (monotonic)."""
        self._workers: dict[str, _WorkerState] = {}
        self._holders: dict[KvTier, dict[str, set[str]]] = {t: {} for t in KV_TIERS}

    # Updates ------------------------------------------------------------------------------------
    def apply(self, event: KvEvent) -> bool:
        """Apply one live event; False (nothing applied) means: fetch this worker's state.

        A newer incarnation than the loaded one makes the loaded state stale: it is forgotten.
        An older incarnation (a late event of a dead process) leaves the state as it is.
        """
        state = self._workers.get(event.worker_id)
        if state is None:
            return False
        if event.incarnation != state.incarnation:
            if event.incarnation > state.incarnation:
                self.forget(event.worker_id)
            return False
        if event.seq <= state.last_seq:
            return True  # a duplicate: already applied or covered by the loaded state
        if event.seq != state.last_seq + 1:
            return False  # a gap: events were lost
        tier = event.tier
        if event.cleared:
            self._clear(event.worker_id, state, tier)
        self._remove(event.worker_id, state, tier, event.removed)
        self._store(event.worker_id, state, tier, event.stored)
        state.last_seq = event.seq
        return True

    def load_state(self, event: KvEvent) -> None:
        """Replace the worker's state with a `kv_state` reply (every hash of every tier, its
        seq)."""
        if not event.cleared or event.tier != "gpu":
            raise ValueError("a kv_state reply must have cleared=True and tier gpu")
        self.forget(event.worker_id)
        state = _WorkerState(incarnation=event.incarnation, last_seq=event.seq)
        self._workers[event.worker_id] = state
        self._store(event.worker_id, state, "gpu", event.stored)
        for lower in event.lower_tiers:
            self._store(event.worker_id, state, lower.tier, lower.stored)

    def forget(self, worker_id: str) -> None:
        """Drop everything known about the worker, in every tier (gone, restarted, or its
        stream broke)."""
        state = self._workers.pop(worker_id, None)
        if state is not None:
            for tier in KV_TIERS:
                self._clear(worker_id, state, tier)

    # Queries ------------------------------------------------------------------------------------
    def workers(self) -> set[str]:
        """Workers whose state is loaded."""
        return set(self._workers)

    def incarnation(self, worker_id: str) -> int | None:
        """The incarnation whose state is loaded, or None when none is."""
        state = self._workers.get(worker_id)
        return None if state is None else state.incarnation

    def last_seq(self, worker_id: str) -> int | None:
        state = self._workers.get(worker_id)
        return None if state is None else state.last_seq

    def num_hashes(self, worker_id: str, tier: KvTier | None = None) -> int:
        """Hashes indexed for the worker in `tier`, or in every tier (None)."""
        state = self._workers.get(worker_id)
        if state is None:
            return 0
        return state.num_hashes if tier is None else len(state.hashes[tier])

    def matched_blocks(self, worker_id: str, hashes: Sequence[str]) -> int:
        """How many leading blocks of the prompt (`hashes`, in order) the worker can use, as
        `match_tiers` counts them."""
        state = self._workers.get(worker_id)
        if state is None:
            return 0
        gpu, host, disk = (state.hashes[t] for t in ("gpu", "host", "disk"))
        num = 0
        on_gpu = True
        for h in hashes:
            on_gpu = on_gpu and h in gpu
            if not on_gpu and h not in host and h not in disk:
                break
            num += 1
        return num

    def match_all(self, hashes: Sequence[str]) -> dict[str, int]:
        """`matched_blocks` of every worker holding at least the prompt's first block."""
        return {w: m.num_blocks for w, m in self.match_tiers(hashes).items()}

    def match_tiers(self, hashes: Sequence[str]) -> dict[str, PrefixMatch]:
        """Per worker holding at least the prompt's first block (in some tier), the prefix of
        the prompt it can use as its engine does: the leading run in GPU memory, then the run
        that continues in a lower tier (host memory, else disk), stopping at the first block
        held in neither."""
        matched: dict[str, PrefixMatch] = {}
        if not hashes:
            return matched
        gpu, host, disk = (self._holders[t] for t in ("gpu", "host", "disk"))
        first = hashes[0]
        on_gpu: set[str] = set()  # workers whose run is still in GPU memory
        for holders in (gpu, host, disk):
            on_gpu |= holders.get(first, _NONE)
        if not on_gpu:
            return matched  # nobody holds the first block: no run to follow
        loading: set[str] = set()  # workers whose run went on in a lower tier
        lower: dict[str, list[int]] = {}  # worker -> [host blocks, disk blocks]
        for i, h in enumerate(hashes):
            in_gpu = gpu.get(h, _NONE)
            if not loading and on_gpu <= in_gpu:
                continue  # the usual case: every worker still matching holds it in GPU memory
            missed = on_gpu - in_gpu
            if missed:
                on_gpu -= missed
                loading |= missed
            rest = set(loading)
            for k, holders in enumerate((host, disk)):
                held = rest & holders.get(h, _NONE)
                for worker_id in held:
                    lower.setdefault(worker_id, [0, 0])[k] += 1
                rest -= held
            for worker_id in rest:  # in no lower tier: the worker's run ends before block i
                matched[worker_id] = _match(i, lower.get(worker_id))
            loading -= rest
            if not on_gpu and not loading:
                return matched
        for worker_id in on_gpu | loading:
            matched[worker_id] = _match(len(hashes), lower.get(worker_id))
        return matched

    # Internals ----------------------------------------------------------------------------------
    def _store(
        self, worker_id: str, state: _WorkerState, tier: KvTier, hashes: Sequence[str]
    ) -> None:
        held = state.hashes[tier]
        reverse = self._holders[tier]
        num = state.num_hashes
        for h in hashes:
            if h in held:
                continue
            if num >= self.max_hashes_per_worker:
                self.num_dropped_hashes += 1
                continue
            held.add(h)
            num += 1
            reverse.setdefault(h, set()).add(worker_id)

    def _remove(
        self, worker_id: str, state: _WorkerState, tier: KvTier, hashes: Sequence[str]
    ) -> None:
        held = state.hashes[tier]
        reverse = self._holders[tier]
        for h in hashes:
            if h not in held:
                continue
            held.discard(h)
            holders = reverse[h]
            holders.discard(worker_id)
            if not holders:
                del reverse[h]

    def _clear(self, worker_id: str, state: _WorkerState, tier: KvTier) -> None:
        self._remove(worker_id, state, tier, list(state.hashes[tier]))


def _match(num_blocks: int, lower: list[int] | None) -> PrefixMatch:
    if lower is None:
        return PrefixMatch(num_blocks)
    return PrefixMatch(num_blocks, lower[0], lower[1])
