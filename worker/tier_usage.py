"""The worker record's `kv_tiers` (what `kvrail status` shows per worker), from the engine's
tier counts: pure, so the record loop in `kvrail.worker.__main__` only passes numbers in.

The record loop calls, about every second, with the lower tiers' current counts and the
cumulative hit and load counts (the same numbers as the `kvrail_kv_tier_*` metrics):

    record = _with(record, ..., kv_tiers=kv_tier_usage(usage, hits, loads))
"""

from __future__ import annotations

from collections.abc import Mapping

from kvrail.messages import KV_TIERS, KvTier, KvTierUsage

TierCounts = tuple[int, int, int]
"""One tier's (used bytes, capacity bytes, blocks held)."""


def kv_tier_usage(
    usage: Mapping[KvTier, TierCounts],
    hits: Mapping[KvTier, int] | None = None,
    loads: Mapping[KvTier, int] | None = None,
) -> tuple[KvTierUsage, ...]:
    """One `KvTierUsage` per lower tier in `usage`, fastest first. `hits` are prompt blocks
    found in a tier, `loads` loads from it to the GPU, both since the worker started (a tier
    missing from them counts 0). The GPU is not a lower tier: an entry for it is left out (the
    record has its own `num_blocks` and `kv_utilization`). Raises ValueError for a negative
    count."""
    hits = hits or {}
    loads = loads or {}
    return tuple(
        KvTierUsage(
            tier=tier,
            used_bytes=usage[tier][0],
            capacity_bytes=usage[tier][1],
            num_blocks=usage[tier][2],
            num_hit_blocks=hits.get(tier, 0),
            num_loads=loads.get(tier, 0),
        )
        for tier in KV_TIERS
        if tier != "gpu" and tier in usage
    )
