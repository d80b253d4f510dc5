"""The pieces of a scattered KV copy in one process, on the GPU: the `copy_blocks` kernel's time
(CUDA events) over 512 scattered blocks of 1 MiB (an 8k prompt's FP8 KV) and 2 MiB (bf16) at
several words per program, a contiguous `copy_` of the same bytes (the bound), the time to put
two id lists on the GPU with `torch.tensor` (what the IPC path did before it staged them in
pinned memory), the launch alone and ids + kernel + stream wait from the host.

    python3 -P bench/studies/handoff/ipc_phases.py     # output: ipc_phases.txt
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch
import triton

from kvrail.kernels import block_copy


def _host_us(fn: Callable[[], object], n: int = 20) -> float:
    times = []
    for _ in range(n + 3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e6


def _gpu_us(fn: Callable[[], object], n: int = 10) -> float:
    fn()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _one_size(mib: int, blocks: int = 512) -> None:
    words = (mib << 20) // 8
    src = torch.randint(0, 1 << 30, (blocks, words), dtype=torch.int64, device="cuda")
    dst = torch.empty((blocks * 2, words), dtype=torch.int64, device="cuda")
    src_list = list(range(blocks))
    dst_list = random.Random(0).sample(range(blocks * 2), blocks)

    def ids() -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.tensor(src_list, dtype=torch.int64, device="cuda"),
            torch.tensor(dst_list, dtype=torch.int64, device="cuda"),
        )

    si, di = ids()
    label = f"{blocks} x {mib} MiB:"
    for chunk in (1024, 2048, 4096):
        grid = (blocks, triton.cdiv(words, chunk))

        def run(grid: tuple[int, int] = grid, chunk: int = chunk) -> None:
            block_copy._copy_between_kernel[grid](src, dst, si, di, words, CHUNK=chunk)

        print(f"{label} kernel at {chunk} words a program {_gpu_us(run):.1f} us")
    t_ids = _host_us(ids)
    t_launch = _host_us(lambda: block_copy.copy_blocks(src, dst, si, di))
    torch.cuda.synchronize()

    def full() -> None:
        a, b = ids()
        block_copy.copy_blocks(src, dst, a, b)
        torch.cuda.current_stream().synchronize()

    t_full = _host_us(full)
    print(f"{label} ids by torch.tensor {t_ids:.1f} us, launch {t_launch:.1f} us, "
          f"ids + kernel + wait {t_full:.1f} us")  # fmt: skip
    out = torch.empty_like(src)
    print(f"{label} contiguous copy_ {_gpu_us(lambda: out.copy_(src)):.1f} us")


def main() -> int:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for mib in (1, 2):
        _one_size(mib)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
