"""SiLU * up quantized to e4m3 rows (`kvrail.kernels.silu_and_mul.silu_and_mul_fp8`), the FP8
MLP's activation before its down projection, on the GPU: microseconds per call and the bytes it
must move (bf16 gate and up in, e4m3 out) per second, at Llama-3-8B's intermediate size.

    python3 -P bench/studies/gemm/silu_fp8.py            # the tree on PYTHONPATH

Run it over two trees in one device command to compare them (bench/studies/gemm/silu_fp8.txt).
Timing: a CUDA graph of 20 calls over inputs that together exceed L2, best of five replays.
"""

from __future__ import annotations

import torch

from kvrail.kernels import silu_and_mul

INTER = 14336


def main() -> int:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for rows in (256, 2048, 8192):
        copies = max(2, (1 << 30) // (rows * 2 * INTER * 2))
        xs = [
            torch.randn(rows, 2 * INTER, dtype=torch.bfloat16, device="cuda")
            for _ in range(min(copies, 20))
        ]
        for x in xs[:2]:
            silu_and_mul.silu_and_mul_fp8(x, None)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20 // len(xs)):
                for x in xs:
                    silu_and_mul.silu_and_mul_fp8(x, None)
        calls = (20 // len(xs)) * len(xs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(5):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / calls)
        moved = rows * INTER * (2 * 2 + 1)
        print(f"rows {rows:5d} x {INTER}: {best * 1e6:8.1f} us  {moved / best / 1e12:5.2f} TB/s")
        del graph, xs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
