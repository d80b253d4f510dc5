"""The scattered block copy of the same-node handoff (`kvrail.kernels.block_copy.copy_blocks`)
alone, on the GPU: 512 blocks of an 8k prompt's KV (1 MiB each in FP8, 2 MiB in bf16), copied
between two regions of one device at random block ids, as the worker's CUDA IPC path copies
them (as int64 words), for each chunk size (elements per program) and warp count, beside a
contiguous `torch` copy of the same bytes.

    python3 -P bench/transfer/block_copy.py | tee bench/transfer/block_copy.txt

Each figure is the median of 20 launches timed with CUDA events, after 3 untimed ones.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from kvrail.kernels import block_copy

BLOCKS = 512


def _time(fn: Callable[[], None]) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _size(label: str, block_bytes: int, g: torch.Generator) -> None:
    words = block_bytes // 8
    src = torch.randint(0, 1 << 62, (BLOCKS + 88, words), dtype=torch.int64, device="cuda")
    dst = torch.zeros_like(src)
    src_ids = torch.randperm(BLOCKS + 88, generator=g)[:BLOCKS].cuda()
    dst_ids = torch.randperm(BLOCKS + 88, generator=g)[:BLOCKS].cuda()
    nbytes = BLOCKS * block_bytes
    flat_src, flat_dst = src[:BLOCKS].view(-1), dst[:BLOCKS].view(-1)
    t = _time(lambda: flat_dst.copy_(flat_src))
    print(f"{label}: {nbytes >> 20} MiB; a contiguous torch copy {t * 1e3:.3f} ms")
    for tiles in (1, 4, 16, 32, 64):
        chunk = tiles * block_copy.TILE
        for warps in (4, 8):
            t = _time(
                lambda c=chunk, w=warps: block_copy.copy_blocks(
                    src, dst, src_ids, dst_ids, chunk=c, num_warps=w
                )
            )
            programs = BLOCKS * -(-words // chunk)
            print(
                f"  chunk {chunk:6d} warps {warps}: {programs:6d} programs "
                f"{t * 1e3:.3f} ms {nbytes / t / 1e9:7.0f} GB/s"
            )
    assert torch.equal(dst[dst_ids], src[src_ids])


def main() -> int:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    g = torch.Generator().manual_seed(0)
    for label, block_bytes in (("FP8 (1 MiB blocks)", 1 << 20), ("bf16 (2 MiB blocks)", 2 << 20)):
        _size(label, block_bytes, g)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
