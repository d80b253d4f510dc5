"""Step inputs onto the device, and step outputs back to the host, without waiting for it.

A plain host-to-device copy in PyTorch synchronises the stream: it waits for every kernel queued
before it. The engine queues the next step while the current one runs (`Scheduler.schedule_ahead`),
so its small per-step inputs go through pinned memory and an asynchronous copy instead; PyTorch's
caching host allocator keeps each pinned block until its copy has run.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """`values` on `device`, queued on the current stream (on the CPU: a view, no copy)."""
    tensor = torch.from_numpy(values)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a device tensor in pinned host memory, queued on the current stream without
    waiting (read it once an event recorded after it has passed); a CPU tensor as it is."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def feed_tokens(input_ids: torch.Tensor, rows: np.ndarray, sampled: torch.Tensor) -> None:
    """Fill `input_ids[rows[0]]` with `sampled[rows[1]]` on the device: the tokens that the step
    still running sampled become inputs of the next without visiting the host."""
    if rows.shape[1] == 0:
        return
    index = to_device(rows, input_ids.device)
    input_ids.index_copy_(0, index[0], sampled.index_select(0, index[1]))
