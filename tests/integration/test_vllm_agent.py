"""The vLLM agent against a real vLLM server (vLLM's CPU build, SmolLM2, role `colocated`,
no connector) and a real etcd: what it registers, the load it publishes, readiness when vLLM
stops answering and comes back, and deregistration on SIGTERM.

Needs `.venv-vllm` (`make vllm-env`; `make test` builds it): without it the tests fail with that
hint. One server for the module (~80 s to start here); the test that kills it runs last.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import httpx
import pytest

from kvrail.agent.vllm import NOT_READY_AFTER_S
from kvrail.keys import PoolKeys
from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer
from kvrail.messages import WorkerRecord
from kvrail.registry import Registry, etcd_client
from kvrail.settings import load_settings
from kvrail.testing.vllm import (
    SERVED_MODEL_NAME,
    VllmEnvMissing,
    VllmPool,
    serve_config,
    vllm_model_dir,
    vllm_python,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

POOL = f"va-{uuid.uuid4().hex[:8]}"
NAME = "vllm-0"
MAX_MODEL_LEN = 1024
Records = Callable[[], Awaitable[dict[str, WorkerRecord]]]


@pytest.fixture(scope="module")
def vllm_pool(
    etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmPool]:
    try:
        vllm_python()
    except VllmEnvMissing as err:
        pytest.fail(str(err))
    model_dir = vllm_model_dir()
    pool = VllmPool(
        {"KVRAIL_POOL": POOL, **etcd_server.client_env()},
        tmp_path_factory.mktemp("vllm-agent"),
        model_dir,
    )
    cfg = serve_config(model_dir, "colocated", free_port(), free_port(), MAX_MODEL_LEN)
    try:
        pool.start({NAME: (cfg, 0)})
        yield pool
    finally:
        pool.stop()


@pytest.fixture
async def records(vllm_pool: VllmPool) -> AsyncIterator[Records]:
    settings = load_settings(environ=vllm_pool.pool_env)
    async with etcd_client(settings) as etcd:
        registry = Registry(etcd, PoolKeys("default", POOL))

        async def read() -> dict[str, WorkerRecord]:
            return (await registry.workers())[0]

        yield read


async def wait_for(
    read: Records, check: Callable[[dict[str, WorkerRecord]], bool], timeout_s: float
) -> dict[str, WorkerRecord]:
    """Poll the pool's records until `check` holds; fail with the last records at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = await read()
        if check(current):
            return current
        if time.monotonic() > deadline:
            raise AssertionError(f"records did not change in {timeout_s:.0f}s: {current}")
        await asyncio.sleep(0.1)


async def test_the_agent_registers_its_server_as_a_ready_vllm_worker(
    vllm_pool: VllmPool, records: Records
) -> None:
    server = vllm_pool.servers[NAME]
    current = await wait_for(records, lambda r: NAME in r, 10)
    record = current[NAME]
    assert record.engine == "vllm"
    assert record.role == "colocated"
    assert record.address == server.url  # pod IP 127.0.0.1 and vLLM's port
    assert record.worker_id == NAME and record.pod_uid == f"uid-{NAME}"
    assert record.max_model_len == MAX_MODEL_LEN  # what vLLM reports in /v1/models
    assert record.block_size == 128  # what vLLM reports in vllm:cache_config_info
    assert record.num_blocks > 0
    assert record.is_ready
    assert len(record.fingerprint) == 64
    assert (record.num_running, record.num_waiting) == (0, 0)


async def test_the_record_carries_vllms_load_while_requests_run(
    vllm_pool: VllmPool, records: Records
) -> None:
    server = vllm_pool.servers[NAME]
    body = {
        "model": SERVED_MODEL_NAME, "prompt": "Count from one to one thousand: one, two,",
        "max_tokens": 200, "temperature": 0, "ignore_eos": True,
    }  # fmt: skip
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
        requests = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(4)]
        busy = await wait_for(
            records, lambda r: r[NAME].num_running + r[NAME].num_waiting >= 2, 120
        )
        assert busy[NAME].kv_utilization > 0
        assert busy[NAME].is_ready
        for response in await asyncio.gather(*requests):
            assert response.status_code == 200
    await wait_for(records, lambda r: r[NAME].num_running == r[NAME].num_waiting == 0, 10)


async def test_sigterm_removes_the_record_at_once_and_a_new_agent_registers_again(
    vllm_pool: VllmPool, records: Records
) -> None:
    agent = vllm_pool.servers[NAME].agent
    assert agent is not None
    old = (await records())[NAME]
    agent.stop(grace_s=10)
    assert agent.returncode() == 0
    assert NAME not in await records()  # revoked, not expired
    vllm_pool.start_agent(NAME)
    vllm_pool.wait_agent_ready(NAME)
    new = (await wait_for(records, lambda r: NAME in r, 10))[NAME]
    assert new.incarnation > old.incarnation and new.is_ready


async def test_a_frozen_vllm_makes_the_record_not_ready_until_it_answers_again(
    vllm_pool: VllmPool, records: Records
) -> None:
    process = vllm_pool.servers[NAME].process
    assert process.pid is not None
    os.killpg(process.pid, signal.SIGSTOP)  # API server, EngineCore and worker
    try:
        started = time.monotonic()
        await wait_for(records, lambda r: not r[NAME].is_ready, NOT_READY_AFTER_S + 10)
        assert time.monotonic() - started >= NOT_READY_AFTER_S - 1  # a short grace first
    finally:
        os.killpg(process.pid, signal.SIGCONT)
    await wait_for(records, lambda r: r[NAME].is_ready, 30)


async def test_a_killed_vllm_leaves_a_not_ready_record_until_the_agent_stops(
    vllm_pool: VllmPool, records: Records
) -> None:
    server = vllm_pool.servers[NAME]
    server.process.kill()
    await wait_for(records, lambda r: NAME in r and not r[NAME].is_ready, NOT_READY_AFTER_S + 10)
    assert server.agent is not None and server.agent.is_running()
    server.agent.stop(grace_s=10)
    assert server.agent.returncode() == 0
    assert NAME not in await records()
