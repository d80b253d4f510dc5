"""Layer groups of a layer-wise KV transfer (docs/layerwise.md): which layers each group holds,
which bytes of a block they are, and their checksums. Pure but for reading a region's bytes.

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


def bad_groups(want: Sequence[str], got: Sequence[str], num_blocks: int) -> list[int]:
    """The groups (indices) whose checksums differ, for group-major lists of equal length."""
    if num_blocks < 1 or len(want) != len(got) or len(want) % num_blocks:
        raise ValueError("checksum lists of different shapes")
    return [
        g
        for g in range(len(want) // num_blocks)
        if want[g * num_blocks : (g + 1) * num_blocks] != got[g * num_blocks : (g + 1) * num_blocks]
    ]
