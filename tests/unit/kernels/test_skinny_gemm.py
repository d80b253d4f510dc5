"""The skinny split-K GEMM against torch: interpreted on CPU with small irregular shapes (every
split count, with and without bias, uneven K and N), and under the `gpu` marker on CUDA with the
Llama-3-8B projections in bf16, inside and outside a CUDA graph. The gated variant (SiLU * up in
the epilogue) against the projection followed by `silu_and_mul`. Inputs are seeded."""

from __future__ import annotations

import pytest
import torch

from kvrail.kernels import reference
from kvrail.kernels.testing import load_kernels

HAS_CUDA = torch.cuda.is_available()
_MODULES = load_kernels()
SKINNY, SILU = _MODULES["skinny_gemm"], _MODULES["silu_and_mul"]
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _operands(
    m: int, n: int, k: int, dtype: torch.dtype, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


def _expected(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    if b is not None:
        out += b.double()
    return out.to(x.dtype)


@pytest.mark.parametrize(
    ("m", "n", "k", "splits", "bias"),
    [
        (1, 64, 256, 1, False),
        (5, 96, 256, 2, True),  # two N tiles of 32, rows padded to 16
        (32, 64, 512, 4, False),
        (3, 70, 300, 2, True),  # N and K not tile multiples: masked loads
        (17, 40, 200, 4, False),  # more splits asked than K has tiles for: fewer are launched
    ],
)
def test_matches_torch_for_every_split_count(
    m: int, n: int, k: int, splits: int, bias: bool
) -> None:
    x, w, b = _operands(m, n, k, torch.float32, bias)
    config = SKINNY.SkinnyConfig(block_n=32, block_k=32, splits=splits, num_warps=4, num_stages=2)
    out = SKINNY.linear(x, w, b, config)
    torch.testing.assert_close(out, _expected(x, w, b), atol=1e-4, rtol=1e-4)
    again = SKINNY.linear(x, w, b, config)
    assert torch.equal(out, again)  # the last program sums splits in a fixed order
    assert int(SKINNY.allocate_semaphores(x.device).abs().sum()) == 0  # all reset for the next


def test_the_default_config_splits_a_long_k_and_keeps_tiles_whole() -> None:
    cfg = SKINNY.pick_config(32, 6144, 4096)
    assert cfg.splits > 1
    assert 4096 % (cfg.splits * cfg.block_k) == 0
    assert SKINNY.pick_config(32, 64, 128).splits == 1  # nothing to split


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "bias_shape"),
    [
        ((4, 64), (32, 65), None),  # K differs
        ((SKINNY.MAX_ROWS + 1, 64), (32, 64), None),  # too many rows for this kernel
        ((4, 64), (32, 64), (31,)),  # bias of the wrong length
        ((4, 64, 1), (32, 64), None),  # not a matrix
    ],
)
def test_rejects_operands_that_do_not_chain(
    x_shape: tuple[int, ...], w_shape: tuple[int, ...], bias_shape: tuple[int, ...] | None
) -> None:
    x, w = torch.zeros(x_shape, device=DEVICE), torch.zeros(w_shape, device=DEVICE)
    bias = None if bias_shape is None else torch.zeros(bias_shape, device=DEVICE)
    with pytest.raises(ValueError):  # noqa: PT011 - the messages differ per check
        SKINNY.linear(x, w, bias)


@pytest.mark.parametrize(
    ("m", "inter", "k", "splits", "bias"),
    [
        (1, 64, 256, 1, False),
        (5, 48, 256, 2, True),  # three tiles of 16 per half; the up bias is the second half
        (17, 40, 200, 4, False),  # uneven: masked loads, fewer splits than asked
    ],
)
def test_gated_equals_the_projection_then_silu_and_mul(
    m: int, inter: int, k: int, splits: int, bias: bool
) -> None:
    x, w, b = _operands(m, 2 * inter, k, torch.float32, bias)
    config = SKINNY.SkinnyConfig(block_n=32, block_k=32, splits=splits, num_warps=4, num_stages=2)
    out = SKINNY.gated_linear(x, w, b, config)
    torch.testing.assert_close(
        out, reference.silu_and_mul(_expected(x, w, b)), atol=1e-4, rtol=1e-4
    )
    # the same tiles per half as an ungated launch of half the width: the same sums, one rounding
    half = SKINNY.SkinnyConfig(block_n=16, block_k=32, splits=splits, num_warps=4, num_stages=2)
    if inter % 16 == 0:
        assert torch.equal(out, SILU.silu_and_mul(SKINNY.linear(x, w, b, half)))
    assert int(SKINNY.allocate_semaphores(x.device).abs().sum()) == 0


def test_gated_rejects_an_odd_weight_and_too_narrow_a_tile() -> None:
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="intermediate"):
        SKINNY.gated_linear(x, torch.zeros(33, 64, device=DEVICE))
    narrow = SKINNY.SkinnyConfig(block_n=16, block_k=32, splits=1, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="too narrow"):
        SKINNY.gated_linear(x, torch.zeros(32, 64, device=DEVICE), None, narrow)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 7, 32])
@pytest.mark.parametrize("splits", [None, 4])
def test_gated_llama_gate_up_equals_the_unfused_kernels_in_bf16(m: int, splits: int | None) -> None:
    x, w, _ = _operands(m, 2 * 14336, 4096, torch.bfloat16, bias=False)
    full = SKINNY.pick_config(m, 2 * 14336, 4096)
    if splits is not None:
        full = SKINNY.SkinnyConfig(full.block_n, full.block_k, splits, 4, 3)
    half = SKINNY.SkinnyConfig(full.block_n // 2, full.block_k, full.splits, 4, full.num_stages)
    out = SKINNY.gated_linear(x, w, None, full)
    assert torch.equal(out, SILU.silu_and_mul(SKINNY.linear(x, w, None, half)))
    cublas = reference.silu_and_mul(torch.nn.functional.linear(x, w))
    torch.testing.assert_close(out, cublas, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 7, 32])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_llama_projections_match_cublas_in_bf16(m: int, n: int, k: int) -> None:
    x, w, b = _operands(m, n, k, torch.bfloat16, bias=n == 6144)
    out = SKINNY.linear(x, w, b)
    expected = _expected(x, w, b)
    # one rounding of a float32 sum either way; the orders differ
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    cublas = torch.nn.functional.linear(x, w, b)
    assert (out.float() - expected.float()).abs().mean() <= 1.5 * (
        (cublas.float() - expected.float()).abs().mean() + 1e-6
    )


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_cuda_graph_replays_the_split_k_reduction() -> None:
    x, w, _ = _operands(32, 6144, 4096, torch.bfloat16, bias=False)
    eager = SKINNY.linear(x, w)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        SKINNY.linear(x, w)  # warm-up (the eager call above already allocated the semaphores)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = SKINNY.linear(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, SKINNY.linear(x, w))
