"""What the lower tiers report: their use, and what they served."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from kvrail.messages import KvTier
from kvrail.worker import metrics

LowerTier = Literal["host", "disk"]


@dataclass(slots=True)
class TierStats:
    """What `kvrail status` and the metrics show of each lower tier (bytes are block bytes)."""

    capacity_bytes: dict[KvTier, int] = field(default_factory=dict)
    used_bytes: dict[KvTier, int] = field(default_factory=dict)
    blocks: dict[KvTier, int] = field(default_factory=dict)
    hit_blocks: dict[KvTier, int] = field(default_factory=dict)
    """Prompt blocks loaded from each tier since the engine started."""
    loads: dict[KvTier, int] = field(default_factory=dict)
    """Loads to the GPU since the engine started, by the slowest tier each read."""

    @classmethod
    def of(
        cls,
        use: dict[LowerTier, tuple[int, int]],
        block_bytes: int,
        hit_blocks: dict[KvTier, int],
        loads: dict[KvTier, int],
    ) -> TierStats:
        """From each tier's (capacity, used) in blocks and its counters; sets the gauges."""
        stats = cls()
        for tier, (capacity, used) in use.items():
            stats.capacity_bytes[tier] = capacity * block_bytes
            stats.used_bytes[tier] = used * block_bytes
            stats.blocks[tier] = used
            stats.hit_blocks[tier] = hit_blocks[tier]
            stats.loads[tier] = loads[tier]
            metrics.KV_TIER_CAPACITY_BYTES.labels(tier=tier).set(capacity * block_bytes)
            metrics.KV_TIER_BYTES.labels(tier=tier).set(used * block_bytes)
            metrics.KV_TIER_BLOCKS.labels(tier=tier).set(used)
        return stats


class LoadCounts:
    """What the loads served since the engine started, per tier (and the metrics counting it)."""

    def __init__(self) -> None:
        self.hit_blocks: dict[KvTier, int] = {"host": 0, "disk": 0}
        self.loads: dict[KvTier, int] = {"host": 0, "disk": 0}

    def record(self, num_host: int, num_disk: int, slowest: LowerTier, started: float) -> None:
        """A load started at `started` (`time.perf_counter()`) finished: `num_host` and
        `num_disk` blocks passed; `slowest` is the slowest tier it read."""
        counts: tuple[tuple[LowerTier, int], ...] = (("host", num_host), ("disk", num_disk))
        for tier, count in counts:
            self.hit_blocks[tier] += count
            metrics.KV_TIER_HIT_BLOCKS.labels(tier=tier).inc(count)
        self.loads[slowest] += 1
        metrics.KV_TIER_LOADS.labels(tier=slowest).inc()
        metrics.KV_TIER_LOAD_SECONDS.labels(tier=slowest).observe(time.perf_counter() - started)
