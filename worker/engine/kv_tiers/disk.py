"""The disk tier: one file per block under a directory, written and read by a thread of its own.

A file is `<block hash hex>.kvb`: a header (magic, format version, block size in bytes, the
block's checksum, its hash, the engine's layout key) and the block's bytes. It is written to a
`.tmp` file and renamed, so a file under its final name is whole unless the disk lost it since.

Files from an earlier incarnation are never trusted as they are: at start every file's header is
read and the file kept only if its magic, version, size, layout key (the model fingerprint: no
hit across models, layouts or dtypes) and name all agree; anything else of ours is deleted. The
bytes of a kept file are trusted no more than any other: a load compares the checksum of what
reached the GPU with the header's (see `checksum`).

The engine thread owns the index (`DiskTier`); the thread (`DiskThread`) only does file I/O and
hands results back through `completed()`, so the engine never waits for the disk.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvrail.worker.engine.block_pool import ChangeJournal, KvChanges

log = logging.getLogger(__name__)

MAGIC = b"KVRAILKV"
VERSION = 1
# magic, version, padding, block bytes, checksum, block hash, layout key
_HEADER = struct.Struct("<8sII Q q 16s 32s")
HEADER_BYTES = _HEADER.size
SUFFIX = ".kvb"


class DiskBlockError(Exception):
    """A block file is missing, short, or not what its name says."""


@dataclass(frozen=True, slots=True)
class BlockFile:
    """What the tier knows of one file: everything in its header."""

    block_hash: bytes
    checksum: int


def _header(block_hash: bytes, checksum: int, block_bytes: int, layout: bytes) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, 0, block_bytes, checksum, block_hash, layout)


class DiskFiles:
    """The directory's files (synchronous I/O; only `DiskThread` and start-up call these)."""

    def __init__(self, path: str | Path, block_bytes: int, layout: bytes) -> None:
        if len(layout) != 32:
            raise ValueError("a layout key is 32 bytes")
        self.path = Path(path)
        self.block_bytes = block_bytes
        self.layout = layout
        self.path.mkdir(parents=True, exist_ok=True)

    def file_of(self, block_hash: bytes) -> Path:
        return self.path / f"{block_hash.hex()}{SUFFIX}"

    def scan(self) -> list[BlockFile]:
        """The valid files, oldest first; deletes ours that are not (torn writes, another layout,
        a name that disagrees with its header)."""
        found: list[tuple[float, BlockFile]] = []
        for file in self.path.iterdir():
            if file.suffix == ".tmp" and len(file.stem) == 32:
                file.unlink(missing_ok=True)  # a write that never finished
                continue
            if file.suffix != SUFFIX:
                continue
            try:
                block = self._check(file)
                found.append((file.stat().st_mtime, block))
            except (OSError, DiskBlockError, ValueError) as err:
                log.warning("disk KV tier: dropping %s: %s", file.name, err)
                file.unlink(missing_ok=True)
        return [block for _mtime, block in sorted(found, key=lambda item: item[0])]

    def _check(self, file: Path) -> BlockFile:
        if file.stat().st_size != HEADER_BYTES + self.block_bytes:
            raise DiskBlockError("wrong size")
        with file.open("rb") as f:
            block = self._read_header(f.read(HEADER_BYTES))
        if block.block_hash.hex() != file.stem:
            raise DiskBlockError("its header names another block")
        return block

    def _read_header(self, raw: bytes) -> BlockFile:
        magic, version, _pad, block_bytes, checksum, block_hash, layout = _HEADER.unpack(raw)
        if magic != MAGIC or version != VERSION:
            raise DiskBlockError("not a kvrail KV block of this format version")
        if block_bytes != self.block_bytes or layout != self.layout:
            raise DiskBlockError("written by an engine of another model or KV layout")
        return BlockFile(block_hash, checksum)

    def write(self, block_hash: bytes, checksum: int, data: memoryview) -> None:
        final = self.file_of(block_hash)
        tmp = final.with_suffix(".tmp")
        with tmp.open("wb") as f:
            f.write(_header(block_hash, checksum, self.block_bytes, self.layout))
            f.write(data)
        os.replace(tmp, final)

    def read_into(self, block_hash: bytes, out: memoryview) -> int:
        """Read a block's bytes into `out`; returns the header's checksum."""
        with self.file_of(block_hash).open("rb") as f:
            block = self._read_header(f.read(HEADER_BYTES))
            if block.block_hash != block_hash:
                raise DiskBlockError("its header names another block")
            if f.readinto(out) != self.block_bytes:
                raise DiskBlockError("short file")
        return block.checksum

    def delete(self, block_hash: bytes) -> None:
        self.file_of(block_hash).unlink(missing_ok=True)


Job = Callable[[], object]


class DiskThread:
    """Runs file jobs in order on one thread; `completed()` returns (tag, result or exception)
    of those done since the last call. `close()` finishes the queued jobs first."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[object, Job] | None] = queue.Queue()
        self._done: deque[tuple[object, object]] = deque()
        self.num_queued = 0  # engine thread: submitted and not yet taken from completed()
        self._thread = threading.Thread(target=self._run, name="kv-disk", daemon=True)
        self._thread.start()

    def submit(self, tag: object, job: Job) -> None:
        self.num_queued += 1
        self._jobs.put((tag, job))

    def completed(self) -> list[tuple[object, object]]:
        out = []
        while self._done:
            out.append(self._done.popleft())
        self.num_queued -= len(out)
        return out

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            tag, job = item
            try:
                result = job()
            except Exception as err:  # handed to the engine thread, which decides
                result = err
            self._done.append((tag, result))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


class DiskIndex:
    """The engine thread's view of the disk tier: committed hashes, LRU, bounded by count."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"a disk tier needs room for one block at least, got {max_blocks}")
        self.max_blocks = max_blocks
        self._checksums: OrderedDict[bytes, int] = OrderedDict()  # least recent first
        self._journal = ChangeJournal("disk")

    def __len__(self) -> int:
        return len(self._checksums)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._checksums

    def commit(self, block: BlockFile) -> list[bytes]:
        """Add a written block (most recent); returns the hashes evicted to stay in bounds."""
        self._checksums[block.block_hash] = block.checksum
        self._journal.record(block.block_hash, stored=True)
        evicted = []
        while len(self._checksums) > self.max_blocks:
            victim, _checksum = self._checksums.popitem(last=False)
            self._journal.record(victim, stored=False)
            evicted.append(victim)
        return evicted

    def touch(self, block_hash: bytes) -> None:
        self._checksums.move_to_end(block_hash)

    def forget(self, block_hash: bytes) -> bool:
        if self._checksums.pop(block_hash, None) is None:
            return False
        self._journal.record(block_hash, stored=False)
        return True

    def take_changes(self) -> KvChanges:
        return self._journal.take()

    def hashes(self) -> list[bytes]:
        return list(self._checksums)
