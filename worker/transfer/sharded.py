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

A layer-wise write (docs/layerwise.md) is the same mechanism cut in two: `write_layers` moves
layers `[a, b)` of every shard, rank to rank, with no notification, and returns once every
shard's bytes landed; `notify` then sends the frames alone, one per rank from that rank's agent
(each after its own shard's writes, which its rank ran one at a time), rank 0's with the
payload, so the peer's assembler hands the payload over once every shard's frame came, as after
a whole write. `layer_checksums` is `block_checksums` of those layers: every shard, rank-major.
On CUDA a group's `ready` event is rank 0's, recorded after its layers; this waits for it on the
calling thread before any rank writes. That event passing means every rank's layers ran too:
each layer ends in row-parallel all-reduces over every rank, placed on each rank's stream after
its attention wrote the layer's KV, and rank 0's all-reduce completes only once every rank's
joined. On CPU the collectives block, and the engine calls after the layer.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Callable, Sequence
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
_ArgsOf = Callable[[int, str], tuple[Any, ...]]
"""A call's arguments on one rank: `(rank, that rank's agent of the peer) -> args`."""


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
        key = self._next_key()
        src, dst = list(src_block_ids), list(dst_block_ids)

        def args(rank: int, rank_peer: str) -> tuple[Any, ...]:
            note = frame(key, rank, self.size, notification if rank == 0 else b"")
            return rank_peer, src, dst, note, deadline_s

        return self._write_shards(peer, "write", args, deadline_s)

    supports_layers = True
    """`write_layers`, `notify` and `layer_checksums` work on every shard (module docstring)."""

    def write_layers(
        self,
        peer: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        layers: tuple[int, int],
        deadline_s: float,
        ready: Any = None,
    ) -> TransferStats:
        if ready is not None:  # rank 0's event: every rank's layers ran (module docstring)
            ready.synchronize()  # this thread waits; the engine's stream does not
        src, dst, span = list(src_block_ids), list(dst_block_ids), tuple(layers)

        def args(_rank: int, rank_peer: str) -> tuple[Any, ...]:
            return rank_peer, src, dst, span, deadline_s

        return self._write_shards(peer, "write_layers", args, deadline_s)

    def notify(self, peer: str, notification: bytes) -> None:
        key = self._next_key()

        def args(rank: int, rank_peer: str) -> tuple[Any, ...]:
            return rank_peer, frame(key, rank, self.size, notification if rank == 0 else b"")

        self._on_every_rank(peer, "notify", args, time.monotonic() + _CALL_TIMEOUT_S)

    def block_checksums(self, block_ids: Sequence[int]) -> tuple[str, ...]:
        return self._checksums("block_checksums", list(block_ids))

    def layer_checksums(self, block_ids: Sequence[int], layers: tuple[int, int]) -> tuple[str, ...]:
        return self._checksums("layer_checksums", list(block_ids), tuple(layers))

    def _next_key(self) -> str:
        """A key no other transfer of this writer has (its shards' frames carry it)."""
        return f"{self.local.agent_name}:{next(self._keys)}"

    def _write_shards(
        self, peer: str, method: str, args: _ArgsOf, deadline_s: float
    ) -> TransferStats:
        """`method` (`write` or `write_layers`) on every rank: what every shard moved together,
        and how long the slowest took."""
        started = time.perf_counter()
        stats: list[TransferStats] = self._on_every_rank(peer, method, args, deadline_s)
        seconds = time.perf_counter() - started
        return TransferStats(sum(s.num_bytes for s in stats), seconds, stats[0].transport)

    def _on_every_rank(self, peer: str, method: str, args: _ArgsOf, deadline_s: float) -> list[Any]:
        """`method(*args(rank, that rank's agent of the peer))` on every rank's connector, rank
        0's here while the others run theirs; the results in rank order. Raises TransferError
        when a rank's failed, once every rank's outcome is known (none still counted on)."""
        rank_peers = self._peers.get(peer)
        if rank_peers is None:
            raise TransferError(f"unknown or removed peer {peer}")
        calls: list[Future[Any]] = [
            client.call_async(method, *args(i, rank_peer))
            for i, (client, rank_peer) in enumerate(zip(self.ranks, rank_peers, strict=True), 1)
        ]
        try:
            own = getattr(self.local, method)(*args(0, peer))
        finally:  # every shard's outcome is known before this returns (or raises)
            results, errors = _wait_all(calls, deadline_s)
        if errors:
            raise TransferError(f"{len(errors)} of {self.size - 1} rank shards failed: {errors[0]}")
        return [own, *results]

    def _checksums(self, method: str, *args: Any) -> tuple[str, ...]:
        """`method`'s checksums on every rank, rank-major."""
        calls: list[Future[Any]] = [c.call_async(method, *args) for c in self.ranks]
        own = getattr(self.local, method)(*args)
        results, errors = _wait_all(calls, time.monotonic() + _CALL_TIMEOUT_S)
        if errors:
            raise TransferError(f"a rank's checksums are unknown: {errors[0]}")
        return tuple(own) + tuple(s for r in results for s in r)

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
