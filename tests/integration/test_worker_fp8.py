"""FP8 in a pool: real worker processes, etcd, NATS and NIXL (SmolLM2 on CPU, float32 compute).

Five workers of one pool: `prefill-0`, `decode-0` and `colo-0` (colocated, the baseline) with
`kv_dtype` float8_e4m3fn, `decode-wide` with the default KV dtype (the weights' float32), and
`colo-fp8` (colocated) with FP8 weights. The FP8 blocks move over NIXL as they are: a quarter
of float32's bytes, and the decode worker continues exactly as the colocated FP8 worker does.
The float32-KV decode worker has another fingerprint, so no FP8 prefill worker ever prefills for
it: it prefills locally. The FP8-weight worker serves, under a fingerprint of its own.
"""

from __future__ import annotations

import asyncio
import functools
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
from nats.aio.client import Client as NatsClient

from kvrail.bus import connect
from kvrail.keys import PoolKeys
from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.testing.pool import LocalPool, tokens_of
from kvrail.testing.pool import generate as pool_generate

POOL = f"kvd-{uuid.uuid4().hex[:8]}"
KEYS = PoolKeys("default", POOL)
PROMPT = tuple(range(500, 650))  # 150 tokens: 10 blocks of 16, prefilled remotely (threshold 32)
# SmolLM2: 30 layers, K and V, 3 KV heads of 64, 16 tokens a block, 1 byte an FP8 value
FP8_BLOCK_BYTES = 30 * 2 * 3 * 64 * 16

generate = functools.partial(pool_generate, keys=KEYS)


@pytest.fixture(scope="module")
def pool(
    etcd_server: EtcdServer, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalPool, int]]:
    p = LocalPool(etcd_server, nats_server, tmp_path_factory.mktemp("kv-dtype"), POOL, {
        "KVRAIL_MIN_REMOTE_PREFILL_TOKENS": "32", "KVRAIL_TRANSFER_CHECKSUMS": "true",
        "KVRAIL_NUM_KV_BLOCKS": "48", "KVRAIL_MAX_MODEL_LEN": "512",
        "KVRAIL_KV_DTYPE": "float8_e4m3fn",
    })  # fmt: skip
    metrics_port = free_port()
    try:
        p.start("prefill-0", "prefill", KVRAIL_HTTP_PORT=str(metrics_port))
        p.start("decode-0", "decode")
        p.start("colo-0", "colocated", KVRAIL_DISAGGREGATION_MODE="colocated")
        p.start("decode-wide", "decode", KVRAIL_KV_DTYPE="auto")
        p.start("colo-fp8", "colocated", KVRAIL_DISAGGREGATION_MODE="colocated",
                KVRAIL_KV_DTYPE="auto", KVRAIL_QUANTIZATION="fp8")  # fmt: skip
        for worker_id in p.procs:
            p.wait_ready(worker_id)
        yield p, metrics_port
    finally:
        p.stop()


@pytest.fixture
async def nc(pool: tuple[LocalPool, int]) -> NatsClient:
    client = await connect(pool[0].settings, "test-client")
    yield client  # type: ignore[misc]
    await client.close()


async def test_fp8_kv_moves_as_fp8_bytes_and_decodes_like_the_colocated_fp8_worker(
    pool: tuple[LocalPool, int], nc: NatsClient
) -> None:
    workers, metrics_port = pool
    colocated = await generate(nc, "colo-0", PROMPT)
    disaggregated = await generate(nc, "decode-0", PROMPT)
    assert colocated[0].prefill_mode == "local"
    assert disaggregated[0].prefill_mode == "remote"
    assert len(tokens_of(colocated)) == 8
    assert tokens_of(disaggregated) == tokens_of(colocated)
    metrics = await asyncio.to_thread(scrape, metrics_port)
    moved = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith('kvrail_kv_transfer_bytes_total{transport="nixl-ucx"}')
    ]
    assert moved == [10 * FP8_BLOCK_BYTES]  # float32 KV: 4 times as many
    await workers.assert_all_blocks_free(nc)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


async def test_a_decode_worker_with_another_kv_dtype_never_pairs_with_the_fp8_prefill_worker(
    pool: tuple[LocalPool, int], nc: NatsClient
) -> None:
    workers, _ = pool
    records = await workers.records()
    assert records["decode-wide"].fingerprint != records["decode-0"].fingerprint
    assert records["prefill-0"].fingerprint == records["decode-0"].fingerprint
    events = await generate(nc, "decode-wide", PROMPT)
    assert events[0].prefill_mode == "local"
    assert len(tokens_of(events)) == 8
    await workers.assert_all_blocks_free(nc)


async def test_a_worker_with_fp8_weights_serves_under_its_own_fingerprint(
    pool: tuple[LocalPool, int], nc: NatsClient
) -> None:
    workers, _ = pool
    records = await workers.records()
    assert records["colo-fp8"].fingerprint not in {
        records[w].fingerprint for w in ("decode-0", "decode-wide")
    }
    events = await generate(nc, "colo-fp8", PROMPT)
    assert events[0].prefill_mode == "local"
    assert len(tokens_of(events)) == 8
    await workers.assert_all_blocks_free(nc)
