"""The real etcd of the harness: keys under a lease vanish when the lease expires."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlparse

import aetcd

from kvrail.keys import PoolKeys
from kvrail.local.servers import EtcdServer


def _client(server: EtcdServer) -> aetcd.Client:
    url = urlparse(server.endpoint)
    return aetcd.Client(host=url.hostname or "127.0.0.1", port=url.port or 2379)


async def test_key_under_a_lease_disappears_when_the_lease_expires(etcd_server: EtcdServer) -> None:
    key = PoolKeys("default", "lease-test").worker("w-0").encode()
    async with _client(etcd_server) as client:
        lease = await client.lease(ttl=1)
        await client.put(key, b'{"role":"decode"}', lease=lease)
        assert (await client.get(key)) is not None
        deadline = time.monotonic() + 10
        while (await client.get(key)) is not None:
            assert time.monotonic() < deadline, "key outlived its 1 s lease by 10 s"
            await asyncio.sleep(0.2)


async def test_key_survives_while_its_lease_is_refreshed(etcd_server: EtcdServer) -> None:
    key = PoolKeys("default", "lease-test").worker("w-1").encode()
    async with _client(etcd_server) as client:
        lease = await client.lease(ttl=1)
        await client.put(key, b"{}", lease=lease)
        for _ in range(8):  # 2 s, twice the TTL
            await lease.refresh()
            await asyncio.sleep(0.25)
        assert (await client.get(key)) is not None
        await lease.revoke()
        assert (await client.get(key)) is None


async def test_prefix_delete_removes_only_the_pools_keys(etcd_server: EtcdServer) -> None:
    a, b = PoolKeys("default", "pool-a"), PoolKeys("default", "pool-ab")
    async with _client(etcd_server) as client:
        await client.put(a.worker("w-0").encode(), b"a")
        await client.put(b.worker("w-0").encode(), b"b")
        await client.delete_prefix(a.pool_prefix.encode())
        assert (await client.get(a.worker("w-0").encode())) is None
        assert (await client.get(b.worker("w-0").encode())) is not None
