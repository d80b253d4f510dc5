"""Copies between the GPU's KV cache and the host tier's buffer, with checksums, never waited for.

On CUDA each direction has a stream of its own (write-behind and loads never queue behind each
other or behind a step), ordered after everything queued on the engine's stream when the copy is
queued (a load may be ordered after an earlier point of it, a `mark`); a `CopyHandle` says when
the copy and its checksums are done (`done()` never blocks). The host buffer is ordinary memory
registered with the driver (page-locked), so the copies run asynchronously at the link's speed;
it is registered rather than allocated pinned because PyTorch's pinned allocator rounds a
request up to a power of two. On a CPU device the copies run as they are queued.
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from kvrail.worker.engine.kv_tiers.checksum import block_checksums
from kvrail.worker.engine.staging import to_device, to_host
from kvrail.worker.kv_cache import KVCache, coalesce

_CHUNK_BYTES = 64 << 20
"""Bytes a load copies before checksumming them beside the next chunk's copy."""


class CopyHandle:
    """One queued batch of copies; `result()` once `done()`: per block, the offload's checksum
    or whether the load's bytes passed theirs."""

    __slots__ = ("_event", "_out")

    def __init__(self, event: torch.cuda.Event | None, out: torch.Tensor) -> None:
        self._event = event
        self._out = out

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> list[int]:
        assert self.done(), "read a copy's result once it is done"
        return self._out.tolist()


class Copier:
    def __init__(self, kv_cache: KVCache, num_slots: int) -> None:
        num_blocks, block_bytes = kv_cache.num_blocks, kv_cache.block_bytes
        self.region = kv_cache.tensor.view(-1).view(torch.uint8).view(num_blocks, block_bytes)
        self.device = kv_cache.tensor.device
        # Anonymous pages: page-aligned (as registering needs) and zero until written.
        self._memory = mmap.mmap(-1, num_slots * block_bytes)
        self.host = torch.frombuffer(self._memory, dtype=torch.uint8).view(num_slots, block_bytes)
        self._streams: tuple[torch.cuda.Stream, ...] | None = None
        if self.device.type == "cuda":
            nbytes = self.host.numel()
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(self.host.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cannot page-lock {nbytes} bytes for the host KV tier: {err}")
            # Unregistered before the pages go back (the finalizer keeps them until it ran):
            # a later mapping at the same address could not be registered otherwise.
            weakref.finalize(self, _unregister, self.host.data_ptr(), self._memory)
            self._streams = tuple(torch.cuda.Stream(self.device) for _ in range(3))
        self._marks: dict[int, torch.cuda.Event] = {}  # the last two, by epoch

    def mark(self, epoch: int) -> None:
        """Note how far the engine's stream has been queued when schedule `epoch` starts (an
        event on it), so that a load may be ordered after that point rather than after all the
        work queued since (`load`). The last two marks are kept."""
        if self._streams is None:
            return
        event = torch.cuda.Event()
        event.record()
        self._marks[epoch] = event
        for old in [e for e in self._marks if e < epoch - 1]:
            del self._marks[old]

    def host_bytes(self, slot: int) -> memoryview:
        """A slot's bytes, for the disk thread to write from or read into."""
        return self.host[slot].numpy().data

    def offload(self, block_ids: Sequence[int], slots: Sequence[int]) -> CopyHandle:
        """Queue GPU blocks -> host slots; the handle's result is each block's checksum."""
        with self._on(0):
            index = to_device(np.asarray(block_ids, dtype=np.int64), self.device)
            sums = block_checksums(self.region, index)
            for src, dst, n in coalesce(block_ids, slots):
                self.host[dst : dst + n].copy_(self.region[src : src + n], non_blocking=True)
            return self._handle(sums)

    def load(
        self,
        slots: Sequence[int],
        block_ids: Sequence[int],
        checksums: Sequence[int],
        after_mark: int | None = None,
    ) -> CopyHandle:
        """Queue host slots -> GPU blocks; the handle's result says, per block, whether the
        bytes that landed have the checksum given. The checksums of a chunk run on a third
        stream while the next chunk copies, so they add about one chunk's sum to the copy.

        The copies are ordered after the mark of epoch `after_mark` or the earliest later one
        kept, or, when none is kept (or `after_mark` is None), after everything queued on the
        engine's stream so far. The caller vouches that no work queued after that mark touches
        `block_ids`."""
        after = self._mark_after(after_mark)
        with self._on(2, event=after):  # its tensors belong to the checksum stream alone
            index = to_device(np.asarray(block_ids, dtype=np.int64), self.device)
            expected = to_device(np.asarray(checksums, dtype=np.int64), self.device)
            sums = torch.empty_like(expected)
        step = max(1, _CHUNK_BYTES // self.region.shape[1])
        for start in range(0, len(block_ids), step):
            end = start + step
            with self._on(1, event=after):
                for src, dst, n in coalesce(slots[start:end], block_ids[start:end]):
                    self.region[dst : dst + n].copy_(self.host[src : src + n], non_blocking=True)
            with self._on(2, after=1):
                sums[start:end] = block_checksums(self.region, index[start:end])
        with self._on(2, after=1):
            return self._handle(sums == expected)

    def zero_slot(self, slot: int) -> None:
        self.host[slot].zero_()

    def _handle(self, out: torch.Tensor) -> CopyHandle:
        if self._streams is None:
            return CopyHandle(None, out)
        host = to_host(out)
        event = torch.cuda.Event()
        event.record()
        return CopyHandle(event, host)

    def _mark_after(self, epoch: int | None) -> torch.cuda.Event | None:
        kept = sorted(e for e in self._marks if epoch is not None and e >= epoch)
        return self._marks[kept[0]] if kept else None

    def _on(
        self, which: int, after: int | None = None, event: torch.cuda.Event | None = None
    ) -> _StreamScope:
        """Stream `which` (0 write-behind, 1 load copies, 2 load checksums), ordered after the
        work queued so far on the engine's stream, or on stream `after`, or only up to `event`
        (a mark) of the engine's stream."""
        if self._streams is None:
            return _StreamScope(None, None)
        stream = self._streams[which]
        return _StreamScope(stream, None if after is None else self._streams[after], event)


def _unregister(address: int, memory: mmap.mmap) -> None:
    """Unpin `memory` (held until now so its pages outlive the registration)."""
    torch.cuda.cudart().cudaHostUnregister(address)


class _StreamScope:
    """Run on `stream`, ordered after the work queued so far on `after` (the current stream
    when None), or else after `event` alone."""

    def __init__(
        self,
        stream: torch.cuda.Stream | None,
        after: torch.cuda.Stream | None,
        event: torch.cuda.Event | None = None,
    ) -> None:
        self._stream = stream
        self._after = after
        self._event = event
        self._ctx: torch.cuda.StreamContext | None = None

    def __enter__(self) -> None:
        if self._stream is not None:
            if self._after is None and self._event is not None:
                self._stream.wait_event(self._event)
            else:
                after = self._after or torch.cuda.current_stream(self._stream.device)
                self._stream.wait_stream(after)
            self._ctx = torch.cuda.stream(self._stream)
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None
