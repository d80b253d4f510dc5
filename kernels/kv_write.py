"""Triton kernel: write each token's K and V into its slot of the paged caches.

Same contract as `kvrail.kernels.reference.write_kv`: key/value [T, Hkv, D], caches
[num_blocks, block_size, Hkv, D] with any strides (innermost stride 1), slot_mapping [T] (negative
slots are skipped). One program per token. Into an FP8 cache the values saturate at the
format's largest finite value (`to_cache`), as the reference rounds them.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrail.kernels.reference import FP8_DTYPES


def fp8_limit(cache: torch.Tensor) -> float:
    """The saturation bound `to_cache` takes for a cache: its largest finite value when FP8,
    else 0 (no clamp)."""
    return float(torch.finfo(cache.dtype).max) if cache.dtype in FP8_DTYPES else 0.0


@triton.jit
def to_cache(x, cache, LIMIT: tl.constexpr):
    """x rounded to `cache`'s element type; with LIMIT (an FP8 cache's largest finite value,
    `fp8_limit`) clamped to +-LIMIT first in float32, so that large values saturate and NaN
    stays NaN (comparisons with NaN are false)."""
    if LIMIT > 0:
        x = x.to(tl.float32)
        x = tl.where(x > LIMIT, LIMIT, tl.where(x < -LIMIT, -LIMIT, x))
    return x.to(cache.dtype.element_ty)


@triton.jit
def _write_kv_kernel(
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    block_size,
    num_heads,
    head_dim,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    LIMIT: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    k = tl.load(key + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value + t * stride_vt + h * stride_vh + d, mask=mask)
    kc = k_cache + blk * stride_cb + off * stride_cs + h * stride_ch + d
    vc = v_cache + blk * stride_vcb + off * stride_vcs + h * stride_vch + d
    tl.store(kc, to_cache(k, k_cache, LIMIT), mask=mask)
    tl.store(vc, to_cache(v, v_cache, LIMIT), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (num_heads, head_dim):
        raise ValueError(
            f"caches {tuple(k_cache.shape)} do not hold [*, *, {num_heads}, {head_dim}]"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} is not [{num_tokens}]")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache {v_cache.dtype}")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit innermost stride")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_cache.shape[1],
        num_heads,
        head_dim,
        H_PAD=triton.next_power_of_2(num_heads),
        D_PAD=triton.next_power_of_2(head_dim),
        LIMIT=fp8_limit(k_cache),
    )
