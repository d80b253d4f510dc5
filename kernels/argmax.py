"""Triton kernels: the argmax of each row of the logits (greedy sampling), in two passes.

Same contract as `kvrail.kernels.reference.argmax`: x [rows, vocab] -> int64 [rows], the index of
the first maximal value of each row, compared in float32 (exact for bf16, fp16 and fp32), with
NaN taken as larger than any number (as torch does). torch's own argmax gives a 128k-token
vocabulary few blocks per row: 26.6, 27.2 and 45.8 us at 1, 32 and 256 rows on the H200, against
2.2, 6.9 and 36.3 for these two passes (bench/studies/gemm/decode_step_parts.txt; wider pass-1 tiles
saved at most 3 us at 256 rows and cost 0.6 at one).

Pass 1, grid (row, chunk): each program reduces BLOCK columns to (max, first index of it).
Pass 2, grid (row,): merges the row's chunks (the first chunk holding the maximum wins, so ties
keep the first index). Triton's max with indices breaks ties to the left in both passes. Both
take part in programmatic dependent launch (`kvrail.kernels.launch`).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvrail.kernels.launch import pdl

BLOCK = 2048


@triton.jit
def _chunk_kernel(
    x, part_max, part_idx, stride_x, cols, chunks, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    if PDL:  # see kvrail.kernels.launch
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    v = tl.load(x + row * stride_x + offs, mask=mask, other=float("-inf")).to(tl.float32)
    is_nan = v != v
    first_nan = tl.min(tl.where(is_nan, offs, cols), 0)
    best, at = tl.max(tl.where(is_nan, float("-inf"), v), 0, return_indices=True)
    has_nan = first_nan < cols  # a NaN outranks every number: the chunk's answer is the first
    tl.store(part_max + row * chunks + chunk, tl.where(has_nan, float("nan"), best))
    tl.store(part_idx + row * chunks + chunk, tl.where(has_nan, first_nan, chunk * BLOCK + at))


@triton.jit
def _merge_kernel(part_max, part_idx, out, chunks, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see kvrail.kernels.launch
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    mask = c < chunks
    best = tl.load(part_max + row * chunks + c, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx + row * chunks + c, mask=mask, other=0)
    nan = best != best
    first_nan = tl.min(tl.where(nan, c, CHUNKS), 0)
    _, at = tl.max(tl.where(nan, float("-inf"), best), 0, return_indices=True)
    pick = tl.where(first_nan < CHUNKS, first_nan, at)
    tl.store(out + row, tl.sum(tl.where(c == pick, idx, 0), 0).to(tl.int64))


def argmax(x: torch.Tensor, block: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """`block` (columns per pass-1 program, a power of two) and `num_warps`: tuning knobs (None:
    BLOCK and 4 warps; see bench/studies/gemm/decode_step_parts.py)."""
    block = block or BLOCK
    if block < 2 or block & (block - 1):
        raise ValueError(f"block {block} is not a power of two")
    if x.dim() != 2:
        raise ValueError(f"x {tuple(x.shape)} is not [rows, vocab]")
    if x.shape[1] == 0:
        raise ValueError("argmax of an empty row")
    if x.stride(-1) != 1:
        raise ValueError("x must have a unit innermost stride")
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(cols, block)
    part_max = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    on = pdl(x.device)
    _chunk_kernel[(rows, chunks)](
        x,
        part_max,
        part_idx,
        x.stride(0),
        cols,
        chunks,
        BLOCK=block,
        PDL=on,
        launch_pdl=on,
        num_warps=num_warps or 4,
    )
    _merge_kernel[(rows,)](
        part_max,
        part_idx,
        out,
        chunks,
        CHUNKS=max(2, triton.next_power_of_2(chunks)),
        PDL=on,
        launch_pdl=on,
    )
    return out
