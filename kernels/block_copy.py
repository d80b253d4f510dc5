"""Triton kernels: pack blocks of the KV region into a contiguous buffer and unpack them back,
and copy blocks between two regions (`copy_blocks`: one launch for any number of scattered
blocks, the same-node transfer path).

Same contract as `kvrail.kernels.reference.gather_blocks` / `scatter_blocks` / `copy_blocks`.
The cache must be contiguous ([num_blocks, ...], one block = one contiguous range); the buffer is
[n, ...]. One kernel does all three. Grid: (blocks, chunks of a block), each program copying its
chunk (CHUNK elements, 512 KiB of int64) TILE elements at a time: a 2 MiB block is 4 programs.
The first version gave each program 1,024 elements, and a 1 GiB handoff of 512 scattered blocks
launched 131,072 programs, whose scheduling, not the bytes, set its time
(bench/transfer/block_copy.txt).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 2048  # elements a program copies per step of its loop
CHUNK = 32 * TILE  # elements of one block a program copies (a block of more takes several)
NUM_WARPS = 4


@triton.jit
def _copy_kernel(
    src,
    dst,
    src_ids,
    dst_ids,
    block_numel,
    chunk,
    SRC_IDS: tl.constexpr,
    DST_IDS: tl.constexpr,
    TILE: tl.constexpr,
):
    """Block i: source block src_ids[i] (or i) to destination block dst_ids[i] (or i); this
    program copies `chunk` elements of it, TILE at a time."""
    i = tl.program_id(0)
    lo = tl.program_id(1) * chunk
    hi = tl.minimum(lo + chunk, block_numel)
    s = tl.load(src_ids + i).to(tl.int64) if SRC_IDS else i.to(tl.int64)
    d = tl.load(dst_ids + i).to(tl.int64) if DST_IDS else i.to(tl.int64)
    src_block = src + s * block_numel
    dst_block = dst + d * block_numel
    for start in range(lo, hi, TILE):
        offs = start + tl.arange(0, TILE)
        mask = offs < hi
        values = tl.load(src_block + offs, mask=mask)
        tl.store(dst_block + offs, values.to(dst.dtype.element_ty), mask=mask)


def _launch(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor | None,
    dst_ids: torch.Tensor | None,
    n: int,
    block_numel: int,
    chunk: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Copy n blocks; a None id tensor means blocks 0..n-1 (the packed buffer's order)."""
    if n == 0:
        return
    chunk = chunk or CHUNK
    if chunk % TILE:
        raise ValueError(f"chunk {chunk} is not a multiple of {TILE} elements")
    ids = src_ids if src_ids is not None else dst_ids
    _copy_kernel[(n, triton.cdiv(block_numel, chunk))](
        src,
        dst,
        ids if src_ids is None else src_ids,
        ids if dst_ids is None else dst_ids,
        block_numel,
        chunk,
        SRC_IDS=src_ids is not None,
        DST_IDS=dst_ids is not None,
        TILE=TILE,
        num_warps=num_warps or NUM_WARPS,
    )


def _check(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> int:
    if not kv_cache.is_contiguous():
        raise ValueError("the KV region must be contiguous")
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got {tuple(block_ids.shape)}")
    return kv_cache[0].numel()


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    block_numel = _check(kv_cache, block_ids)
    out = kv_cache.new_empty((block_ids.shape[0], *kv_cache.shape[1:]))
    _launch(kv_cache, out, block_ids, None, block_ids.shape[0], block_numel)
    return out


def scatter_blocks(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    block_numel = _check(kv_cache, block_ids)
    if buffer.shape != (block_ids.shape[0], *kv_cache.shape[1:]) or not buffer.is_contiguous():
        raise ValueError(f"buffer {tuple(buffer.shape)} is not a contiguous [n, *block] tensor")
    _launch(buffer, kv_cache, None, block_ids, block_ids.shape[0], block_numel)


def copy_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    *,
    chunk: int | None = None,
    num_warps: int | None = None,
) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] for every i; both regions [num_blocks, ...] alike.
    `chunk` (elements per program, a multiple of TILE) and `num_warps`: tuning knobs (None: the
    defaults; see bench/transfer/block_copy.py)."""
    block_numel = _check(src, src_ids)
    if _check(dst, dst_ids) != block_numel or src.dtype != dst.dtype:
        raise ValueError("source and destination blocks differ in size or dtype")
    if src_ids.shape != dst_ids.shape:
        raise ValueError(f"{src_ids.shape[0]} source ids but {dst_ids.shape[0]} destination ids")
    _launch(src, dst, src_ids, dst_ids, src_ids.shape[0], block_numel, chunk, num_warps)
