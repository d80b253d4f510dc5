"""The discovery plane: worker records in etcd, each under its worker's lease.

A worker registers one `WorkerRecord` at `PoolKeys.worker(worker_id)`, bound to a lease that a
background task refreshes every third of its TTL. A worker that dies stops refreshing and its
record disappears when the lease expires; a worker that stops cleanly revokes the lease, so the
record disappears at once. Peers `watch()` the prefix: a snapshot first, then every change, so a
restarted worker (same id, new incarnation) replaces its old record the moment it registers and
peers drop the stale NIXL agent then, not after a TTL.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import aetcd
import aetcd.client
import aetcd.rpc
import aetcd.watcher

from kvrail.codec import MessageError, decode
from kvrail.keys import PoolKeys
from kvrail.messages import WorkerRecord
from kvrail.settings import Settings, read_secret
from kvrail.tasks import cancel_and_wait
from kvrail.tls import etcd_credentials

log = logging.getLogger(__name__)


def etcd_client(settings: Settings) -> aetcd.Client:
    """A client for the first configured endpoint, with credentials read from their files: TLS
    for `https://` endpoints (see `kvrail.tls`), plaintext for `http://` ones. Raises ConfigError
    for a CA file with plaintext endpoints or a CA file that cannot be read."""
    credentials = etcd_credentials(settings.etcd_endpoints, settings.etcd_ca_file)
    url = urlparse(settings.etcd_endpoints[0])
    args = {
        "host": url.hostname or "127.0.0.1",
        "port": url.port or 2379,
        "username": settings.etcd_username,
        "password": read_secret(settings.etcd_password_file),
    }
    if credentials is None:
        return aetcd.Client(**args)
    return _TlsClient(credentials, **args)


class _TlsClient(aetcd.Client):  # type: ignore[misc]  # aetcd has no type hints
    """An aetcd client over TLS. aetcd 1.0 opens plaintext gRPC channels only
    (martyanov/aetcd#37), so `connect` is ours: a TLS channel, the login (when credentials are
    set) only once TLS is up, then the stubs and the watcher aetcd's methods use. The TLS tests
    in tests/integration/test_secure_planes.py catch an aetcd release that renames them."""

    def __init__(self, credentials: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._credentials = credentials
        self._connect_lock = asyncio.Lock()

    @aetcd.client._handle_errors  # type: ignore[untyped-decorator]
    async def connect(self) -> None:
        async with self._connect_lock:
            if self._connected.is_set():
                return
            channel = aetcd.rpc.secure_channel(
                f"{self._host}:{self._port}", self._credentials, options=self._options.items()
            )
            token: tuple[tuple[str, str], ...] | None = None
            if self._username is not None and self._password is not None:
                login = aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password)
                reply = await aetcd.rpc.AuthStub(channel).Authenticate(login, timeout=self._timeout)
                token = (("token", reply.token),)
            self._use(channel, token)
            self._connected.set()

    def _use(self, channel: Any, token: tuple[tuple[str, str], ...] | None) -> None:
        """Point every stub aetcd's methods call at `channel`, with the login token."""
        self.channel, self.metadata = channel, token
        self.auth_stub = aetcd.rpc.AuthStub(channel)
        self.kvstub = aetcd.rpc.KVStub(channel)
        self.clusterstub = aetcd.rpc.ClusterStub(channel)
        self.leasestub = aetcd.rpc.LeaseStub(channel)
        self.maintenancestub = aetcd.rpc.MaintenanceStub(channel)
        watch = aetcd.rpc.WatchStub(channel)
        self._watcher = aetcd.watcher.Watcher(watch, timeout=self._timeout, metadata=token)


@dataclass(frozen=True, slots=True)
class WorkerChange:
    """One observed change; `record` is None when the worker is gone."""

    worker_id: str
    record: WorkerRecord | None


class Registration:
    """A live registration. `update()` replaces the record; `close()` deregisters at once."""

    def __init__(self, client: aetcd.Client, key: bytes, record: WorkerRecord, ttl_s: int) -> None:
        self._client = client
        self._key = key
        self.record = record
        self._ttl_s = ttl_s
        self._lease: aetcd.Lease | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> Registration:
        await self._grant_and_put()
        self._task = asyncio.create_task(self._keep_alive(), name=f"lease:{self.record.worker_id}")
        return self

    async def update(self, record: WorkerRecord) -> None:
        if record.worker_id != self.record.worker_id:
            raise ValueError("a registration cannot change its worker id")
        self.record = record
        await self._client.put(self._key, record.encode(), lease=self._lease)

    async def close(self) -> None:
        if self._task:
            await cancel_and_wait(self._task)
        if self._lease is not None:
            await self._lease.revoke()
            self._lease = None
        log.info("worker deregistered worker=%s", self.record.worker_id)

    async def _grant_and_put(self) -> None:
        self._lease = await self._client.lease(ttl=self._ttl_s)
        await self._client.put(self._key, self.record.encode(), lease=self._lease)
        log.info(
            "worker registered worker=%s incarnation=%d role=%s ttl_s=%d",
            self.record.worker_id, self.record.incarnation, self.record.role, self._ttl_s,
        )  # fmt: skip

    async def _keep_alive(self) -> None:
        interval_s = max(self._ttl_s / 3, 0.2)
        while True:
            await asyncio.sleep(interval_s)
            assert self._lease is not None
            try:
                reply = await self._lease.refresh()
                if reply.TTL > 0:
                    continue
                # The lease expired (we were partitioned longer than the TTL): register anew.
                log.warning("lease expired, registering again worker=%s", self.record.worker_id)
                await self._grant_and_put()
            except aetcd.exceptions.ClientError as err:
                log.warning("lease refresh failed worker=%s error=%s", self.record.worker_id, err)


class Registry:
    """Worker records of one pool."""

    def __init__(self, client: aetcd.Client, keys: PoolKeys) -> None:
        self.client = client
        self.keys = keys

    async def register(self, record: WorkerRecord, ttl_s: int = 3) -> Registration:
        if ttl_s < 1:
            raise ValueError("ttl_s must be at least 1")
        return await Registration(self.client, self._key(record.worker_id), record, ttl_s).start()

    async def workers(self) -> tuple[dict[str, WorkerRecord], int]:
        """Every valid record and the etcd revision they were read at."""
        result = await self.client.get_prefix(self.keys.workers_prefix.encode())
        records: dict[str, WorkerRecord] = {}
        for kv in result:
            change = self.change_of("PUT", kv.key, kv.value)
            if change is not None and change.record is not None:
                records[change.worker_id] = change.record
        return records, result.header.revision

    async def watch(
        self, on_snapshot: Callable[[], None] | None = None
    ) -> AsyncIterator[WorkerChange]:
        """The current records, then every change, in order, until the caller stops iterating.
        `on_snapshot` is called once the current records were yielded, before the first change:
        a caller that held older records learns which of them are gone by their absence."""
        records, revision = await self.workers()
        for worker_id, record in sorted(records.items()):
            yield WorkerChange(worker_id, record)
        if on_snapshot is not None:
            on_snapshot()
        prefix = self.keys.workers_prefix.encode()
        watch = await self.client.watch_prefix(prefix, start_revision=revision + 1)
        try:
            async for event in watch:
                change = self.change_of(event.kind, event.kv.key, event.kv.value)
                if change is not None:
                    yield change
        finally:
            await watch.cancel()

    async def delete_pool(self) -> None:
        """Remove every key the pool owns (the operator's finalizer)."""
        await self.client.delete_prefix(self.keys.pool_prefix.encode())

    def _key(self, worker_id: str) -> bytes:
        return self.keys.worker(worker_id).encode()

    def _worker_id(self, key: bytes) -> str | None:
        try:
            return self.keys.worker_id_of(key.decode())
        except (UnicodeDecodeError, ValueError):
            log.warning("ignoring a foreign key under the workers prefix")
            return None

    def change_of(self, kind: str, key: bytes, value: bytes) -> WorkerChange | None:
        """The change one etcd event (`kind` PUT or DELETE) under the workers prefix means, or
        None for a foreign key or an invalid record (logged, ignored)."""
        worker_id = self._worker_id(key)
        if worker_id is None:
            return None
        if kind == "DELETE":
            return WorkerChange(worker_id, None)
        try:
            record = decode(value, WorkerRecord)
        except MessageError as err:
            log.warning("ignoring an invalid worker record worker=%s error=%s", worker_id, err)
            return None
        if record.worker_id != worker_id:
            log.warning("ignoring a worker record filed under another id worker=%s", worker_id)
            return None
        return WorkerChange(worker_id, record)
