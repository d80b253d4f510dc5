"""The host tier's bookkeeping: which block hash lives in which slot of the pinned buffer.

Pure logic, no memory and no device: `KvTiers` owns the buffer and the copies. An entry goes
through two states:

- pending: a slot is reserved and a copy into it is queued (from the GPU, or read from disk);
  nobody may read it, and a lookup does not see it;
- resident: its bytes and their checksum are complete; a lookup sees it.

An entry with `pins > 0` is being read (a load to the GPU, a write to disk) and is never evicted
or dropped. Reserving a slot when none is free evicts the least recently used resident, unpinned
entry; when every entry is pending or pinned the reservation is refused (the caller skips that
write-behind: the tier is best effort, a request never waits for it). Every resident hash entering
or leaving the tier is journaled (`take_changes`, the tier's KV events).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvrail.worker.engine.block_pool import ChangeJournal, KvChanges


@dataclass(eq=False, slots=True)
class HostEntry:
    slot: int
    checksum: int = 0
    resident: bool = False
    pins: int = 0


class HostIndex:
    """Slots `0..num_slots-1` of the host tier, LRU over resident entries."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # least recent first
        self._journal = ChangeJournal("host")
        self.num_resident = 0

    def __contains__(self, block_hash: bytes) -> bool:
        """Whether the hash has an entry, pending or resident."""
        return block_hash in self._entries

    def entry(self, block_hash: bytes) -> HostEntry | None:
        """The hash's entry, pending or resident, else None."""
        return self._entries.get(block_hash)

    def resident(self, block_hash: bytes) -> HostEntry | None:
        """The hash's entry if its bytes are complete, else None. Side-effect free."""
        entry = self._entries.get(block_hash)
        return entry if entry is not None and entry.resident else None

    def touch(self, block_hash: bytes) -> None:
        """Mark the entry most recently used."""
        self._entries.move_to_end(block_hash)

    def reserve(self, block_hash: bytes) -> tuple[HostEntry, bytes | None] | None:
        """A pending entry for a hash that has none, and the hash it evicted (or None); None
        when every slot is pending or pinned."""
        assert block_hash not in self._entries, "a hash has at most one entry"
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, e in self._entries.items() if e.resident and not e.pins), None)
            if victim is None:
                return None
            slot = self._entries[victim].slot
            self._forget(victim)
            evicted = victim
        entry = self._entries[block_hash] = HostEntry(slot)
        return entry, evicted

    def commit(self, block_hash: bytes, checksum: int) -> HostEntry:
        """A pending entry's bytes are complete: it becomes resident (and most recent)."""
        entry = self._entries[block_hash]
        assert not entry.resident, "committed twice"
        entry.checksum = checksum
        entry.resident = True
        self._entries.move_to_end(block_hash)
        self.num_resident += 1
        self._journal.record(block_hash, stored=True)
        return entry

    def drop(self, block_hash: bytes) -> HostEntry | None:
        """Remove an unpinned entry (pending or resident) and free its slot; None if absent."""
        entry = self._entries.get(block_hash)
        if entry is None:
            return None
        assert not entry.pins, "a pinned entry is being read"
        self._forget(block_hash)
        self._free.append(entry.slot)
        return entry

    def _forget(self, block_hash: bytes) -> None:
        entry = self._entries.pop(block_hash)
        if entry.resident:
            self.num_resident -= 1
            self._journal.record(block_hash, stored=False)

    def take_changes(self) -> KvChanges:
        return self._journal.take()

    def hashes(self) -> list[bytes]:
        """Every resident hash, least recently used first."""
        return [h for h, e in self._entries.items() if e.resident]

    def check_invariants(self) -> None:
        slots = [e.slot for e in self._entries.values()] + self._free
        assert sorted(slots) == list(range(self.num_slots)), "every slot once"
        assert self.num_resident == sum(e.resident for e in self._entries.values())
        assert all(e.pins >= 0 for e in self._entries.values())
