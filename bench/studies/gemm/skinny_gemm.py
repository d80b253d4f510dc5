"""The skinny split-K GEMM (`kvrail.kernels.skinny_gemm`) against cuBLAS on the Llama-3-8B decode
projections, on the GPU (the sweep `pick_config` was derived from).

    python3 -P bench/studies/gemm/skinny_gemm.py | tee bench/studies/gemm/skinny_gemm.txt
    python3 -P bench/studies/gemm/skinny_gemm.py --sweep   # also every configuration at 32 rows
    python3 -P bench/studies/gemm/skinny_gemm.py --chain 1,32   # only the layer chain below
    python3 -P bench/studies/gemm/skinny_gemm.py --chain 1 --fp8   # the chain over e4m3 weights

`--chain` times what the kernels do together: 32 Llama-3-8B layers without attention (residual
add + RMSNorm, QKV, output projection of the first 4,096 QKV columns, add + RMSNorm, gate/up,
SiLU * up, down) at the given row counts, captured in one CUDA graph, for cuBLAS and the skinny
kernel, each with and without programmatic dependent launch (kvrail.kernels.launch); the variants
are alternated, two rounds. With `--fp8` the weights are e4m3 (a scale per row) and the chain
runs on the skinny kernel with PDL and SiLU in gate/up: with the RMSNorms writing bf16 (the
kernel quantizes x per K tile), with them writing e4m3 rows and scales (what QKV and gate/up
take in the model), and without the two RMSNorm kernels: what folding the norms into the
projections could save at most (the values are not looked at, and without the norms they
overflow). (pdl_chain.txt also has variants since
removed, from 4d84bce: a GEMM that prefetched part of its weight into L2 before waiting for the
previous kernel, and one that let the next kernel in before its main loop. Neither helped.)

Each timing replays a CUDA graph that runs the GEMM over enough distinct weight copies (at least
1 GiB in all) that none stays in L2, as the 32 layers of a decode step do; the figure is the
graph's time over the number of copies, so it includes the gap between kernels in a graph.
cuBLAS (`F.linear`) and the skinny kernel are timed alternately, two rounds of three timings
each, and the best of each is printed with the weight bytes per second it reached.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional

from kvrail.kernels import reference, rms_norm, silu_and_mul, skinny_gemm
from kvrail.kernels.skinny_gemm import SkinnyConfig

sys.path.insert(0, str(Path(__file__).parent))
from gemm_layouts import SHAPES  # the Llama-3-8B projections, name: (N, K)

ROWS = (1, 8, 16, 32)  # up to skinny_gemm.MAX_ROWS


def _weights(n: int, k: int) -> list[torch.Tensor]:
    copies = max(2, (1 << 30) // (n * k * 2))
    return [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]


def _cublas(x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda w: functional.linear(x, w)


def _skinny(x: torch.Tensor, cfg: SkinnyConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda w: skinny_gemm.linear(x, w, None, cfg)


def _time(fn: Callable[[torch.Tensor], torch.Tensor], ws: list[torch.Tensor]) -> float:
    """Seconds per GEMM, replayed from a graph over every weight copy."""
    for w in ws[:2]:
        fn(w)  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            fn(w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / 5 / len(ws))
    del graph
    return best


def _candidates(n: int, k: int) -> list[SkinnyConfig]:
    out = []
    for block_n, block_k, splits, (warps, stages) in itertools.product(
        (32, 64, 128), (128, 256), (1, 2, 4, 8, 16), ((4, 3), (4, 4))
    ):
        programs = -(-n // block_n) * splits
        if programs < 132 or programs > 2048 or k % (splits * block_k):
            continue
        out.append(SkinnyConfig(block_n, block_k, splits, warps, stages))
    return out


Linear = Callable[[torch.Tensor, Any], torch.Tensor]


def _chain_layer(
    x: torch.Tensor,
    residual: torch.Tensor,
    ws: dict[str, Any],
    lin: Linear,
    gated: bool,
    norms: bool = True,
    quantized: bool = False,
) -> torch.Tensor:
    """One layer without attention; FP8 weights are (values, row scales) pairs. Without
    `norms` the two RMSNorm kernels are left out: the bound on folding them into the
    projections that read their output. With `quantized` the RMSNorms write e4m3 rows and
    their scales (`fused_add_rms_norm_fp8`), which QKV and gate/up multiply as they are."""

    def norm(x: torch.Tensor) -> Any:
        if not norms:
            return x
        if quantized:
            return rms_norm.fused_add_rms_norm_fp8(x, residual, ws["norm"], 1e-5, None)[0]
        return rms_norm.fused_add_rms_norm(x, residual, ws["norm"], 1e-5)[0]

    h = norm(x)
    qkv = lin(h, ws["qkv"])
    o = lin(qkv[:, :4096], ws["o_proj"])
    h = norm(o)
    if gated:  # SiLU * up in the gate/up projection's epilogue
        w = ws["gate_up"]
        act = (
            skinny_gemm.gated_linear(h, w[0], None, None, w[1])
            if isinstance(w, tuple)
            else skinny_gemm.gated_linear(h, w)
        )
        return lin(act, ws["down"])
    return lin(silu_and_mul.silu_and_mul(lin(h, ws["gate_up"])), ws["down"])


def _skinny_default(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return skinny_gemm.linear(x, w)


def _fp8_linear(x: Any, w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return skinny_gemm.linear(x, w[0], None, None, w[1])


def chain(rows: int, fp8: bool = False) -> None:
    def weight(n: int, k: int) -> Any:
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        return reference.quantize_fp8_rows(w) if fp8 else w

    layers = [
        {name: weight(n, k) for name, (n, k) in SHAPES.items() if name != "lm_head"}
        | {"norm": torch.ones(4096, dtype=torch.bfloat16, device="cuda")}
        for _ in range(32)
    ]
    x0 = torch.randn(rows, 4096, dtype=torch.bfloat16, device="cuda")
    residual = torch.zeros_like(x0)
    cublas: Linear = lambda x, w: functional.linear(x, w)  # noqa: E731
    # name: (PDL, linear, SiLU in gate/up, the RMSNorm kernels, norms writing e4m3 rows)
    variants: dict[str, tuple[bool, Linear, bool, bool, bool]] = {
        "cuBLAS, no PDL": (False, cublas, False, True, False),
        "cuBLAS, PDL on norms/SiLU": (True, cublas, False, True, False),
        "skinny, no PDL": (False, _skinny_default, False, True, False),
        "skinny, PDL": (True, _skinny_default, False, True, False),
        "skinny, PDL, SiLU in gate/up": (True, _skinny_default, True, True, False),
    }
    if fp8:  # e4m3 weights run only on the skinny kernel at decode rows
        variants = {
            "fp8 skinny, PDL, SiLU in gate/up": (True, _fp8_linear, True, True, False),
            "the same, norms write e4m3 rows": (True, _fp8_linear, True, True, True),
            "the same without the RMSNorms": (True, _fp8_linear, True, False, False),
        }
    best = {name: float("inf") for name in variants}
    for _ in range(2):
        for name, (on, lin, gated, norms, quantized) in variants.items():
            os.environ["KVRAIL_PDL"] = "1" if on else "0"

            def step(
                lin: Linear = lin, gated: bool = gated, norms: bool = norms, q: bool = quantized
            ) -> None:
                x = x0
                for ws in layers:
                    x = _chain_layer(x, residual, ws, lin, gated, norms, q)

            step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            end.synchronize()
            best[name] = min(best[name], start.elapsed_time(end) / 20)
            del graph
    os.environ.pop("KVRAIL_PDL", None)
    kind = "FP8" if fp8 else "bf16"
    print(
        f"\n## 32 {kind} layers without attention, {rows} rows, one CUDA graph (best of 2 rounds)"
    )
    for name, ms in best.items():
        print(f"{name:34s} {ms:6.3f} ms  {ms / 32 * 1e3:6.1f} us/layer", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="every configuration at 32 rows")
    parser.add_argument("--chain", type=str, default="", help="only the layer chain: rows, 1,32")
    parser.add_argument("--fp8", action="store_true", help="the chain over e4m3 weights")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    torch.manual_seed(0)
    if args.chain:
        for rows in args.chain.split(","):
            chain(int(rows), args.fp8)
        return 0
    head = f"{'gemm':8s} {'M':>3s} {'cuBLAS us':>9s} {'TB/s':>5s} {'skinny us':>9s} {'TB/s':>5s}"
    print(f"{head}  config")
    for name, (n, k) in SHAPES.items():
        ws = _weights(n, k)
        nbytes = n * k * 2
        for m in ROWS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            cfg = skinny_gemm.pick_config(m, n, k)
            cublas = skinny = float("inf")
            for _ in range(2):  # alternated
                cublas = min(cublas, _time(_cublas(x), ws))
                skinny = min(skinny, _time(_skinny(x, cfg), ws))
            print(
                f"{name:8s} {m:3d} {cublas * 1e6:9.1f} {nbytes / cublas / 1e12:5.2f} "
                f"{skinny * 1e6:9.1f} {nbytes / skinny / 1e12:5.2f}  {cfg}",
                flush=True,
            )
        del ws
    if not args.sweep:
        return 0
    print("\n## every configuration at 32 rows, best 6 per shape")
    for name, (n, k) in SHAPES.items():
        if name == "lm_head":
            continue
        ws = _weights(n, k)
        x = torch.randn(32, k, dtype=torch.bfloat16, device="cuda")
        results = []
        for cfg in _candidates(n, k):
            try:
                t = _time(_skinny(x, cfg), ws)
            except Exception as exc:  # a configuration the GPU cannot run (shared memory)
                print(f"  {name} {cfg}: {type(exc).__name__}", flush=True)
                continue
            results.append((t, cfg))
        results.sort(key=lambda r: r[0])
        for t, cfg in results[:6]:
            print(
                f"{name:8s} {t * 1e6:7.1f} us {n * k * 2 / t / 1e12:5.2f} TB/s  {cfg}", flush=True
            )
        del ws
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
