"""Triton kernel: y = x @ w.T (+ bias) for a few rows of x (decode batches), split over K and
reduced inside the same launch.

At decode batch sizes a linear layer reads its weight once and does little arithmetic per byte,
so its time is the weight's size over the memory bandwidth. cuBLAS cuts the small projections of
a Llama-8B layer (QKV: 6,144 x 4,096, output: 4,096 x 4,096) into fewer output tiles than the
H200 has SMs, and when it splits K it runs a second kernel to add the splits.

Here the grid is (N tile, K split). Each program multiplies its [BLOCK_N, K / SPLITS] slice of
the weight by the matching slice of every row of x on the tensor cores into a float32
accumulator, writes that partial sum to a float32 workspace and counts itself in at its N tile's
semaphore. The program that arrives last adds the tile's partials in split order (so the result
does not depend on which program finished last), adds the bias, rounds once to y's dtype, and
sets the semaphore back to zero for the next launch. One launch, deterministic, CUDA-graph
capturable: the workspace is allocated per call (graph capture gives it graph-pool memory) and
the semaphores are allocated once per device (`allocate_semaphores`), never inside a capture.
Two launches must not run at the same time on one device (a worker runs its model on one stream),
or their semaphores would mix.

On its own the kernel streams weights about as fast as cuBLAS (bench/engine/skinny_gemm.txt:
16.7 against 16.1 us for QKV at 32 rows, 12.2 against 12.8 for the output projection). What it
adds is programmatic dependent launch (kvrail.kernels.launch), which cuBLAS's kernels do not
take part in: it waits for the previous kernel only when it starts, and lets the next one in
once its main loop is done, so the whole decode path overlaps its kernel boundaries
(bench/engine/gpu_pdl_ab.txt: batch-1 decode 226 against 213 tok/s on an H200).

`linear` picks the configuration from `pick_config`, which tunes on the problem's shape (see
bench/engine/skinny_gemm.py for the sweep it was derived from); callers decide when to use this
kernel instead of cuBLAS (`MAX_ROWS`; `kvrail.kernels.dispatch.linear`).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvrail.kernels.launch import pdl

MAX_ROWS = 32  # x rows it is tuned for: at 48 and 64 cuBLAS was faster (skinny_gemm.txt)
MAX_TILES = 8192  # semaphores per device: the N tiles of the widest split weight


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int


@triton.jit
def _rotary_epilogue(
    y_bf,
    partner_bf,
    cols,
    rm,
    m_mask,
    mask,
    positions,
    cos,
    sin,
    stride_cos,
    q_out,
    k_out,
    k_cache,
    v_cache,
    slot_mapping,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    block_size,
    q_size,
    kv_size,
    HEAD_DIM: tl.constexpr,
):
    """What `kvrail.kernels.rotary_kv` does, on a [columns, rows] tile of the QKV output that
    holds whole heads: rotate q and k columns (with the same roundings), store q and k, and
    write k and v into the rows' cache slots."""
    dtype = y_bf.dtype
    d = cols % HEAD_DIM
    half = HEAD_DIM // 2
    pos = tl.load(positions + rm, mask=m_mask, other=0).to(tl.int64)
    trig = pos[None, :] * stride_cos + d[:, None]
    c = tl.load(cos + trig, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin + trig, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)
    a = (y_bf.to(tl.float32) * c).to(dtype).to(tl.float32)
    b = ((sign[:, None] * partner_bf.to(tl.float32)) * s).to(dtype).to(tl.float32)
    rotated = (a + b).to(dtype)
    is_q = cols < q_size
    tl.store(q_out + rm[None, :] * q_size + cols[:, None], rotated, mask=mask & is_q[:, None])
    kv_col = tl.where(is_q, 0, cols - q_size)
    is_k = (~is_q) & (kv_col < kv_size)
    tl.store(k_out + rm[None, :] * kv_size + kv_col[:, None], rotated, mask=mask & is_k[:, None])
    slot = tl.load(slot_mapping + rm, mask=m_mask, other=-1).to(tl.int64)
    write = mask & (slot[None, :] >= 0)
    slot = tl.maximum(slot, 0)
    blk = (slot // block_size)[None, :]
    off = (slot % block_size)[None, :]
    k_head = (kv_col // HEAD_DIM)[:, None]
    kc = k_cache + blk * stride_cb + off * stride_cs + k_head * stride_ch + d[:, None]
    tl.store(kc, rotated.to(k_cache.dtype.element_ty), mask=write & is_k[:, None])
    v_col = tl.where(is_q | is_k, 0, kv_col - kv_size)
    v_head = (v_col // HEAD_DIM)[:, None]
    vc = v_cache + blk * stride_vcb + off * stride_vcs + v_head * stride_vch + d[:, None]
    is_v = ~(is_q | is_k)
    tl.store(vc, y_bf.to(v_cache.dtype.element_ty), mask=write & is_v[:, None])


@triton.jit
def _skinny_gemm_kernel(
    x,
    w,
    bias,
    y,
    partials,
    semaphores,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    k_per_split,
    positions,
    cos,
    sin,
    stride_cos,
    q_out,
    k_out,
    k_cache,
    v_cache,
    slot_mapping,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    block_size,
    q_size,
    kv_size,
    HAS_BIAS: tl.constexpr,
    SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    ROTARY: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    m_mask = rm < M
    k_lo = split * k_per_split
    if PDL:  # see kvrail.kernels.launch
        gdc_wait()
    w_ptrs = w + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
    x_ptrs = x + rm[:, None] * stride_xm + (k_lo + rk)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        if EVEN:
            wt = tl.load(w_ptrs)
            xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            k_mask = (k_lo + k0 + rk) < K
            wt = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(wt, tl.trans(xt), acc, input_precision=PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if PDL:  # let the next kernel in for the epilogue, not earlier (pdl_chain.txt)
        gdc_launch_dependents()
    if SPLITS * GROUP == 1 and not ROTARY:
        out_mask = n_mask[:, None] & m_mask[None, :]
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(
            y + rm[None, :] * stride_ym + rn[:, None], acc.to(y.dtype.element_ty), mask=out_mask
        )
    else:
        # Every program writes its partial sum; the last of the GROUP tiles x SPLITS programs
        # that share a semaphore adds them up for all GROUP tiles (whole heads, for ROTARY).
        out_mask = n_mask[:, None] & m_mask[None, :]
        tl.store(partials + split * M * N + rm[None, :] * N + rn[:, None], acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the count goes up
        group = pid_n // GROUP
        arrived = tl.atomic_add(semaphores + group, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS * GROUP - 1:
            cols = group * (GROUP * BLOCK_N) + tl.arange(0, GROUP * BLOCK_N)
            mask = (cols < N)[:, None] & m_mask[None, :]
            offs = rm[None, :] * N + cols[:, None]
            total = tl.zeros([GROUP * BLOCK_N, BLOCK_M], dtype=tl.float32)
            for j in range(SPLITS):
                total += tl.load(
                    partials + j * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg"
                )
            if HAS_BIAS:
                total += tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
            y_bf = total.to(y.dtype.element_ty)
            tl.store(y + rm[None, :] * stride_ym + cols[:, None], y_bf, mask=mask)
            if ROTARY:
                half = HEAD_DIM // 2
                partner = tl.where(cols % HEAD_DIM < half, cols + half, cols - half)
                poffs = rm[None, :] * N + partner[:, None]
                other = tl.zeros([GROUP * BLOCK_N, BLOCK_M], dtype=tl.float32)
                for j in range(SPLITS):
                    other += tl.load(
                        partials + j * M * N + poffs, mask=mask, other=0.0, cache_modifier=".cg"
                    )
                if HAS_BIAS:
                    other += tl.load(bias + partner, mask=cols < N, other=0.0).to(tl.float32)[
                        :, None
                    ]
                _rotary_epilogue(
                    y_bf,
                    other.to(y.dtype.element_ty),
                    cols,
                    rm,
                    m_mask,
                    mask,
                    positions,
                    cos,
                    sin,
                    stride_cos,
                    q_out,
                    k_out,
                    k_cache,
                    v_cache,
                    slot_mapping,
                    stride_cb,
                    stride_cs,
                    stride_ch,
                    stride_vcb,
                    stride_vcs,
                    stride_vch,
                    block_size,
                    q_size,
                    kv_size,
                    HEAD_DIM,
                )
            tl.store(semaphores + group, 0)


_SEMAPHORES: dict[torch.device, torch.Tensor] = {}


def allocate_semaphores(device: torch.device | str) -> torch.Tensor:
    """The zeroed semaphores for launches on `device`, allocated on first use. Call it once
    outside CUDA-graph capture (the model's warm-up step does) before capturing."""
    device = torch.device(device)
    found = _SEMAPHORES.get(device)
    if found is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "skinny_gemm: semaphores are allocated outside CUDA-graph capture; run one "
                "eager step on this device before capturing"
            )
        found = _SEMAPHORES[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return found


def pick_config(rows: int, n: int, k: int) -> SkinnyConfig:
    """The launch configuration for an [rows, k] x [n, k]^T product (rows <= MAX_ROWS): wide
    tiles for wide weights, then K split in halves until there are about 1.5 programs per SM of
    an H200 (192), each split still at least 4 tiles of K. This reproduces the fastest
    configuration of the sweep in bench/engine/skinny_gemm.txt for each Llama-3-8B projection at
    32 rows (QKV 64 x 2 splits, output 32 x 2, gate/up 128 x 1, down 64 x 4)."""
    block_k = 128
    block_n = 128 if n >= 16384 else 64 if (n >= 6144 or k >= 8192) else 32
    tiles = triton.cdiv(n, block_n)
    splits = 1
    while tiles * splits < 192 and k % (splits * 2 * block_k) == 0 and k >= splits * 8 * block_k:
        splits *= 2
    stages = 3 if splits > 1 and block_n > 32 else 4
    return SkinnyConfig(block_n, block_k, splits, num_warps=4, num_stages=stages)


@dataclass(frozen=True, slots=True)
class _Rotary:
    """The rotary + KV-write epilogue's operands (see `qkv_rotary_write_kv`)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_out: torch.Tensor
    k_out: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    q_size: int
    kv_size: int
    head_dim: int


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not chain")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{x.shape[0]} rows; the skinny kernel takes at most {MAX_ROWS}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight must have a unit innermost stride")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(-1) != 1):
        raise ValueError(f"bias {tuple(bias.shape)} does not match weight {tuple(weight.shape)}")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T + bias[N] -> [M, N] in x's dtype; M at most `MAX_ROWS`."""
    _check(x, weight, bias)
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _launch(x, weight, bias, y, config, None)
    return y


def qkv_rotary_write_kv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused QKV projection (weight rows: q heads, then k, then v) followed by what
    `kvrail.kernels.rotary_kv.rotary_write_kv` does, in one launch: the last program of each
    group of tiles holding whole heads rotates them in its epilogue and writes the rows' k and v
    into their cache slots. Returns (q rotated [T, Hq, D], k rotated [T, Hkv, D], v [T, Hkv, D]),
    bit for bit what `linear` followed by `rotary_write_kv` returns."""
    _check(x, weight, bias)
    m = x.shape[0]
    head_dim = k_cache.shape[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if weight.shape[0] != q_size + 2 * kv_size:
        raise ValueError(f"weight {tuple(weight.shape)} is not [{q_size} + 2 * {kv_size}, K]")
    if head_dim % 2 or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim:
        raise ValueError(f"cos/sin {tuple(cos.shape)} are not [max_position, {head_dim}]")
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError("cos and sin need the same strides and a unit innermost one")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"caches {tuple(k_cache.shape)} do not hold [*, *, Hkv, {head_dim}]")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches need a unit innermost stride")
    if positions.shape != (m,) or slot_mapping.shape != (m,):
        raise ValueError(f"positions/slot_mapping are not [{m}]")
    y = torch.empty(m, weight.shape[0], dtype=x.dtype, device=x.device)
    q_out = torch.empty(m, num_heads, head_dim, dtype=x.dtype, device=x.device)
    k_out = torch.empty(m, num_kv_heads, head_dim, dtype=x.dtype, device=x.device)
    v = y[:, q_size + kv_size :].view(m, num_kv_heads, head_dim)
    if m:
        rotary = _Rotary(
            positions,
            cos,
            sin,
            q_out,
            k_out,
            k_cache,
            v_cache,
            slot_mapping,
            q_size,
            kv_size,
            head_dim,
        )
        _launch(x, weight, bias, y, config, rotary)
    return q_out, k_out, v


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    config: SkinnyConfig | None,
    rotary: _Rotary | None,
) -> None:
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or pick_config(m, n, k)
    tiles = triton.cdiv(n, cfg.block_n)
    if tiles > MAX_TILES:
        raise ValueError(f"{n} output columns need {tiles} tiles; at most {MAX_TILES}")
    group = 1
    if rotary is not None:  # the last program of a group of tiles sees whole heads
        if max(cfg.block_n, rotary.head_dim) % min(cfg.block_n, rotary.head_dim):
            raise ValueError(f"tiles of {cfg.block_n} columns do not hold whole heads")
        group = max(1, rotary.head_dim // cfg.block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.splits), cfg.block_k) * cfg.block_k
    even = n % cfg.block_n == 0 and k % (cfg.splits * cfg.block_k) == 0
    splits = triton.cdiv(k, k_per_split)  # a short K can need fewer splits than asked
    reduce = splits * group > 1 or rotary is not None
    partials = torch.empty((splits, m, n) if reduce else (1,), dtype=torch.float32, device=x.device)
    semaphores = allocate_semaphores(x.device) if reduce else partials
    r = rotary
    rotary_args = (
        (r.positions, r.cos, r.sin, r.cos.stride(0), r.q_out, r.k_out, r.k_cache, r.v_cache)
        + (r.slot_mapping, *r.k_cache.stride()[:3], *r.v_cache.stride()[:3])
        + (r.k_cache.shape[1], r.q_size, r.kv_size)
        if r is not None
        else (y, y, y, 0, y, y, y, y, y, 0, 0, 0, 0, 0, 0, 1, 0, 0)
    )
    on = pdl(x.device)
    _skinny_gemm_kernel[(tiles, splits)](
        x,
        weight,
        weight if bias is None else bias,
        y,
        partials,
        semaphores,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        k_per_split,
        *rotary_args,
        HAS_BIAS=bias is not None,
        SPLITS=splits,
        GROUP=group,
        EVEN=even,
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=on,
        ROTARY=r is not None,
        HEAD_DIM=r.head_dim if r is not None else 1,
        launch_pdl=on,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
