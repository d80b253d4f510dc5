"""KV block transfer with real NIXL (UCX, DRAM), between two processes as in production."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
import torch

from kvrail.errors import TransferError
from kvrail.messages import PrefillDone
from kvrail.worker.kv_cache import KVCache
from kvrail.worker.transfer.blocks import coalesce, count_runs, run_starts
from kvrail.worker.transfer.envelope import EnvelopeError, Reservation, block_checksums, validate
from kvrail.worker.transfer.kv_connector import KvConnector
from kvrail.worker.transfer.testing import recv, start_decode_peer

NUM_BLOCKS, BLOCK_ELEMS = 64, 4096  # 64 blocks of 16 KiB (float32)


@contextlib.contextmanager
def _peer(agent_name: str, device: str = "cpu") -> Iterator[Connection]:
    conn, proc = start_decode_peer(agent_name, NUM_BLOCKS, BLOCK_ELEMS, device=device)
    try:
        yield conn
    finally:
        with contextlib.suppress(OSError):
            conn.send("bye")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


@pytest.fixture
def decode_peer() -> Iterator[Connection]:
    with _peer("decode-0-1") as conn:
        yield conn


def test_blocks_written_to_another_process_arrive_intact_with_one_notification(
    decode_peer: Connection,
) -> None:
    src = torch.randn(NUM_BLOCKS, BLOCK_ELEMS, generator=torch.Generator().manual_seed(0))
    region = KVCache(src, NUM_BLOCKS)
    prefill = KvConnector("prefill-0-7", region)
    try:
        peer = prefill.add_peer(recv(decode_peer))  # type: ignore[arg-type]
        assert peer == "decode-0-1"
        decode_peer.send(prefill.metadata())
        src_ids, dst_ids = [3, 4, 5, 10, 2], [20, 21, 22, 40, 63]
        stats = prefill.write(peer, src_ids, dst_ids, b"req-1", time.monotonic() + 30)
        assert stats.num_bytes == 5 * region.block_bytes and stats.transport == "nixl-ucx"
        time.sleep(0.5)  # let the notification arrive before asking (the poll loop has a deadline)
        decode_peer.send(dst_ids)
        notes, landed_sums, landed = recv(decode_peer)  # type: ignore[misc]
        assert notes == [("prefill-0-7", b"req-1")]
        assert torch.equal(landed, src[src_ids])
        assert landed_sums == block_checksums(region, src_ids)
    finally:
        prefill.close()


def test_bad_block_ids_and_unknown_peers_fail_before_anything_moves(
    decode_peer: Connection,
) -> None:
    region = KVCache(torch.ones(NUM_BLOCKS, BLOCK_ELEMS), NUM_BLOCKS)
    prefill = KvConnector("prefill-0-8", region)
    try:
        peer = prefill.add_peer(recv(decode_peer))  # type: ignore[arg-type]
        decode_peer.send(prefill.metadata())
        deadline = time.monotonic() + 30
        for src_ids, dst_ids, message in (
            ([0], [NUM_BLOCKS], "destination block"),
            ([-1], [0], "source block"),
            ([0, 1], [5, 5], "repeat"),
            ([], [], "at least one"),
            ([0, 1], [2], "2 source blocks, 1 destination"),
            ([1.0], [0], "not integers"),
        ):
            with pytest.raises(TransferError, match=message):
                prefill.write(peer, src_ids, dst_ids, b"x", deadline)
        with pytest.raises(TransferError, match="unknown or removed"):
            prefill.write("decode-0-0", [0], [0], b"x", deadline)  # a stale incarnation
        prefill.remove_peer(peer)
        with pytest.raises(TransferError, match="unknown or removed"):
            prefill.write(peer, [0], [0], b"x", deadline)
        decode_peer.send([0])
        notes, _, landed = recv(decode_peer)  # type: ignore[misc]
        assert notes == []  # nothing was sent, so nothing was notified
        assert not landed.any()  # and nothing landed
    finally:
        prefill.close()


def test_a_peer_with_another_block_size_is_refused() -> None:
    a = KvConnector("a-1", KVCache(torch.zeros(8, 1024), 8))
    b = KvConnector("b-1", KVCache(torch.zeros(8, 2048), 8))
    try:
        with pytest.raises(TransferError, match="byte DRAM blocks"):
            a.add_peer(b.metadata())
        with pytest.raises(TransferError, match="malformed"):
            a.add_peer(b"\x01")
    finally:
        a.close()
        b.close()


def test_coalesce_merges_runs_contiguous_on_both_sides() -> None:
    assert coalesce([1, 2, 3, 7, 8], [10, 11, 12, 13, 14]) == [(1, 10, 3), (7, 13, 2)]
    assert coalesce([], []) == []
    with pytest.raises(ValueError, match="destination"):
        coalesce([1], [])


def _runs_one_by_one(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """The runs found block by block: the reference `coalesce` and `run_starts` must match."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def test_run_starts_and_counts_are_where_and_how_many_runs_coalesce_finds() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 64):
        for src, dst in (
            (np.arange(n), np.arange(n) + 5),  # one run
            (np.arange(n), rng.permutation(64)[:n]),  # scattered
            (rng.permutation(64)[:n], np.arange(n)),
            (np.r_[np.arange(n), 70 + np.arange(n)], np.r_[np.arange(n), 90 + np.arange(n)]),
        ):
            runs = _runs_one_by_one(src.tolist(), dst.tolist())
            assert coalesce(src.tolist(), dst.tolist()) == runs
            starts = run_starts(src, dst)
            assert [int(src[i]) for i in starts] == [s for s, _, _ in runs]
            assert [int(dst[i]) for i in starts] == [d for _, d, _ in runs]
            assert count_runs(src, dst) == len(runs)
    assert run_starts(np.arange(0), np.arange(0)) == []
    assert count_runs(np.arange(0), np.arange(0)) == 0


@pytest.fixture
def cuda_decode_peer() -> Iterator[Connection]:
    if not torch.cuda.is_available():
        pytest.skip("CUDA IPC needs a GPU (runs on the lent H200)")
    with _peer("decode-0-3", device="cuda") as conn:
        yield conn


def test_blocks_written_over_cuda_ipc_arrive_intact_in_runs_and_scattered(
    cuda_decode_peer: Connection,
) -> None:
    """A few runs go as one copy each, many through the copy kernel: both land every byte,
    and the notification comes once the bytes are there."""
    gen = torch.Generator().manual_seed(1)
    src = torch.randn(NUM_BLOCKS, BLOCK_ELEMS, generator=gen).cuda()
    region = KVCache(src, NUM_BLOCKS)
    prefill = KvConnector("prefill-0-9", region)
    try:
        peer = prefill.add_peer(recv(cuda_decode_peer))  # type: ignore[arg-type]
        assert prefill.transport_to(peer) == "cuda-ipc"
        cuda_decode_peer.send(prefill.metadata())
        runs_src, runs_dst = [0, 1, 2, 9, 10], [30, 31, 32, 5, 6]  # two runs
        scattered_src = list(range(12, 44))
        scattered_dst = torch.randperm(NUM_BLOCKS, generator=gen)[:32].tolist()
        scattered_dst = [d for d in scattered_dst if d not in runs_dst][:20]
        scattered_src = scattered_src[: len(scattered_dst)]
        deadline = time.monotonic() + 30
        for i, (s_ids, d_ids) in enumerate(((runs_src, runs_dst), (scattered_src, scattered_dst))):
            stats = prefill.write(peer, s_ids, d_ids, f"w{i}".encode(), deadline)
            assert stats.transport == "cuda-ipc"
            assert stats.num_bytes == len(s_ids) * region.block_bytes
        time.sleep(0.5)
        cuda_decode_peer.send(runs_dst + scattered_dst)
        notes, landed_sums, landed = recv(cuda_decode_peer)  # type: ignore[misc]
        assert notes == [("prefill-0-9", b"w0"), ("prefill-0-9", b"w1")]
        assert torch.equal(landed, src[runs_src + scattered_src].cpu())
        assert landed_sums == block_checksums(region, runs_src + scattered_src)
    finally:
        prefill.close()


def test_a_write_does_not_wait_for_work_queued_on_the_engines_stream(
    cuda_decode_peer: Connection,
) -> None:
    """A prefill worker computes its next prompt while it writes the last one's blocks: the
    write and the checksums of those blocks must not queue behind that work (here a sleep of
    about two seconds on the default stream)."""
    src = torch.arange(NUM_BLOCKS * BLOCK_ELEMS, dtype=torch.float32).view(NUM_BLOCKS, -1).cuda()
    region = KVCache(src, NUM_BLOCKS)
    prefill = KvConnector("prefill-0-8", region)
    try:
        peer = prefill.add_peer(recv(cuda_decode_peer))  # type: ignore[arg-type]
        cuda_decode_peer.send(prefill.metadata())
        src_ids, dst_ids = list(range(2, 40, 2)), list(range(40, 21, -1))  # the kernel's path
        deadline = time.monotonic() + 30
        prefill.write(peer, src_ids, dst_ids, b"w0", deadline)  # the kernel compiled before
        prefill.block_checksums(src_ids)
        calibrate = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        calibrate[0].record()
        torch.cuda._sleep(10**7)
        calibrate[1].record()
        calibrate[1].synchronize()
        cycles_per_s = 10**7 / (calibrate[0].elapsed_time(calibrate[1]) / 1e3)
        torch.cuda._sleep(int(2 * cycles_per_s))  # the engine's next step, on its stream
        started = time.monotonic()
        stats = prefill.write(peer, src_ids, dst_ids, b"w1", deadline)
        sums = prefill.block_checksums(src_ids)
        took = time.monotonic() - started
        torch.cuda.synchronize()
        assert took < 1.0, f"the write waited {took:.2f} s for the default stream"
        assert stats.transport == "cuda-ipc"
        cuda_decode_peer.send(dst_ids)
        notes, landed_sums, landed = recv(cuda_decode_peer)  # type: ignore[misc]
        assert notes == [("prefill-0-8", b"w0"), ("prefill-0-8", b"w1")]
        assert torch.equal(landed, src[src_ids].cpu())
        assert landed_sums == sums == block_checksums(region, src_ids)
    finally:
        prefill.close()


def _done(**kw: Any) -> PrefillDone:
    base: dict[str, Any] = dict(
        request_id="r", fingerprint="f", dest_incarnation=2, block_ids=(1, 2),
        first_token_id=9, num_prompt_tokens=32, prefill_worker_id="p", prefill_incarnation=1,
    )  # fmt: skip
    base.update(kw)
    return PrefillDone(**base)


RES = Reservation("r", "f", 2, (1, 2), 32, deadline_unix_s=100.0)


@pytest.mark.parametrize(
    "done,reason",
    [
        (_done(request_id="other"), "wrong_request"),
        (_done(error="boom"), "prefill_failed"),
        (_done(fingerprint="g"), "fingerprint"),
        (_done(dest_incarnation=1), "stale_incarnation"),
        (_done(block_ids=(1, 3)), "blocks"),
        (_done(num_prompt_tokens=31), "tokens"),
    ],
)
def test_a_completion_that_does_not_match_its_reservation_is_refused(
    done: PrefillDone, reason: str
) -> None:
    with pytest.raises(EnvelopeError) as err:
        validate(done, RES, now_unix_s=50.0)
    assert err.value.reason == reason
    validate(_done(), RES, now_unix_s=50.0)
    with pytest.raises(EnvelopeError, match="deadline"):
        validate(_done(), RES, now_unix_s=101.0)


def test_a_corrupted_block_is_caught_by_its_checksum() -> None:
    region = KVCache(torch.randn(4, 256), 4)
    sums = block_checksums(region, [1, 2])
    landed = partial(block_checksums, region)
    validate(_done(block_checksums=sums), RES, 50.0, landed)
    region.tensor[2, 17] += 1.0
    with pytest.raises(EnvelopeError, match="1 of 2 blocks differ"):
        validate(_done(block_checksums=sums), RES, 50.0, landed)
    with pytest.raises(EnvelopeError, match="no checksum"):
        validate(_done(), RES, 50.0, landed)


def test_a_layer_group_lands_in_the_same_layers_of_scattered_blocks_and_nothing_else(
    decode_peer: Connection,
) -> None:
    """A layer-wise write (docs/layerwise.md): layers [1, 3) of each block, one descriptor per
    block, no notification until `notify`; the other layers of the destination stay untouched.
    The writer's region has the engine's layout, with the peer's block size."""
    layers, per_layer = 4, BLOCK_ELEMS // 4
    region = KVCache.allocate(NUM_BLOCKS, layers, 4, 2, 64, torch.float32)  # 4096 floats a block
    region.tensor.copy_(
        torch.randn(region.tensor.shape, generator=torch.Generator().manual_seed(3))
    )
    prefill = KvConnector("prefill-0-9", region)
    try:
        peer = prefill.add_peer(recv(decode_peer))  # type: ignore[arg-type]
        decode_peer.send(prefill.metadata())
        deadline = time.monotonic() + 30
        for bad in ((0, 0), (3, 5), (-1, 2)):
            with pytest.raises(TransferError, match="outside the model"):
                prefill.write_layers(peer, [0], [0], bad, deadline)
        src_ids, dst_ids = [7, 2, 3, 40], [11, 30, 31, 5]
        stats = prefill.write_layers(peer, src_ids, dst_ids, (1, 3), deadline)
        assert stats.num_bytes == 4 * 2 * per_layer * 4 and stats.transport == "nixl-ucx"
        prefill.notify(peer, b"req-9")
        time.sleep(0.5)
        decode_peer.send(dst_ids)
        notes, _, landed = recv(decode_peer)  # type: ignore[misc]
        assert notes == [("prefill-0-9", b"req-9")]
        sent = region.tensor[src_ids].reshape(len(src_ids), layers, per_layer)
        got = landed.reshape(len(dst_ids), layers, per_layer)
        assert torch.equal(got[:, 1:3], sent[:, 1:3])
        assert not got[:, 0].any() and not got[:, 3].any()
    finally:
        prefill.close()
