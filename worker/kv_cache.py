"""The worker's KV cache: ONE contiguous tensor, so one NIXL registration covers it.

The same object is the engine's cache and the transfer's region. Layout (`allocate`):
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` (2 = K, V), contiguous. Block b
is the byte range `[b * block_bytes, (b + 1) * block_bytes)` of the region and holds its tokens'
K and V for every layer, so moving a block to another worker is one contiguous copy and a
transfer descriptor is pure arithmetic. Layer l's K cache is the strided view `[:, l, 0]` of
shape `[num_blocks, block_size, num_kv_heads, head_dim]`, which is what the kernels take. This
layout is "NHD" in the model fingerprint.

Blocks contiguous in two regions (or two places of one) form runs (`coalesce`): one copy or one
transfer descriptor each instead of one per block.

Transfer code and its tests may also wrap any contiguous tensor as `num_blocks` equal blocks
(`KVCache(tensor, num_blocks)`); only an allocated cache has layers.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True, slots=True, eq=False)
class KVCache:
    """A contiguous tensor viewed as `num_blocks` equal blocks; see the module docstring."""

    tensor: torch.Tensor
    num_blocks: int

    def __post_init__(self) -> None:
        if not self.tensor.is_contiguous():
            raise ValueError("a KV region must be one contiguous tensor")
        if self.num_blocks < 1 or self.nbytes % self.num_blocks:
            raise ValueError(f"{self.nbytes} bytes do not split into {self.num_blocks} blocks")

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """A zeroed cache in the engine's layout."""
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), num_blocks)

    @property
    def num_layers(self) -> int:
        return int(self._layout()[1])

    @property
    def block_size(self) -> int:
        return int(self._layout()[3])

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def block_bytes(self) -> int:
        return self.nbytes // self.num_blocks

    @property
    def base_address(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def device_id(self) -> int:
        return self.tensor.device.index or 0 if self.tensor.is_cuda else 0

    def block_byte_range(self, block_id: int) -> tuple[int, int]:
        """Offsets of a block inside the region: [start, end) bytes from `tensor.data_ptr()`."""
        self._check(block_id)
        return block_id * self.block_bytes, (block_id + 1) * self.block_bytes

    def block_bytes_view(self, block_id: int) -> torch.Tensor:
        """The raw bytes of one block (a view, no copy)."""
        start, end = self.block_byte_range(block_id)
        return self.tensor.view(-1).view(torch.uint8)[start:end]

    def zero_blocks(self, block_ids: torch.Tensor) -> None:
        """Zero the given blocks' bytes (every layer, K and V): 0.0 in every float dtype. On a
        GPU the fill is queued on the current stream."""
        self.tensor.view(torch.uint8).index_fill_(0, block_ids, 0)  # no FP8 fill in torch

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) views of one layer, each [num_blocks, block_size, Hkv, D]."""
        self._layout()
        return self.tensor[:, layer_idx, 0], self.tensor[:, layer_idx, 1]

    @staticmethod
    def num_blocks_for_bytes(
        nbytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many blocks fit in `nbytes` of memory."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return nbytes // (2 * num_layers * block_size * num_kv_heads * head_dim * itemsize)

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} outside 0..{self.num_blocks - 1}")

    def _layout(self) -> torch.Size:
        if self.tensor.dim() != 6:
            raise ValueError("this KV region was not allocated in the engine's layout")
        return self.tensor.shape


def coalesce(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge block pairs into runs `(src_start, dst_start, length)` that are contiguous on both
    sides, so a transport issues one descriptor per run instead of one per block."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    src, dst = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    return runs_at(src, dst, run_starts(src, dst))


def run_starts(src_ids: Any, dst_ids: Any) -> list[int]:
    """The indices where the runs of `coalesce` start, for two int64 arrays of equal length
    (vectorized: a handoff of an 8k prompt has 512 blocks)."""
    return [0, *(np.flatnonzero(_breaks(src_ids, dst_ids)) + 1).tolist()] if src_ids.size else []


def count_runs(src_ids: Any, dst_ids: Any) -> int:
    """How many runs `coalesce` would find, without listing them (for 512 scattered blocks
    about half of `run_starts`'s 15 us on the VM: bench/studies/handoff/id_checks.py)."""
    return int(np.count_nonzero(_breaks(src_ids, dst_ids))) + 1 if src_ids.size else 0


def _breaks(src_ids: Any, dst_ids: Any) -> Any:
    """Whether block i + 1 starts a new run, for each i."""
    return (np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)


def runs_at(src_ids: Any, dst_ids: Any, starts: list[int]) -> list[tuple[int, int, int]]:
    """The runs `(src_start, dst_start, length)` that begin at `starts` (`run_starts`)."""
    bounds = itertools.pairwise([*starts, src_ids.size])
    return [(int(src_ids[a]), int(dst_ids[a]), b - a) for a, b in bounds]
