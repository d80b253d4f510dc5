"""The lower KV tiers of one engine: write-behind from the GPU, loads back on a prefix hit.

Write-behind: when a full block joins the GPU prefix cache (its KV written, `Scheduler`), it is
copied to a slot of the pinned host buffer on a stream of its own, with its checksum, and the
GPU block is pinned (an extra reference) until the copy has run, so an eviction never reuses it
under the copy. With a disk tier, a block that lands in host memory is then written to its file
by the disk thread. Both are best effort: when the host tier has no slot that is not busy, or the
disk thread is behind, that block is skipped (counted), never waited for.

Load: `lookup` counts how many blocks of a prompt, after its GPU prefix hits, the lower tiers hold
in a row; `start_load` pins their host entries (reading disk-only blocks into host slots first, on
the disk thread), pins the destination GPU blocks, and queues the host-to-GPU copies on a load
stream, ordered after the device work that may still use those blocks (`TierLoads` says how),
then compares the landed bytes' checksums with the stored ones on the GPU. `poll` (each schedule)
returns the loads that finished with how many blocks passed in a row; the request runs from
there (a failed block is recomputed and dropped). Nothing here waits for device or disk.

With `zero_on_release` (security.zeroKVOnRelease), a GPU block's release also zeroes its host
slot and deletes its disk file, so nothing of a finished request stays in any tier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvrail.worker import metrics
from kvrail.worker.engine.block_pool import KvChanges
from kvrail.worker.engine.kv_tiers.copier import Copier, CopyHandle
from kvrail.worker.engine.kv_tiers.disk import (
    HEADER_BYTES,
    BlockFile,
    DiskFiles,
    DiskIndex,
    DiskThread,
)
from kvrail.worker.engine.kv_tiers.host import HostEntry, HostIndex
from kvrail.worker.engine.kv_tiers.stats import LoadCounts, LowerTier, TierStats
from kvrail.worker.kv_cache import KVCache

log = logging.getLogger(__name__)

MAX_DISK_QUEUE = 256
"""Disk jobs queued at most before write-behind to disk skips blocks."""

Pins = Callable[[Sequence[int]], None]


@dataclass(eq=False, slots=True)
class _Load:
    request_id: str
    hashes: list[bytes]
    block_ids: list[int]
    entries: list[HostEntry]
    reading: set[bytes]  # disk reads not yet done
    from_disk: set[bytes]  # blocks read from disk for it
    started: float
    released_at: int | None  # the latest epoch one of its GPU blocks was released in
    handle: CopyHandle | None = None


@dataclass(eq=False, slots=True)
class _Offload:
    hashes: list[bytes]
    block_ids: list[int]
    handle: CopyHandle


class KvTiers:
    def __init__(
        self,
        kv_cache: KVCache,
        host_bytes: int,
        *,
        pin: Pins,
        unpin: Pins,
        layout: bytes,
        disk_path: str = "",
        disk_bytes: int = 0,
        zero_on_release: bool = False,
    ) -> None:
        """`pin`/`unpin` add and drop a reference to GPU blocks (the scheduler's block pool).
        `layout` (32 bytes) names the model and KV layout; disk files of another are dropped."""
        block_bytes = kv_cache.block_bytes
        num_slots = host_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(f"a host tier of {host_bytes} bytes holds no {block_bytes}-byte block")
        self.block_bytes = block_bytes
        self.host = HostIndex(num_slots)
        self.copier = Copier(kv_cache, num_slots)
        self._pin, self._unpin = pin, unpin
        self.zero_on_release = zero_on_release
        self._loads: dict[str, _Load] = {}
        self._offloads: list[_Offload] = []
        self._offloaded_from: dict[int, bytes] = {}  # zero_on_release: GPU block -> its hash
        self._doomed: set[bytes] = set()  # to drop once no longer pinned (zero_on_release)
        self._orphans: set[bytes] = set()  # disk reads no load waits for any more
        self._counts = LoadCounts()
        self.disk: DiskIndex | None = None
        self._files: DiskFiles | None = None
        self._disk_thread: DiskThread | None = None
        if disk_path:
            self._open_disk(disk_path, disk_bytes, layout)
        log.info("KV tiers ready host_blocks=%d disk_blocks=%d block_bytes=%d", num_slots,
                 self.disk.max_blocks if self.disk else 0, block_bytes)  # fmt: skip

    def _open_disk(self, path: str, disk_bytes: int, layout: bytes) -> None:
        files = DiskFiles(path, self.block_bytes, layout)
        index = DiskIndex(disk_bytes // (HEADER_BYTES + self.block_bytes))
        for block in files.scan():  # oldest first: the newest stay when over the bound
            for victim in index.commit(block):
                files.delete(victim)
        self.disk, self._files, self._disk_thread = index, files, DiskThread()

    # -- lookups and loads -------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, a lower tier holds (side-effect free)."""
        count = 0
        for block_hash in hashes:
            if self.host.resident(block_hash) is None and not self._on_disk(block_hash):
                break
            count += 1
        return count

    def _on_disk(self, block_hash: bytes) -> bool:
        return self.disk is not None and block_hash in self.disk and block_hash not in self.host

    def start_load(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        released_at: int | None = None,
    ) -> int:
        """Queue loading `hashes` (which `lookup` counted) into the GPU blocks `block_ids`, last
        released in epoch `released_at` (see `Copier.load`; None: after all work queued); returns
        how many it will load (fewer when the host tier has no slot for a disk read), 0: none."""
        load = _Load(request_id, [], [], [], set(), set(), time.perf_counter(), released_at)
        for block_hash, block_id in zip(hashes, block_ids, strict=True):
            entry = self.host.resident(block_hash)
            if entry is None:
                entry = self._read_from_disk(block_hash)
                if entry is None:
                    break
                load.reading.add(block_hash)
                load.from_disk.add(block_hash)
            else:
                self.host.touch(block_hash)
            entry.pins += 1
            load.hashes.append(block_hash)
            load.block_ids.append(block_id)
            load.entries.append(entry)
        if not load.hashes:
            return 0
        self._pin(load.block_ids)
        self._loads[request_id] = load
        if not load.reading:
            self._issue_load(load)
        return len(load.hashes)

    def _read_from_disk(self, block_hash: bytes) -> HostEntry | None:
        assert self.disk is not None and self._files is not None and self._disk_thread
        if self._disk_thread.num_queued >= MAX_DISK_QUEUE:
            return None
        reserved = self.host.reserve(block_hash)
        if reserved is None:
            return None
        entry, evicted = reserved
        self._evicted_from_host(evicted)
        self.disk.touch(block_hash)
        files, out = self._files, self.copier.host_bytes(entry.slot)
        self._disk_thread.submit(("read", block_hash), lambda: files.read_into(block_hash, out))
        return entry

    def _issue_load(self, load: _Load) -> None:
        slots = [e.slot for e in load.entries]
        checksums = [e.checksum for e in load.entries]
        after = None if load.released_at is None else load.released_at + 1
        load.handle = self.copier.load(slots, load.block_ids, checksums, after_mark=after)

    def poll(self) -> list[tuple[str, int]]:
        """Progress copies and disk jobs; returns (request id, blocks loaded in a row) for each
        load that finished since the last call."""
        if self._disk_thread is not None:
            for tag, result in self._disk_thread.completed():
                self._disk_done(tag, result)
        self._finish_offloads()
        loaded = [(request_id, self.poll_load(request_id)) for request_id in list(self._loads)]
        return [(request_id, n) for request_id, n in loaded if n is not None]

    def poll_load(self, request_id: str) -> int | None:
        """`poll` for one load: the blocks it loaded in a row if it is done now, else None (on
        a CPU device a load from host memory is done as soon as it is started)."""
        load = self._loads.get(request_id)
        if load is None or load.handle is None or not load.handle.done():
            return None
        del self._loads[request_id]
        return self._finish_load(load)

    def _finish_load(self, load: _Load) -> int:
        passed = load.handle.result() if load.handle is not None else []
        num_ok = next((i for i, ok in enumerate(passed) if not ok), len(passed))
        for entry, block_hash, ok in zip(load.entries, load.hashes, passed, strict=True):
            entry.pins -= 1
            if not ok:  # corrupted in host memory or on disk: never served again
                metrics.KV_TIER_CHECKSUM_FAILURES.labels(tier="host").inc()
                log.warning("KV tier block failed its checksum; dropped, recomputed")
                self._doomed.add(block_hash)
                self._drop_disk(block_hash)
            self._drop_if_doomed(block_hash, entry)
        self._unpin(load.block_ids)
        num_disk = sum(h in load.from_disk for h in load.hashes[:num_ok])
        slowest: LowerTier = "disk" if load.from_disk & set(load.hashes) else "host"
        self._counts.record(num_ok - num_disk, num_disk, slowest, load.started)
        return num_ok

    # -- write-behind ------------------------------------------------------------------------

    def offload(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Write newly cached GPU blocks (id, hash) behind to the host tier."""
        ids, hashes, slots = [], [], []
        for block_id, block_hash in blocks:
            if block_hash in self.host:
                if self.host.resident(block_hash) is not None:
                    self.host.touch(block_hash)
                continue
            reserved = self.host.reserve(block_hash)
            if reserved is None:
                metrics.KV_TIER_OFFLOADS_SKIPPED.labels(tier="host").inc()
                continue
            entry, evicted = reserved
            self._evicted_from_host(evicted)
            entry.pins += 1  # until its bytes are in: nothing reads or drops it
            ids.append(block_id)
            hashes.append(block_hash)
            slots.append(entry.slot)
        if not ids:
            return
        self._pin(ids)
        self._offloads.append(_Offload(hashes, ids, self.copier.offload(ids, slots)))

    def _finish_offloads(self) -> None:
        while self._offloads and self._offloads[0].handle.done():
            done = self._offloads.pop(0)
            for block_id, block_hash, checksum in zip(
                done.block_ids, done.hashes, done.handle.result(), strict=True
            ):
                entry = self.host.commit(block_hash, int(checksum))
                entry.pins -= 1
                metrics.KV_TIER_OFFLOADS.labels(tier="host").inc()
                if self.zero_on_release:
                    self._offloaded_from[block_id] = block_hash
                self._write_to_disk(block_hash, entry)
            self._unpin(done.block_ids)  # may release them: zero_on_release drops them then

    def _write_to_disk(self, block_hash: bytes, entry: HostEntry) -> None:
        if self.disk is None or block_hash in self.disk:
            return
        assert self._files is not None and self._disk_thread is not None
        if self._disk_thread.num_queued >= MAX_DISK_QUEUE:
            metrics.KV_TIER_OFFLOADS_SKIPPED.labels(tier="disk").inc()
            return
        entry.pins += 1
        files, data, checksum = self._files, self.copier.host_bytes(entry.slot), entry.checksum
        self._disk_thread.submit(
            ("write", block_hash, checksum), lambda: files.write(block_hash, checksum, data)
        )

    def _disk_done(self, tag: object, result: object) -> None:
        assert isinstance(tag, tuple) and self.disk is not None and self._files is not None
        kind, block_hash = tag[0], tag[1]
        if kind == "write":
            entry = self.host.resident(block_hash)
            assert entry is not None and entry.pins > 0, "an entry being written stays"
            entry.pins -= 1
            if isinstance(result, Exception):
                log.warning("disk KV tier write failed: %s", result)
            elif block_hash not in self._doomed:
                metrics.KV_TIER_OFFLOADS.labels(tier="disk").inc()
                for victim in self.disk.commit(BlockFile(block_hash, tag[2])):
                    self._delete_file(victim)
            else:
                self._delete_file(block_hash)
            self._drop_if_doomed(block_hash, entry)
        elif kind == "read":
            self._read_done(block_hash, result)

    def _read_done(self, block_hash: bytes, result: object) -> None:
        """A disk read into a host slot finished: the slot's entry becomes resident (or is
        dropped), and the load that waited for it goes on (or loads less)."""
        entry = self.host.entry(block_hash)
        assert entry is not None and not entry.resident, "a slot being read stays pending"
        checksum = result if isinstance(result, int) else None
        if checksum is None:  # lost or damaged since the scan
            log.warning("disk KV tier read failed: %s", result)
            self._drop_disk(block_hash)
        if block_hash in self._orphans:  # its load gave up on it: the read held its pin
            self._orphans.discard(block_hash)
            entry.pins -= 1
            if checksum is None:
                self.host.drop(block_hash)
            else:
                self.host.commit(block_hash, checksum)
            return
        load = next(x for x in self._loads.values() if block_hash in x.reading)
        load.reading.discard(block_hash)
        if checksum is None:
            self._truncate(load, load.hashes.index(block_hash))
        else:
            self.host.commit(block_hash, checksum)
        if not load.reading:
            self._issue_load(load)

    def _truncate(self, load: _Load, index: int) -> None:
        """Load only the blocks before `index` (a disk read failed). A read still running
        keeps its slot's pin until it ends (`_orphans`)."""
        for block_hash, entry in zip(load.hashes[index:], load.entries[index:], strict=True):
            if block_hash in load.reading:
                load.reading.discard(block_hash)
                self._orphans.add(block_hash)
                continue
            entry.pins -= 1
            if not entry.resident:
                self.host.drop(block_hash)
            else:
                self._drop_if_doomed(block_hash, entry)
        self._unpin(load.block_ids[index:])
        del load.hashes[index:], load.block_ids[index:], load.entries[index:]

    # -- dropping ----------------------------------------------------------------------------

    def _evicted_from_host(self, block_hash: bytes | None) -> None:
        if block_hash is not None and self.zero_on_release:
            self._doomed.discard(block_hash)

    def released(self, block_ids: Sequence[int]) -> None:
        """GPU blocks released under zero_on_release: drop their copies from every tier."""
        for block_id in block_ids:
            block_hash = self._offloaded_from.pop(block_id, None)
            if block_hash is None:
                continue
            self._drop_disk(block_hash)
            entry = self.host.resident(block_hash)
            if entry is not None:  # dropped now, or by whoever unpins it last
                self._doomed.add(block_hash)
                self._drop_if_doomed(block_hash, entry)

    def _drop_if_doomed(self, block_hash: bytes, entry: HostEntry) -> None:
        if entry.pins or block_hash not in self._doomed or block_hash not in self.host:
            return
        self._doomed.discard(block_hash)
        self.host.drop(block_hash)
        self.copier.zero_slot(entry.slot)

    def _drop_disk(self, block_hash: bytes) -> None:
        if self.disk is not None and self.disk.forget(block_hash):
            self._delete_file(block_hash)

    def _delete_file(self, block_hash: bytes) -> None:
        assert self._files is not None and self._disk_thread is not None
        files = self._files
        self._disk_thread.submit(("delete", block_hash), lambda: files.delete(block_hash))

    # -- reporting ---------------------------------------------------------------------------

    def take_changes(self) -> list[KvChanges]:
        """Each tier's net changes since the last call, host first; empty ones left out."""
        changes = [self.host.take_changes()]
        if self.disk is not None:
            changes.append(self.disk.take_changes())
        return [c for c in changes if not c.is_empty]

    def hashes(self, tier: LowerTier) -> list[bytes]:
        if tier == "host":
            return self.host.hashes()
        return self.disk.hashes() if self.disk is not None else []

    def stats(self) -> TierStats:
        """Each tier's use now, in blocks (and the metrics' gauges set to it)."""
        use: dict[LowerTier, tuple[int, int]] = {
            "host": (self.host.num_slots, self.host.num_resident)
        }
        if self.disk is not None:
            use["disk"] = (self.disk.max_blocks, len(self.disk))
        return TierStats.of(use, self.block_bytes, self._counts.hit_blocks, self._counts.loads)

    @property
    def busy(self) -> bool:
        """Whether copies or disk jobs are still in flight (`poll` has work to finish)."""
        disk_queued = self._disk_thread is not None and self._disk_thread.num_queued > 0
        return bool(self._offloads or self._loads or disk_queued)

    def close(self) -> None:
        """Finish the disk jobs queued (writes complete or are never renamed into place)."""
        if self._disk_thread is not None:
            self._disk_thread.close()
