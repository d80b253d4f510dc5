"""Two small parts of a decode step on the GPU (diagnostics for bench/engine tuning):

    python3 -P bench/studies/gemm/decode_step_parts.py \\
        | tee bench/studies/gemm/decode_step_parts.txt

1. greedy token choice over a 128,256-token vocabulary for 1, 32 and 256 rows: `torch.argmax`
   against a two-pass `greedy_argmax` of torch ops and against the Triton kernel the sampler
   uses (`kvrail.kernels.argmax`) at a few pass-1 tile widths and warp counts (`--argmax` runs
   only this part; `--gemm-rows 64 256` only part 2, at those row counts);
2. the Llama-3-8B decode GEMMs at 1 and 32 tokens: cuBLAS's default choice against the fastest
   algorithm PyTorch's TunableOp finds for the shape (it benchmarks every implementation it
   knows).

Everything is replayed from CUDA graphs (`triton.testing.do_bench_cudagraph`), as in the engine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
from torch.nn import functional

sys.path.insert(0, str(Path(__file__).parent))
from gemm_layouts import SHAPES


def greedy_argmax(logits: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Row-wise argmax in two passes: the maximum of every `chunk`-wide slice of the vocabulary,
    then the best slice (the first maximal index, as `torch.argmax`; the vocabulary here is a
    multiple of `chunk`). Tried for the sampler, not adopted: see the README."""
    rows, vocab = logits.shape
    values, within = logits.view(rows, vocab // chunk, chunk).max(dim=-1)
    best = values.argmax(dim=-1, keepdim=True)
    return (best * chunk + within.gather(-1, best)).squeeze(-1)


def bench_us(fn: object) -> float:
    return float(triton.testing.do_bench_cudagraph(fn, rep=20)) * 1e3


def argmax_rows() -> None:
    from kvrail.kernels import argmax as kernel

    tiles = ((2048, 4), (4096, 4), (8192, 8), (16384, 8))
    kernel_columns = " ".join(f"{f'kernel {b}/{w} us':>17s}" for b, w in tiles)
    print(f"{'rows':>5s} {'torch.argmax us':>16s} {'greedy_argmax us':>17s} {kernel_columns} equal")
    for rows in (1, 32, 256):
        logits = torch.randn(rows, 128256, device="cuda").to(torch.bfloat16)
        expected = logits.argmax(-1)
        equal = torch.equal(expected, greedy_argmax(logits))
        plain = bench_us(lambda: logits.argmax(-1))  # noqa: B023
        two_pass = bench_us(lambda: greedy_argmax(logits))  # noqa: B023
        times = []
        for block, warps in tiles:
            equal &= torch.equal(expected, kernel.argmax(logits, block, warps))
            times.append(bench_us(lambda b=block, w=warps: kernel.argmax(logits, b, w)))  # noqa: B023
        cells = " ".join(f"{t:17.1f}" for t in times)
        print(f"{rows:5d} {plain:16.1f} {two_pass:17.1f} {cells} {equal}")


def gemms(rows: tuple[int, ...]) -> None:
    tunable = torch.cuda.tunable
    tunable.set_filename("/tmp/tunableop_results.csv")
    print(f"{'gemm':8s} {'M':>4s} {'cuBLAS us':>10s} {'TB/s':>6s} {'tuned us':>9s} {'TB/s':>6s}")
    for m in rows:
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            nbytes = w.numel() * 2
            tunable.enable(False)
            default = bench_us(lambda: functional.linear(x, w))  # noqa: B023
            tunable.enable(True)
            tunable.tuning_enable(True)
            functional.linear(x, w)  # tunes this shape
            torch.cuda.synchronize()
            tunable.tuning_enable(False)
            tuned = bench_us(lambda: functional.linear(x, w))  # noqa: B023
            tunable.enable(False)
            tflops = 2 * m * n * k / 1e6
            print(
                f"{name:8s} {m:4d} {default:10.1f} {nbytes / default / 1e6:6.2f} "
                f"{tuned:9.1f} {nbytes / tuned / 1e6:6.2f}  TFLOP/s {tflops / default:5.0f} "
                f"{tflops / tuned:5.0f}"
            )


def main() -> int:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    args = sys.argv[1:]
    if "--gemm-rows" in args:  # only the GEMMs, at these row counts
        gemms(tuple(int(a) for a in args[args.index("--gemm-rows") + 1 :]))
        return 0
    argmax_rows()
    if "--argmax" not in args:
        gemms((1, 32))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
