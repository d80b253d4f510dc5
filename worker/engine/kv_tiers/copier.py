"""Copies between the GPU's KV cache and the host tier's buffer, with checksums, never waited for.

On CUDA each direction has a stream of its own (write-behind and loads never queue behind each
other or behind a step), ordered after everything queued on the engine's stream when the copy is
queued; a `CopyHandle` says when the copy and its checksums are done (`done()` never blocks). The
host buffer is ordinary memory registered with the driver (page-locked), so the copies run
asynchronously at the link's speed; it is registered rather than allocated pinned because
PyTorch's pinned allocator rounds a request up to a power of two. On a CPU device the copies run
as they are queued.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvrail.worker.engine.kv_tiers.checksum import block_checksums
from kvrail.worker.engine.staging import to_device, to_host
from kvrail.worker.kv_cache import KVCache


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
        self.host = torch.zeros((num_slots, block_bytes), dtype=torch.uint8)
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        if self.device.type == "cuda":
            nbytes = self.host.numel()
            err = torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cannot page-lock {nbytes} bytes for the host KV tier: {err}")
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))

    def host_bytes(self, slot: int) -> memoryview:
        """A slot's bytes, for the disk thread to write from or read into."""
        return self.host[slot].numpy().data

    def offload(self, block_ids: Sequence[int], slots: Sequence[int]) -> CopyHandle:
        """Queue GPU blocks -> host slots; the handle's result is each block's checksum."""
        with self._on(0):
            for block_id, slot in zip(block_ids, slots, strict=True):
                self.host[slot].copy_(self.region[block_id], non_blocking=True)
            index = to_device(np.asarray(block_ids, dtype=np.int64), self.device)
            return self._handle(block_checksums(self.region, index))

    def load(
        self, slots: Sequence[int], block_ids: Sequence[int], checksums: Sequence[int]
    ) -> CopyHandle:
        """Queue host slots -> GPU blocks; the handle's result says, per block, whether the
        bytes that landed have the checksum given."""
        with self._on(1):
            for slot, block_id in zip(slots, block_ids, strict=True):
                self.region[block_id].copy_(self.host[slot], non_blocking=True)
            index = to_device(np.asarray(block_ids, dtype=np.int64), self.device)
            expected = to_device(np.asarray(checksums, dtype=np.int64), self.device)
            return self._handle(block_checksums(self.region, index) == expected)

    def zero_slot(self, slot: int) -> None:
        self.host[slot].zero_()

    def _handle(self, out: torch.Tensor) -> CopyHandle:
        if self._streams is None:
            return CopyHandle(None, out)
        host = to_host(out)
        event = torch.cuda.Event()
        event.record()
        return CopyHandle(event, host)

    def _on(self, which: int) -> _StreamScope:
        return _StreamScope(self._streams[which] if self._streams is not None else None)


class _StreamScope:
    """Run on `stream`, ordered after the work queued on the current stream so far."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._stream = stream
        self._ctx: torch.cuda.StreamContext | None = None

    def __enter__(self) -> None:
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
            self._ctx = torch.cuda.stream(self._stream)
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None
