"""Triton kernel: SiLU(gate) * up over the fused gate_up projection output.

Same contract as `kvrail.kernels.reference.silu_and_mul`: x [T, 2I] (gate columns first) ->
[T, I]. SiLU is computed in float32 and rounded to the activation dtype before the product, as
torch does for `silu(gate) * up`. Grid: (row, BLOCK-column tile).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvrail.kernels.launch import pdl


@triton.jit
def _silu_and_mul_kernel(x, out, stride_x, stride_o, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see kvrail.kernels.launch
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + row * stride_x + inter + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(x.dtype.element_ty)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out + row * stride_o + cols, y.to(out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x {tuple(x.shape)} is not [T, 2 * intermediate]")
    if x.stride(-1) != 1:
        raise ValueError("x must have a unit innermost stride")
    inter = x.shape[1] // 2
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
