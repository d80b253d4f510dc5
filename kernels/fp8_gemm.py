"""FP8 projections of more rows than the skinny kernel takes (prefill): activations quantized to
e4m3 per token by a Triton kernel, then one cuBLASLt FP8 GEMM (torch's `_scaled_mm`) with the
tokens' scales and the weight rows' scales applied in its epilogue, output in bfloat16.

Same contract as `kvrail.kernels.reference.fp8_linear`: x [.., K] in bfloat16, weight [N, K] in
e4m3 with float32 `weight_scale` [N], a checkpoint's static `input_scale` (one float32 value) or
None for a dynamic scale per token (its largest magnitude over 448, at least 1e-12). K and N must
be multiples of 16 (cuBLASLt's FP8 alignment); the loader's projections always are for the models
kvrail runs (Llama hidden and intermediate sizes).

The GEMM accumulates as the tensor cores do for FP8 (`use_fast_accum`), without promoting its
partial sums to float32 every few K steps. At 8,192 rows that made the four Llama-3-8B
projections 8-13% faster (down 800 -> 724 us, gate/up 1,662 -> 1,451) and the 8k prefill 0.150
-> 0.139 s, for a relative L2 error against float32 of 2.1e-3 instead of 1.7e-3 (3.3e-3 for the
down projection's K of 14,336), an order of magnitude below what rounding x and the weight to
e4m3 costs (bench/studies/gemm/fp8_gemm_accum.txt). vLLM's FP8 GEMMs on Hopper run CUTLASS's
fast-accumulation schedules too.

`quantize_rows` is one program per row: a pass for the row's largest magnitude, then a pass
that divides, saturates at +-448 and stores e4m3 (`kvrail.kernels.kv_write.to_cache`). Where the
kernel that writes the activations quantizes them itself (the RMSNorms and SiLU * up of an FP8
model's prefill, `kvrail.kernels.dispatch.takes_quantized_rows`), `fp8_linear` takes its
`QuantizedRows` and this pass is skipped.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrail.kernels.kv_write import to_cache
from kvrail.kernels.reference import FP8_MAX, FP8_MIN_SCALE, FP8_WEIGHT_DTYPE, QuantizedRows

_BLOCK = 1024


@triton.jit
def row_scale(amax, static_scale, STATIC: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE):
    """A row's scale: the static one, or its largest magnitude over FP8_MAX (at least
    MIN_SCALE)."""
    if STATIC:
        return tl.load(static_scale).to(tl.float32)
    return tl.maximum(amax / FP8_MAX, MIN_SCALE)


@triton.jit
def _quantize_rows_kernel(
    x,
    out,
    scales,
    static_scale,
    K,
    stride_x,
    stride_o,
    STATIC: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    src = x + row * stride_x
    dst = out + row * stride_o
    amax = tl.zeros([BLOCK], tl.float32)
    if not STATIC:
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            v = tl.load(src + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
    scale = row_scale(tl.max(amax, 0), static_scale, STATIC, FP8_MAX, MIN_SCALE)
    tl.store(scales + row, scale)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < K
        v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + offs, to_cache(v / scale, dst, FP8_MAX), mask=mask)


def check_input_scale(input_scale: torch.Tensor | None) -> None:
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"input_scale has {input_scale.numel()} values; a static scale has one")


def check_activations(dtype: torch.dtype) -> None:
    if dtype != torch.bfloat16:
        raise ValueError(f"FP8 projections on CUDA take bfloat16 activations, not {dtype}")


def empty_rows(m: int, k: int, dtype: torch.dtype, device: torch.device) -> QuantizedRows:
    """Storage for m rows of k activations of `dtype` quantized to e4m3, and their scales."""
    return QuantizedRows(
        torch.empty((m, k), dtype=FP8_WEIGHT_DTYPE, device=device),
        torch.empty(m, dtype=torch.float32, device=device),
        dtype,
    )


def rows_for(
    m: int, k: int, dtype: torch.dtype, device: torch.device, input_scale: torch.Tensor | None
) -> QuantizedRows:
    """Storage for a kernel that writes m rows of k activations of `dtype` quantized for an FP8
    projection (`kvrail.kernels.rms_norm`, `kvrail.kernels.silu_and_mul`), once `dtype` and the
    projection's `input_scale` are checked."""
    check_activations(dtype)
    check_input_scale(input_scale)
    return empty_rows(m, k, dtype, device)


def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> QuantizedRows:
    """x [M, K] -> e4m3 [M, K] and float32 scales [M]: each row over its own scale (dynamic),
    or over `input_scale` (static, every row's scale the same)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} is not [M, K] with a unit innermost stride")
    check_input_scale(input_scale)
    m, k = x.shape
    out, scales, _ = rows = empty_rows(m, k, x.dtype, x.device)
    if m:
        _quantize_rows_kernel[(m,)](
            x,
            out,
            scales,
            scales if input_scale is None else input_scale,
            k,
            x.stride(0),
            out.stride(0),
            STATIC=input_scale is not None,
            FP8_MAX=FP8_MAX,
            MIN_SCALE=FP8_MIN_SCALE,
            BLOCK=min(_BLOCK, triton.next_power_of_2(k)),
        )
    return rows


def fp8_linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [.., K] @ (weight [N, K] e4m3 * weight_scale [N]).T + bias -> [.., N] in bfloat16; x
    bfloat16, or already quantized ([T, K] rows of bfloat16 activations)."""
    dtype = x.dtype
    check_activations(dtype)
    n, k = weight.shape
    shape = x.values.shape if isinstance(x, QuantizedRows) else x.shape
    if shape[-1] != k or k % 16 or n % 16:
        raise ValueError(
            f"x {tuple(shape)} and an FP8 weight {tuple(weight.shape)} do not chain in an FP8 "
            "GEMM (K and N multiples of 16)"
        )
    if weight_scale.shape != (n,) or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} is not float32 [{n}]")
    lead = shape[:-1]
    if isinstance(x, QuantizedRows):
        rows = x
    elif x.numel():
        rows = quantize_rows(x.reshape(-1, k).contiguous(), input_scale)
    else:
        return x.new_empty((*lead, n))
    if not rows.values.shape[0]:
        return torch.empty((*lead, n), dtype=dtype, device=weight.device)
    out = torch._scaled_mm(
        rows.values,
        weight.t(),
        scale_a=rows.scales[:, None],
        scale_b=weight_scale[None, :],
        out_dtype=torch.bfloat16,
        use_fast_accum=True,  # see the module's docstring
    )
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, n)
