"""Causal prefill attention at Llama-3-8B's shape (32 query heads, 8 KV heads, 128 wide) on the
GPU: torch's bf16 `scaled_dot_product_attention` on cuDNN (what the engine runs from 4,096 tokens
on) and on flash attention, against kvrail's FP8 attention (`kvrail.kernels.fp8_attention`:
cuDNN's FP8 flash attention over e4m3 q/k/v as the FP8 KV cache rounds them, the output e4m3
over 256 / amax(v), `reference.FP8_ATTENTION_RANGE`).

    python3 -P bench/studies/attention/fp8_attention.py      # needs nvidia-cudnn-frontend (1.18.0)

First, for 4,096 and 8,192 tokens, each call after an L2 flush: bf16 cuDNN attention with v a
strided view of the QKV output as the engine passes it, with v contiguous, and with v copied
first; and the FP8 attention. Then per length: milliseconds per call (best of five CUDA-event
timings of 10 calls) and TFLOP/s of the causal attention's two matmuls; for FP8, the call as the
engine would make it (its output scale computed, its rows' scales written) and with K and V
expanded to every query head, and the time to build the plan of a new shape; and the error of
each against float32 attention over the bf16 inputs on four heads (relative RMS and largest
absolute error): for FP8 it includes rounding q, k and v to e4m3. Runs:
fp8_attention_2026-12-05.txt (an H100; it also tried an output in bf16, which cuDNN 9.19
refuses), and a first version's (cuDNN's inference mode, scales of 448, wrong outputs):
fp8_attention_inference_2026-12-05.txt.
"""

from __future__ import annotations

import math
import time

import torch
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvrail.kernels import fp8_attention
from kvrail.kernels import reference as ref_ops

HQ, HKV, D = 32, 8, 128
FP8 = torch.float8_e4m3fn


def timed(fn, calls: int = 10) -> float:
    """Seconds per call: best of five timings of `calls` calls."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    return best


def reference(q, k, v, heads: int = 4) -> torch.Tensor:
    """float32 causal attention of the first `heads` query heads -> [L, heads, D]."""
    length = q.shape[0]
    group = HQ // HKV
    mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    outs = []
    for h in range(heads):
        qh, kh, vh = q[:, h].float(), k[:, h // group].float(), v[:, h // group].float()
        s = (qh @ kh.T) / math.sqrt(D)
        s.masked_fill_(~mask, float("-inf"))
        outs.append(torch.softmax(s, dim=-1) @ vh)
    return torch.stack(outs, dim=1)


def error(out: torch.Tensor, ref: torch.Tensor) -> str:
    diff = out.float() - ref
    rel = diff.norm() / ref.norm()
    return f"rel RMS {rel.item():.4f}, max abs {diff.abs().max().item():.4f}"


def bench_length(length: int) -> None:
    q = torch.randn(length, HQ, D, dtype=torch.bfloat16, device="cuda") * 2
    k = torch.randn(length, HKV, D, dtype=torch.bfloat16, device="cuda") * 2
    v = torch.randn(length, HKV, D, dtype=torch.bfloat16, device="cuda")
    flops = 4 * length * length / 2 * D * HQ
    scale = 1 / math.sqrt(D)

    def bf16(backend):
        qs, ks, vs = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel([backend]):
            return functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            ).transpose(1, 2)[0]

    ref = reference(q, k, v)
    print(f"\nlength {length}: {flops / 1e9:.0f} GFLOP a layer")
    for name, backend in (("cuDNN bf16", SDPBackend.CUDNN_ATTENTION),
                          ("flash bf16", SDPBackend.FLASH_ATTENTION)):  # fmt: skip
        try:
            t = timed(lambda b=backend: bf16(b))
        except RuntimeError as err:  # e.g. no kernel of this backend for GQA
            print(f"  {name:12s} not run: {str(err)[:300]}")
            continue
        print(f"  {name:12s} {t * 1e3:7.3f} ms  {flops / t / 1e12:6.0f} TFLOP/s  "
              f"{error(bf16(backend)[:, :4], ref)}")  # fmt: skip
    q8, k8, v8 = (ref_ops.to_cache_dtype(x, FP8) for x in (q, k, v))
    v_amax = v8.float().abs().amax().reshape(1)
    k8x, v8x = (x.repeat_interleave(HQ // HKV, dim=1).contiguous() for x in (k8, v8))
    variants = {  # what the engine calls, and with K/V expanded (no GQA)
        "kvrail FP8": lambda: fp8_attention.fp8_causal_attention(
            q8, k8, v8, v_amax, 1, scale, torch.bfloat16
        ),
        "FP8, K/V expanded to 32 heads": lambda: fp8_attention.fp8_causal_attention(
            q8, k8x, v8x, v_amax, 1, scale, torch.bfloat16
        ),
    }
    for name, fn in variants.items():
        try:
            started = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            built = time.perf_counter() - started
            t = timed(fn)
            out = ref_ops.dequantize_rows(fn()).view(length, HQ, D)
        except Exception as err:  # report and go on with the next variant
            print(f"  {name} failed: {type(err).__name__}: {str(err)[:300]}")
            continue
        print(f"  {name:12s} {t * 1e3:7.3f} ms  {flops / t / 1e12:6.0f} TFLOP/s  "
              f"{error(out[:, :4], ref)}; first call (the plan) {built * 1e3:.0f} ms")  # fmt: skip


def cold(fn, calls: int = 10) -> float:
    """Seconds of one call with L2 flushed before it (256 MB written), the median of `calls`:
    in the engine the attention's inputs come after GEMMs that went through the cache."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(calls):
        flush.zero_()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[calls // 2]


def bench_layouts(length: int) -> None:
    """bf16 cuDNN attention with v as the engine passes it, a strided view of the QKV
    projection's output ([T, (Hq + 2 Hkv) D]), against a contiguous v, each call after an L2
    flush; and the FP8 attention the same way."""
    qkv = torch.randn(length, (HQ + 2 * HKV) * D, dtype=torch.bfloat16, device="cuda")
    q = qkv[:, : HQ * D].reshape(length, HQ, D).contiguous()  # the rotary pass's outputs
    k = qkv[:, HQ * D : (HQ + HKV) * D].reshape(length, HKV, D).contiguous()
    v_view = qkv[:, (HQ + HKV) * D :].view(length, HKV, D)
    v_packed = v_view.contiguous()
    flops = 4 * length * length / 2 * D * HQ
    scale = 1 / math.sqrt(D)

    def bf16(v: torch.Tensor, copy: bool = False) -> torch.Tensor:
        v = v.contiguous() if copy else v
        qs, ks, vs = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            )

    print(f"\nlength {length}, each call after an L2 flush (median of 10):")
    cases = {
        "cuDNN bf16, v a view of QKV (the engine's)": lambda: bf16(v_view),
        "cuDNN bf16, v contiguous": lambda: bf16(v_packed),
        "cuDNN bf16, v copied first (copy timed)": lambda: bf16(v_view, copy=True),
    }
    for name, fn in cases.items():
        t = cold(fn)
        print(f"  {name:44s} {t * 1e3:7.3f} ms  {flops / t / 1e12:6.0f} TFLOP/s")
    try:
        q8, k8, v8 = (ref_ops.to_cache_dtype(x, FP8) for x in (q, k, v_packed))
        v_amax = v8.float().abs().amax().reshape(1)
        t = cold(
            lambda: fp8_attention.fp8_causal_attention(q8, k8, v8, v_amax, 1, scale, torch.bfloat16)
        )
        print(f"  {'kvrail FP8':44s} {t * 1e3:7.3f} ms  {flops / t / 1e12:6.0f} TFLOP/s")
    except Exception as err:  # the bf16 figures stand on their own
        print(f"  kvrail FP8 failed: {type(err).__name__}: {str(err)[:300]}")


def main() -> int:
    import cudnn

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"# cuDNN backend {cudnn.backend_version()}, frontend {cudnn.__version__}")
    torch.manual_seed(0)
    for length in (4096, 8192):
        bench_layouts(length)
        torch.cuda.empty_cache()
    for length in (4096, 8192, 16384):
        try:
            bench_length(length)
        except Exception as err:  # report and go on with the next length
            print(f"length {length} failed: {type(err).__name__}: {str(err)[:300]}")
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
