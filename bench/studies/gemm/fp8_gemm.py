"""FP8 projections of the Llama-3-8B shape against bf16, on the GPU.

    python3 -P bench/studies/gemm/fp8_gemm.py | tee bench/studies/gemm/fp8_gemm.txt
    python3 -P bench/studies/gemm/fp8_gemm.py --sweep    # also the skinny kernel's configurations

Decode rows (1, 32): the skinny kernel over bf16 weights against the same kernel over e4m3
weights (`kvrail.kernels.skinny_gemm`), with the default configuration
(`pick_config`) in each of its `fp8_dot` modes (what the tensor cores multiply: e4m3 with x
quantized per K tile, or the weight converted to float16 or to x's dtype) and, with `--sweep`,
the best of `skinny_gemm.py`'s candidates at 32 rows (e4m3).
Prefill rows (512, 8,192): cuBLAS bf16 (`F.linear`) against kvrail's FP8 GEMM
(`kvrail.kernels.fp8_gemm`: per-token activation quantization, then torch's `_scaled_mm` with
row scales and `use_fast_accum`), and `_scaled_mm` alone on activations quantized beforehand:
with its partial sums promoted to float32 (`fp8 GEMM`), accumulating fast (`fast acc`), and with
one scale per operand (`per-tensor`, cuBLASLt's tensor-wise path). `--prefill-only` prints only
these rows, with the error of each accumulation against float32; `--quantization-error` (on the
CPU) prints what rounding the operands to e4m3 costs beside it. Timing as in skinny_gemm.py: a
CUDA graph over enough weight copies (1 GiB or more) that none stays in L2, best of three, the
weight bytes per second.

    python3 -P bench/studies/gemm/fp8_gemm.py --prefill-only   # fp8_gemm_accum.txt
    python3 -P bench/studies/gemm/fp8_gemm.py --quantization-error
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional

from kvrail.kernels import fp8_gemm, reference, skinny_gemm

sys.path.insert(0, str(Path(__file__).parent))
from gemm_layouts import SHAPES  # the Llama-3-8B projections, name: (N, K)
from skinny_gemm import _candidates, _time

FP8 = torch.float8_e4m3fn


def _copies(n: int, k: int, itemsize: int) -> int:
    return max(2, (1 << 30) // (n * k * itemsize))


def _bf16_weights(n: int, k: int) -> list[torch.Tensor]:
    return [
        torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        for _ in range(_copies(n, k, 2))
    ]


def _fp8_weights(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(_copies(n, k, 1)):
        values, scales = reference.quantize_fp8_rows(
            torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        )
        out.append((values, scales))
    return out


def _time_fp8(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ws: list[tuple[torch.Tensor, torch.Tensor]],
) -> float:
    """`_time` over (weight, scale) pairs: the pairs are packed as indices into `ws`."""
    index = {id(w): (w, s) for w, s in ws}
    return _time(lambda w: fn(*index[id(w)]), [w for w, _ in ws])


def _row(label: str, seconds: float, nbytes: int) -> str:
    return f"{label:44s} {seconds * 1e6:9.1f} us {nbytes / seconds / 1e12:6.2f} TB/s"


def quantization_error() -> None:
    """On the CPU: what rounding both operands to e4m3 (x per token, the weight per row) costs a
    projection against its bf16 operands, sums in float32 (the reference FP8 GEMM), to set the
    fast accumulation's error beside."""
    torch.manual_seed(0)
    for name in ("qkv", "down"):
        n, k = SHAPES[name]
        x = torch.randn(256, k).bfloat16()
        w = (torch.randn(n, k) * 0.02).bfloat16()
        exact = x.float() @ w.float().T
        got = reference.fp8_linear(x, *reference.quantize_fp8_rows(w), None).float()
        err = float((got - exact).norm() / exact.norm())
        print(f"{name:8s} [{n}x{k}] m=256   e4m3 operands against bf16 ones: relative L2 {err:.2e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--prefill-only", action="store_true", help="only the prefill rows")
    parser.add_argument(
        "--quantization-error", action="store_true", help="on the CPU: e4m3 against bf16 operands"
    )
    args = parser.parse_args()
    if args.quantization_error:
        quantization_error()
        return 0
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, (n, k) in SHAPES.items():
        if name == "lm_head":  # not quantized: the LM head stays in the model's dtype
            continue
        bf16, fp8 = _bf16_weights(n, k), _fp8_weights(n, k)
        for m in () if args.prefill_only else (1, 32):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            t_bf16 = _time(lambda w, x=x: skinny_gemm.linear(x, w), bf16)
            cfg = skinny_gemm.pick_config(m, n, k, 1)
            print(_row(f"{name:8s} [{n}x{k}] m={m:<4d} skinny bf16", t_bf16, n * k * 2))
            print(f"#   fp8 default {cfg}")
            for mode in skinny_gemm.FP8_DOTS:
                c = dataclasses.replace(cfg, fp8_dot=mode)
                t = _time_fp8(lambda w, s, x=x, c=c: skinny_gemm.linear(x, w, None, c, s), fp8)
                print(_row(f"{name:8s} [{n}x{k}] m={m:<4d} skinny fp8 {mode}", t, n * k))
            if args.sweep and m == 32:
                best: tuple[float, object] = (float("inf"), None)
                for c in _candidates(n, k):  # fp8_dot e4m3
                    try:
                        t = _time_fp8(
                            lambda w, s, x=x, c=c: skinny_gemm.linear(x, w, None, c, s), fp8
                        )
                    except Exception as err:  # a configuration the compiler refuses
                        print(f"#   {c}: {type(err).__name__}")
                        continue
                    best = min(best, (t, c), key=lambda p: p[0])
                print(_row(f"{name:8s} m={m:<4d} fp8 best {best[1]}"[:44], best[0], n * k))
                print(f"#   best: {best[1]}")
        for m in (512, 8192):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            xq, xs, _ = fp8_gemm.quantize_rows(x)
            t_bf16 = _time(lambda w, x=x: functional.linear(x, w), bf16)
            t_fp8 = _time_fp8(lambda w, s, x=x: fp8_gemm.fp8_linear(x, w, s, None), fp8)
            t_mm = _time_fp8(
                lambda w, s, xq=xq, xs=xs: torch._scaled_mm(
                    xq, w.t(), scale_a=xs[:, None], scale_b=s[None, :], out_dtype=torch.bfloat16
                ),
                fp8,
            )
            t_fast = _time_fp8(
                lambda w, s, xq=xq, xs=xs: torch._scaled_mm(
                    xq, w.t(), scale_a=xs[:, None], scale_b=s[None, :], out_dtype=torch.bfloat16,
                    use_fast_accum=True,
                ),
                fp8,
            )  # fmt: skip
            one = torch.ones((), device="cuda")
            t_tensor = _time_fp8(  # one scale per operand: cuBLASLt's tensor-wise path
                lambda w, s, xq=xq, one=one: torch._scaled_mm(
                    xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
                ),
                fp8,
            )
            if args.prefill_only:  # what the fast accumulation costs in accuracy
                w, s = fp8[0]
                exact = (xq.float() * xs[:, None]) @ (w.float() * s[:, None]).T
                for fast in (False, True):
                    got = torch._scaled_mm(
                        xq, w.t(), scale_a=xs[:, None], scale_b=s[None, :],
                        out_dtype=torch.bfloat16, use_fast_accum=fast,
                    ).float()  # fmt: skip
                    err = float((got - exact).norm() / exact.norm())
                    worst = float(((got - exact).abs() / exact.abs().clamp(min=1e-3)).max())
                    print(
                        f"{name:8s} [{n}x{k}] m={m:<5d} fast_accum={fast!s:5s} relative L2 "
                        f"error against float32 {err:.2e}, largest relative {worst:.2e}"
                    )
            flops = 2 * m * n * k
            for label, t in (
                ("cuBLAS bf16", t_bf16),
                ("fp8 quant+GEMM", t_fp8),
                ("fp8 GEMM", t_mm),
                ("fp8 GEMM fast acc", t_fast),
                ("fp8 GEMM per-tensor", t_tensor),
            ):
                print(
                    f"{name:8s} [{n}x{k}] m={m:<5d} {label:19s} {t * 1e6:9.1f} us "
                    f"{flops / t / 1e12:7.1f} TFLOP/s"
                )
        del bf16, fp8
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
