"""The tensor-parallel KV transfer over real NIXL agents (CPU, one process): two workers of two
ranks each, every rank its own agent over its own shard, rank 1 reached through its link as a
worker reaches it (`rank_link.serve_transfers` on a thread, `RankTransferClient` on a socket).

A write moves each shard rank to rank and the payload comes out on the receiving side once, when
every shard landed; checksums cover every shard; a peer of another layout is refused; a write
whose rank is gone fails, and its payload never comes out. A layer-wise write (docs/layerwise.md)
moves each group of layers of every shard, then its completion alone, which comes out once
every rank's frame came; its checksums per group cover every shard, and the envelope names the
group and the rank whose bytes differ."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import pytest
import torch

from kvrail.errors import TransferError
from kvrail.messages import PrefillDone
from kvrail.worker.kv_cache import KVCache
from kvrail.worker.transfer.envelope import EnvelopeError, Reservation, checksums_of, validate
from kvrail.worker.transfer.kv_connector import KvConnector
from kvrail.worker.transfer.layer_groups import group_layers, plan_groups
from kvrail.worker.transfer.rank_link import RankTransferClient, serve_transfers
from kvrail.worker.transfer.sharded import ShardedConnector

NUM_BLOCKS = 8


@dataclass
class Worker:
    """A two-rank worker's transfer side: rank 0's sharded connector, rank 1 behind its link."""

    connector: ShardedConnector
    regions: list[KVCache]
    rank1: KvConnector
    server: threading.Thread
    stopping: threading.Event = field(default_factory=threading.Event)
    notes: list[tuple[str, bytes]] = field(default_factory=list)

    def poll(self) -> None:  # the decode role's poller, on its own thread here
        while not self.stopping.is_set():
            self.notes.extend(self.connector.notifications())
            time.sleep(0.002)


def make_worker(name: str, fill: float, num_layers: int = 0) -> Worker:
    """Two ranks' regions of `NUM_BLOCKS` blocks, flat (64 floats a block) or in the engine's
    layout with `num_layers` layers (random values, one seed per worker and rank)."""
    if num_layers:
        regions = [
            KVCache.allocate(NUM_BLOCKS, num_layers, 4, 2, 8, torch.float32) for _ in range(2)
        ]
        for r, region in enumerate(regions):
            seeded = torch.Generator().manual_seed(int(fill) * 10 + r)
            region.tensor.copy_(torch.randn(region.tensor.shape, generator=seeded))
    else:
        regions = [KVCache(torch.full((NUM_BLOCKS, 64), fill + r), NUM_BLOCKS) for r in range(2)]
    rank1 = KvConnector(f"{name}-rank1", regions[1])
    ours, theirs = socket.socketpair()
    stopping = threading.Event()
    server = threading.Thread(
        target=serve_transfers, args=(Connection(theirs.detach()), rank1, stopping), daemon=True
    )
    server.start()
    client = RankTransferClient(1, Connection(ours.detach()))
    connector = ShardedConnector(KvConnector(name, regions[0]), [client], [rank1.metadata()])
    return Worker(connector, regions, rank1, server, stopping)


@pytest.fixture(params=[0], ids=["flat"])
def workers(request: pytest.FixtureRequest) -> Iterator[tuple[Worker, Worker]]:
    num_layers = request.param
    src, dst = make_worker("prefill", 1.0, num_layers), make_worker("decode", 10.0, num_layers)
    poller = threading.Thread(target=dst.poll, daemon=True)
    poller.start()
    try:
        yield src, dst
    finally:
        for w in (src, dst):
            w.stopping.set()
        poller.join(5)
        for w in (src, dst):
            w.connector.close()
            w.server.join(5)
            w.rank1.close()


def wait_notes(worker: Worker, timeout_s: float = 5.0) -> list[tuple[str, bytes]]:
    deadline = time.monotonic() + timeout_s
    while not worker.notes and time.monotonic() < deadline:
        time.sleep(0.01)
    return worker.notes


def test_each_shard_goes_rank_to_rank_and_the_payload_comes_once_all_landed(
    workers: tuple[Worker, Worker],
) -> None:
    src, dst = workers
    peer = src.connector.add_peer(dst.connector.metadata(), dst.connector.rank_metadata())
    stats = src.connector.write(peer, [1, 2], [5, 6], b"prefill-done", time.monotonic() + 10)
    assert stats.num_bytes == 2 * 2 * src.regions[0].block_bytes  # 2 blocks, 2 shards
    assert [payload for _, payload in wait_notes(dst)] == [b"prefill-done"]
    for rank in (0, 1):
        assert torch.equal(dst.regions[rank].tensor[5:7], src.regions[rank].tensor[1:3])
    assert dst.regions[0].tensor[5, 0] == 1.0 and dst.regions[1].tensor[5, 0] == 2.0
    sums = src.connector.block_checksums([1, 2])
    assert len(sums) == 4 and dst.connector.block_checksums([5, 6]) == sums
    dst.regions[1].tensor[6, 3] += 1.0  # rank 1's shard of the second block
    landed = dst.connector.block_checksums([5, 6])
    assert [a == b for a, b in zip(landed, sums, strict=True)] == [True, True, True, False]


def test_a_peer_of_another_layout_is_refused(workers: tuple[Worker, Worker]) -> None:
    src, dst = workers
    with pytest.raises(TransferError, match="1 tensor-parallel ranks, this worker 2"):
        src.connector.add_peer(dst.connector.metadata())  # as a one-device worker lists itself
    single = KvConnector("single", KVCache(torch.zeros(NUM_BLOCKS, 64), NUM_BLOCKS))
    try:
        with pytest.raises(TransferError, match="runs 2 tensor-parallel ranks, this worker one"):
            single.add_peer(dst.connector.metadata(), dst.connector.rank_metadata())
    finally:
        single.close()


def test_a_write_whose_rank_is_gone_fails_and_its_payload_never_comes_out(
    workers: tuple[Worker, Worker],
) -> None:
    src, dst = workers
    peer = src.connector.add_peer(dst.connector.metadata(), dst.connector.rank_metadata())
    src.stopping.set()  # the source's rank 1 stops serving: its link closes
    src.server.join(5)
    with pytest.raises(TransferError, match="rank shards failed: rank 1 is gone"):
        src.connector.write(peer, [1], [3], b"never", time.monotonic() + 5)
    assert torch.equal(dst.regions[0].tensor[3], src.regions[0].tensor[1])  # rank 0's landed
    deadline = time.monotonic() + 5
    while dst.connector.num_partial_writes < 1:  # and its note arrived, held back
        assert time.monotonic() < deadline, "rank 0's shard note never arrived"
        time.sleep(0.01)
    assert dst.notes == []  # the payload stays back: rank 1's shard never came
    with pytest.raises(TransferError, match="rank 1 is gone"):
        src.connector.block_checksums([1])


@pytest.mark.parametrize("workers", [4], ids=["4-layers"], indirect=True)
def test_a_layer_wise_write_moves_each_group_of_every_shard_then_its_completion_alone(
    workers: tuple[Worker, Worker],
) -> None:
    src, dst = workers
    peer = src.connector.add_peer(dst.connector.metadata(), dst.connector.rank_metadata())
    groups = plan_groups(4, 2)  # layers [0, 2) and [2, 4)
    src_ids, dst_ids = [1, 2, 5], [6, 0, 3]
    before = [r.tensor.clone() for r in dst.regions]
    stats = src.connector.write_layers(peer, src_ids, dst_ids, (0, 2), time.monotonic() + 10)
    assert stats.num_bytes == 3 * 2 * src.regions[0].block_bytes // 2  # 3 blocks, 2 of 4 layers
    for rank in (0, 1):  # the first group's layers landed, rank to rank; nothing else moved
        dst_rows, src_rows = dst.regions[rank].tensor[dst_ids], src.regions[rank].tensor[src_ids]
        assert torch.equal(dst_rows[:, :2], src_rows[:, :2])
        assert torch.equal(dst_rows[:, 2:], before[rank][dst_ids][:, 2:])
    src.connector.write_layers(peer, src_ids, dst_ids, (2, 4), time.monotonic() + 10)
    time.sleep(0.1)
    assert dst.notes == []  # layer groups carry no notification
    sums = tuple(
        checksum
        for g in range(len(groups))
        for checksum in src.connector.layer_checksums(src_ids, group_layers(groups, g))
    )
    assert len(sums) == 2 * 2 * 3  # groups x ranks x blocks
    src.connector.notify(peer, b"prefill-done")
    assert [payload for _, payload in wait_notes(dst)] == [b"prefill-done"]
    for rank in (0, 1):
        assert torch.equal(dst.regions[rank].tensor[dst_ids], src.regions[rank].tensor[src_ids])
    done = PrefillDone(
        request_id="r-1", fingerprint="f" * 64, dest_incarnation=1, block_ids=tuple(dst_ids),
        first_token_id=1, num_prompt_tokens=12, prefill_worker_id="p", prefill_incarnation=1,
        block_checksums=sums, layer_groups=groups,
    )  # fmt: skip
    reservation = Reservation("r-1", "f" * 64, 1, tuple(dst_ids), 12, 2e9)
    validate(done, reservation, 0.0, checksums_of(done, dst.connector))  # as it landed
    dst.regions[1].tensor[0, 3, 1, 2] += 1.0  # rank 1's shard of block 0, layer 3: group 1
    with pytest.raises(EnvelopeError, match=r"layer groups \[1\] differ \(ranks \[1\] of 2\)"):
        validate(done, reservation, 0.0, checksums_of(done, dst.connector))


@pytest.mark.parametrize("workers", [4], ids=["4-layers"], indirect=True)
def test_a_layer_group_whose_rank_is_gone_fails_and_no_completion_comes_out(
    workers: tuple[Worker, Worker],
) -> None:
    src, dst = workers
    peer = src.connector.add_peer(dst.connector.metadata(), dst.connector.rank_metadata())
    src.connector.write_layers(peer, [1], [3], (0, 2), time.monotonic() + 10)
    src.stopping.set()  # the source's rank 1 stops serving between the groups
    src.server.join(5)
    with pytest.raises(TransferError, match="rank shards failed: rank 1 is gone"):
        src.connector.write_layers(peer, [1], [3], (2, 4), time.monotonic() + 5)
    with pytest.raises(TransferError, match="rank shards failed: rank 1 is gone"):
        src.connector.notify(peer, b"never")
    deadline = time.monotonic() + 5
    while dst.connector.num_partial_writes < 1:  # rank 0's frame arrived, held back
        assert time.monotonic() < deadline, "rank 0's frame never arrived"
        time.sleep(0.01)
    assert dst.notes == []
