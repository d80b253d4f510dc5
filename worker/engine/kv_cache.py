"""The worker's KV cache: ONE preallocated tensor, so one NIXL registration covers it.

Layout: `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` (2 = K, V), contiguous.
Block b is the byte range `[b * block_nbytes, (b + 1) * block_nbytes)` of the region and holds its
tokens' K and V for every layer, so moving a block to another worker is one contiguous copy and a
transfer descriptor is pure arithmetic. Layer l's K cache is the strided view `[:, l, 0]` of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`, which is what the kernels take. This layout
is "NHD" in the model fingerprint.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = block_size

    @property
    def block_nbytes(self) -> int:
        return self.tensor[0].numel() * self.tensor.element_size()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def block_byte_range(self, block_id: int) -> tuple[int, int]:
        """Offsets of a block inside the region: [start, end) bytes from `tensor.data_ptr()`."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} outside 0..{self.num_blocks - 1}")
        return block_id * self.block_nbytes, (block_id + 1) * self.block_nbytes

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) views of one layer, each [num_blocks, block_size, Hkv, D]."""
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
