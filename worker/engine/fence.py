"""A fence in the device's queue: it passes once the device work queued before it has finished.

A remote KV writer (another process's NIXL WRITE or CUDA IPC copy) is not ordered after this
worker's device work. Blocks reserved for it may have been freed a moment ago while a step still
in flight writes them (a request that stopped on its in-flight token), or while their zeroing is
still queued; the writer must start only once that work is done. The reservation carries a
fence taken when it was made, and the decode role grants the write only once the fence has
passed, so neither the engine thread nor the device waits for it.
"""

from __future__ import annotations

import torch


class DeviceFence:
    """Passes once the work queued on the current CUDA stream before it was taken has finished.
    On the CPU device work runs as it is queued, so a CPU fence has always passed."""

    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self._event = event

    @classmethod
    def now(cls, device: torch.device) -> DeviceFence:
        """A fence behind everything queued on `device`'s current stream so far."""
        if device.type != "cuda":
            return PASSED
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return cls(event)

    def passed(self) -> bool:
        """Whether the work before it has finished (never blocks)."""
        return self._event is None or self._event.query()


PASSED = DeviceFence()
"""A fence with nothing before it."""
