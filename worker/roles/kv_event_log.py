"""The pure half of KV events: seq numbering, splitting, and the per-tier mirror that answers
kvstate (`kv_events.KvEventPublisher` is the I/O half; its docstring states the guarantees).

Each tier's changes (`KvChanges.tier`: the GPU's prefix cache, or a lower tier's) become events
of that tier, numbered in one sequence per incarnation across tiers, so a router detects a lost
event of any tier the same way. The mirror keeps, per tier, every hash the events so far left
stored there, in stored order; `state()` reads it, so a reply is exactly the state after `seq`.

Limits: one NATS message must fit the server's `max_payload` (1 MiB by default; each hash costs
35 bytes of JSON), and one list of a message at most `MAX_BLOCKS` hashes (the codec's limit).
`block_limits` derives both from the payload: an event holds at most min(`MAX_BLOCKS`, ~14,900
at 1 MiB) hashes per list (a larger batch is split into events with consecutive seqs), and a
kvstate reply at most min(3 x `MAX_BLOCKS`, ~29,900 at 1 MiB) hashes over all tiers, each tier's
list at most `MAX_BLOCKS`. A worker caching more replies with the GPU's hashes first, then the
host tier's, then the disk tier's (fastest first: a GPU hit saves the most), each in the order
they were stored, and logs a warning; a router then misses the rest until their events come
again. A NATS `max_payload` of 8 MiB (kvrail's `MAX_MESSAGE_BYTES`, which `kvrail.local.servers`
and the chart's NATS set) lifts the limits to `MAX_BLOCKS` (65,536) per list, every tier's list
included.
"""

from __future__ import annotations

import itertools
import logging

from kvrail.codec import MAX_BLOCKS
from kvrail.messages import KV_TIERS, KvEvent, KvTier, KvTierState
from kvrail.worker.engine.block_pool import KvChanges

log = logging.getLogger("kvrail.worker.roles.kv_events")  # one logger for both halves

_HASH_JSON_BYTES = 35  # '"' + 32 hex digits + '",'
_ENVELOPE_BYTES = 512  # the rest of a KvEvent (ids, seq, keys, the lower tiers' names)
MAX_STATE_BLOCKS = len(KV_TIERS) * MAX_BLOCKS
"""The most hashes one kvstate reply may hold: a full list per tier."""


def block_limits(max_payload_bytes: int) -> tuple[int, int]:
    """(hashes per list of one event, hashes in one kvstate reply over every tier) such that the
    message fits in `max_payload_bytes` and each list within `MAX_BLOCKS`."""
    fit = (max_payload_bytes - _ENVELOPE_BYTES) // _HASH_JSON_BYTES
    if fit < 2:
        raise ValueError(f"a max payload of {max_payload_bytes} bytes holds no KV event")
    return min(MAX_BLOCKS, fit // 2), min(MAX_STATE_BLOCKS, fit)


class KvEventLog:
    """Seq numbering, splitting and the per-tier mirror of the cached hashes.

    `events_for` turns one batch of one tier's changes into the events to publish, in order, and
    applies them to `cached[tier]` before it returns; `state` is the kvstate reply for the same
    moment.
    """

    def __init__(
        self,
        worker_id: str,
        incarnation: int,
        *,
        max_event_blocks: int = MAX_BLOCKS,
        max_state_blocks: int = MAX_STATE_BLOCKS,
    ) -> None:
        if not 1 <= max_event_blocks <= MAX_BLOCKS or not 1 <= max_state_blocks <= MAX_STATE_BLOCKS:
            raise ValueError(
                f"block limits must be within 1..{MAX_BLOCKS} per event and "
                f"1..{MAX_STATE_BLOCKS} per state"
            )
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.max_event_blocks = max_event_blocks
        self.max_state_blocks = max_state_blocks
        self.seq = 0  # the last seq handed out, over every tier
        self.cached: dict[KvTier, dict[str, None]] = {tier: {} for tier in KV_TIERS}
        """Per tier, every hash stored there after event `seq`, in stored order."""

    def events_for(self, changes: KvChanges) -> list[KvEvent]:
        """The events of one batch (none if it is empty), with consecutive seqs."""
        tier = changes.tier
        stored = [h.hex() for h in changes.stored]
        removed = [h.hex() for h in changes.removed]
        events: list[KvEvent] = []
        step = self.max_event_blocks
        for start in range(0, max(len(stored), len(removed)), step):
            self.seq += 1
            events.append(
                KvEvent(
                    worker_id=self.worker_id,
                    incarnation=self.incarnation,
                    seq=self.seq,
                    stored=tuple(stored[start : start + step]),
                    removed=tuple(removed[start : start + step]),
                    tier=tier,
                )
            )
        cached = self.cached[tier]
        for block_hash in removed:
            cached.pop(block_hash, None)
        for block_hash in stored:
            cached[block_hash] = None
        return events

    def state(self) -> KvEvent:
        """Every cached hash of every tier as of event `seq` (at most `max_state_blocks`, see
        the module's limits): the GPU's in `stored`, each lower tier holding any in
        `lower_tiers`."""
        budget = self.max_state_blocks
        lists: dict[KvTier, tuple[str, ...]] = {}
        for tier in KV_TIERS:
            cached = self.cached[tier]
            lists[tier] = tuple(itertools.islice(cached, min(budget, MAX_BLOCKS)))
            budget -= len(lists[tier])
        num_cached = sum(len(c) for c in self.cached.values())
        num_reply = sum(len(x) for x in lists.values())
        if num_reply < num_cached:
            log.warning(
                "kv state truncated worker=%s cached_blocks=%d reply_blocks=%d",
                self.worker_id,
                num_cached,
                num_reply,
            )
        return KvEvent(
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            seq=self.seq,
            stored=lists["gpu"],
            cleared=True,
            lower_tiers=tuple(
                KvTierState(tier, lists[tier]) for tier in KV_TIERS[1:] if self.cached[tier]
            ),
        )
