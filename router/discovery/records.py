"""Worker records from etcd: the half of `WorkerView` that follows the registry.

`RecordFollower` applies a snapshot of the pool's worker records, watches from the revision after
it, reads them again every `resync_interval_s`, and follows again from a fresh read when the watch
breaks. A worker that joins, changes incarnation, role or engine, or leaves has its index state
dropped and its state fetch started or stopped (`KvEventFollower`). The guarantees are in the
docstring of `kvrail.router.discovery.view`. The class holds no state of its own:
`WorkerView.__init__` sets every attribute declared on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aetcd

from kvrail.messages import WorkerRecord
from kvrail.registry import Registry
from kvrail.router.discovery.kv_events import INDEXED_ENGINES, KvEventFollower

log = logging.getLogger(__name__)


class RecordFollower(KvEventFollower):
    """The registry-following methods of `WorkerView`; not used on its own."""

    registry: Registry
    ready: asyncio.Event
    _resync_interval_s: float
    _clock: int
    _stamps: dict[str, int]
    _ours: Callable[[str], int] | None
    _ours_at_report: dict[str, int]
    _ready_by_role: tuple[tuple[WorkerRecord, ...], tuple[WorkerRecord, ...]] | None

    # Registry -----------------------------------------------------------------------------------
    async def _follow_registry(self) -> None:
        """Apply a snapshot, then watch from exactly the revision after it, until cancelled.

        NOTE: this does not iterate `Registry.watch()`, which reads its own snapshot: a record
        deleted between our read (which sets `ready`) and that one would never be reported gone.
        Watching from our read's revision leaves no such window.
        """
        delay_s = self._retry_initial_s
        while True:
            try:
                revision = await self._resync()
                self.ready.set()
                self._notify()
                watch = await self.registry.client.watch_prefix(
                    self.keys.workers_prefix.encode(), start_revision=revision + 1
                )
                try:
                    async for event in watch:
                        change = self.registry.change_of(event.kind, event.kv.key, event.kv.value)
                        if change is not None:
                            self._apply_record(change.worker_id, change.record)
                        delay_s = self._retry_initial_s
                finally:
                    await watch.cancel()
                log.warning("registry watch ended, following again")
            except (aetcd.exceptions.ClientError, ConnectionError) as err:
                log.warning("registry watch failed, retrying error=%s", type(err).__name__)
            await asyncio.sleep(self._jittered(delay_s))
            delay_s = min(delay_s * 2, self._retry_max_s)

    async def _resync_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._resync_interval_s)
            try:
                await self._resync()
            except (aetcd.exceptions.ClientError, ConnectionError) as err:
                log.warning("registry resync failed error=%s", type(err).__name__)

    async def _resync(self) -> int:
        """Read every record and apply what changed, except where the watch was newer; returns
        the etcd revision of the read."""
        mark = self._clock
        records, revision = await self.registry.workers()
        for worker_id, record in records.items():
            if self._stamps.get(worker_id, -1) <= mark:
                self._apply_record(worker_id, record)
        for worker_id in list(self._records):
            if worker_id not in records and self._stamps.get(worker_id, -1) <= mark:
                self._apply_record(worker_id, None)
        for worker_id, stamp in list(self._stamps.items()):
            if worker_id not in self._records and stamp <= mark:
                del self._stamps[worker_id]
        return revision

    def _apply_record(self, worker_id: str, record: WorkerRecord | None) -> None:
        self._clock += 1
        self._stamps[worker_id] = self._clock
        old = self._records.get(worker_id)
        if record is None:
            self._ours_at_report.pop(worker_id, None)
            if old is None:
                return
            del self._records[worker_id]
            self._ready_by_role = None
            self._cancel_fetch(worker_id)
            self.index.forget(worker_id)
            log.info("worker left worker=%s incarnation=%d", worker_id, old.incarnation)
            self._notify()
            return
        if self._ours is not None:  # every report, an unchanged one too: it is a newer count
            self._ours_at_report[worker_id] = self._ours(worker_id)
        if record == old:
            return
        self._records[worker_id] = record
        self._ready_by_role = None
        if (
            old is None
            or old.incarnation != record.incarnation
            or old.role != record.role
            or old.engine != record.engine
        ):
            log.info(
                "worker joined worker=%s incarnation=%d role=%s engine=%s is_ready=%s "
                "fingerprint=%s", worker_id, record.incarnation, record.role, record.engine,
                record.is_ready, record.fingerprint[:12],
            )  # fmt: skip
            if record.engine not in INDEXED_ENGINES:
                self._cancel_fetch(worker_id)
                self.index.forget(worker_id)
            elif self.index.incarnation(worker_id) != record.incarnation:
                # The state held (if any) is an older process's. A state loaded from the new
                # incarnation's events, which may beat its record here, is kept.
                self._cancel_fetch(worker_id)
                self.index.forget(worker_id)
                self._start_fetch(worker_id, ())
        self._notify()
