"""Scattered block copies into a peer's CUDA IPC mapping, replayed from CUDA graphs.

A CUDA IPC write of many scattered blocks is one `copy_blocks` kernel. Launched from Python, each
write paid host time that does not shrink with its bytes: the ids' upload and the kernel's launch
took 100-260 us of lent H200s' hosts beside the 297 us the kernel copies an 8k prompt's FP8 KV in
(bench/transfer/README.md). Here every bucket of block counts (a power of two, at least
`MIN_BUCKET`) gets a CUDA graph, captured on the connector's stream the first time a write needs
it: the ids' upload from a pinned buffer, then the kernel over the bucket's length. A write puts
its ids into that buffer, pads the rest with -1 (pairs the kernel skips) and replays the graph.

The graphs hold the peer's mapped addresses: `close()` drops them, and the connector closes the
copier before it unmaps the peer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvrail.kernels import dispatch

MIN_BUCKET = 64  # block counts below this share one graph (a 1k-token prompt is 64 blocks)


def bucket(num_blocks: int) -> int:
    """The captured length that serves a write of `num_blocks` blocks."""
    if num_blocks < 1:
        raise ValueError(f"a copy needs at least one block, got {num_blocks}")
    return max(MIN_BUCKET, 1 << (num_blocks - 1).bit_length())


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    pinned: torch.Tensor  # [2, length] int64 in pinned host memory: source ids, destination ids
    host: Any  # `pinned` as a numpy array
    ids: torch.Tensor  # the same on the device, filled by the graph
    filled: int  # how many leading pairs of `pinned` may hold a previous write's ids


class GraphedBlockCopy:
    """dst[d] = src[s] for pairs of block ids, each call one graph replay on `stream`.

    `src` and `dst` are [num_blocks, words] views of two regions with equal blocks (the
    connector's region, the peer's mapping). One owner calls it, and waits for `stream` after
    each call: the graph reads the pinned ids when it runs, so the next call may refill them
    only then.
    """

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream) -> None:
        # the regions' shapes and dtypes are checked by `copy_blocks`, which the first capture
        # runs once before capturing
        self._src, self._dst, self._stream = src, dst, stream
        self._graphs: dict[int, _Captured] = {}

    def copy(self, src_ids: Any, dst_ids: Any) -> None:
        """Queue the copy of checked, equally long int64 id arrays (numpy) on the stream."""
        n = len(src_ids)
        length = bucket(n)
        entry = self._graphs.get(length) or self._capture(length)
        host = entry.host
        host[0, :n] = src_ids
        host[1, :n] = dst_ids
        if entry.filled > n:  # pad over what a longer write left there
            host[:, n : entry.filled] = -1
        entry.filled = n
        with torch.cuda.stream(self._stream):
            entry.graph.replay()

    def _capture(self, length: int) -> _Captured:
        pinned = torch.full((2, length), -1, dtype=torch.int64, pin_memory=True)
        ids = torch.full((2, length), -1, dtype=torch.int64, device=self._src.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            # compiled and loaded before the capture: every pair is padding, nothing moves
            dispatch.copy_blocks(self._src, self._dst, ids[0], ids[1])
            # thread_local: the engine keeps launching on its own thread while this captures
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                ids.copy_(pinned, non_blocking=True)
                dispatch.copy_blocks(self._src, self._dst, ids[0], ids[1])
            finally:
                graph.capture_end()
        entry = _Captured(graph, pinned, pinned.numpy(), ids, 0)
        self._graphs[length] = entry
        return entry

    def close(self) -> None:
        """Drop the graphs (and with them the peer's addresses); waits for the stream first."""
        self._stream.synchronize()
        self._graphs.clear()
