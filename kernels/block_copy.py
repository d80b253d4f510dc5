"""Triton kernels: pack blocks of the KV region into a contiguous buffer and unpack them back,
and copy blocks between two regions (`copy_blocks`: one launch for any number of scattered
blocks, the same-node transfer path).

Same contract as `kvrail.kernels.reference.gather_blocks` / `scatter_blocks` / `copy_blocks`.
The cache must be contiguous ([num_blocks, ...], one block = one contiguous range); the buffer is
[n, ...].
Grid: (blocks, chunks of one block).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 1024
# copy_blocks: 4,096 words a program. 512 scattered blocks on an H200 (the handoff of an 8k
# prompt) took 297 us of 1 MiB and 571 us of 2 MiB against 306 and 599 at 1,024 words; a
# contiguous copy of the same bytes took 266 and 523 (bench/studies/handoff/ipc_phases.txt).
_COPY_CHUNK = 4096


@triton.jit
def _copy_blocks_kernel(
    src, dst, block_ids, block_numel, GATHER: tl.constexpr, CHUNK: tl.constexpr
):
    i = tl.program_id(0)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    bid = tl.load(block_ids + i).to(tl.int64)
    if GATHER:
        src_base = bid * block_numel
        dst_base = i.to(tl.int64) * block_numel
    else:
        src_base = i.to(tl.int64) * block_numel
        dst_base = bid * block_numel
    values = tl.load(src + src_base + offs, mask=mask)
    tl.store(dst + dst_base + offs, values.to(dst.dtype.element_ty), mask=mask)


def _check(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> int:
    if not kv_cache.is_contiguous():
        raise ValueError("the KV region must be contiguous")
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got {tuple(block_ids.shape)}")
    return kv_cache[0].numel()


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    block_numel = _check(kv_cache, block_ids)
    out = kv_cache.new_empty((block_ids.shape[0], *kv_cache.shape[1:]))
    if block_ids.numel():
        grid = (block_ids.shape[0], triton.cdiv(block_numel, _CHUNK))
        _copy_blocks_kernel[grid](kv_cache, out, block_ids, block_numel, GATHER=True, CHUNK=_CHUNK)
    return out


def scatter_blocks(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    block_numel = _check(kv_cache, block_ids)
    if buffer.shape != (block_ids.shape[0], *kv_cache.shape[1:]) or not buffer.is_contiguous():
        raise ValueError(f"buffer {tuple(buffer.shape)} is not a contiguous [n, *block] tensor")
    if block_ids.numel():
        grid = (block_ids.shape[0], triton.cdiv(block_numel, _CHUNK))
        _copy_blocks_kernel[grid](
            buffer, kv_cache, block_ids, block_numel, GATHER=False, CHUNK=_CHUNK
        )


@triton.jit
def _copy_between_kernel(src, dst, src_ids, dst_ids, block_numel, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    s_id = tl.load(src_ids + i).to(tl.int64)
    d_id = tl.load(dst_ids + i).to(tl.int64)
    mask = offs < tl.where(tl.minimum(s_id, d_id) < 0, 0, block_numel)  # negative: padding
    s = s_id * block_numel
    d = d_id * block_numel
    tl.store(dst + d + offs, tl.load(src + s + offs, mask=mask), mask=mask)


def copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] for every i where neither id is negative (padding, so
    a captured launch can serve fewer blocks than it was captured for); both regions
    [num_blocks, ...] alike."""
    block_numel = _check(src, src_ids)
    if _check(dst, dst_ids) != block_numel or src.dtype != dst.dtype:
        raise ValueError("source and destination blocks differ in size or dtype")
    if src_ids.shape != dst_ids.shape:
        raise ValueError(f"{src_ids.shape[0]} source ids but {dst_ids.shape[0]} destination ids")
    if src_ids.numel():
        grid = (src_ids.shape[0], triton.cdiv(block_numel, _COPY_CHUNK))
        _copy_between_kernel[grid](src, dst, src_ids, dst_ids, block_numel, CHUNK=_COPY_CHUNK)
