"""Moving estimates of how fast a prefill worker's KV writes and prefills go: what
`kv_transfer_layer_groups: auto` feeds `layer_groups.choose_num_groups` (docs/layerwise.md).
Pure: the prefill role feeds them what it timed.

A link's bandwidth comes from the writes to that peer that completed, as the connector timed
them (`TransferStats`: on a tensor-parallel worker every shard's bytes over the slowest shard's
seconds, the whole KV's rate), whole writes and layer groups alike. Before the first, a
documented default by path: `DEFAULT_BYTES_PER_S`.
"""

from __future__ import annotations

from collections import OrderedDict

from kvrail.worker.transfer.blocks import TransferStats

DEFAULT_BYTES_PER_S = {"cuda-ipc": 1.0e12}
"""A peer's bandwidth before any write to it completed, by transport: CUDA IPC between two GPUs
of one node (2.0 TB/s measured on an H200 for a 1 GiB handoff: bench/transfer/README.md; half
of it here, so a first write there is whole)."""
DEFAULT_NIXL_BYTES_PER_S = 25e9 / 8
"""... and over NIXL (any other transport): a 25 Gb/s NIC without RDMA, the slow end of what
layer-wise transfer is for. An RDMA link shows itself in the first write's measurement."""
HALF_LIFE_SAMPLES = 8.0
"""A sample's weight halves with every this many newer ones."""
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


class PeerBandwidth:
    """Each peer's link bandwidth in bytes per second, from the writes to it that completed."""

    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        self.max_peers = max_peers
        self._links: OrderedDict[str, DecayedRatio] = OrderedDict()

    def observe(self, peer: str, stats: TransferStats) -> None:
        """A write to `peer` completed (a failed one says nothing of the link's speed)."""
        link = self._links.pop(peer, None) or DecayedRatio()
        link.add(stats.num_bytes, stats.seconds)
        self._links[peer] = link
        while len(self._links) > self.max_peers:
            self._links.popitem(last=False)

    def estimate(self, peer: str, transport: str) -> float:
        """`peer`'s measured bandwidth, or the default of `transport` before any write."""
        link = self._links.get(peer)
        measured = link.value if link is not None else None
        if measured is not None:
            return measured
        return DEFAULT_BYTES_PER_S.get(transport, DEFAULT_NIXL_BYTES_PER_S)

    def is_measured(self, peer: str) -> bool:
        link = self._links.get(peer)
        return link is not None and link.value is not None
