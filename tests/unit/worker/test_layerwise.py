"""Layer-wise KV transfer, the pure parts (docs/layerwise.md): group planning, a group's bytes
and checksums, the per-group envelope check, the engine's layer sinks, and one job's writes
in order on a real single thread with a recording connector. The real thing (NIXL, processes,
SmolLM2, every failure path) runs in tests/integration/test_worker_layerwise.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

import pytest
import torch

from kvrail.errors import TransferError
from kvrail.messages import PrefillDone, PrefillJob
from kvrail.sampling import SamplingParams
from kvrail.worker.engine.layer_sinks import LayerSinks
from kvrail.worker.engine.request import Request
from kvrail.worker.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from kvrail.worker.kv_cache import KVCache
from kvrail.worker.roles.layerwise import LayeredWrite
from kvrail.worker.roles.prefill_replies import Refused
from kvrail.worker.transfer.blocks import TransferStats
from kvrail.worker.transfer.connector import Connector
from kvrail.worker.transfer.envelope import EnvelopeError, Reservation, checksums_of, validate
from kvrail.worker.transfer.faults import TransportFaults
from kvrail.worker.transfer.layer_groups import (
    bad_groups,
    check_groups,
    completed_group,
    group_layers,
    layer_byte_range,
    layer_checksums,
    plan_groups,
)


@pytest.mark.parametrize(
    ("num_layers", "num_groups", "ends"),
    [
        (32, 4, (8, 16, 24, 32)),
        (30, 4, (8, 16, 23, 30)),  # SmolLM2: the first 30 mod 4 groups take one layer more
        (3, 8, (1, 2, 3)),  # never more groups than layers
        (5, 1, (5,)),
        (5, 0, ()),  # off
    ],
)
def test_groups_are_consecutive_layers_as_equal_as_they_can_be(
    num_layers: int, num_groups: int, ends: tuple[int, ...]
) -> None:
    assert plan_groups(num_layers, num_groups) == ends
    if ends:
        check_groups(ends, num_layers)
        sizes = [b - a for a, b in (group_layers(ends, g) for g in range(len(ends)))]
        assert sum(sizes) == num_layers and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("ends", [(), (8, 16), (8, 8, 32), (16, 8, 32), (8, 16, 33), (0, 32)])
def test_a_plan_that_does_not_cover_the_layers_in_order_is_refused(ends: tuple[int, ...]) -> None:
    with pytest.raises(TransferError, match="do not cover 32 layers"):
        check_groups(ends, 32)


def test_a_group_completes_at_its_last_layer_only() -> None:
    ends = plan_groups(10, 3)  # (4, 7, 10)
    assert [completed_group(ends, n) for n in range(1, 11)] == [
        None, None, None, 0, None, None, 1, None, None, 2,
    ]  # fmt: skip


def region(num_blocks: int = 6, num_layers: int = 5) -> KVCache:
    cache = KVCache.allocate(num_blocks, num_layers, 4, 2, 8, torch.float32)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=torch.Generator().manual_seed(0)))
    return cache


def test_a_groups_bytes_of_a_block_are_its_layers_and_nothing_else() -> None:
    cache = region()
    flat = cache.tensor.view(-1).view(torch.uint8)
    start, end = layer_byte_range(cache, 3, (1, 3))
    expected = cache.tensor[3, 1:3].contiguous().view(-1).view(torch.uint8)
    assert torch.equal(flat[start:end], expected)
    before = layer_checksums(cache, [2, 3], (1, 3))
    cache.tensor[3, 3] += 1.0  # another group's layer of the same block
    cache.tensor[4, 1] += 1.0  # the same layers of another block
    assert layer_checksums(cache, [2, 3], (1, 3)) == before
    cache.tensor[3, 2, 1] += 1.0  # V of layer 2 in block 3
    after = layer_checksums(cache, [2, 3], (1, 3))
    assert after[0] == before[0] and after[1] != before[1]


def test_bad_groups_names_the_groups_whose_checksums_differ() -> None:
    want = ("a", "b", "c", "d", "e", "f")  # 3 groups of 2 blocks
    assert bad_groups(want, want, 3, 2) == []
    assert bad_groups(want, ("a", "b", "x", "d", "e", "y"), 3, 2) == [(1, 0), (2, 0)]
    with pytest.raises(ValueError, match="shapes"):
        bad_groups(want, want[:4], 3, 2)
    with pytest.raises(ValueError, match="shapes"):
        bad_groups(want[:4], want[:4], 3, 2)  # not 3 groups of whole shards


def test_bad_groups_names_the_group_and_the_shard_of_a_tensor_parallel_write() -> None:
    """Per group, every shard's checksums, rank-major: 2 groups x 2 ranks x 3 blocks."""
    want = tuple(f"g{g}r{r}b{b}" for g in range(2) for r in range(2) for b in range(3))
    got = list(want)
    got[1 * 6 + 1 * 3 + 2] = "x"  # group 1, rank 1, block 2
    assert bad_groups(want, got, 2, 3) == [(1, 1)]
    got[0 * 6 + 0 * 3 + 0] = "y"  # group 0, rank 0, block 0
    assert bad_groups(want, got, 2, 3) == [(0, 0), (1, 1)]


class RecordingConnector:
    """A `Connector`'s layer-wise half over one region: writes copy into `peer_region`."""

    supports_layers = True

    def __init__(self, src: KVCache, dst: KVCache) -> None:
        self.region, self.peer_region = src, dst
        self.writes: list[tuple[tuple[int, int], threading.Thread]] = []
        self.notes: list[bytes] = []
        self.fail_at: tuple[int, int] | None = None

    def write_layers(
        self, peer: str, src_ids: Sequence[int], dst_ids: Sequence[int], layers: tuple[int, int],
        deadline_s: float, ready: Any = None,
    ) -> TransferStats:  # fmt: skip
        if layers == self.fail_at:
            raise TransferError("peer gone")
        self.writes.append((layers, threading.current_thread()))
        for s, d in zip(src_ids, dst_ids, strict=True):
            self.peer_region.tensor[d, layers[0] : layers[1]] = self.region.tensor[
                s, layers[0] : layers[1]
            ]
        return TransferStats(len(src_ids), 0.001, "nixl-ucx")

    def layer_checksums(self, block_ids: Sequence[int], layers: tuple[int, int]) -> tuple[str, ...]:
        return layer_checksums(self.region, block_ids, layers)

    def block_checksums(self, block_ids: Sequence[int]) -> tuple[str, ...]:
        raise AssertionError("a layer-wise completion is checked per group")

    def notify(self, peer: str, notification: bytes) -> None:
        self.notes.append(notification)


JOB = PrefillJob(
    request_id="r-1", token_ids=tuple(range(16)), fingerprint="f" * 64, dest_worker_id="decode-0",
    dest_incarnation=7, dest_agent_name="decode-0-7", dest_block_ids=(4, 5, 0),
    first_block_index=1, deadline_unix_s=2e9, sampling=SamplingParams(max_tokens=1),
    with_checksums=True,
)  # fmt: skip
SRC_TABLE = [3, 1, 2, 5]  # the prefill worker's table: block 3 is a cached prefix, not written
WHOLE = (0, 16)  # the prompt's 16 tokens (4 blocks of 4) in one step


@pytest.fixture
def nixl_thread() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nixl")
    yield pool
    pool.shutdown(wait=True)


def layered(
    pool: concurrent.futures.ThreadPoolExecutor, job: PrefillJob = JOB
) -> tuple[LayeredWrite, RecordingConnector]:
    conn = RecordingConnector(region(), region(num_blocks=8))
    conn.peer_region.tensor.zero_()
    write = LayeredWrite(
        job, plan_groups(5, 2), cast(Connector, conn), TransportFaults(), pool.submit,
        time.monotonic() + 30, block_size=4,
    )  # fmt: skip
    return write, conn


def done_for(job: PrefillJob, sums: tuple[str, ...], groups: tuple[int, ...]) -> PrefillDone:
    return PrefillDone(
        request_id=job.request_id, fingerprint=job.fingerprint, dest_incarnation=7,
        block_ids=job.dest_block_ids, first_token_id=1, num_prompt_tokens=16,
        prefill_worker_id="p", prefill_incarnation=1, block_checksums=sums, layer_groups=groups,
    )  # fmt: skip


async def test_groups_are_written_in_order_on_the_nixl_thread_then_the_completion_alone(
    nixl_thread: concurrent.futures.ThreadPoolExecutor,
) -> None:
    write, conn = layered(nixl_thread)
    for n in range(1, 6):  # the engine thread, layer after layer (CPU: no event)
        write.sink(n, SRC_TABLE, None, WHOLE)
    sent: list[PrefillDone] = []

    def note(sums: tuple[str, ...]) -> bytes:
        sent.append(done_for(JOB, sums, write.groups))
        return sent[-1].encode()

    nixl_thread.submit(lambda: None).result(timeout=5)  # both groups landed
    result = await write.finish(SRC_TABLE[1:], note)
    assert result is not None and result.num_groups == 2
    # Every group landed before the prefill "ended" (finish was called): all overlapped.
    assert result.overlap == 1.0 and result.tail_s == 0.0
    assert result.stats.num_bytes == 2 * 3  # the recording connector counts blocks per group
    assert [layers for layers, _ in conn.writes] == [(0, 3), (3, 5)]
    assert all(thread.name.startswith("nixl") for _, thread in conn.writes)
    assert len(conn.notes) == 1 and len(sent[0].block_checksums) == 2 * 3
    for s, d in zip(SRC_TABLE[1:], JOB.dest_block_ids, strict=True):
        assert torch.equal(conn.peer_region.tensor[d], conn.region.tensor[s])
    # The decode side: its own bytes, per group, match; one flipped value names its group.
    reservation = Reservation("r-1", "f" * 64, 7, JOB.dest_block_ids, 16, 2e9)
    peer = RecordingConnector(conn.peer_region, conn.peer_region)
    validate(sent[0], reservation, 0.0, checksums_of(sent[0], cast(Connector, peer)))
    conn.peer_region.tensor[5, 4, 0, 0, 0, 0] += 1.0  # block 5, layer 4: the second group
    with pytest.raises(EnvelopeError, match=r"layer groups \[1\] differ"):
        validate(sent[0], reservation, 0.0, checksums_of(sent[0], cast(Connector, peer)))
    wrong = done_for(JOB, sent[0].block_checksums, (2, 4))  # not this model's 5 layers
    with pytest.raises(EnvelopeError, match="layer_groups"):
        validate(wrong, reservation, 0.0, checksums_of(wrong, cast(Connector, peer)))


class TwoShards(RecordingConnector):
    """A tensor-parallel worker's checksums as `ShardedConnector` gives them: rank 0's region,
    then rank 1's, for every call."""

    def __init__(self, rank0: KVCache, rank1: KVCache) -> None:
        super().__init__(rank0, rank0)
        self.rank1 = rank1

    def layer_checksums(self, block_ids: Sequence[int], layers: tuple[int, int]) -> tuple[str, ...]:
        return layer_checksums(self.region, block_ids, layers) + layer_checksums(
            self.rank1, block_ids, layers
        )


def test_a_group_that_differs_on_one_shard_is_named_with_its_rank() -> None:
    ranks = [region(num_blocks=8), region(num_blocks=8)]
    ranks[1].tensor.add_(1.0)  # another shard, other bytes
    groups = plan_groups(5, 2)
    shards = TwoShards(*ranks)
    sums = tuple(
        s
        for g in range(2)
        for s in shards.layer_checksums(JOB.dest_block_ids, group_layers(groups, g))
    )
    assert len(sums) == 2 * 2 * 3  # groups x ranks x blocks
    done = done_for(JOB, sums, groups)
    reservation = Reservation("r-1", "f" * 64, 7, JOB.dest_block_ids, 16, 2e9)
    validate(done, reservation, 0.0, checksums_of(done, cast(Connector, shards)))
    ranks[1].tensor[0, 4, 1, 0, 0, 0] += 1.0  # block 0 (the job's third), layer 4: group 1
    with pytest.raises(EnvelopeError, match=r"layer groups \[1\] differ \(ranks \[1\] of 2\)"):
        validate(done, reservation, 0.0, checksums_of(done, cast(Connector, shards)))


async def test_a_stop_between_groups_writes_no_more_and_finish_refuses(
    nixl_thread: concurrent.futures.ThreadPoolExecutor,
) -> None:
    write, conn = layered(nixl_thread)
    for n in range(1, 4):
        write.sink(n, SRC_TABLE, None, WHOLE)
    write.stop("cancelled")
    for n in range(4, 6):
        write.sink(n, SRC_TABLE, None, WHOLE)
    with pytest.raises(Refused, match="cancelled"):
        await write.finish(SRC_TABLE[1:], lambda _sums: b"")
    await write.settle()
    assert len(conn.writes) <= 1 and not conn.notes
    assert (3, 5) not in [layers for layers, _ in conn.writes]


async def test_a_failed_group_fails_the_write_and_no_later_group_runs(
    nixl_thread: concurrent.futures.ThreadPoolExecutor,
) -> None:
    write, conn = layered(nixl_thread)
    conn.fail_at = (0, 3)
    for n in range(1, 6):
        write.sink(n, SRC_TABLE, None, WHOLE)
    with pytest.raises(TransferError, match="peer gone"):
        await write.finish(SRC_TABLE[1:], lambda _sums: b"")
    assert conn.writes == [] and conn.notes == []


async def test_settle_returns_only_once_no_group_is_in_flight(
    nixl_thread: concurrent.futures.ThreadPoolExecutor,
) -> None:
    write, conn = layered(nixl_thread)
    release = threading.Event()
    nixl_thread.submit(release.wait)  # the NIXL thread is busy: the groups queue behind it
    write.sink(3, SRC_TABLE, None, WHOLE)
    settling = asyncio.create_task(write.settle())  # stops first, then waits for the thread
    await asyncio.sleep(0.05)
    assert not settling.done()  # the queued group has not run yet
    release.set()
    await asyncio.wait_for(settling, 5)
    assert conn.writes == []  # queued before the settle, it never wrote after it


async def test_no_group_handed_over_means_the_caller_writes_the_whole_prompt(
    nixl_thread: concurrent.futures.ThreadPoolExecutor,
) -> None:
    write, conn = layered(nixl_thread)
    assert await write.finish(SRC_TABLE[1:], lambda _sums: b"") is None
    assert conn.writes == [] and conn.notes == []


def scheduled(
    rid: str, prompt_len: int, start: int, chunk: int, blocks: list[int]
) -> ScheduledRequest:
    request = Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=1))
    end = start + chunk
    return ScheduledRequest(request, start, list(range(start, end)), blocks, end == prompt_len)


def test_a_sink_hears_every_layer_of_every_step_of_its_prompt_until_the_last() -> None:
    sinks = LayerSinks()
    heard: list[tuple[str, int, list[int], tuple[int, int]]] = []
    sinks.add("a", lambda n, ids, ready, tokens: heard.append(("a", n, list(ids), tokens)))
    sinks.add("b", lambda n, ids, ready, tokens: heard.append(("b", n, list(ids), tokens)))
    other = SchedulerOutput(prefills=[scheduled("c", 8, 0, 8, [9])])
    assert sinks.hook_for(other, cuda=False) is None  # no watched prompt in the step
    first_chunk = SchedulerOutput(prefills=[scheduled("a", 40, 0, 16, [1]),
                                            scheduled("c", 8, 0, 8, [9])])  # fmt: skip
    hook = sinks.hook_for(first_chunk, cuda=False)
    assert hook is not None
    hook(1)
    assert heard == [("a", 1, [1], (0, 16))]
    last = SchedulerOutput(prefills=[scheduled("a", 40, 16, 24, [1, 2, 3])])
    hook = sinks.hook_for(last, cuda=False)
    assert hook is not None
    for n in (1, 2):
        hook(n)
    assert heard[1:] == [("a", 1, [1, 2, 3], (16, 40)), ("a", 2, [1, 2, 3], (16, 40))]
    assert sinks.hook_for(last, cuda=False) is None  # taken by the prompt's last step
    sinks.discard("b")
    assert not sinks


async def test_blocks_an_earlier_chunk_filled_go_whole_and_the_groups_carry_the_rest(
    nixl_thread: concurrent.futures.ThreadPoolExecutor,
) -> None:
    write, conn = layered(nixl_thread)
    for n in range(1, 6):  # tokens [0, 10): blocks 3 (not written: a cached prefix) and 1 full
        write.sink(n, SRC_TABLE, None, (0, 10))
    for n in range(1, 6):  # tokens [10, 16): the prompt's last step
        write.sink(n, SRC_TABLE, None, (10, 16))
    nixl_thread.submit(lambda: None).result(timeout=5)
    sent: list[PrefillDone] = []

    def note(sums: tuple[str, ...]) -> bytes:
        sent.append(done_for(JOB, sums, write.groups))
        return sent[-1].encode()

    result = await write.finish(SRC_TABLE[1:], note)
    assert result is not None and len(conn.notes) == 1
    assert [layers for layers, _ in conn.writes] == [(0, 5), (0, 3), (3, 5)]
    assert result.stats.num_bytes == 1 + 2 + 2  # block 1 whole, then blocks 2 and 5 per group
    for s, d in zip(SRC_TABLE[1:], JOB.dest_block_ids, strict=True):
        assert torch.equal(conn.peer_region.tensor[d], conn.region.tensor[s])
    assert len(sent[0].block_checksums) == 2 * 3  # every block in every group, block 1 too
    reservation = Reservation("r-1", "f" * 64, 7, JOB.dest_block_ids, 16, 2e9)
    peer = RecordingConnector(conn.peer_region, conn.peer_region)
    validate(sent[0], reservation, 0.0, checksums_of(sent[0], cast(Connector, peer)))


async def test_a_prompt_the_engine_restarted_is_left_to_a_whole_write(
    nixl_thread: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """Preempted after a chunk whose blocks went early, the prompt is computed again from its
    start: those blocks may have been reused meanwhile, so nothing more is sent in parts."""
    write, conn = layered(nixl_thread)
    for n in range(1, 6):
        write.sink(n, SRC_TABLE, None, (0, 10))
    for n in range(1, 6):  # recomputed from the start, in one step
        write.sink(n, SRC_TABLE, None, (0, 16))
    assert await write.finish(SRC_TABLE[1:], lambda _sums: b"") is None
    assert [layers for layers, _ in conn.writes] == [(0, 5)] and not conn.notes
