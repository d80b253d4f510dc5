"""Triton kernel: RMSNorm, optionally fused with the residual add before it (one pass per row).

Same contract as `kvrail.kernels.reference.rms_norm` / `fused_add_rms_norm`. One program per row.
Rounding follows transformers step by step, so bf16 outputs match it: the sum is rounded to the
activation dtype (that is the new residual), the norm is computed in float32 from it and rounded,
then multiplied by the weight in the activation dtype. With a residual, the new residual is
written over the input residual in place (the returned residual is that tensor).

`rms_norm_fp8` / `fused_add_rms_norm_fp8` write the normed rows quantized for the FP8 projection
that takes them (`kvrail.kernels.dispatch.takes_quantized_rows`): each row rounded as above, then
divided by its scale and stored in e4m3, the same bytes as `kvrail.kernels.fp8_gemm.quantize_rows`
over the bf16 output, without writing and reading that output.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvrail.kernels.fp8_gemm import row_scale, rows_for
from kvrail.kernels.kv_write import to_cache
from kvrail.kernels.launch import pdl
from kvrail.kernels.reference import FP8_MAX, FP8_MIN_SCALE, QuantizedRows


@triton.jit
def _rms_norm_kernel(
    x,
    residual,
    weight,
    out,
    scales,
    static_scale,
    stride_x,
    stride_r,
    stride_o,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    STATIC: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # see kvrail.kernels.launch
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual + row * stride_r + cols, mask=mask, other=0.0)
        h = (r.to(tl.float32) + h.to(tl.float32)).to(x.dtype.element_ty)
        tl.store(residual + row * stride_r + cols, h, mask=mask)
    hf = h.to(tl.float32)
    variance = tl.sum(hf * hf, 0) / hidden
    normed = (hf * tl.math.rsqrt(variance + eps)).to(x.dtype.element_ty)
    w = tl.load(weight + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    if QUANT:  # the bf16 output's bytes, then quantized as fp8_gemm.quantize_rows does
        y = y.to(x.dtype.element_ty).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(y), 0), static_scale, STATIC, FP8_MAX, MIN_SCALE)
        tl.store(scales + row, scale)
        tl.store(out + row * stride_o + cols, to_cache(y / scale, out, FP8_MAX), mask=mask)
    else:
        tl.store(out + row * stride_o + cols, y.to(out.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x {tuple(x.shape)} is not [T, H] for weight {tuple(weight.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight must have a unit innermost stride")


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    rows: QuantizedRows | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The normed rows into a new tensor, or into `rows` (quantized with `input_scale` or per
    row); returns the tensor written."""
    hidden = x.shape[1]
    if rows is None:
        out = torch.empty(x.shape, dtype=torch.result_type(x, weight), device=x.device)
        scales = out
    else:
        out, scales, _ = rows
    if x.shape[0] == 0:
        return out
    block = triton.next_power_of_2(hidden)
    on = pdl(x.device)
    _rms_norm_kernel[(x.shape[0],)](
        x,
        x if residual is None else residual,
        weight,
        out,
        scales,
        scales if input_scale is None else input_scale,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        out.stride(0),
        hidden,
        eps,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        QUANT=rows is not None,
        STATIC=input_scale is not None,
        FP8_MAX=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE,
        PDL=on,
        launch_pdl=on,
        num_warps=min(16, max(1, block // 512)),
    )
    return out


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")


def _quantized_rows(
    x: torch.Tensor, weight: torch.Tensor, input_scale: torch.Tensor | None
) -> QuantizedRows:
    """Storage for the normed rows quantized: the dtype checked is the output's, as `_launch`
    rounds it."""
    return rows_for(x.shape[0], x.shape[1], torch.result_type(x, weight), x.device, input_scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight)
    return _launch(x, None, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, weight)
    _check_residual(x, residual)
    return _launch(x, residual, weight, eps), residual


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, input_scale: torch.Tensor | None
) -> QuantizedRows:
    _check(x, weight)
    rows = _quantized_rows(x, weight, input_scale)
    _launch(x, None, weight, eps, rows, input_scale)
    return rows


def fused_add_rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    input_scale: torch.Tensor | None,
) -> tuple[QuantizedRows, torch.Tensor]:
    _check(x, weight)
    _check_residual(x, residual)
    rows = _quantized_rows(x, weight, input_scale)
    _launch(x, residual, weight, eps, rows, input_scale)
    return rows, residual
