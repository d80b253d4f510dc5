"""Completion notifications of a sharded KV write, and their reassembly (pure).

A tensor-parallel prefill worker writes shard i of a request's blocks from its rank i into the
decode worker's rank i, each write with its own NIXL notification, which the destination agent
receives only after that write's bytes landed. Each carries a frame: the transfer's key (unique
per writer and write), the shard's rank, the number of shards, and (rank 0's only) the payload
(the encoded `PrefillDone`). The decode side's `ShardAssembler` hands a payload over only once
every shard of its transfer has arrived, so a request becomes runnable only when its whole KV
is there (and, with checksums, validated: `ShardedConnector.block_checksums` covers every
shard). Partial transfers (a shard's write failed) are forgotten after `max_age_s`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

_MAGIC = b"KVSHARD1"
_HEAD = struct.Struct("<I")
MAX_PENDING = 10_000


class ShardFrameError(ValueError):
    """A notification is not a shard frame (or a malformed one)."""


def frame(key: str, rank: int, num_shards: int, payload: bytes = b"") -> bytes:
    head = json.dumps({"key": key, "rank": rank, "of": num_shards}, separators=(",", ":"))
    raw = head.encode()
    return _MAGIC + _HEAD.pack(len(raw)) + raw + payload


def unframe(note: bytes) -> tuple[str, int, int, bytes]:
    """(key, rank, number of shards, payload) of a frame; ShardFrameError otherwise."""
    if not note.startswith(_MAGIC) or len(note) < len(_MAGIC) + _HEAD.size:
        raise ShardFrameError("not a KV shard notification")
    start = len(_MAGIC) + _HEAD.size
    (n,) = _HEAD.unpack_from(note, len(_MAGIC))
    try:
        head = json.loads(note[start : start + n])
        key, rank, of = str(head["key"]), int(head["rank"]), int(head["of"])
    except (ValueError, KeyError, TypeError) as err:
        raise ShardFrameError("malformed KV shard notification") from err
    if not 0 <= rank < of:
        raise ShardFrameError(f"shard {rank} of {of}")
    return key, rank, of, note[start + n :]


@dataclass(slots=True)
class _Partial:
    first_seen_s: float
    ranks: set[int] = field(default_factory=set)
    payload: bytes | None = None


class ShardAssembler:
    """Collects shard frames from every rank of this worker; `add` returns the payload once the
    last of `num_shards` shards of a transfer arrived (exactly once), else None."""

    def __init__(self, num_shards: int, max_age_s: float = 600.0) -> None:
        self.num_shards = num_shards
        self.max_age_s = max_age_s
        self._partial: dict[str, _Partial] = {}

    @property
    def num_pending(self) -> int:
        return len(self._partial)

    def add(self, note: bytes, now_s: float) -> bytes | None:
        """Raises ShardFrameError for a note that is not a frame of this worker's layout."""
        key, rank, of, payload = unframe(note)
        if of != self.num_shards:
            raise ShardFrameError(f"a {of}-shard write reached a {self.num_shards}-rank worker")
        self._expire(now_s)
        partial = self._partial.setdefault(key, _Partial(now_s))
        partial.ranks.add(rank)
        if rank == 0:
            partial.payload = payload
        if len(partial.ranks) < self.num_shards:
            return None
        del self._partial[key]
        return partial.payload

    def _expire(self, now_s: float) -> None:
        old = [k for k, p in self._partial.items() if now_s - p.first_seen_s > self.max_age_s]
        for key in old:
            del self._partial[key]
        while len(self._partial) >= MAX_PENDING:
            del self._partial[next(iter(self._partial))]
