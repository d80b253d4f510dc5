"""A prefix held by another worker of the pool, in any KV tier, is moved, not recomputed: real
worker processes (SmolLM2 on CPU), etcd, NATS and NIXL.

Three colocated workers of one pool: `colo-a` and `colo-b` with a host-memory tier and a small
GPU pool, `colo-ref` without tiers (the baseline that computes every prompt itself). A request
sent to `colo-b` naming `colo-a` (`GenerateRequest.prefill_worker_id`, the router's pick when
`colo-a` holds more of the prompt's prefix: `router.policy.holding_peer`) is prefilled by
`colo-a` from its own cache and tiers, and its KV lands in `colo-b` over NIXL with the same write
grant, envelope and checksums as a prefill worker's. The answer is the one `colo-ref` computes.
The last test kills `colo-a` with a job on its way to it.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from kvrail.bus import connect
from kvrail.keys import PoolKeys
from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.testing.pool import LocalPool, random_prompt, tokens_of
from kvrail.testing.pool import generate as pool_generate

POOL = f"ph-{uuid.uuid4().hex[:8]}"
KEYS = PoolKeys("default", POOL)
BLOCK = 16  # SmolLM2's KV block, in tokens
PREFIX = 10 * BLOCK  # the earlier turn: ten full blocks
HOST_TIER = {"KVRAIL_KV_HOST_TIER_BYTES": str(64 << 20)}

generate = functools.partial(pool_generate, keys=KEYS)


class Pool(LocalPool):
    def __init__(self, etcd: EtcdServer, nats: NatsServer, log_dir: Path) -> None:
        super().__init__(etcd, nats, log_dir, POOL, {
            "KVRAIL_DISAGGREGATION_MODE": "colocated",
            "KVRAIL_MIN_REMOTE_PREFILL_TOKENS": "32",
            "KVRAIL_TRANSFER_CHECKSUMS": "true",
            "KVRAIL_KV_LOAD_FAILURE_POLICY": "recompute",
            "KVRAIL_NUM_KV_BLOCKS": "32",
            "KVRAIL_MAX_MODEL_LEN": "512",
        })  # fmt: skip
        self.metrics_port = free_port()


@pytest.fixture(scope="module")
def pool(
    etcd_server: EtcdServer, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pool]:
    p = Pool(etcd_server, nats_server, tmp_path_factory.mktemp("workers"))
    try:
        p.start("colo-a", "colocated", KVRAIL_HTTP_PORT=str(p.metrics_port), **HOST_TIER)
        p.start("colo-b", "colocated", **HOST_TIER)
        p.start("colo-ref", "colocated", KVRAIL_NUM_KV_BLOCKS="64")
        for worker_id in p.procs:
            p.wait_ready(worker_id)
        yield p
    finally:
        p.stop()


@pytest.fixture
async def nc(pool: Pool) -> AsyncIterator[NatsClient]:
    client = await connect(pool.settings, "test-client")
    yield client
    await client.close()


def host_hits(pool: Pool) -> float:
    url = f"http://127.0.0.1:{pool.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(r'^kvrail_kv_tier_hit_blocks_total\{tier="host"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def written_by(pool: Pool, worker_id: str, request_id: str) -> bool:
    log = pool.procs[worker_id].log_path.read_text()
    return f"prefill written request_id={request_id} dest=colo-b " in log


async def test_a_prefix_in_a_peer_s_gpu_cache_is_moved_and_the_answer_is_unchanged(
    pool: Pool, nc: NatsClient
) -> None:
    earlier = random_prompt(PREFIX, seed=1)
    await generate(nc, "colo-a", earlier)  # colo-a now caches the earlier turn's blocks
    prompt = earlier + random_prompt(40, seed=2)
    rid = f"ph-{uuid.uuid4().hex[:8]}"
    events = await generate(nc, "colo-b", prompt, request_id=rid, prefill_worker_id="colo-a")
    assert events[0].prefill_mode == "remote"
    assert events[0].output.num_cached_tokens == PREFIX  # found in colo-a's cache, not computed
    assert tokens_of(events) == tokens_of(await generate(nc, "colo-ref", prompt))
    assert written_by(pool, "colo-a", rid)
    await pool.assert_all_blocks_free(nc)


async def test_a_prefix_in_a_peer_s_host_tier_is_loaded_there_and_moved(
    pool: Pool, nc: NatsClient
) -> None:
    earlier = random_prompt(PREFIX, seed=3)
    await generate(nc, "colo-a", earlier)
    for seed in (4, 5, 6):  # 3 x 19 blocks through colo-a's 32: the earlier turn's go to host
        await generate(nc, "colo-a", random_prompt(300, seed=seed))
    hits = host_hits(pool)
    prompt = earlier + random_prompt(40, seed=7)
    rid = f"ph-{uuid.uuid4().hex[:8]}"
    events = await generate(nc, "colo-b", prompt, request_id=rid, prefill_worker_id="colo-a")
    assert events[0].prefill_mode == "remote"
    assert events[0].output.num_cached_tokens == PREFIX
    assert host_hits(pool) - hits >= PREFIX // BLOCK  # colo-a loaded them from its host tier
    assert tokens_of(events) == tokens_of(await generate(nc, "colo-ref", prompt))
    assert written_by(pool, "colo-a", rid)
    await pool.assert_all_blocks_free(nc)


async def test_a_name_that_is_not_a_ready_peer_is_a_local_prefill(
    pool: Pool, nc: NatsClient
) -> None:
    prompt = random_prompt(120, seed=8)
    expected = tokens_of(await generate(nc, "colo-ref", prompt))
    for named in ("colo-b", "colo-z", ""):  # itself, a worker that is not there, nobody
        events = await generate(nc, "colo-b", prompt[:-1] + (len(named),), prefill_worker_id=named)
        assert events[0].prefill_mode == "local"
    events = await generate(nc, "colo-b", prompt, prefill_worker_id="colo-z")
    assert tokens_of(events) == expected
    await pool.assert_all_blocks_free(nc)


async def test_a_peer_killed_with_the_job_on_its_way_is_recomputed_here(
    pool: Pool, nc: NatsClient
) -> None:
    """colo-a dies -9 while a job addressed to it waits in its queue: colo-b gives the job up
    when colo-a's lease ends (not at its remote-prefill timeout) and, under the recompute
    policy, prefills locally; every block of the live workers is free after."""
    earlier = random_prompt(PREFIX, seed=9)
    await generate(nc, "colo-a", earlier)
    pool.kill("colo-a")  # its record lives on until its lease runs out
    prompt = earlier + random_prompt(40, seed=10)
    started = time.monotonic()
    events = await asyncio.wait_for(
        generate(nc, "colo-b", prompt, prefill_worker_id="colo-a", deadline_s=60), timeout=70
    )
    assert events[0].prefill_mode == "recompute"
    assert tokens_of(events) == tokens_of(await generate(nc, "colo-ref", prompt))
    assert time.monotonic() - started < 30
    await pool.assert_all_blocks_free(nc)
