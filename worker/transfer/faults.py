"""Fault injection at the KV transport, for tests and the soak (every fault off by default).

A prefill worker's NIXL WRITE goes through `TransportFaults.write`, which can fail it before
anything is written (`fault_fail_kv_writes`, a fraction of writes: the first, then every
`1 / fraction`-th), delay it on the NIXL thread
like a slow link (`fault_delay_kv_writes_s`, counted in the write's seconds as a slow link's
time would be: the transfer metrics and `auto` layer groups see it), or let the bytes land but
lose the completion notification (`fault_lose_kv_notifications`, a fraction), so the decode
worker never hears of it and its remote-prefill timeout decides. Each injected fault is logged
with the request id.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvrail.errors import TransferError
from kvrail.settings import Settings
from kvrail.worker.transfer.blocks import TransferStats
from kvrail.worker.transfer.connector import Connector

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TransportFaults:
    fail: float = 0.0
    delay_s: float = 0.0
    lose_notification: float = 0.0
    _seen: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    """Writes (and notifications) seen so far, per fault: a fraction p hits the n-th one when
    `ceil(n p)` steps up, so the first one is hit and then every `1 / p`-th, not at random (a
    short window of a test or a soak still sees its fault; a rerun sees the same ones)."""

    def _hits(self, fault: str, fraction: float) -> bool:
        if not fraction:
            return False
        n = self._seen[fault] = self._seen.get(fault, 0) + 1
        return math.ceil(n * fraction) > math.ceil((n - 1) * fraction)

    @classmethod
    def from_settings(cls, settings: Settings) -> TransportFaults:
        return cls(
            settings.fault_fail_kv_writes,
            settings.fault_delay_kv_writes_s,
            settings.fault_lose_kv_notifications,
        )

    def write(
        self,
        nixl: Connector,
        request_id: str,
        peer: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        notification: bytes,
        deadline_s: float,
    ) -> TransferStats:
        """`nixl.write`, with the configured faults (on the NIXL thread)."""
        if self._hits("fail", self.fail):
            log.warning("fault injection: failing a KV write request_id=%s", request_id)
            raise TransferError("fault injection: KV write failed")
        if self.delay_s:
            time.sleep(self.delay_s)
        if self._hits("lose", self.lose_notification):
            log.warning("fault injection: losing a KV notification request_id=%s", request_id)
            notification = b""
        stats = nixl.write(peer, src_block_ids, dst_block_ids, notification, deadline_s)
        return replace(stats, seconds=stats.seconds + self.delay_s)

    def write_layers(
        self,
        nixl: Connector,
        request_id: str,
        peer: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        layers: tuple[int, int],
        deadline_s: float,
        ready: object = None,
    ) -> TransferStats:
        """`nixl.write_layers` (one layer group), with the failure and the delay faults."""
        if self._hits("fail", self.fail):
            log.warning("fault injection: failing a KV layer write request_id=%s", request_id)
            raise TransferError("fault injection: KV layer write failed")
        if self.delay_s:
            time.sleep(self.delay_s)
        stats = nixl.write_layers(peer, src_block_ids, dst_block_ids, layers, deadline_s, ready)
        return replace(stats, seconds=stats.seconds + self.delay_s)

    def notify(self, nixl: Connector, request_id: str, peer: str, notification: bytes) -> None:
        """`nixl.notify` (a layer-wise write's completion), with the lost-notification fault."""
        if self._hits("lose", self.lose_notification):
            log.warning("fault injection: losing a KV notification request_id=%s", request_id)
            return
        nixl.notify(peer, notification)
