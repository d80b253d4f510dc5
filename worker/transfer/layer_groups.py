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
"""... and adds a group only while it lands the prompt this much sooner than one group less."""


def choose_num_groups(
    kv_bytes: int,
    bandwidth_bytes_per_s: float,
    prefill_s: float,
    setup_s: float,
    num_layers: int,
) -> int:
    """How many layer groups a prompt's KV should go in (0: one whole write), given the link's
    bandwidth, the prompt's KV bytes, the prefill's expected seconds and one write's set-up
    seconds (`kv_transfer_layer_groups: auto`, docs/layerwise.md). Pure.

    The model: the transfer takes `T = kv_bytes / bandwidth`; the prefill's layers take equal
    time, `P / L` each; a group's write takes its share of the transfer plus a set-up, `T / G +
    c`, and the writes run one after another, each once its group's last layer ran. Group `g`
    (from 0) is ready at `P (g + 1) / G`, so the last one lands at

        max over g of  P (g + 1) / G + (G - g) (T / G + c)  =  max(P + T/G + c,  P/G + T + G c)

    (linear in g: one end decides). The first term is the tail: the last group's transfer after
    the prefill, what grouping exists to shrink. The second is a link slower than the compute:
    every group's transfer and set-up after the first group's layers. A whole write lands at
    `P + T + c`. So groups pay when both the prefill and the transfer are long against a set-up:
    the saving is at most `min(P, T)`, the tail left `T / G`, and each group costs `c` once the
    link is the bottleneck. G grows from 1 while one more group lands the prompt at least
    `MIN_GROUP_GAIN_S` sooner (past that, a group's set-up buys almost nothing: the tail shrinks
    by `T / (G (G + 1))`), up to one group per layer; the answer is 0 when the best G saves less
    than `MIN_SAVING_S` against a whole write (a small transfer, a short prefill, a costly
    set-up: overlap that saves under a millisecond is not worth a write per group).
    """
    if kv_bytes < 0 or bandwidth_bytes_per_s <= 0 or prefill_s < 0 or setup_s < 0:
        raise ValueError("a positive bandwidth, and no negative bytes or seconds")
    if num_layers < 1:
        raise ValueError(f"a model of {num_layers} layers")
    transfer_s = kv_bytes / bandwidth_bytes_per_s

    def lands_s(groups: int) -> float:
        tail = prefill_s + transfer_s / groups + setup_s
        return max(tail, prefill_s / groups + transfer_s + groups * setup_s)

    groups = 1
    while groups < num_layers and lands_s(groups + 1) <= lands_s(groups) - MIN_GROUP_GAIN_S:
        groups += 1
    whole_s = prefill_s + transfer_s + setup_s
    return groups if lands_s(groups) <= whole_s - MIN_SAVING_S else 0
