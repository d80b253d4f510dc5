"""The transfer interface and the pure helpers every transport shares.

A worker's KV cache is one contiguous region of `num_blocks` blocks of `block_bytes` each (layout
in `kvrail.worker.engine.kv_cache`), so block i is the byte range
`[i * block_bytes, (i + 1) * block_bytes)` and one registration covers the whole pool. A transfer
writes whole blocks from the local region into a peer's region and ends with a notification the
peer receives exactly once per successful transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class BlockRegion:
    """A registered KV region: a contiguous tensor viewed as `num_blocks` equal blocks."""

    tensor: torch.Tensor
    num_blocks: int

    def __post_init__(self) -> None:
        if not self.tensor.is_contiguous():
            raise ValueError("a KV region must be one contiguous tensor")
        if self.num_blocks < 1 or self.nbytes % self.num_blocks:
            raise ValueError(f"{self.nbytes} bytes do not split into {self.num_blocks} blocks")

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

    def block_bytes_view(self, block_id: int) -> torch.Tensor:
        """The raw bytes of one block (a view, no copy)."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} outside [0, {self.num_blocks})")
        flat = self.tensor.view(-1).view(torch.uint8)
        return flat[block_id * self.block_bytes : (block_id + 1) * self.block_bytes]


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one transfer moved, how long it took and over which path."""

    num_bytes: int
    seconds: float
    transport: str

    @property
    def bytes_per_s(self) -> float:
        return self.num_bytes / self.seconds if self.seconds > 0 else 0.0


def coalesce(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge block pairs into runs `(src_start, dst_start, length)` that are contiguous on both
    sides, so a transport issues one descriptor per run instead of one per block."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


class Connector(Protocol):
    """One transport. Implementations are not thread-safe; one owner calls them.

    Guarantees:
    - `write()` returns only after every byte landed in the peer's region, or raises
      `TransferError`; the notification is delivered to the peer only after a complete write.
    - A peer removed with `remove_peer()` is never written to again; a write to an unknown peer
      raises `TransferError` at once.
    - Block ids are checked against both regions before anything moves (no partial effect).
    """

    transport: str
    agent_name: str

    def metadata(self) -> bytes:
        """What a peer needs to reach this worker (published in its registry record)."""
        ...

    def add_peer(self, metadata: bytes) -> str:
        """Make a peer reachable from its `metadata()`; returns its agent name."""
        ...

    def remove_peer(self, agent_name: str) -> None: ...

    def write(
        self,
        peer: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        notification: bytes,
        deadline_s: float,
    ) -> TransferStats: ...

    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as (peer agent name, payload)."""
        ...

    def close(self) -> None: ...
