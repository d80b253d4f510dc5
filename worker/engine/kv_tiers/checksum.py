"""Block checksums computed where the block is: on the GPU for a GPU cache, with torch alone.

A block's checksum is taken from its GPU bytes when it is written behind to the host tier, stored
beside it (in host memory and in its disk file), and taken again from the GPU bytes a load wrote,
so one comparison covers every hop: host memory, the disk file, both copies. Computing it where
the bytes are keeps the host's CPU out of a load's path (a CPU hash of 1 GiB takes 50 ms or more,
longer than the copy over PCIe) and needs nothing beyond torch.

The function: the block viewed as int32 words w_i, sum_i w_i * k_i over int64 with wrap-around,
where k_i are fixed odd 64-bit multipliers. Changing any one word by d != 0 changes the sum by
d * k_i, which is never 0 modulo 2^64 for an odd k_i and |d| < 2^32: every single corrupted word
is caught; several corrupted words go unnoticed with probability about 2^-64 for unstructured
damage. It is a check against corruption, not against an adversary (nothing untrusted writes the
tiers).
"""

from __future__ import annotations

import torch

_CHUNK_BYTES = 64 << 20
"""Bytes of blocks summed per pass (the int64 temporaries are twice that): bounds the memory a
checksum needs whatever the number of blocks."""

_multipliers: dict[tuple[int, torch.device], torch.Tensor] = {}


def _keys(num_words: int, device: torch.device) -> torch.Tensor:
    key = (num_words, device)
    keys = _multipliers.get(key)
    if keys is None:
        generator = torch.Generator().manual_seed(0x6B7672)  # fixed: checksums outlive processes
        raw = torch.randint(-(2**62), 2**62, (num_words,), dtype=torch.int64, generator=generator)
        keys = _multipliers[key] = (raw | 1).to(device)
    return keys


def block_checksums(region: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The checksums (int64, on the region's device) of `region[block_ids]`, where `region` is a
    `[num_blocks, block_bytes]` uint8 view of a KV cache. Queued on the current stream."""
    block_bytes = region.shape[1]
    if block_bytes % 4:
        raise ValueError(f"a block of {block_bytes} bytes is not whole int32 words")
    words = region.view(torch.int32)  # [num_blocks, block_bytes // 4]
    keys = _keys(words.shape[1], region.device)
    step = max(1, _CHUNK_BYTES // block_bytes)
    out = torch.empty(len(block_ids), dtype=torch.int64, device=region.device)
    for start in range(0, len(block_ids), step):
        rows = words.index_select(0, block_ids[start : start + step]).to(torch.int64)
        out[start : start + step] = (rows * keys).sum(dim=1)
    return out
