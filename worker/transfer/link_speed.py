"""Moving estimates of how fast a prefill worker's KV writes and prefills go: what
`kv_transfer_layer_groups: auto` feeds `layer_groups.choose_num_groups` (docs/layerwise.md).
Pure: the prefill role feeds them what it timed.

Each peer's link is learned from the writes to it that completed, as the connector timed them
(on a tensor-parallel worker every shard's bytes over the slowest shard's seconds, the whole
KV's rate), in the two regimes `layer_groups.WriteCost` models:
- its **bandwidth** from the writes that started after the prefill had ended (whole writes and
  late groups), where the bytes' time decides;
- its **busy per-block cost** from the writes that started while the prefill still ran (early
  groups and chunks), where each block's descriptor can cost more than the bytes: a write that
  took longer than its bytes would at the bandwidth (`DESCRIPTOR_BOUND`) gives its seconds per
  block; one that did not only bounds that cost, and lowers an estimate above it.
Before the first, documented defaults: `DEFAULT_BYTES_PER_S` by path, `BUSY_BLOCK_S`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvrail.worker.transfer.blocks import TransferStats

DEFAULT_BYTES_PER_S = {"cuda-ipc": 1.0e12}
"""A peer's bandwidth before any write to it completed, by transport: CUDA IPC between two GPUs
of one node (2.0 TB/s measured on an H200 for a 1 GiB handoff: bench/transfer/README.md; half
of it here). Only reported: `GroupChoice` writes whole over CUDA IPC whatever it is."""
DEFAULT_NIXL_BYTES_PER_S = 25e9 / 8
"""... and over NIXL (any other transport): a 25 Gb/s NIC without RDMA, the slow end of what
layer-wise transfer is for. An RDMA link shows itself in the first write's measurement."""
HALF_LIFE_SAMPLES = 8.0
"""A sample's weight halves with every this many newer ones."""
BUSY_BLOCK_S = 150e-6
"""Over NIXL, what a block's descriptor costs a write that starts while the prefill runs, before
any such write to the peer was timed: on the lent H100 (UCX between two processes of one GPU,
bench/transfer/layerwise_auto_h100_2026-12-07.txt) groups of 512 blocks written during an 8k
prefill took 54-109 ms for 6.7 ms of bytes, 105-210 us a block."""
IDLE_BLOCK_S = 10e-6
"""... and one that starts after it (not learned: there the bytes' time decided every write
measured; the same run's late groups of 512 blocks took their bytes' 6.8 ms, under 13 us a
block)."""
DESCRIPTOR_BOUND = 1.25
"""A write during the prefill that took more than this times its bytes' time at the link's
bandwidth was bound by its descriptors."""
MAX_PEERS = 1024
"""Links remembered; the least recently written is forgotten first."""


class DecayedRatio:
    """`sum(w_i x_i) / sum(w_i y_i)` over the samples `(x_i, y_i)` added, a sample's weight
    `w_i` halving with every `half_life` newer ones. A ratio of sums, not a mean of ratios: a
    long write (or prefill) weighs in proportion to its size, and a short one, which its
    set-up dominates, hardly moves it."""

    def __init__(self, half_life: float = HALF_LIFE_SAMPLES) -> None:
        if half_life <= 0:
            raise ValueError("a half-life of at least one sample")
        self._keep = 0.5 ** (1.0 / half_life)
        self._x = 0.0
        self._y = 0.0

    def add(self, x: float, y: float) -> None:
        """Add a sample; one with `y <= 0` or a negative `x` is ignored (nothing was timed)."""
        if y <= 0 or x < 0:
            return
        self._x = self._x * self._keep + x
        self._y = self._y * self._keep + y

    @property
    def value(self) -> float | None:
        """The ratio, None before the first sample."""
        return self._x / self._y if self._y > 0 else None


@dataclass(frozen=True, slots=True)
class WriteTiming:
    """One write of a job's KV to a peer, whole or a layer group (or an early chunk's blocks):
    its bytes, its blocks, its seconds, and when it landed, in seconds from the prefill's end
    (negative: before it)."""

    num_bytes: int
    num_blocks: int
    seconds: float
    landed_s: float

    @classmethod
    def whole(cls, stats: TransferStats, num_blocks: int) -> WriteTiming:
        """A whole write, started as the prefill ended."""
        return cls(stats.num_bytes, num_blocks, stats.seconds, stats.seconds)

    @property
    def during_prefill(self) -> bool:
        """It started before the prefill ended."""
        return self.landed_s - self.seconds < 0


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    """What `PeerLinks.estimate` knows of a link."""

    bytes_per_s: float
    busy_block_s: float
    measured: bool
    """Its bandwidth was measured (not the path's default)."""


class _Link:
    def __init__(self) -> None:
        self.bandwidth = DecayedRatio()  # bytes / seconds
        self.busy_block = DecayedRatio()  # seconds / blocks


class PeerLinks:
    """Each peer's link, from the writes to it that completed (the module docstring)."""

    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        self.max_peers = max_peers
        self._links: OrderedDict[str, _Link] = OrderedDict()

    def observe(self, peer: str, writes: Sequence[WriteTiming]) -> None:
        """A job's writes to `peer` completed, in order (a failed job says nothing of the link)."""
        link = self._links.pop(peer, None) or _Link()
        for write in writes:  # the bandwidth first: the busy writes are judged by it
            if not write.during_prefill:
                link.bandwidth.add(write.num_bytes, write.seconds)
        bandwidth = link.bandwidth.value
        for write in writes:
            if not write.during_prefill or write.num_blocks < 1 or write.seconds <= 0:
                continue
            per_block = write.seconds / write.num_blocks
            bytes_s = write.num_bytes / bandwidth if bandwidth else 0.0
            known = link.busy_block.value
            if write.seconds > DESCRIPTOR_BOUND * bytes_s or per_block < (known or BUSY_BLOCK_S):
                link.busy_block.add(write.seconds, write.num_blocks)
        self._links[peer] = link
        while len(self._links) > self.max_peers:
            self._links.popitem(last=False)

    def estimate(self, peer: str, transport: str) -> LinkEstimate:
        """`peer`'s link as measured, the defaults of `transport` where nothing was."""
        link = self._links.get(peer)
        bandwidth = link.bandwidth.value if link is not None else None
        busy = link.busy_block.value if link is not None else None
        default = DEFAULT_BYTES_PER_S.get(transport, DEFAULT_NIXL_BYTES_PER_S)
        return LinkEstimate(
            bandwidth or default, BUSY_BLOCK_S if busy is None else busy, bandwidth is not None
        )
