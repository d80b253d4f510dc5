"""The KV index: which decode worker caches which prompt blocks (pure, no I/O).

Fed by the workers' `KvEvent`s (`kvrail.keys.PoolKeys.kv_events`) and rebuilt from their
`kv_state` replies. Per worker it keeps the incarnation and the last event seq it applied, and the
set of block hashes (hex strings of `kvrail.hashing` hashes) the worker caches; a reverse map
hash -> worker ids makes a lookup cost O(prompt blocks x matching workers), not O(workers).

Guarantees:
- `apply()` has no partial effect: it applies the whole event or nothing. It applies an event
  only when it is the next one of the incarnation whose state was loaded (`seq == last_seq + 1`);
  a duplicate (`seq <= last_seq`) is ignored; anything else (unknown worker, gap, another
  incarnation) returns False, telling the caller to fetch the worker's state.
- Within one event, `cleared` is applied first, then `removed`, then `stored`. A hash both removed
  and stored in one event therefore stays: a stale hit costs the worker a recompute, never a
  wrong answer.
- Memory is bounded: a worker holds at most `max_hashes_per_worker` hashes (default
  `MAX_HASHES_PER_WORKER`). Hashes stored beyond the cap are not indexed and are counted in
  `num_dropped_hashes`; the only cost is a missed cache hit (a request routed as if those blocks
  were not cached). An indexed hash costs about 380 bytes (measured with tracemalloc: the 32-char
  string, its slot in the worker's set, and its reverse-map entry with a set of holders), so the
  default cap bounds one worker at about 380 MB. That is a worst case: an H200 caching a
  Llama-3-8B shape holds about 1M tokens, i.e. 64k blocks of 16 tokens (about 25 MB here).

`match_all()` relies on the chained hash: block i's hash covers every token before it, so a hit
on block i after a miss on an earlier block can never be used, and only leading runs count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrail.hashing import block_hashes, root_hash
from kvrail.messages import KvEvent

MAX_HASHES_PER_WORKER = 1_000_000


def prompt_hashes(
    token_ids: Sequence[int], block_size: int, fingerprint: str, tenant_salt: str = ""
) -> list[str]:
    """The hex hashes of a prompt's full blocks, as the workers of `fingerprint` compute them."""
    return [
        h.hex() for h in block_hashes(token_ids, block_size, root_hash(fingerprint, tenant_salt))
    ]


@dataclass(slots=True)
class _WorkerState:
    incarnation: int
    last_seq: int
    hashes: set[str] = field(default_factory=set)


class KvIndex:
    """Per decode worker, the block hashes it caches; see the module docstring for guarantees."""

    def __init__(self, max_hashes_per_worker: int = MAX_HASHES_PER_WORKER) -> None:
        if max_hashes_per_worker < 1:
            raise ValueError("max_hashes_per_worker must be at least 1")
        self.max_hashes_per_worker = max_hashes_per_worker
        self.num_dropped_hashes = 0
        """Hashes not indexed because their worker was at the cap (monotonic)."""
        self._workers: dict[str, _WorkerState] = {}
        self._holders: dict[str, set[str]] = {}

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
        if event.cleared:
            self._clear(event.worker_id, state)
        self._remove(event.worker_id, state, event.removed)
        self._store(event.worker_id, state, event.stored)
        state.last_seq = event.seq
        return True

    def load_state(self, event: KvEvent) -> None:
        """Replace the worker's state with a `kv_state` reply (every hash it caches, its seq)."""
        if not event.cleared:
            raise ValueError("a kv_state reply must have cleared=True")
        self.forget(event.worker_id)
        state = _WorkerState(incarnation=event.incarnation, last_seq=event.seq)
        self._workers[event.worker_id] = state
        self._store(event.worker_id, state, event.stored)

    def forget(self, worker_id: str) -> None:
        """Drop everything known about the worker (gone, restarted, or its stream broke)."""
        state = self._workers.pop(worker_id, None)
        if state is not None:
            self._clear(worker_id, state)

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

    def num_hashes(self, worker_id: str) -> int:
        state = self._workers.get(worker_id)
        return 0 if state is None else len(state.hashes)

    def matched_blocks(self, worker_id: str, hashes: Sequence[str]) -> int:
        """How many leading blocks of the prompt (`hashes`, in order) the worker caches."""
        state = self._workers.get(worker_id)
        if state is None:
            return 0
        num = 0
        for h in hashes:
            if h not in state.hashes:
                break
            num += 1
        return num

    def match_all(self, hashes: Sequence[str]) -> dict[str, int]:
        """`matched_blocks` of every worker caching at least the prompt's first block."""
        matched: dict[str, int] = {}
        if not hashes:
            return matched
        candidates = self._holders.get(hashes[0])
        if not candidates:
            return matched
        alive = set(candidates)
        for i, h in enumerate(hashes[1:], start=1):
            holders = self._holders.get(h)
            still = alive & holders if holders else set()
            for worker_id in alive - still:
                matched[worker_id] = i
            alive = still
            if not alive:
                return matched
        for worker_id in alive:
            matched[worker_id] = len(hashes)
        return matched

    # Internals ----------------------------------------------------------------------------------
    def _store(self, worker_id: str, state: _WorkerState, hashes: Sequence[str]) -> None:
        for h in hashes:
            if h in state.hashes:
                continue
            if len(state.hashes) >= self.max_hashes_per_worker:
                self.num_dropped_hashes += 1
                continue
            state.hashes.add(h)
            self._holders.setdefault(h, set()).add(worker_id)

    def _remove(self, worker_id: str, state: _WorkerState, hashes: Sequence[str]) -> None:
        for h in hashes:
            if h not in state.hashes:
                continue
            state.hashes.discard(h)
            holders = self._holders[h]
            holders.discard(worker_id)
            if not holders:
                del self._holders[h]

    def _clear(self, worker_id: str, state: _WorkerState) -> None:
        self._remove(worker_id, state, list(state.hashes))
