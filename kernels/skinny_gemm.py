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

On its own the kernel streams weights about as fast as cuBLAS (bench/studies/gemm/skinny_gemm.txt:
16.7 against 16.1 us for QKV at 32 rows, 12.2 against 12.8 for the output projection). What it
adds is programmatic dependent launch (kvrail.kernels.launch), which cuBLAS's kernels do not
take part in: it waits for the previous kernel only when it starts, and lets the next one in
once its main loop is done, so the whole decode path overlaps its kernel boundaries
(bench/engine/gpu_pdl_ab.txt: batch-1 decode 226 against 213 tok/s on an H200).

`gated_linear` is the same launch for a SwiGLU MLP's fused gate/up weight: each program takes
matching rows from the gate half and the up half, and its epilogue stores silu(gate) * up, with
the roundings of the projection followed by `silu_and_mul`. That drops a kernel and its
boundary from every layer: a 32-layer chain without attention took 3.975 against 4.129 ms at
32 rows and 3.650 against 3.724 at one row (bench/studies/gemm/pdl_chain.txt).

An e4m3 weight (with its float32 scale per row) is read as stored, half the bytes of bf16. By
default (`SkinnyConfig.fp8_dot` e4m3) each program quantizes its K tile of x to e4m3 with a
scale per row, multiplies e4m3 by e4m3 on the FP8 tensor cores, and scales the tile's product
before adding it; the weight scales are applied once, in the epilogue. At 32 rows the four
Llama-3-8B projections took 85 us a layer against bf16's 124 (bench/studies/gemm/fp8_gemm.txt);
converting the weight to bf16 or fp16 in registers instead was no faster than bf16.

x may also come quantized (`QuantizedRows`: e4m3 rows and a float32 scale per row, as the FP8
RMSNorms write them). The loop is then loads and dots only, and the rows' scales are applied
with the weight's in the epilogue: a 32-layer FP8 chain without attention took 68.3 against
71.2 us a layer at one row and 87.4 against 91.7 at 32 rows, as fast as with no RMSNorm
kernels at all (bench/studies/gemm/pdl_chain.txt).

`linear` picks the configuration from `pick_config`, which tunes on the problem's shape (see
bench/studies/gemm/skinny_gemm.py for the sweep it was derived from); callers decide when to use
this kernel instead of cuBLAS (`MAX_ROWS`; `kvrail.kernels.dispatch.linear`).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvrail.kernels.launch import pdl
from kvrail.kernels.reference import FP8_WEIGHT_DTYPE, QuantizedRows

MAX_ROWS = 32  # x rows it is tuned for: at 48 and 64 cuBLAS was faster (skinny_gemm.txt)
MAX_TILES = 8192  # semaphores per device: the N tiles of the widest split weight
FP8_DOTS = ("e4m3", "float16", "x")  # SkinnyConfig.fp8_dot


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int
    fp8_dot: str = "e4m3"
    """FP8 weights only, what the tensor cores multiply: `e4m3` (x quantized to e4m3 per row
    and K tile, with a float32 scale per row and tile applied to that tile's partial product),
    `float16` (the weight converted to it, and x, saturating at float16's largest finite
    value) or `x` (the weight converted to x's dtype)."""


@triton.jit
def _skinny_gemm_kernel(
    x,
    x_scales,
    w,
    w_scale,
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
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    FP8_W: tl.constexpr,
    FP8_DOT: tl.constexpr,
    X_FP8: tl.constexpr,
    SPLITS: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    # N is y's width; with GATED the weight has 2N rows (gate, then up) and y = silu(gate) * up
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
    u_ptrs = w + (rn + N)[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]  # GATED: up
    x_ptrs = x + rm[:, None] * stride_xm + (k_lo + rk)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        if EVEN:
            wt = tl.load(w_ptrs)
            xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            if GATED:
                ut = tl.load(u_ptrs)
        else:
            k_mask = (k_lo + k0 + rk) < K
            wt = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if GATED:
                ut = tl.load(u_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if X_FP8:  # x came as e4m3 rows: its scales are applied once, in the epilogue
            acc = tl.dot(wt, tl.trans(xt), acc)
            if GATED:
                acc_u = tl.dot(ut, tl.trans(xt), acc_u)
        elif FP8_W and FP8_DOT == "e4m3":
            # this K tile of x in e4m3 over a scale per row: the tensor cores read the weight
            # as stored, and each tile's product is scaled before it is summed
            xf = xt.to(tl.float32)
            tile_scale = tl.maximum(tl.max(tl.abs(xf), 1) / 448.0, 1e-12)
            xq = (xf / tile_scale[:, None]).to(tl.float8e4nv)
            acc += tl.dot(wt, tl.trans(xq)) * tile_scale[None, :]
            if GATED:
                acc_u += tl.dot(ut, tl.trans(xq)) * tile_scale[None, :]
        else:
            if FP8_W:  # e4m3 weights converted in registers (exact: e4m3 fits either type)
                if FP8_DOT == "float16":
                    xt = xt.to(tl.float32)
                    xt = tl.where(xt > 65504.0, 65504.0, tl.where(xt < -65504.0, -65504.0, xt))
                    xt = xt.to(tl.float16)
                wt = wt.to(xt.dtype)
                if GATED:
                    ut = ut.to(xt.dtype)
            acc = tl.dot(wt, tl.trans(xt), acc, input_precision=PRECISION)
            if GATED:
                acc_u = tl.dot(ut, tl.trans(xt), acc_u, input_precision=PRECISION)
        if GATED:
            u_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if PDL:  # let the next kernel in for the epilogue, not earlier (pdl_chain.txt)
        gdc_launch_dependents()
    out_mask = n_mask[:, None] & m_mask[None, :]
    y_ptrs = y + rm[None, :] * stride_ym + rn[:, None]
    if SPLITS == 1:
        _store_tile(
            acc, acc_u, x_scales, w_scale, bias, y_ptrs, rm, rn, m_mask, n_mask, out_mask, N,
            HAS_BIAS, GATED, FP8_W, X_FP8,
        )  # fmt: skip
    else:
        # partials [SPLITS, 1 or 2 (gate, up), M, N]
        offs = rm[None, :] * N + rn[:, None]
        planes = 2 if GATED else 1
        tl.store(partials + (split * planes) * M * N + offs, acc, mask=out_mask)
        if GATED:
            tl.store(partials + (split * planes + 1) * M * N + offs, acc_u, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the count goes up
        arrived = tl.atomic_add(semaphores + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            total_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for j in range(SPLITS):
                total += tl.load(
                    partials + (j * planes) * M * N + offs,
                    mask=out_mask,
                    other=0.0,
                    cache_modifier=".cg",
                )
                if GATED:
                    total_u += tl.load(
                        partials + (j * planes + 1) * M * N + offs,
                        mask=out_mask,
                        other=0.0,
                        cache_modifier=".cg",
                    )
            _store_tile(
                total, total_u, x_scales, w_scale, bias, y_ptrs, rm, rn, m_mask, n_mask, out_mask,
                N, HAS_BIAS, GATED, FP8_W, X_FP8,
            )  # fmt: skip
            tl.store(semaphores + pid_n, 0)


@triton.jit
def _store_tile(
    acc,
    acc_u,
    x_scales,
    w_scale,
    bias,
    y_ptrs,
    rm,
    rn,
    m_mask,
    n_mask,
    out_mask,
    N,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    FP8_W: tl.constexpr,
    X_FP8: tl.constexpr,
):
    """Scale by the weight rows' scales (FP8_W) and x's rows' scales (X_FP8), add the bias,
    round once to y's dtype; when GATED, round gate and up to it as the unfused projection
    would, then apply SiLU * up exactly as `silu_and_mul` does."""
    dtype = y_ptrs.dtype.element_ty
    if FP8_W:
        acc *= tl.load(w_scale + rn, mask=n_mask, other=0.0)[:, None]
        if GATED:
            acc_u *= tl.load(w_scale + N + rn, mask=n_mask, other=0.0)[:, None]
    if X_FP8:
        xs = tl.load(x_scales + rm, mask=m_mask, other=0.0)[None, :]
        acc *= xs
        if GATED:
            acc_u *= xs
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if GATED:
        if HAS_BIAS:
            acc_u += tl.load(bias + N + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        out = act.to(tl.float32) * acc_u.to(dtype).to(tl.float32)
        tl.store(y_ptrs, out.to(dtype), mask=out_mask)
    else:
        tl.store(y_ptrs, acc.to(dtype), mask=out_mask)


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


def pick_config(rows: int, n: int, k: int, weight_bytes: int = 2) -> SkinnyConfig:
    """The launch configuration for an [rows, k] x [n, k]^T product (rows <= MAX_ROWS): wide
    tiles for wide weights, then K split in halves until there are about 1.5 programs per SM of
    an H200 (192), each split still at least 4 tiles of K. This reproduces the fastest
    configuration of the sweep in bench/studies/gemm/skinny_gemm.txt for each Llama-3-8B projection
    at 32 rows (QKV 64 x 2 splits, output 32 x 2, gate/up 128 x 1, down 64 x 4).

    A one-byte (FP8) weight multiplied in e4m3 takes 128-row tiles and splits K down to 4 tiles
    of 128 per split: at 32 rows this is the sweep's fastest for the output projection (8
    splits), gate/up (1) and down (8), and for QKV 4 splits of 128 rows against the sweep's 64
    rows x 4 (bench/studies/gemm/fp8_gemm.txt)."""
    if weight_bytes == 1:
        block_n, block_k, min_split_tiles = 128, 128, 4
    else:
        block_k, min_split_tiles = 128, 8
        block_n = 128 if n >= 16384 else 64 if (n >= 6144 or k >= 8192) else 32
    tiles = triton.cdiv(n, block_n)
    splits = 1
    while (
        tiles * splits < 192
        and k % (splits * 2 * block_k) == 0
        and k >= splits * 2 * min_split_tiles * block_k
    ):
        splits *= 2
    if weight_bytes == 1:
        return SkinnyConfig(block_n, block_k, splits, num_warps=4, num_stages=4)
    stages = 3 if splits > 1 and block_n > 32 else 4
    return SkinnyConfig(block_n, block_k, splits, num_warps=4, num_stages=stages)


def linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T + bias[N] -> [M, N] in x's dtype; M at most `MAX_ROWS`. An
    e4m3 weight comes with its float32 `weight_scale` [N] (one per row), and the product is
    (x @ weight.T) * weight_scale + bias with x multiplied as `config.fp8_dot` says (by default
    quantized to e4m3 per row and K tile). x may come quantized (`QuantizedRows`, an e4m3 weight
    only): its e4m3 rows are multiplied as they are, and its scales applied with the weight's."""
    return _launch(x, weight, bias, config, weight_scale, gated=False)


def gated_linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU's first half in one launch: with weight [2I, K] (gate rows, then up rows) and
    g, u = (x @ weight.T + bias).chunk(2, -1), returns silu(g) * u [M, I], bit for bit what
    `linear` followed by the `silu_and_mul` kernel gives. `config` is the one `linear` would
    use for the whole weight (each program takes half its tile from each half); an e4m3
    weight's `weight_scale` [2I] as in `linear`."""
    if weight.dim() != 2 or weight.shape[0] % 2:
        raise ValueError(f"weight {tuple(weight.shape)} is not [2 * intermediate, K]")
    return _launch(x, weight, bias, config, weight_scale, gated=True)


def _launch(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig | None,
    weight_scale: torch.Tensor | None,
    gated: bool,
) -> torch.Tensor:
    fp8 = weight.dtype == FP8_WEIGHT_DTYPE
    x_scale = None
    out_dtype = x.dtype
    if isinstance(x, QuantizedRows):
        if not fp8:
            raise ValueError(f"quantized rows are for an e4m3 weight, not {weight.dtype}")
        x, x_scale, out_dtype = x
        if x_scale.shape != (x.shape[0],) or x_scale.dtype != torch.float32:
            raise ValueError(f"x's scales {tuple(x_scale.shape)} are not float32 [{x.shape[0]}]")
        x_scale = x_scale.contiguous()  # a static scale may come expanded over the rows
    if config is not None and config.fp8_dot not in FP8_DOTS:
        raise ValueError(f"fp8_dot {config.fp8_dot!r} is not one of {', '.join(FP8_DOTS)}")
    if fp8 != (weight_scale is not None):
        raise ValueError("an e4m3 weight, and only one, comes with its weight_scale")
    if weight_scale is not None and (
        weight_scale.shape != (weight.shape[0],) or weight_scale.dtype != torch.float32
    ):
        raise ValueError(
            f"weight_scale {tuple(weight_scale.shape)} is not float32 [{weight.shape[0]}]"
        )
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not chain")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{x.shape[0]} rows; the skinny kernel takes at most {MAX_ROWS}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight must have a unit innermost stride")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(-1) != 1):
        raise ValueError(f"bias {tuple(bias.shape)} does not match weight {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or pick_config(m, weight.shape[0], k, weight.element_size())
    block_n = cfg.block_n // 2 if gated else cfg.block_n
    if block_n < 16:
        raise ValueError(f"block_n {cfg.block_n} is too narrow (tiles of 16 rows at the least)")
    tiles = triton.cdiv(n, block_n)
    if tiles > MAX_TILES:
        raise ValueError(f"{n} output columns need {tiles} tiles; at most {MAX_TILES}")
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.splits), cfg.block_k) * cfg.block_k
    even = n % block_n == 0 and k % (cfg.splits * cfg.block_k) == 0
    splits = triton.cdiv(k, k_per_split)  # a short K can need fewer splits than asked
    planes = 2 if gated else 1
    partials = torch.empty(
        (splits, planes, m, n) if splits > 1 else (1,), dtype=torch.float32, device=x.device
    )
    semaphores = allocate_semaphores(x.device) if splits > 1 else partials
    on = pdl(x.device)
    _skinny_gemm_kernel[(tiles, splits)](
        x,
        x if x_scale is None else x_scale,
        weight,
        weight if weight_scale is None else weight_scale,
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
        HAS_BIAS=bias is not None,
        GATED=gated,
        FP8_W=fp8,
        FP8_DOT=cfg.fp8_dot,
        X_FP8=x_scale is not None,
        SPLITS=splits,
        EVEN=even,
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=cfg.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=on,
        launch_pdl=on,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y
