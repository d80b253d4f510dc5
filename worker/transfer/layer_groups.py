"""Layer groups of a layer-wise KV transfer (docs/layerwise.md): which layers each group holds,
which bytes of a block they are, their checksums, and how many groups a prompt should go in
(`choose_num_groups`, for `kv_transfer_layer_groups: auto`). Pure but for reading a region's
bytes.

A plan is written as the groups' end layers, in order: `(8, 16, 24, 32)` is four groups of
eight layers of a 32-layer model. Group g holds layers `[ends[g - 1], ends[g])` (the first from
0). In the KV layout (`kv_cache.py`, `[block, layer, K/V, token, head, dim]`) a block's layers
`[a, b)` are one contiguous byte range, so a group's transfer is one range per block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrail.errors import TransferError
from kvrail.worker.kv_cache import KVCache

LayerGroups = tuple[int, ...]
"""The groups' end layers, strictly increasing, the last being the model's number of layers."""


def plan_groups(num_layers: int, num_groups: int) -> LayerGroups:
    """`min(num_groups, num_layers)` groups of consecutive layers, as equal as they can be (the
    first `num_layers mod G` have one layer more); () when `num_groups` is 0 (layer-wise off)."""
    if num_layers < 1 or num_groups < 0:
        raise ValueError(f"cannot plan {num_groups} groups of {num_layers} layers")
    groups = min(num_groups, num_layers)
    if not groups:
        return ()
    size, extra = divmod(num_layers, groups)
    ends, end = [], 0
    for g in range(groups):
        end += size + (g < extra)
        ends.append(end)
    return tuple(ends)


def check_groups(ends: Sequence[int], num_layers: int) -> None:
    """Raise TransferError unless `ends` is a plan of this many layers (what a peer sent)."""
    starts = (0, *ends[:-1])
    if not ends or ends[-1] != num_layers or any(b <= a for a, b in zip(starts, ends, strict=True)):
        raise TransferError(f"layer groups {tuple(ends)} do not cover {num_layers} layers in order")


def group_layers(ends: Sequence[int], group: int) -> tuple[int, int]:
    """Group `group`'s layers `[first, end)`."""
    return (ends[group - 1] if group else 0), ends[group]


def completed_group(ends: Sequence[int], num_layers_done: int) -> int | None:
    """The group whose last layer is layer `num_layers_done - 1`, if one is (None otherwise)."""
    for g, end in enumerate(ends):
        if end == num_layers_done:
            return g
    return None


def layer_byte_range(region: KVCache, block_id: int, layers: tuple[int, int]) -> tuple[int, int]:
    """Bytes `[start, end)` of `block_id`'s layers `[a, b)` inside the region."""
    start, _ = region.block_byte_range(block_id)
    per_layer = region.block_bytes // region.num_layers
    return start + layers[0] * per_layer, start + layers[1] * per_layer


def layer_checksums(
    region: KVCache, block_ids: Sequence[int], layers: tuple[int, int]
) -> tuple[str, ...]:
    """8-byte BLAKE2b of each block's bytes of layers `[a, b)`, in order (copied to host memory
    for a GPU region); the group's part of `PrefillDone.block_checksums`."""
    flat = region.tensor.view(-1).view(torch.uint8)
    out = []
    for block_id in block_ids:
        start, end = layer_byte_range(region, block_id, layers)
        data = flat[start:end]
        data = data.cpu() if data.is_cuda else data
        out.append(hashlib.blake2b(data.numpy().tobytes(), digest_size=8).hexdigest())
    return tuple(out)


def bad_groups(
    want: Sequence[str], got: Sequence[str], num_groups: int, num_blocks: int
) -> list[tuple[int, int]]:
    """The (group, shard) pairs whose checksums differ, for lists of equal length, group-major
    and shard-major within a group (`num_blocks` per shard: what `Connector.layer_checksums`
    gives per group, one shard on one device, every rank's on a tensor-parallel worker)."""
    per_group = num_groups * num_blocks
    if num_groups < 1 or num_blocks < 1 or len(want) != len(got) or len(want) % per_group:
        raise ValueError("checksum lists of different shapes")
    num_shards = len(want) // per_group
    return [
        divmod(part, num_shards)
        for part in range(num_groups * num_shards)
        if list(want[part * num_blocks : (part + 1) * num_blocks])
        != list(got[part * num_blocks : (part + 1) * num_blocks])
    ]


MIN_SAVING_S = 1e-3
"""`choose_num_groups` writes the prompt whole unless groups land it this much sooner."""
MIN_GROUP_GAIN_S = 1e-4
"""... and takes a group more only where that lands the prompt at least this much sooner per
group added."""


@dataclass(frozen=True, slots=True)
class WriteCost:
    """What one write costs beyond its bytes' time on the link: a set-up, and per block (one
    NIXL descriptor each: a group's layers are one range per block) seconds that differ by
    whether the prefill still runs (`busy_block_s`: the write shares the GPU with the prefill's
    compute) or has ended (`idle_block_s`). A write's blocks go at the busy cost until the
    prefill ends and at the idle cost after it, while its bytes go at the link's bandwidth: it
    lands after its set-up and the slower of the two (measured on the lent H100:
    docs/layerwise.md)."""

    setup_s: float
    busy_block_s: float = 0.0
    idle_block_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.setup_s, self.busy_block_s, self.idle_block_s) < 0:
            raise ValueError("a write cost of negative seconds")

    def blocks_done_s(self, start_s: float, num_blocks: int, prefill_s: float) -> float:
        """When `num_blocks` descriptors posted at `start_s` are through: at the busy cost
        until `prefill_s`, at the idle cost after it."""
        if start_s < prefill_s:
            busy_s = prefill_s - start_s
            if num_blocks * self.busy_block_s <= busy_s:
                return start_s + num_blocks * self.busy_block_s
            done = busy_s / self.busy_block_s  # > 0: busy_block_s > 0 here
            return prefill_s + (num_blocks - done) * self.idle_block_s
        return start_s + num_blocks * self.idle_block_s


def lands_s(
    num_groups: int, transfer_s: float, prefill_s: float, num_blocks: int, cost: WriteCost
) -> float:
    """Seconds from the prefill's start to the last group's landing when a prompt goes in
    `num_groups` groups (1: one write after the prefill, as a whole write). Pure.

    The prefill's layers take equal time, so group `g` (from 0) is ready at `P (g + 1) / G`;
    the writes run one after another, each once its group is ready and the write before it
    landed, each carrying `T / G` of the transfer and every block (`WriteCost`: a write begun
    during the prefill pays the busy cost only for the blocks it posts before the prefill
    ends)."""
    end = 0.0
    for group in range(num_groups):
        start = max(prefill_s * (group + 1) / num_groups, end) + cost.setup_s
        end = max(start + transfer_s / num_groups, cost.blocks_done_s(start, num_blocks, prefill_s))
    return end


def choose_num_groups(
    kv_bytes: int,
    bandwidth_bytes_per_s: float,
    prefill_s: float,
    num_blocks: int,
    cost: WriteCost,
    num_layers: int,
) -> int:
    """How many layer groups a prompt's KV should go in (0: one whole write), given the link's
    bandwidth, the prompt's KV bytes and blocks, the prefill's expected seconds and what a write
    costs (`kv_transfer_layer_groups: auto`, docs/layerwise.md). Pure.

    Each count from 1 to one group per layer is played out by `lands_s`. Without a per-block
    cost that is `max(P + T/G + c, P/G + T + G c)` (T the transfer, P the prefill, c the
    set-up): the tail after the prefill, or, over a link slower than the compute, every group's
    transfer and set-up after the first group's layers; the saving against a whole write (`P +
    T + c`) is at most `min(P, T)`. A per-block cost while the prefill runs makes small groups
    dear until the prefill ends, after which only their bytes count: so a few large groups
    during the prefill, not many small ones. The answer is the fewest groups that no larger
    count beats by `MIN_GROUP_GAIN_S` per group added, or 0 when that saves less than
    `MIN_SAVING_S` against a whole write (a small transfer, a short prefill, a costly set-up).
    """
    if kv_bytes < 0 or bandwidth_bytes_per_s <= 0 or prefill_s < 0 or num_blocks < 0:
        raise ValueError("a positive bandwidth, and no negative bytes, blocks or seconds")
    if num_layers < 1:
        raise ValueError(f"a model of {num_layers} layers")
    transfer_s = kv_bytes / bandwidth_bytes_per_s
    times = [lands_s(g, transfer_s, prefill_s, num_blocks, cost) for g in range(1, num_layers + 1)]
    groups = next(
        g
        for g in range(1, num_layers + 1)
        if all(
            times[more - 1] > times[g - 1] - MIN_GROUP_GAIN_S * (more - g)
            for more in range(g + 1, num_layers + 1)
        )
    )
    return groups if times[groups - 1] <= times[0] - MIN_SAVING_S else 0
