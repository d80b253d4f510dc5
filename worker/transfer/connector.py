"""The Protocol the roles see: one worker's end of every KV transfer, on one device or many.

`KvConnector` is the one-device worker's (one NIXL agent over its one KV region);
`ShardedConnector` a tensor-parallel worker's (one agent per rank, each over its KV shard,
driven from rank 0). The roles use only what is here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvrail.worker.kv_cache import KVCache
from kvrail.worker.transfer.blocks import TransferStats


class Connector(Protocol):
    """Guarantees (each implementation states how it keeps them):
    - `write()` returns only after every byte of every shard landed in the peer's region(s), or
      raises `TransferError`; the peer hands the notification over (`notifications()`) only
      after every shard of the write landed.
    - A peer removed with `remove_peer()` is never written to again; a write to an unknown peer
      raises `TransferError` at once; block ids are checked before anything moves.
    - `add_peer` refuses a peer of another layout (block size, memory kind, number of ranks).
    - `block_checksums(ids)` covers every shard of those blocks, in a fixed order (rank-major),
      so the same KV gives the same checksums on both sides of a transfer.
    """

    transport: str
    """The path to a peer that is not on CUDA IPC (what the worker's record reports)."""

    @property
    def region(self) -> KVCache:
        """Rank 0's KV region (the whole region on one device)."""
        ...

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every shard (what a transfer of one block moves)."""
        ...

    def metadata(self) -> bytes:
        """Rank 0's agent metadata, framed with its region's geometry."""
        ...

    def rank_metadata(self) -> tuple[bytes, ...]:
        """The same for ranks 1..N-1 (empty on one device)."""
        ...

    def add_peer(self, metadata: bytes, rank_metadata: Sequence[bytes] = ()) -> str:
        """Load a peer from its `metadata()` and `rank_metadata()`; returns its agent name."""
        ...

    def remove_peer(self, agent_name: str) -> None: ...

    def transport_to(self, peer: str) -> str: ...

    def write(
        self,
        peer: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        notification: bytes,
        deadline_s: float,
    ) -> TransferStats: ...

    def block_checksums(self, block_ids: Sequence[int]) -> tuple[str, ...]: ...

    supports_layers: bool
    """Whether the three layer-wise calls below work (else they raise `TransferError`):
    `write_layers` moves layers `[a, b)` of blocks with no notification, once `ready` (a CUDA
    event, or None) passed, and returns once they landed; `notify` sends a notification alone;
    `layer_checksums` is `block_checksums` of layers `[a, b)` only (docs/layerwise.md)."""

    def write_layers(
        self,
        peer: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        layers: tuple[int, int],
        deadline_s: float,
        ready: Any = None,
    ) -> TransferStats: ...

    def notify(self, peer: str, notification: bytes) -> None: ...

    def layer_checksums(
        self, block_ids: Sequence[int], layers: tuple[int, int]
    ) -> tuple[str, ...]: ...

    def notifications(self) -> list[tuple[str, bytes]]: ...

    def close(self) -> None: ...
