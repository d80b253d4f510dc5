"""Decode-step GEMMs of the Llama-3-8B shape on the GPU: does the weight layout change what
cuBLAS does? (diagnostics for bench/engine tuning)

    python3 -P bench/studies/gemm/gemm_layouts.py | tee bench/studies/gemm/gemm_layouts.txt

For batches of 1, 32 and 256 tokens, times `F.linear(x, W)` with W [N, K] (the model's layout)
and `x @ Wt` with Wt [K, N] contiguous, replayed from a CUDA graph, and prints the weight bytes
per second each reaches (the weights dominate: at these batches a GEMM streams them once).
"""

from __future__ import annotations

import torch
import triton
from torch.nn import functional

SHAPES = {  # name: (N, K)
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def time_pair(m: int, n: int, k: int) -> tuple[float, float, int]:
    """(F.linear ms, x @ Wt ms, weight bytes) for one shape."""
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    wt = w.t().contiguous()
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    linear = triton.testing.do_bench_cudagraph(lambda: functional.linear(x, w), rep=20)
    matmul = triton.testing.do_bench_cudagraph(lambda: x @ wt, rep=20)
    return float(linear), float(matmul), w.numel() * 2


def main() -> int:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'gemm':8s} {'M':>4s} {'linear us':>10s} {'TB/s':>6s} {'x@Wt us':>9s} {'TB/s':>6s}")
    for m in (1, 32, 256):
        for name, (n, k) in SHAPES.items():
            linear, matmul, nbytes = time_pair(m, n, k)
            print(
                f"{name:8s} {m:4d} {linear * 1e3:10.1f} {nbytes / linear / 1e9:6.2f} "
                f"{matmul * 1e3:9.1f} {nbytes / matmul / 1e9:6.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
