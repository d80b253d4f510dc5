"""The decode workers' NIXL agents as a prefill worker holds them, and the one thread of its
NIXL calls.

A decode worker's agent is loaded when the worker registers (same fingerprint, NIXL metadata
published) and dropped at once when it goes away or restarts (a new incarnation is a different
agent). Loading, dropping and writing all run on one thread, in order (`NixlPeers.call`), so a
write never races the loading or dropping of its destination's agent.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import logging
from collections.abc import Callable
from typing import TypeVar

from kvrail.errors import TransferError
from kvrail.messages import DECODE_ROLES, WorkerRecord
from kvrail.worker.roles.context import WorkerContext

log = logging.getLogger(__name__)

T = TypeVar("T")


class NixlPeers:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self._nixl_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nixl")
        ctx.peers.listen(self._on_peer_change)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the NIXL thread, after every NIXL call submitted before it."""
        return await asyncio.get_running_loop().run_in_executor(self._nixl_thread, fn)

    def submit(self, fn: Callable[[], None]) -> concurrent.futures.Future[None]:
        """`call` from any thread (the engine's: a layer-wise write's groups)."""
        return self._nixl_thread.submit(fn)

    def shutdown(self) -> None:
        """Wait for the NIXL calls submitted, then stop the thread."""
        self._nixl_thread.shutdown(wait=True)

    def _on_peer_change(
        self, worker_id: str, old: WorkerRecord | None, new: WorkerRecord | None
    ) -> None:
        restarted = old is not None and (new is None or new.incarnation != old.incarnation)
        if restarted and old is not None and old.nixl_agent_name:
            self._nixl_thread.submit(self._remove_peer, old.nixl_agent_name)
        added = new is not None and (old is None or restarted)
        if added and new is not None and self._is_destination(new):
            self._nixl_thread.submit(self._add_peer, new)

    def _is_destination(self, record: WorkerRecord) -> bool:
        return (
            record.worker_id != self.ctx.worker_id
            and record.role in DECODE_ROLES
            and record.fingerprint == self.ctx.fingerprint
            and bool(record.nixl_metadata_b64)
        )

    def _add_peer(self, record: WorkerRecord) -> None:  # on the NIXL thread
        try:
            self.ctx.connector.add_peer(
                base64.b64decode(record.nixl_metadata_b64, validate=True),
                [base64.b64decode(m, validate=True) for m in record.rank_nixl_metadata_b64],
            )
        except (TransferError, binascii.Error, ValueError) as err:
            log.warning("cannot load a decode worker's agent worker=%s error=%s",
                        record.worker_id, err)  # fmt: skip

    def _remove_peer(self, agent_name: str) -> None:  # on the NIXL thread
        self.ctx.connector.remove_peer(agent_name)
