"""Triton kernel: the scores of a seeded draw's exponential race, in one pass.

Same contract as `kvrail.kernels.reference.race_scores`: probs [rows, vocab] float32 and each
row's 64-bit key as two int64 halves (low, high: values in [0, 2**32)) -> float32 [rows, vocab],
p / E where E = -log(u), u made of 23 bits of a 32-bit hash of (token id ^ low), then of that
^ high (xor-shift-multiply, two rounds). The hash is bit for bit the reference's (int64
products masked to their low 32 bits, which a wrap past 2**64 keeps), so the argmax of the
scores, the drawn token, is the same on CPU and GPU up to the last bit of a logarithm. torch's
version takes a dozen passes over [rows, vocab] int64 tensors; this takes one read of the
probabilities and one write of the scores.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _hash32(x):
    # int64 values in [0, 2**32): a product may wrap past 2**64, which keeps its low 32 bits
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _race_kernel(probs, low, high, out, stride_p, cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    p = tl.load(probs + row * stride_p + offs, mask=mask, other=0.0)
    key_low = tl.load(low + row)
    key_high = tl.load(high + row)
    bits = _hash32(_hash32(offs.to(tl.int64) ^ key_low) ^ key_high)
    uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # reference.race_uniform
    tl.store(out + row * cols + offs, p / -tl.log(uniform), mask=mask)


def race_scores(probs: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    if probs.dim() != 2 or probs.dtype != torch.float32 or probs.stride(-1) != 1:
        raise ValueError("probs must be float32 [rows, vocab] with a unit innermost stride")
    rows, cols = probs.shape
    if low.shape != (rows,) or high.shape != (rows,):
        raise ValueError("one key (low, high) per row")
    out = torch.empty(rows, cols, dtype=torch.float32, device=probs.device)
    if rows and cols:
        grid = (rows, triton.cdiv(cols, BLOCK))
        _race_kernel[grid](probs, low, high, out, probs.stride(0), cols, BLOCK=BLOCK)
    return out
