"""One row of x (batch-1 decode) through the skinny kernel, on the GPU: every Llama-3-8B
projection in FP8 (e4m3 with a scale per row; the LM head, which stays in the model's dtype, in
bf16).

    python3 -P bench/studies/gemm/skinny_one_row.py | tee bench/studies/gemm/skinny_one_row.txt

For each projection it prints `pick_config`'s choice, then the fastest configuration of a sweep,
with the weight bytes per second each reached. The gate/up projection runs as the model runs it
(`gated_linear`, SiLU * up in the epilogue). A read-only reference kernel (`torch.sum` over
1 GiB) says what bandwidth a plain stream reaches on the same GPU. Timing as in skinny_gemm.py:
a CUDA graph over enough weight copies (1 GiB or more) that none stays in L2, best of three.

skinny_one_row.txt was written by this script at 202aef9, which also swept an `fma` mode (one
row on the CUDA cores, no tensor cores). It was no faster and was removed.

    python3 -P bench/studies/gemm/skinny_one_row.py --engine-rows   # skinny_one_row_2026-12-05.txt

With `--engine-rows` QKV and gate/up take their row as e4m3 values and a scale
(`QuantizedRows`), as the FP8 RMSNorms write it for the engine, instead of in bf16.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from kvrail.kernels import fp8_gemm, skinny_gemm
from kvrail.kernels.skinny_gemm import SkinnyConfig

sys.path.insert(0, str(Path(__file__).parent))
from fp8_gemm import _bf16_weights, _fp8_weights, _time_fp8
from gemm_layouts import SHAPES  # the Llama-3-8B projections, name: (N, K)
from skinny_gemm import _time


def _timer(
    n: int, k: int, fp8: bool, gated: bool, quantized: bool = False
) -> Callable[[SkinnyConfig | None], float]:
    """Seconds per launch over 1 GiB of weight copies (FP8 with its row scales), one row of x
    (`quantized`: as e4m3 rows)."""
    row = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    x = fp8_gemm.quantize_rows(row) if quantized else row
    fn = skinny_gemm.gated_linear if gated else skinny_gemm.linear
    if fp8:
        pairs = _fp8_weights(n, k)
        return lambda cfg: _time_fp8(lambda w, s: fn(x, w, None, cfg, s), pairs)
    ws = _bf16_weights(n, k)
    return lambda cfg: _time(lambda w: fn(x, w, None, cfg), ws)


def _candidates(n: int, k: int) -> Iterator[SkinnyConfig]:
    """Split counts that give 1.5 to 8 programs per SM of an H200 (more without a split)."""
    tiles = [(64, 128), (128, 128), (128, 256)]
    for (block_n, block_k), splits, num_stages in itertools.product(
        tiles, (1, 2, 4, 8, 16), (3, 4)
    ):
        programs = -(-n // block_n) * splits
        too_many = programs > 1100 and splits > 1
        if programs < 200 or too_many or k % (splits * block_k) or k // splits < 2 * block_k:
            continue
        yield SkinnyConfig(block_n, block_k, splits, 4, num_stages)


def _row(label: str, seconds: float, nbytes: int) -> str:
    return f"{label:58s} {seconds * 1e6:8.1f} us {nbytes / seconds / 1e12:6.2f} TB/s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fp8-shapes", default="qkv,o_proj,gate_up,down")
    parser.add_argument("--bf16-shapes", default="lm_head")
    parser.add_argument("--engine-rows", action="store_true", help="see the module's docstring")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    stream = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    t = _time(lambda w: w.sum(), [stream, stream[1:]])  # consecutive reads: 1 GiB each
    print(_row("torch.sum over 1 GiB (a plain read)", t, stream.numel() * 2))
    del stream
    for dtype, names in (("fp8", args.fp8_shapes), ("bf16", args.bf16_shapes)):
        fp8 = dtype == "fp8"
        for name in filter(None, names.split(",")):
            n, k = SHAPES[name]
            quantized = args.engine_rows and fp8 and name in ("qkv", "gate_up")
            time = _timer(n, k, fp8, gated=name == "gate_up", quantized=quantized)
            nbytes = n * k * (1 if fp8 else 2)
            print(_row(f"{name} [{n}x{k}] {dtype} pick_config", time(None), nbytes))
            print(f"#   {skinny_gemm.pick_config(1, n, k, 1 if fp8 else 2)}")
            best: tuple[float, SkinnyConfig | None] = (float("inf"), None)
            for cfg in _candidates(n, k):  # e4m3 dots for FP8 weights
                try:
                    best = min(best, (time(cfg), cfg), key=lambda p: p[0])
                except Exception as err:  # a configuration the compiler refuses
                    print(f"#   {cfg}: {type(err).__name__}")
            print(_row(f"{name} [{n}x{k}] {dtype} best", best[0], nbytes))
            print(f"#   {best[1]}")
            sys.stdout.flush()
            del time  # its weight copies
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
