"""Tensor-parallel workers end to end: real worker and rank processes, real etcd, NATS and NIXL.

Three workers of one pool serve a random-weight model (8 heads, 4 KV heads; a model directory
with SmolLM2's tokenizer) on CPU: `prefill-0` and `decode-0` on two ranks each (gloo, one NIXL
agent per rank, checksums on, kvLoadFailurePolicy recompute; the prefill worker waits 2 s before
each KV write, so a rank can die between a job's compute and its write) and `colo-0`, colocated
on one device: the baseline. A remote prefill from the two-rank prefill worker into the two-rank
decode worker decodes exactly like the colocated worker, and every block is free afterwards, as
after a cancel between the prefill's compute and its write.
Then the fault tests, in file order: a prefill rank is killed with SIGKILL mid-job (its worker
fails as a whole, its lease goes at once, the decode worker recomputes), then a decode rank
mid-request (the request ends with an error event, the worker's lease goes, it exits 1);
nothing hangs.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from kvrail.bus import connect
from kvrail.keys import PoolKeys
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.messages import Cancel
from kvrail.testing.pool import LocalPool, tokens_of
from kvrail.testing.pool import generate as pool_generate
from kvrail.testing.pool import random_prompt as prompt
from kvrail.worker.testing import write_random_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

POOL = f"tp-{uuid.uuid4().hex[:8]}"
KEYS = PoolKeys("default", POOL)
LONG_PROMPT = 150  # tokens: remote prefill (threshold 32)
TP = {"KVRAIL_TENSOR_PARALLEL_SIZE": "2"}


def gpus(first: int) -> dict[str, str]:
    """On a machine with 4 GPUs or more (the multi-GPU run), each two-rank worker its own pair:
    the decode worker's ranks on GPUs 2 and 3, so shards cross GPUs. Elsewhere nothing: on CPU
    all run there; with 2 or 3 GPUs both two-rank workers share GPUs 0 and 1."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 4:
        return {"CUDA_VISIBLE_DEVICES": f"{first},{first + 1}"}
    return {}


@pytest.fixture(scope="module")
def pool(
    etcd_server: EtcdServer, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPool]:
    model = write_random_model(
        tmp_path_factory.mktemp("model") / "tp", seed=3,
        num_attention_heads=8, num_key_value_heads=4, hidden_size=128, intermediate_size=256,
    )  # fmt: skip
    p = LocalPool(etcd_server, nats_server, tmp_path_factory.mktemp("workers"), POOL, {
        "KVRAIL_MODEL": str(model),
        "KVRAIL_MIN_REMOTE_PREFILL_TOKENS": "32",
        "KVRAIL_TRANSFER_CHECKSUMS": "true",
        "KVRAIL_KV_LOAD_FAILURE_POLICY": "recompute",
        "KVRAIL_NUM_KV_BLOCKS": "96",
        "KVRAIL_MAX_MODEL_LEN": "1024",
        "KVRAIL_DTYPE": "float32",  # exact comparisons on GPUs too (auto is bfloat16 there)
    })  # fmt: skip
    try:
        p.start("prefill-0", "prefill", KVRAIL_FAULT_DELAY_KV_WRITES_S="2", **TP, **gpus(0))
        p.start("decode-0", "decode", **TP, **gpus(2))
        p.start("colo-0", "colocated", KVRAIL_DISAGGREGATION_MODE="colocated", **gpus(0))
        for worker_id in p.procs:
            p.wait_ready(worker_id)
        yield p
    finally:
        p.stop()


@pytest.fixture
async def nc(pool: LocalPool) -> NatsClient:
    client = await connect(pool.settings, "test-client")
    yield client  # type: ignore[misc]
    await client.close()


generate = functools.partial(pool_generate, keys=KEYS, deadline_s=60.0)


def rank_pids(pool: LocalPool, worker_id: str) -> list[int]:
    found = re.findall(r"tensor parallel ranks started size=\d+ pids=([\d,]+)",
                       pool.procs[worker_id].log_text())  # fmt: skip
    assert found, pool.procs[worker_id].tail()
    return [int(p) for p in found[-1].split(",")]


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not reaped yet, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def wait_gone(pool: LocalPool, worker_id: str, timeout_s: float) -> float:
    """Seconds until `worker_id`'s record left etcd (its lease revoked, not expired)."""
    started = time.monotonic()
    while worker_id in await pool.records():
        assert time.monotonic() - started < timeout_s, f"{worker_id} is still registered"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_every_rank_region_is_registered_and_layouts_do_not_mix(pool: LocalPool) -> None:
    records = await pool.records()
    prefill, dec, colo = records["prefill-0"], records["decode-0"], records["colo-0"]
    assert (dec.tensor_parallel_size, len(dec.rank_nixl_metadata_b64)) == (2, 1)
    assert (colo.tensor_parallel_size, colo.rank_nixl_metadata_b64) == (1, ())
    assert prefill.fingerprint == dec.fingerprint != colo.fingerprint
    assert dec.block_bytes * 2 == colo.block_bytes  # each rank holds half of the KV heads


async def test_a_remote_prefill_between_two_rank_workers_decodes_like_a_colocated_worker(
    pool: LocalPool, nc: NatsClient
) -> None:
    token_ids = prompt(LONG_PROMPT, seed=1)
    colocated = await generate(nc, "colo-0", token_ids, max_tokens=12)
    disaggregated = await generate(nc, "decode-0", token_ids, max_tokens=12)
    assert colocated[0].prefill_mode == "local"
    assert disaggregated[0].prefill_mode == "remote"
    assert tokens_of(disaggregated) == tokens_of(colocated)
    assert disaggregated[0].stages is not None and disaggregated[0].stages.validation_s > 0
    short = prompt(12, seed=2)  # prefilled on the decode worker's own two ranks
    local = await generate(nc, "decode-0", short)
    assert local[0].prefill_mode == "local"
    assert tokens_of(local) == tokens_of(await generate(nc, "colo-0", short))
    await pool.assert_all_blocks_free(nc)


async def test_a_cancel_during_a_remote_prefill_frees_every_block_on_both_workers(
    pool: LocalPool, nc: NatsClient
) -> None:
    request_id = "cancel-tp"
    request = asyncio.create_task(
        generate(nc, "decode-0", prompt(LONG_PROMPT, seed=4), max_tokens=200, request_id=request_id)
    )
    deadline = time.monotonic() + 20
    while (await pool.block_counts(nc, "prefill-0")).num_retained < 1:  # computed, not written
        assert time.monotonic() < deadline, "the prefill worker never computed the job"
        await asyncio.sleep(0.01)
    await nc.publish(KEYS.cancel, Cancel(request_id=request_id).encode())
    events = await asyncio.wait_for(request, 30)
    assert events[-1].output.error == "cancelled"
    await pool.assert_all_blocks_free(nc, timeout_s=15.0)


async def test_a_prefill_rank_killed_mid_job_fails_its_worker_and_the_decode_side_recomputes(
    pool: LocalPool, nc: NatsClient
) -> None:
    token_ids = prompt(LONG_PROMPT, seed=6)
    expected = tokens_of(await generate(nc, "colo-0", token_ids))
    sent = time.monotonic()
    request = asyncio.create_task(generate(nc, "decode-0", token_ids, deadline_s=40))
    deadline = time.monotonic() + 20
    # Computed and retained: the prefill worker now waits 2 s, then writes both shards.
    while (await pool.block_counts(nc, "prefill-0")).num_retained < 1:
        assert time.monotonic() < deadline, "the prefill worker never computed the job"
        await asyncio.sleep(0.01)
    (rank,) = rank_pids(pool, "prefill-0")
    os.kill(rank, signal.SIGKILL)
    killed = time.monotonic()
    assert await wait_gone(pool, "prefill-0", timeout_s=10) < 5  # revoked, not a TTL expiry
    events = await asyncio.wait_for(request, timeout=40)
    assert events[0].prefill_mode == "recompute"
    assert tokens_of(events) == expected
    proc = pool.procs["prefill-0"]
    while proc.is_running():
        assert time.monotonic() - killed < 30, "the failed prefill worker did not exit"
        await asyncio.sleep(0.05)
    assert proc.returncode() == 1, proc.tail()
    assert "worker failed worker=prefill-0 reason=rank_1_lost" in proc.log_text()
    pool.ready.discard("prefill-0")
    # Killed after its write was granted, the job may have had a write under way: the decode
    # side then quarantines the reservation until the job's deadline (40 s, plus 1 s), as it
    # must; killed before the grant, the blocks are free at once.
    await pool.assert_all_blocks_free(nc, timeout_s=max(25.0, sent + 40 + 1 + 5 - time.monotonic()))


async def test_a_decode_rank_killed_mid_request_fails_the_request_and_the_whole_worker(
    pool: LocalPool, nc: NatsClient
) -> None:
    (rank,) = rank_pids(pool, "decode-0")
    streaming = asyncio.Event()
    request = asyncio.create_task(
        generate(nc, "decode-0", prompt(20, seed=9), max_tokens=600, started=streaming)
    )
    await asyncio.wait_for(streaming.wait(), 30)
    os.kill(rank, signal.SIGKILL)
    killed = time.monotonic()
    events = await asyncio.wait_for(request, timeout=20)
    assert events[-1].output.error in ("engine_error", "shutting_down"), events[-1]
    assert len(events) > 1 and events[-1].output.finish_reason is None
    assert await wait_gone(pool, "decode-0", timeout_s=10) < 5
    proc = pool.procs["decode-0"]
    while proc.is_running():
        assert time.monotonic() - killed < 30, "the failed decode worker did not exit"
        await asyncio.sleep(0.05)
    assert proc.returncode() == 1, proc.tail()
    assert not alive(rank)
    pool.ready.discard("decode-0")
    await pool.assert_all_blocks_free(nc, timeout_s=25.0)  # colo-0 is untouched
