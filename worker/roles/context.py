"""What every role of one worker process shares, built once by `kvrail.worker.__main__`."""

from __future__ import annotations

from dataclasses import dataclass

from nats.aio.client import Client as NatsClient

from kvrail.bus import PrefillQueue
from kvrail.keys import PoolKeys
from kvrail.settings import Settings
from kvrail.worker.roles.peers import PeerTable
from kvrail.worker.service import EngineService
from kvrail.worker.transfer.connector import Connector


@dataclass(frozen=True)
class WorkerContext:
    """Identity (`worker_id`, `incarnation`, NIXL `agent_name`, model `fingerprint`), the
    engine's `block_size` (the one source of it for the roles) and the live connections of one
    worker process; the roles borrow them and never close them."""

    settings: Settings
    keys: PoolKeys
    worker_id: str
    incarnation: int
    agent_name: str
    fingerprint: str
    block_size: int
    nc: NatsClient
    prefill_queue: PrefillQueue
    service: EngineService
    connector: Connector
    peers: PeerTable
