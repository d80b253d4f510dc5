"""Triton kernel: SiLU(gate) * up over the fused gate_up projection output.

Same contract as `kvrail.kernels.reference.silu_and_mul`: x [T, 2I] (gate columns first) ->
[T, I]. SiLU is computed in float32 and rounded to the activation dtype before the product, as
torch does for `silu(gate) * up`. Grid: (row, BLOCK-column tile).

`silu_and_mul_fp8` writes the product quantized for the FP8 projection that takes it (the MLP's
down projection, `kvrail.kernels.dispatch.takes_quantized_rows`), the same bytes as
`kvrail.kernels.fp8_gemm.quantize_rows` over `silu_and_mul`'s output. One program per row: a row
of up to `ONE_PASS_MAX` products is loaded once and held in registers while its largest
magnitude is found; a longer one is computed twice, once for its largest magnitude (unless the
scale is static) and again to store it. Reading Llama-3-8B's rows (14,336 products) once took
a call over 8,192 rows from 241 to 161 us on an H200 (2.44 -> 3.65 TB/s of the bytes it must
move; bench/studies/gemm/silu_fp8.txt); the FP8 engine's 256 x 512/128 case went from 10,680-10,713
to 10,814-10,864 output tok/s (bench/engine/gpu_fp8_ab_2026-12-05.txt).
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

ONE_PASS_MAX = 16384  # products a row of silu_and_mul_fp8 holds in registers (see above)


@triton.jit
def _product(x, row, stride_x, inter, cols, mask):
    """silu(gate) * up at `cols` of a row, in float32 (not yet rounded to x's dtype)."""
    gate = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + row * stride_x + inter + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(x.dtype.element_ty)
    return act.to(tl.float32) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x, out, stride_x, stride_o, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see kvrail.kernels.launch
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    y = _product(x, row, stride_x, inter, cols, mask)
    tl.store(out + row * stride_o + cols, y.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x,
    out,
    scales,
    static_scale,
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
    STATIC: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # see kvrail.kernels.launch
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    dst = out + row * stride_o
    if ONE_PASS:  # the whole row in one tile (BLOCK >= inter)
        cols = tl.arange(0, BLOCK)
        mask = cols < inter
        y = _product(x, row, stride_x, inter, cols, mask).to(x.dtype.element_ty).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(y), 0), static_scale, STATIC, FP8_MAX, MIN_SCALE)
        tl.store(scales + row, scale)
        tl.store(dst + cols, to_cache(y / scale, out, FP8_MAX), mask=mask)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        if not STATIC:
            for c0 in range(0, inter, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                mask = cols < inter
                y = _product(x, row, stride_x, inter, cols, mask).to(x.dtype.element_ty)
                amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
        scale = row_scale(tl.max(amax, 0), static_scale, STATIC, FP8_MAX, MIN_SCALE)
        tl.store(scales + row, scale)
        for c0 in range(0, inter, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < inter
            y = _product(x, row, stride_x, inter, cols, mask).to(x.dtype.element_ty)
            tl.store(dst + cols, to_cache(y.to(tl.float32) / scale, out, FP8_MAX), mask=mask)


def _check(x: torch.Tensor) -> int:
    """x's intermediate size, once its shape and strides are checked."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x {tuple(x.shape)} is not [T, 2 * intermediate]")
    if x.stride(-1) != 1:
        raise ValueError("x must have a unit innermost stride")
    return x.shape[1] // 2


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    inter = _check(x)
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (x.shape[0], triton.cdiv(inter, block))
    on = pdl(x.device)
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, PDL=on, launch_pdl=on
    )
    return out


def silu_and_mul_fp8(x: torch.Tensor, input_scale: torch.Tensor | None) -> QuantizedRows:
    inter = _check(x)
    rows = rows_for(x.shape[0], inter, x.dtype, x.device, input_scale)
    if x.shape[0] == 0:
        return rows
    on = pdl(x.device)
    width = triton.next_power_of_2(inter)
    one_pass = width <= ONE_PASS_MAX
    block = width if one_pass else 2048
    _silu_and_mul_fp8_kernel[(x.shape[0],)](
        x,
        rows.values,
        rows.scales,
        rows.scales if input_scale is None else input_scale,
        x.stride(0),
        rows.values.stride(0),
        inter,
        BLOCK=block,
        ONE_PASS=one_pass,
        STATIC=input_scale is not None,
        FP8_MAX=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE,
        PDL=on,
        launch_pdl=on,
        num_warps=min(16, max(4, block // 1024)) if one_pass else 8,  # 32 products a thread
    )
    return rows
