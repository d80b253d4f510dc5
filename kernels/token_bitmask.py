"""Triton kernel: a grammar's token bitmask applied to the constrained rows of the logits.

Same contract as `kvrail.kernels.reference.apply_token_bitmask`: in place, row `rows[i]` of
logits [n, vocab] gets -inf at every token whose bit in bitmask row i (int32 [m, words], bit
t % 32 of word t // 32) is clear or that lies past 32 * words; the other rows are not read or
written. Grid (constrained row, vocabulary tile): each program reads its tile's logits' bits (a
word serves 32 neighbouring lanes) and writes only the masked entries, so a row the grammar
leaves wide open costs a read of its words. The logits may be any float dtype.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _apply_kernel(logits, bitmask, rows, stride_l, stride_b, cols, words, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < cols
    word = offs // 32
    bits = tl.load(bitmask + i * stride_b + word, mask=in_vocab & (word < words), other=0)
    forbidden = ((bits >> (offs % 32)) & 1) == 0
    row = tl.load(rows + i)
    masked = tl.full([BLOCK], float("-inf"), logits.dtype.element_ty)
    tl.store(logits + row * stride_l + offs, masked, mask=in_vocab & forbidden)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError("logits must be [rows, vocab] with a unit innermost stride")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.stride(-1) != 1:
        raise ValueError("bitmask must be int32 [rows, words] with a unit innermost stride")
    if rows.shape != (bitmask.shape[0],) or rows.dtype != torch.int64:
        raise ValueError("one int64 row index per bitmask row")
    num_rows, words = bitmask.shape
    cols = logits.shape[1]
    if num_rows and cols:
        grid = (num_rows, triton.cdiv(cols, BLOCK))
        _apply_kernel[grid](
            logits, bitmask, rows, logits.stride(0), bitmask.stride(0), cols, words, BLOCK=BLOCK
        )
