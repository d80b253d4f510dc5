"""Layer-wise KV transfer between tensor-parallel workers (docs/layerwise.md): real worker and
rank processes, real etcd, NATS and NIXL, on CPU.

A random-weight model of 6 layers (8 heads, 4 KV heads, as tests/integration/
test_worker_tensor_parallel.py's) with SmolLM2's tokenizer. `prefill-lw` runs on two ranks and
writes every prompt in 3 groups of layers, each rank its own KV heads from its own NIXL agent,
while it computes; `decode-0`, on two ranks too (checksums on, kvLoadFailurePolicy recompute),
installs it; `colo-0`, colocated on one device, is the baseline. Then, in file order: a
two-rank decode worker that corrupts rank 0's shard of what it receives refuses the completion,
naming the group and the rank, and recomputes; and `prefill-auto`
(`kv_transfer_layer_groups: auto`, each write delayed as over a slow link) takes the jobs: its
first prompt goes whole (no prefill measured yet), the next in the groups its measurements call
for. Every test ends with every live worker's blocks free.
"""

from __future__ import annotations

import asyncio
import functools
import re
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from nats.aio.client import Client as NatsClient

from kvrail.bus import connect
from kvrail.keys import PoolKeys
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.testing.pool import LocalPool, tokens_of
from kvrail.testing.pool import generate as pool_generate
from kvrail.testing.pool import random_prompt as prompt
from kvrail.worker.testing import write_random_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

POOL = f"lwtp-{uuid.uuid4().hex[:8]}"
KEYS = PoolKeys("default", POOL)
LONG_PROMPT = 150  # tokens: remote prefill (threshold 32)
TP = {"KVRAIL_TENSOR_PARALLEL_SIZE": "2"}

generate = functools.partial(pool_generate, keys=KEYS, deadline_s=60.0, max_tokens=10)


def gpus(first: int) -> dict[str, str]:
    """As in test_worker_tensor_parallel.py: on a machine of 4 GPUs or more each two-rank worker
    its own pair (the decode workers' ranks on GPUs 2 and 3, so shards cross GPUs); elsewhere
    nothing (CPU, or both pairs on GPUs 0 and 1)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 4:
        return {"CUDA_VISIBLE_DEVICES": f"{first},{first + 1}"}
    return {}


@pytest.fixture(scope="module")
def pool(
    etcd_server: EtcdServer, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPool]:
    model = write_random_model(
        tmp_path_factory.mktemp("model") / "tp", seed=5, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, hidden_size=128, intermediate_size=256,
    )  # fmt: skip
    p = LocalPool(etcd_server, nats_server, tmp_path_factory.mktemp("workers"), POOL, {
        "KVRAIL_MODEL": str(model),
        "KVRAIL_MIN_REMOTE_PREFILL_TOKENS": "32",
        "KVRAIL_TRANSFER_CHECKSUMS": "true",
        "KVRAIL_KV_LOAD_FAILURE_POLICY": "recompute",
        "KVRAIL_NUM_KV_BLOCKS": "96",
        "KVRAIL_MAX_MODEL_LEN": "1024",
        "KVRAIL_DTYPE": "float32",
    })  # fmt: skip
    try:
        p.start("prefill-lw", "prefill", KVRAIL_KV_TRANSFER_LAYER_GROUPS="3", **TP, **gpus(0))
        p.start("decode-0", "decode", **TP, **gpus(2))
        p.start("colo-0", "colocated", KVRAIL_DISAGGREGATION_MODE="colocated", **gpus(0))
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


def written_line(pool: LocalPool, worker_id: str, request_id: str) -> str:
    (line,) = [
        line
        for line in pool.procs[worker_id].log_text().splitlines()
        if "prefill written" in line and f"request_id={request_id} " in line
    ]
    return line


def num_groups_written(pool: LocalPool, worker_id: str, request_id: str) -> int:
    found = re.search(r" layer_groups=(\d+) ", written_line(pool, worker_id, request_id))
    assert found is not None
    return int(found.group(1))


async def test_a_layer_wise_write_between_two_rank_workers_decodes_like_a_colocated_worker(
    pool: LocalPool, nc: NatsClient
) -> None:
    token_ids = prompt(LONG_PROMPT, seed=1)
    colocated = await generate(nc, "colo-0", token_ids)
    remote = await generate(nc, "decode-0", token_ids, request_id="lwtp-greedy")
    assert colocated[0].prefill_mode == "local" and remote[0].prefill_mode == "remote"
    assert len(tokens_of(colocated)) == 10
    assert tokens_of(remote) == tokens_of(colocated)
    assert num_groups_written(pool, "prefill-lw", "lwtp-greedy") == 3  # not its fallback
    line = written_line(pool, "prefill-lw", "lwtp-greedy")
    num_blocks = int(re.search(r" blocks=(\d+) ", line).group(1))  # type: ignore[union-attr]
    # Every group of both shards: 3 groups of 2 layers of 10 blocks, 2 KV heads on each rank.
    block_bytes_per_rank = 6 * 2 * 16 * 2 * (128 // 8) * 4  # layers, K/V, tokens, heads, dim
    assert f" bytes={num_blocks * 2 * block_bytes_per_rank} " in line
    assert "fell back" not in pool.procs["prefill-lw"].log_text()
    await pool.assert_all_blocks_free(nc)


async def test_a_group_that_fails_its_checksum_on_one_shard_is_named_and_recomputed(
    pool: LocalPool, nc: NatsClient
) -> None:
    """The fault flips a byte of the first received block in rank 0's shard (layer 0: the first
    group); rank 1's shard is intact."""
    pool.start("decode-bad", "decode", KVRAIL_FAULT_CORRUPT_KV_TRANSFERS="1", **TP, **gpus(2))
    await asyncio.to_thread(pool.wait_ready, "decode-bad")
    token_ids = prompt(LONG_PROMPT, seed=21)
    colocated = await generate(nc, "colo-0", token_ids)
    events = await generate(nc, "decode-bad", token_ids, request_id="lwtp-bad")
    assert events[0].prefill_mode == "recompute"
    assert tokens_of(events) == tokens_of(colocated)
    text = pool.procs["decode-bad"].log_text()
    assert "reason=checksum" in text and "layer groups [0] differ (ranks [0] of 2)" in text
    assert num_groups_written(pool, "prefill-lw", "lwtp-bad") == 3
    await pool.assert_all_blocks_free(nc)
    await asyncio.to_thread(pool.procs["decode-bad"].stop, 20)


async def test_auto_goes_whole_until_it_measured_then_in_the_groups_its_link_calls_for(
    pool: LocalPool, nc: NatsClient
) -> None:
    """Each write of `prefill-auto` is delayed 0.3 s, which its measurements count as the
    link's time (a few MB/s): once its first prompt was prefilled and written whole, the next
    goes in groups, as many as the rule picks (1 to 6), and decodes as the colocated worker."""
    await asyncio.to_thread(pool.procs["prefill-lw"].stop, 20)
    pool.start(
        "prefill-auto", "prefill", KVRAIL_KV_TRANSFER_LAYER_GROUPS="auto",
        KVRAIL_FAULT_DELAY_KV_WRITES_S="0.3", KVRAIL_LOG_LEVEL="DEBUG", **TP, **gpus(0),
    )  # fmt: skip
    await asyncio.to_thread(pool.wait_ready, "prefill-auto")
    for n, seed in enumerate((31, 32)):
        token_ids = prompt(LONG_PROMPT, seed=seed)
        colocated = await generate(nc, "colo-0", token_ids)
        remote = await generate(nc, "decode-0", token_ids, request_id=f"lwtp-auto-{n}")
        assert remote[0].prefill_mode == "remote"
        assert tokens_of(remote) == tokens_of(colocated)
    assert num_groups_written(pool, "prefill-auto", "lwtp-auto-0") == 0
    assert 1 <= num_groups_written(pool, "prefill-auto", "lwtp-auto-1") <= 6
    text = pool.procs["prefill-auto"].log_text()
    (chosen,) = [line for line in text.splitlines() if "layer groups chosen" in line]
    assert "request_id=lwtp-auto-1 " in chosen and "measured=True" in chosen
    assert "fell back" not in text
    await pool.assert_all_blocks_free(nc)
