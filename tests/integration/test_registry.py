"""kvrail.registry against the harness's real etcd."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from kvrail.keys import PoolKeys
from kvrail.local.servers import EtcdServer
from kvrail.messages import WorkerRecord
from kvrail.registry import Registry, WorkerChange, etcd_client
from kvrail.settings import Settings


@pytest.fixture
async def registry(etcd_server: EtcdServer) -> AsyncIterator[Registry]:
    settings = Settings(etcd_endpoints=(etcd_server.endpoint,))
    client = etcd_client(settings)
    async with client:
        yield Registry(client, PoolKeys("default", f"reg-{uuid.uuid4().hex[:8]}"))


def record(worker_id: str, incarnation: int = 1, **kw: object) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, pod_uid=f"uid-{incarnation}", incarnation=incarnation,
                        role="decode", fingerprint="f" * 64, **kw)  # type: ignore[arg-type]  # fmt: skip


async def _next(it: AsyncIterator[WorkerChange], timeout_s: float = 10) -> WorkerChange:
    return await asyncio.wait_for(anext(it), timeout_s)


async def test_a_registered_worker_is_listed_and_gone_at_once_after_close(
    registry: Registry,
) -> None:
    reg = await registry.register(record("decode-0"), ttl_s=2)
    workers, _ = await registry.workers()
    assert workers == {"decode-0": record("decode-0")}
    await reg.close()
    assert (await registry.workers())[0] == {}


async def test_the_record_outlives_its_ttl_while_refreshed_and_updates_in_place(
    registry: Registry,
) -> None:
    reg = await registry.register(record("decode-0"), ttl_s=1)
    await asyncio.sleep(2.5)
    await reg.update(dataclasses.replace(reg.record, num_running=7, kv_utilization=0.5))
    workers, _ = await registry.workers()
    assert workers["decode-0"].num_running == 7
    await reg.close()


async def test_watchers_see_snapshot_changes_restart_and_death(registry: Registry) -> None:
    old = await registry.register(record("prefill-0", incarnation=1), ttl_s=1)
    it = registry.watch().__aiter__()
    assert await _next(it) == WorkerChange("prefill-0", record("prefill-0", incarnation=1))
    # A restart with the same name: the new incarnation replaces the old record at once.
    new = await registry.register(record("prefill-0", incarnation=2), ttl_s=1)
    change = await _next(it)
    assert change.record is not None and change.record.incarnation == 2
    # The key now belongs to the new lease: the old process's lease ending (revoked here, or
    # expiring after a crash) must not remove the new incarnation's record.
    await old.close()
    workers, _ = await registry.workers()
    assert workers["prefill-0"].incarnation == 2
    await new.close()
    assert await _next(it) == WorkerChange("prefill-0", None)


async def test_the_snapshot_end_is_signalled_before_the_first_change(registry: Registry) -> None:
    regs = [await registry.register(record(w)) for w in ("decode-0", "decode-1")]
    seen: list[str] = []
    at_snapshot: list[list[str]] = []
    it = registry.watch(on_snapshot=lambda: at_snapshot.append(list(seen))).__aiter__()
    for _ in range(2):
        seen.append((await _next(it)).worker_id)
    await regs[0].close()
    assert await _next(it) == WorkerChange("decode-0", None)
    assert at_snapshot == [["decode-0", "decode-1"]]  # once, after exactly the snapshot
    await regs[1].close()


async def test_a_crashed_worker_disappears_when_its_lease_expires(registry: Registry) -> None:
    reg = await registry.register(record("decode-9"), ttl_s=1)
    it = registry.watch().__aiter__()
    assert (await _next(it)).record is not None
    assert reg._task is not None
    reg._task.cancel()  # the process "dies": nobody refreshes the lease any more
    started = time.monotonic()
    assert await _next(it, timeout_s=10) == WorkerChange("decode-9", None)
    assert time.monotonic() - started < 5


async def test_invalid_and_foreign_records_are_ignored(registry: Registry) -> None:
    await registry.client.put(registry.keys.worker("bad-0").encode(), b"{not json")
    await registry.client.put(registry.keys.worker("liar-0").encode(), record("other").encode())
    reg = await registry.register(record("good-0"))
    workers, _ = await registry.workers()
    assert set(workers) == {"good-0"}
    await reg.close()
    await registry.delete_pool()
    assert (await registry.client.get_prefix(registry.keys.pool_prefix.encode())).count == 0
