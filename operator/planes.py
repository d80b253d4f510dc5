"""The operator's connections to a pool's discovery plane (etcd) and work queue (NATS JetStream).

A pool's endpoints are its `spec.infrastructure`, else the operator's defaults (its settings,
which also fill the `BuildContext`). Credentials are the operator's own, read from the files its
settings name (mounted Secrets): the operator never reads a Secret through the API. A pool whose
`credentialsSecret` holds other credentials than the operator's is therefore not reachable by the
operator (its planner holds and its cleanup gives up, see `kvrail.operator.handlers`).

`Planes` keeps one etcd client per endpoint and one NATS connection per URL, shared by every pool
that uses them, created on first use inside Kopf's event loop. Every call has a deadline: an
unreachable server costs one `timeout_s`, never a hung handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aetcd
import nats.errors
from nats.aio.client import Client as NatsClient

from kvrail.bus import PrefillQueue, connect
from kvrail.crd.infrastructure import InfrastructureSpec
from kvrail.errors import ConfigError
from kvrail.keys import PoolKeys
from kvrail.registry import Registry, etcd_client
from kvrail.settings import Settings

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3.0
UNREACHABLE = (OSError, TimeoutError, aetcd.exceptions.ClientError, nats.errors.Error)
"""What an unreachable or failing etcd or NATS raises; turned into `PlaneError`."""


class PlaneError(Exception):
    """etcd or NATS could not be reached or answered with an error within the deadline."""


def pool_settings(
    base: Settings, namespace: str, name: str, infrastructure: InfrastructureSpec | None = None
) -> Settings:
    """`base` (the operator's settings) scoped to one pool, with the pool's endpoints where its
    `spec.infrastructure` sets them. The operator's CA files stay for a pool's `https://` etcd and
    `tls://` NATS (they must be signed by the same CA) and are dropped for its `http://` and
    `nats://` ones, which ask for plaintext. Pure."""
    update: dict[str, object] = {"namespace": namespace, "pool": name}
    if infrastructure is not None and infrastructure.etcd is not None:
        update["etcd_endpoints"] = tuple(infrastructure.etcd.endpoints)
        if all(e.startswith("http://") for e in infrastructure.etcd.endpoints):
            update["etcd_ca_file"] = None
    if infrastructure is not None and infrastructure.nats is not None:
        update["nats_url"] = infrastructure.nats.url
        if infrastructure.nats.url.startswith("nats://"):
            update["nats_ca_file"] = None
    return base.model_copy(update=update)


class Planes:
    """Shared etcd clients and NATS connections, keyed by endpoint."""

    def __init__(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._etcd: dict[str, aetcd.Client] = {}
        self._nats: dict[str, NatsClient] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def registry(self, settings: Settings) -> Registry:
        keys = PoolKeys(settings.namespace, settings.pool)
        return Registry(await self._etcd_client(settings), keys)

    async def queue(self, settings: Settings) -> PrefillQueue:
        nc = await self._nats_client(settings)
        keys = PoolKeys(settings.namespace, settings.pool)
        return PrefillQueue(nc.jetstream(timeout=self.timeout_s), keys)

    async def close(self) -> None:
        for client in self._etcd.values():
            with contextlib.suppress(*UNREACHABLE):
                await client.close()
        for nc in self._nats.values():
            with contextlib.suppress(*UNREACHABLE):
                await nc.close()
        self._etcd.clear()
        self._nats.clear()

    async def _etcd_client(self, settings: Settings) -> aetcd.Client:
        """The client connects lazily: an unreachable etcd fails the first call, and gRPC
        reconnects by itself afterwards."""
        endpoint = settings.etcd_endpoints[0]
        async with self._locks.setdefault(f"etcd {endpoint}", asyncio.Lock()):
            client = self._etcd.get(endpoint)
            if client is None:
                try:
                    client = etcd_client(settings)
                    await asyncio.wait_for(client.connect(), self.timeout_s)
                except ConfigError as err:
                    raise PlaneError(f"etcd {endpoint}: {err}") from err
                except UNREACHABLE as err:
                    raise PlaneError(f"etcd {endpoint}: {type(err).__name__}: {err}") from err
                self._etcd[endpoint] = client
            return client

    async def _nats_client(self, settings: Settings) -> NatsClient:
        """A connection that reconnects forever once made; making it has a deadline."""
        url = settings.nats_url
        async with self._locks.setdefault(f"nats {url}", asyncio.Lock()):
            nc = self._nats.get(url)
            if nc is not None and nc.is_closed:
                del self._nats[url]
                nc = None
            if nc is None:
                connecting = connect(
                    settings,
                    "kvrail-operator",
                    connect_timeout=self.timeout_s,
                    reconnect_time_wait=1.0,
                    error_cb=_quiet,
                )
                try:
                    nc = await asyncio.wait_for(connecting, self.timeout_s)
                except ConfigError as err:
                    raise PlaneError(f"NATS {url}: {err}") from err
                except UNREACHABLE as err:
                    raise PlaneError(f"NATS {url}: unreachable ({type(err).__name__})") from err
                self._nats[url] = nc
            return nc


async def _quiet(err: Exception) -> None:
    """NATS connection errors: a planner tick or the finalizer reports them, once, as a reason."""
    log.debug("nats error=%s", err)


async def delete_pool_data(planes: Planes, settings: Settings) -> tuple[bool, bool]:
    """Remove the pool's etcd keys and its JetStream stream (the finalizer's work); idempotent.

    Returns (keys deleted, stream existed). Raises `PlaneError` when either server cannot be
    reached or fails within the deadline; nothing is half-hidden: a retry deletes what is left.
    """
    registry = await planes.registry(settings)
    try:
        await asyncio.wait_for(registry.delete_pool(), planes.timeout_s)
    except UNREACHABLE as err:
        raise PlaneError(f"etcd: {type(err).__name__}: {err}") from err
    queue = await planes.queue(settings)
    try:
        existed = await asyncio.wait_for(queue.delete_stream(), planes.timeout_s)
    except UNREACHABLE as err:
        raise PlaneError(f"NATS: {type(err).__name__}: {err}") from err
    return True, existed
