"""The pool as one worker sees it: the registry's records, kept current by a watch.

`PeerTable.run()` follows `Registry.watch()` (a snapshot, then every change) and keeps
`worker_id -> WorkerRecord`. Listeners hear every change, so a prefill worker can add a decode
worker's NIXL agent when it appears and drop it at once when the worker goes away or comes back
with a new incarnation (a restarted process is a different agent). `ready` is set once the
snapshot has been applied.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aetcd

from kvrail.messages import DECODE_ROLES, GenerateRequest, WorkerRecord
from kvrail.registry import Registry

log = logging.getLogger(__name__)

Listener = Callable[[str, WorkerRecord | None, WorkerRecord | None], None]
"""(worker_id, old record or None, new record or None), called on the event loop."""


class PeerTable:
    def __init__(self, registry: Registry, self_worker_id: str) -> None:
        self.registry = registry
        self.self_worker_id = self_worker_id
        self.records: dict[str, WorkerRecord] = {}
        self.ready = asyncio.Event()
        self._listeners: list[Listener] = []

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def prefill_workers(self, fingerprint: str) -> list[WorkerRecord]:
        """Ready prefill workers of this model, other than this worker, by worker id."""
        return [
            r
            for wid, r in sorted(self.records.items())
            if wid != self.self_worker_id
            and r.role == "prefill"
            and r.is_ready
            and r.fingerprint == fingerprint
        ]

    def prefill_worker(self, request: GenerateRequest, fingerprint: str) -> str | None:
        """Where `request`'s remote prefill goes first: the worker the router named as holding
        more of the prompt's prefix (`GenerateRequest.prefill_worker_id`) while it is one of
        `prefill_workers(fingerprint)` or a `decode_peer`; None: any, from the queue."""
        named = request.prefill_worker_id
        if named and any(r.worker_id == named for r in self.prefill_workers(fingerprint)):
            return named
        return self.decode_peer(request, fingerprint) or None

    def decode_peer(self, request: GenerateRequest, fingerprint: str) -> str:
        """The decode or colocated kvrail worker, other than this one, that the router named to
        prefill `request` (it holds more of the prompt's prefix, in some KV tier) while it is
        ready with our fingerprint; "" otherwise. Such a peer prefills the continuation from its
        own cache and tiers and writes the KV here (`PrefillRole` with `shared_queue=False`)."""
        named = request.prefill_worker_id
        record = self.records.get(named) if named != self.self_worker_id else None
        if (
            record is None
            or record.role not in DECODE_ROLES
            or record.engine != "kvrail"
            or not record.is_ready
            or record.fingerprint != fingerprint
        ):
            return ""
        return named

    async def run(self) -> None:
        """Follow the registry until cancelled; a broken watch is re-established."""
        while True:
            try:
                await self._follow()
            except (aetcd.exceptions.ClientError, ConnectionError) as err:
                log.warning("registry watch failed, retrying error=%s", type(err).__name__)
                await asyncio.sleep(0.5)

    async def _follow(self) -> None:
        snapshot: set[str] = set()
        in_snapshot = True

        def snapshot_applied() -> None:
            nonlocal in_snapshot
            in_snapshot = False
            for worker_id in set(self.records) - snapshot:  # gone while we were not watching
                self._apply(worker_id, None)
            self.ready.set()

        # One read: the watch's own snapshot (a second read before it could list a worker that
        # is gone by the watch's read, and `ready` would wait for it forever).
        async for change in self.registry.watch(on_snapshot=snapshot_applied):
            if in_snapshot:
                snapshot.add(change.worker_id)
            self._apply(change.worker_id, change.record)

    def _apply(self, worker_id: str, record: WorkerRecord | None) -> None:
        old = self.records.get(worker_id)
        if record is None:
            if self.records.pop(worker_id, None) is None:
                return
        else:
            if old == record:
                return
            self.records[worker_id] = record
        for listener in self._listeners:
            listener(worker_id, old, record)
