"""What the lower tiers report: their use, and what they served."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvrail.messages import KvTier

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
