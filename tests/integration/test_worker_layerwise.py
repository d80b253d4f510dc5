"""Layer-wise KV transfer end to end (docs/layerwise.md): real processes, etcd, NATS and NIXL.

`prefill-lw` writes every prompt in 4 groups of SmolLM2's 30 layers while it computes it;
`decode-0` (disaggregated, checksums on, kvLoadFailurePolicy recompute) installs it and
`colo-0` is the baseline. The failure tests run then, in file order: a decode worker that
corrupts what it receives; then `prefill-lw` leaves and `prefill-slow` (each group's write
delayed by a second, like a slow link) takes the jobs, to be cancelled mid-way, to lose its
destination mid-way, and to be killed mid-way. Last, three workers of an FP8 cache. Every test
ends with every live worker's blocks free.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from kvrail.bus import connect
from kvrail.keys import PoolKeys
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.messages import Cancel
from kvrail.sampling import SamplingParams
from kvrail.testing.pool import LocalPool, tokens_of
from kvrail.testing.pool import generate as pool_generate
from kvrail.testing.pool import random_prompt as prompt

POOL = f"lw-{uuid.uuid4().hex[:8]}"
KEYS = PoolKeys("default", POOL)
LONG_PROMPT = 150  # tokens: remote prefill (threshold 32)
GROUPS = "4"

generate = functools.partial(pool_generate, keys=KEYS)


@pytest.fixture(scope="module")
def pool(
    etcd_server: EtcdServer, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPool]:
    p = LocalPool(etcd_server, nats_server, tmp_path_factory.mktemp("workers"), POOL, {
        "KVRAIL_MIN_REMOTE_PREFILL_TOKENS": "32",
        "KVRAIL_TRANSFER_CHECKSUMS": "true",
        "KVRAIL_KV_LOAD_FAILURE_POLICY": "recompute",
        "KVRAIL_NUM_KV_BLOCKS": "96",
        "KVRAIL_MAX_MODEL_LEN": "1024",
    })  # fmt: skip
    try:
        p.start("prefill-lw", "prefill", KVRAIL_KV_TRANSFER_LAYER_GROUPS=GROUPS)
        p.start("decode-0", "decode")
        p.start("colo-0", "colocated", KVRAIL_DISAGGREGATION_MODE="colocated")
        for worker_id in p.procs:
            p.wait_ready(worker_id)
        yield p
    finally:
        p.stop()


@pytest.fixture
async def nc(pool: LocalPool) -> AsyncIterator[NatsClient]:
    client = await connect(pool.settings, "test-client")
    yield client
    await client.close()


def log_of(pool: LocalPool, worker_id: str) -> str:
    return pool.procs[worker_id].log_path.read_text()


def written_line(log_text: str, request_id: str) -> str:
    (line,) = [
        line
        for line in log_text.splitlines()
        if "prefill written" in line and f"request_id={request_id} " in line
    ]
    return line


async def wait_for_log(path: Path, text: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in await asyncio.to_thread(path.read_text):
        assert time.monotonic() < deadline, f"{text!r} never logged"
        await asyncio.sleep(0.02)


async def test_layer_wise_remote_prefill_decodes_exactly_like_a_colocated_worker(
    pool: LocalPool, nc: NatsClient
) -> None:
    token_ids = prompt(LONG_PROMPT, seed=1)
    colocated = await generate(nc, "colo-0", token_ids)
    remote = await generate(nc, "decode-0", token_ids, request_id="lw-greedy")
    assert colocated[0].prefill_mode == "local" and remote[0].prefill_mode == "remote"
    assert len(tokens_of(colocated)) == 8
    assert tokens_of(remote) == tokens_of(colocated)
    line = written_line(log_of(pool, "prefill-lw"), "lw-greedy")
    assert f"layer_groups={GROUPS} " in line  # the layer-wise path, not its fallback
    assert "fell back" not in log_of(pool, "prefill-lw")
    await pool.assert_all_blocks_free(nc)


async def test_a_seeded_request_samples_the_same_tokens_layer_wise_or_colocated(
    pool: LocalPool, nc: NatsClient
) -> None:
    token_ids = prompt(LONG_PROMPT, seed=3)

    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)

    colocated = await generate(nc, "colo-0", token_ids, sampling=seeded(77))
    remote = await generate(nc, "decode-0", token_ids, sampling=seeded(77), request_id="lw-seed")
    assert remote[0].prefill_mode == "remote" and len(tokens_of(colocated)) == 12
    assert tokens_of(remote) == tokens_of(colocated)
    other = await generate(nc, "colo-0", token_ids, sampling=seeded(78))
    assert tokens_of(other) != tokens_of(colocated)  # it really samples
    assert f"layer_groups={GROUPS} " in written_line(log_of(pool, "prefill-lw"), "lw-seed")
    await pool.assert_all_blocks_free(nc)


async def test_a_layer_group_that_fails_its_checksum_is_recomputed(
    pool: LocalPool, nc: NatsClient
) -> None:
    """A decode worker that flips a byte of the first received block (layer 0: the first
    group) refuses the whole completion, names the group, and recomputes locally."""
    pool.start("decode-bad", "decode", KVRAIL_FAULT_CORRUPT_KV_TRANSFERS="1")
    await asyncio.to_thread(pool.wait_ready, "decode-bad")
    token_ids = prompt(LONG_PROMPT, seed=21)
    colocated = await generate(nc, "colo-0", token_ids)
    events = await generate(nc, "decode-bad", token_ids, request_id="lw-bad")
    assert events[0].prefill_mode == "recompute"
    assert tokens_of(events) == tokens_of(colocated)
    text = log_of(pool, "decode-bad")
    assert "reason=checksum" in text and "layer groups [0] differ" in text
    assert f"layer_groups={GROUPS} " in written_line(log_of(pool, "prefill-lw"), "lw-bad")
    await pool.assert_all_blocks_free(nc)
    await asyncio.to_thread(pool.procs["decode-bad"].stop, 20)


async def _slow_prefill_worker(pool: LocalPool) -> Path:
    """Replace `prefill-lw` by `prefill-slow`: each group's write waits a second first."""
    if "prefill-slow" not in pool.live():
        await asyncio.to_thread(pool.procs["prefill-lw"].stop, 20)
        pool.start(
            "prefill-slow", "prefill", KVRAIL_KV_TRANSFER_LAYER_GROUPS=GROUPS,
            KVRAIL_FAULT_DELAY_KV_WRITES_S="1.0", KVRAIL_LOG_LEVEL="DEBUG",
        )  # fmt: skip
        await asyncio.to_thread(pool.wait_ready, "prefill-slow")
    return pool.procs["prefill-slow"].log_path


async def test_a_cancel_between_layer_groups_stops_the_writes_and_frees_everything(
    pool: LocalPool, nc: NatsClient
) -> None:
    log_path = await _slow_prefill_worker(pool)
    request_id = f"lw-cancel-{uuid.uuid4().hex[:6]}"
    running = asyncio.create_task(
        generate(nc, "decode-0", prompt(LONG_PROMPT, seed=8), max_tokens=400,
                 request_id=request_id)
    )  # fmt: skip
    await wait_for_log(log_path, f"layer group written request_id={request_id} group=0 ")
    await nc.publish(KEYS.cancel, Cancel(request_id=request_id).encode())
    events = await asyncio.wait_for(running, 30)
    assert events[-1].output.error == "cancelled"
    await wait_for_log(log_path, f"prefill job refused request_id={request_id} reason=cancelled")
    text = log_path.read_text()
    assert f"request_id={request_id} group=3 " not in text  # the groups left were not written
    assert f"prefill written request_id={request_id} " not in text
    # Well before the 30 s deadline: the refusal, sent once no group was in flight, lifts the
    # decode worker's quarantine.
    await pool.assert_all_blocks_free(nc, timeout_s=15.0)


async def test_killing_the_decode_worker_between_layer_groups_leaves_the_prefill_side_clean(
    pool: LocalPool, nc: NatsClient
) -> None:
    """The destination dies while groups arrive: the next group's write fails (or finds its
    agent removed) and the prefill worker releases everything; the job is never written again
    (its destination is gone)."""
    log_path = await _slow_prefill_worker(pool)
    pool.start("decode-doomed", "decode")
    await asyncio.to_thread(pool.wait_ready, "decode-doomed")
    request_id = f"lw-doomed-{uuid.uuid4().hex[:6]}"
    running = asyncio.create_task(
        generate(nc, "decode-doomed", prompt(LONG_PROMPT, seed=9), request_id=request_id)
    )
    await wait_for_log(log_path, f"layer group written request_id={request_id} group=0 ")
    pool.kill("decode-doomed")
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    # prefill-slow (live) holds no request and no retained block once the job ended.
    await pool.assert_all_blocks_free(nc, timeout_s=25.0)
    text = log_path.read_text()
    assert f"prefill written request_id={request_id} " not in text
    assert f"request_id={request_id} group=3 " not in text
    assert (
        f"prefill write failed request_id={request_id} " in text
        or f"prefill job refused request_id={request_id} " in text
    )


async def test_killing_the_prefill_worker_between_layer_groups_recomputes_and_leaks_nothing(
    pool: LocalPool, nc: NatsClient
) -> None:
    log_path = await _slow_prefill_worker(pool)
    token_ids = prompt(LONG_PROMPT, seed=6)
    expected = tokens_of(await generate(nc, "colo-0", token_ids))
    request_id = f"lw-kill-{uuid.uuid4().hex[:6]}"
    running = asyncio.create_task(
        generate(nc, "decode-0", token_ids, deadline_s=15, request_id=request_id)
    )
    await wait_for_log(log_path, f"layer group written request_id={request_id} group=0 ")
    pool.kill("prefill-slow")
    assert f"request_id={request_id} group=3 " not in log_path.read_text()
    events = await asyncio.wait_for(running, timeout=25)
    assert events[0].prefill_mode == "recompute"
    assert tokens_of(events) == expected
    # The granted reservation stays quarantined until the job's deadline (a dead writer's
    # group can never land in a reused block), then everything is free.
    await pool.assert_all_blocks_free(nc, timeout_s=25.0)


async def test_an_fp8_cache_is_written_layer_wise_and_decodes_like_a_colocated_fp8_worker(
    pool: LocalPool, nc: NatsClient
) -> None:
    """A group is whole layers' bytes, whatever their dtype: an FP8 cache (its own fingerprint,
    so its own three workers, started once no other prefill worker is left to take its job from
    the pool's shared queue) goes layer-wise and decodes exactly as a colocated FP8 worker.
    The prompt is computed in three chunks (a 64-token step budget, the baseline's too: FP8 KV
    read back by a later chunk is not what one step computes): the blocks each earlier chunk
    filled go whole, the groups of the last step carry the rest."""
    fp8 = {"KVRAIL_KV_DTYPE": "float8_e4m3fn"}
    names = ("prefill-fp8", "decode-fp8", "colo-fp8")
    pool.start(
        "prefill-fp8", "prefill", KVRAIL_KV_TRANSFER_LAYER_GROUPS=GROUPS,
        KVRAIL_MAX_NUM_BATCHED_TOKENS="64", KVRAIL_LOG_LEVEL="DEBUG", **fp8,
    )  # fmt: skip
    pool.start("decode-fp8", "decode", **fp8)
    pool.start(
        "colo-fp8", "colocated", KVRAIL_DISAGGREGATION_MODE="colocated",
        KVRAIL_MAX_NUM_BATCHED_TOKENS="64", **fp8,
    )  # fmt: skip
    for name in names:
        await asyncio.to_thread(pool.wait_ready, name)
    token_ids = prompt(LONG_PROMPT, seed=41)
    colocated = await generate(nc, "colo-fp8", token_ids)
    remote = await generate(nc, "decode-fp8", token_ids, request_id="lw-fp8")
    assert colocated[0].prefill_mode == "local" and remote[0].prefill_mode == "remote"
    assert len(tokens_of(colocated)) == 8
    assert tokens_of(remote) == tokens_of(colocated)
    text = log_of(pool, "prefill-fp8")
    assert f"layer_groups={GROUPS} " in written_line(text, "lw-fp8")
    chunks = [line for line in text.splitlines() if "request_id=lw-fp8 group=chunk " in line]
    assert len(chunks) == 2 and all("blocks=4 " in line for line in chunks), chunks
    await pool.assert_all_blocks_free(nc)
    for name in names:
        await asyncio.to_thread(pool.procs[name].stop, 20)
