"""Moving estimates of how fast a prefill worker's KV writes and prefills go: what
`kv_transfer_layer_groups: auto` feeds `layer_groups.choose_num_groups` (docs/layerwise.md).
Pure: the prefill role feeds them what it timed.

A link's bandwidth comes from the writes to that peer that completed, as the connector timed
them (`TransferStats`: on a tensor-parallel worker every shard's bytes over the slowest shard's
seconds, the whole KV's rate), whole writes and layer groups alike. Before the first, a
documented default by path: `DEFAULT_BYTES_PER_S`.

Over NIXL a write also costs something per address range it moves (a descriptor): one per run
of contiguous blocks for a whole write, one per block for a layer group. That cost is fitted
from the same writes (`LinkFit`) once their descriptor counts differ (a layer-wise write among
whole ones): the line `seconds = descriptors x per-descriptor + bytes / bandwidth`, so
the bandwidth then excludes the descriptors' share, and what a layer group's write costs while a
prefill runs on the same GPU (contention included) is what the next plan charges.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

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


_SCALE = np.array([1e-3, 1e-9])  # thousands of descriptors, GB: a sane system to solve
MIN_DESCRIPTOR_SPREAD = 4.0
"""`LinkFit` fits a per-descriptor cost only once the descriptor counts of its writes spread
this much (a weighted root mean square, in descriptors) apart from what their sizes explain."""


class LinkFit:
    """`seconds = a x + b y` over writes of `x` descriptors and `y` bytes, by least squares with
    each write's weight halving with every `half_life` newer ones: `a` is the cost of a
    descriptor (a write's own set-up shares it: a whole write is often one), `1 / b` the
    bandwidth. Pure."""

    def __init__(self, half_life: float = HALF_LIFE_SAMPLES) -> None:
        if half_life <= 0:
            raise ValueError("a half-life of at least one sample")
        self._keep = 0.5 ** (1.0 / half_life)
        self._m = np.zeros((2, 2))
        self._r = np.zeros(2)
        self._weight = 0.0

    def add(self, descriptors: int, num_bytes: int, seconds: float) -> None:
        """Add a write; one with nothing counted or timed is ignored."""
        if descriptors <= 0 or num_bytes <= 0 or seconds <= 0:
            return
        v = np.array([descriptors, num_bytes]) * _SCALE
        self._m = self._m * self._keep + np.outer(v, v)
        self._r = self._r * self._keep + v * seconds
        self._weight = self._weight * self._keep + 1.0

    def solve(self) -> tuple[float, float] | None:
        """(seconds per descriptor, bytes per second), or None while the writes' descriptor
        counts do not spread `MIN_DESCRIPTOR_SPREAD` apart from their sizes (every write the
        same shape), or the fit is not a line of positive bandwidth. A negative cost per
        descriptor is taken as none."""
        m = self._m
        if self._weight <= 0 or m[1, 1] <= 0:
            return None
        spread = m[0, 0] - m[0, 1] ** 2 / m[1, 1]  # of the descriptors, past the bytes' share
        if spread / self._weight < (MIN_DESCRIPTOR_SPREAD * _SCALE[0]) ** 2:
            return None
        a, b = np.linalg.solve(m, self._r) * _SCALE
        if a < 0:  # no cost per descriptor: the line through the sizes alone
            a, b = 0.0, self._r[1] / m[1, 1] * _SCALE[1]
        if b <= 0:
            return None
        return float(a), float(1.0 / b)


class PeerBandwidth:
    """Each peer's link bandwidth in bytes per second, from the writes to it that completed."""

    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        self.max_peers = max_peers
        self._links: OrderedDict[str, tuple[DecayedRatio, LinkFit]] = OrderedDict()

    def observe(self, peer: str, stats: TransferStats) -> None:
        """A write to `peer` completed (a failed one says nothing of the link's speed)."""
        known = self._links.pop(peer) if peer in self._links else None
        ratio, fit = known or (DecayedRatio(), LinkFit())
        ratio.add(stats.num_bytes, stats.seconds)
        fit.add(stats.descriptors, stats.num_bytes, stats.seconds)
        self._links[peer] = ratio, fit
        while len(self._links) > self.max_peers:
            self._links.popitem(last=False)

    def estimate(self, peer: str, transport: str) -> float:
        """`peer`'s measured bandwidth (the fitted line's once `per_descriptor_s` is known), or
        the default of `transport` before any write."""
        link = self._links.get(peer)
        if link is not None:
            fitted = link[1].solve()
            if fitted is not None:
                return fitted[1]
            if link[0].value is not None:
                return link[0].value
        return DEFAULT_BYTES_PER_S.get(transport, DEFAULT_NIXL_BYTES_PER_S)

    def per_descriptor_s(self, peer: str) -> float | None:
        """What one more descriptor costs a write to `peer`, None until `LinkFit` can say."""
        link = self._links.get(peer)
        fitted = link[1].solve() if link is not None else None
        return fitted[0] if fitted is not None else None

    def is_measured(self, peer: str) -> bool:
        link = self._links.get(peer)
        return link is not None and link[0].value is not None
