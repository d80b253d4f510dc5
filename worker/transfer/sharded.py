"""A tensor-parallel worker's end of every KV transfer: one NIXL agent per rank, driven by rank 0.

Rank i's KV shard (its KV heads of every block) is registered by rank i's own agent; rank 0's
is local (`KvConnector`), the others are reached over their links (`rank_link.py`). The worker's
record lists every rank's region (`metadata()` and `rank_metadata()`), and `add_peer` loads a
peer's rank i into our rank i, refusing a peer with another number of ranks: transfers only go
between workers of one layout (the fingerprint says the same), rank i to rank i, no re-sharding.

`write()` moves every shard at once, rank i's blocks from our rank i into the peer's rank i,
each write carrying a shard frame (`shard_notes.py`) as its notification, rank 0's with the
payload; it returns when every shard's write completed, or raises `TransferError` if any failed
(the peer then never hands the payload over: its shards never all arrive). On the receiving
side `notifications()` hands a payload over only once every shard of its write has arrived.
`block_checksums` covers every shard, rank-major.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from kvrail.errors import TransferError
from kvrail.worker.kv_cache import KVCache
from kvrail.worker.transfer.blocks import TransferStats
from kvrail.worker.transfer.kv_connector import KvConnector
from kvrail.worker.transfer.rank_link import RankTransferClient
from kvrail.worker.transfer.shard_notes import ShardAssembler, ShardFrameError, frame

log = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 30.0  # a rank's answer to a call that moves no KV
T = TypeVar("T")


class ShardedConnector:
    """See the module docstring and `connector.Connector` for the guarantees."""

    transport = KvConnector.transport

    def __init__(
        self,
        local: KvConnector,
        ranks: Sequence[RankTransferClient],
        rank_metadata: Sequence[bytes],
    ) -> None:
        if not ranks or len(rank_metadata) != len(ranks):
            raise ValueError("a sharded connector needs every other rank and its metadata")
        self.local = local
        self.ranks = list(ranks)
        self.size = len(ranks) + 1
        self._rank_metadata = tuple(rank_metadata)
        self._peers: dict[str, list[str]] = {}  # peer rank 0's agent -> its ranks' agents
        self._assembler = ShardAssembler(self.size)
        self._keys = itertools.count()

    @property
    def num_partial_writes(self) -> int:
        """Received writes held back: some of their shards have not arrived (yet, or ever)."""
        return self._assembler.num_pending

    @property
    def region(self) -> KVCache:
        return self.local.region

    @property
    def block_bytes(self) -> int:
        return self.local.block_bytes * self.size

    def metadata(self) -> bytes:
        return self.local.metadata()

    def rank_metadata(self) -> tuple[bytes, ...]:
        return self._rank_metadata

    def add_peer(self, metadata: bytes, rank_metadata: Sequence[bytes] = ()) -> str:
        if len(rank_metadata) != len(self.ranks):
            raise TransferError(
                f"peer runs {len(rank_metadata) + 1} tensor-parallel ranks, this worker "
                f"{self.size}: their KV shards do not match"
            )
        name = self.local.add_peer(metadata)
        added: list[tuple[RankTransferClient, str]] = []
        try:
            for client, meta in zip(self.ranks, rank_metadata, strict=True):
                added.append((client, client.call("add_peer", meta, timeout_s=_CALL_TIMEOUT_S)))
        except TransferError:
            for client, rank_name in added:
                _quietly(client, "remove_peer", rank_name)
            self.local.remove_peer(name)
            raise
        self._peers[name] = [rank_name for _, rank_name in added]
        return name

    def remove_peer(self, agent_name: str) -> None:
        for client, rank_name in zip(self.ranks, self._peers.pop(agent_name, []), strict=False):
            _quietly(client, "remove_peer", rank_name)
        self.local.remove_peer(agent_name)

    def transport_to(self, peer: str) -> str:
        return self.local.transport_to(peer)

    def write(
        self,
        peer: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        notification: bytes,
        deadline_s: float,
    ) -> TransferStats:
        rank_peers = self._peers.get(peer)
        if rank_peers is None:
            raise TransferError(f"unknown or removed peer {peer}")
        key = f"{self.local.agent_name}:{next(self._keys)}"
        src, dst = list(src_block_ids), list(dst_block_ids)
        started = time.perf_counter()
        shards: list[Future[Any]] = [
            client.call_async("write", rank_peer, src, dst, frame(key, i, self.size), deadline_s)
            for i, (client, rank_peer) in enumerate(zip(self.ranks, rank_peers, strict=True), 1)
        ]
        try:
            own = self.local.write(
                peer, src, dst, frame(key, 0, self.size, notification), deadline_s
            )
        finally:  # every shard's outcome is known before this returns (or raises)
            results, errors = _wait_all(shards, deadline_s)
        if errors:
            raise TransferError(f"{len(errors)} of {self.size - 1} rank shards failed: {errors[0]}")
        num_bytes = own.num_bytes + sum(r.num_bytes for r in results)
        return TransferStats(num_bytes, time.perf_counter() - started, own.transport)

    def block_checksums(self, block_ids: Sequence[int]) -> tuple[str, ...]:
        ids = list(block_ids)
        calls: list[Future[Any]] = [c.call_async("block_checksums", ids) for c in self.ranks]
        own = self.local.block_checksums(ids)
        results, errors = _wait_all(calls, time.monotonic() + _CALL_TIMEOUT_S)
        if errors:
            raise TransferError(f"a rank's checksums are unknown: {errors[0]}")
        return own + tuple(s for r in results for s in r)

    supports_layers = False
    """Layer-wise writes are not implemented over shards yet (docs/layerwise.md)."""

    def write_layers(
        self,
        peer: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        layers: tuple[int, int],
        deadline_s: float,
        ready: Any = None,
    ) -> TransferStats:
        raise TransferError("layer-wise KV writes are not supported with tensor parallelism")

    def notify(self, peer: str, notification: bytes) -> None:
        raise TransferError("layer-wise KV writes are not supported with tensor parallelism")

    def layer_checksums(self, block_ids: Sequence[int], layers: tuple[int, int]) -> tuple[str, ...]:
        raise TransferError("layer-wise KV checksums are not supported with tensor parallelism")

    def notifications(self) -> list[tuple[str, bytes]]:
        notes = self.local.notifications()
        for client in self.ranks:
            notes += client.notifications()
        out = []
        now = time.monotonic()
        for peer, note in notes:
            try:
                payload = self._assembler.add(note, now)
            except ShardFrameError as err:
                log.warning("ignoring a KV notification peer=%s error=%s", peer, err)
                continue
            if payload is not None:
                out.append((peer, payload))
        return out

    def close(self) -> None:
        for peer in list(self._peers):
            self.remove_peer(peer)
        for client in self.ranks:
            client.close()
        self.local.close()


def _wait_all(futures: list[Future[T]], deadline_s: float) -> tuple[list[T], list[Exception]]:
    """Every future's result, and the errors of those that failed, waiting until `deadline_s`
    (monotonic) at most: when this returns, no call is still counted on."""
    results: list[T] = []
    errors: list[Exception] = []
    for future in futures:
        try:
            results.append(future.result(max(deadline_s - time.monotonic(), 0.0) + 1.0))
        except concurrent.futures.TimeoutError:
            errors.append(TransferError("a rank's call passed its deadline"))
        except TransferError as err:
            errors.append(err)
    return results, errors


def _quietly(client: RankTransferClient, method: str, *args: object) -> None:
    try:
        client.call(method, *args, timeout_s=_CALL_TIMEOUT_S)
    except TransferError as err:
        log.warning("rank call failed rank=%d method=%s error=%s", client.rank, method, err)
