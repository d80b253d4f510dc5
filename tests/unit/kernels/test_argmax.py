"""The two-pass argmax kernel against torch.argmax: interpreted on CPU with rows that span several
chunks (ties within and across chunks, NaN, -inf, a ragged last chunk), and under the `gpu` marker
on CUDA with the Llama-3 vocabulary in every float dtype. Inputs are seeded."""

from __future__ import annotations

import pytest
import torch

from kvrail.kernels import dispatch
from kvrail.kernels.testing import load_kernels

HAS_CUDA = torch.cuda.is_available()
ARGMAX = load_kernels()["argmax"]
DEVICE = "cuda" if HAS_CUDA else "cpu"
BLOCK = ARGMAX.BLOCK


def _rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g).to(DEVICE)


@pytest.mark.parametrize("cols", [1, 7, BLOCK, BLOCK + 1, 2 * BLOCK + 300])
def test_matches_torch_on_random_rows(cols: int) -> None:
    x = _rows(5, cols, cols)
    assert torch.equal(ARGMAX.argmax(x), x.argmax(dim=-1))


def test_ties_keep_the_first_index_within_and_across_chunks() -> None:
    x = _rows(4, 3 * BLOCK - 5, 1)
    x[0, [10, 11, 2000]] = 9.0  # within the first chunk
    x[1, [BLOCK + 3, 2 * BLOCK + 1]] = 9.0  # across chunks: the earlier chunk wins
    x[2, [3 * BLOCK - 6, BLOCK - 1]] = 9.0  # the last column and the end of chunk 0
    x[3] = float("-inf")  # every column the same: index 0
    expected = torch.tensor([10, BLOCK + 3, BLOCK - 1, 0], device=DEVICE)
    assert torch.equal(ARGMAX.argmax(x), expected)
    assert torch.equal(x.argmax(dim=-1), expected)


def test_nan_counts_as_the_maximum_as_in_torch() -> None:
    x = _rows(3, 2 * BLOCK + 9, 2)
    x[0, BLOCK + 4] = float("nan")
    x[0, 5] = float("inf")
    x[1, [2 * BLOCK + 8, 9]] = float("nan")  # the first NaN
    x[2, 0] = float("inf")
    assert torch.equal(ARGMAX.argmax(x), torch.tensor([BLOCK + 4, 9, 0], device=DEVICE))


def test_strided_rows_and_no_rows() -> None:
    wide = _rows(6, 2 * BLOCK + 100, 3)
    view = wide[::2, 50:]  # row stride larger than the row, innermost stride 1
    assert torch.equal(ARGMAX.argmax(view), view.argmax(dim=-1))
    empty = ARGMAX.argmax(torch.zeros(0, 10, device=DEVICE))
    assert empty.shape == (0,) and empty.dtype == torch.int64


@pytest.mark.parametrize(
    "x",
    [torch.zeros(4), torch.zeros(2, 0), torch.zeros(4, 3).T],
    ids=["not-a-matrix", "empty-rows", "column-major"],
)
def test_rejects_what_it_cannot_reduce(x: torch.Tensor) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the messages differ per check
        ARGMAX.argmax(x.to(DEVICE))


def test_rejects_a_tile_that_is_not_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        ARGMAX.argmax(torch.zeros(2, 10, device=DEVICE), block=3000)


def test_dispatch_keeps_torch_for_cpu_and_float64() -> None:
    x = torch.randn(3, 50, dtype=torch.float64)
    assert torch.equal(dispatch.argmax(x), x.argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 32, 256])
def test_llama3_vocabulary_on_the_gpu(rows: int, dtype: torch.dtype) -> None:
    x = _rows(rows, 128256, rows).to(dtype)
    x[0, [77, 128255]] = x.max() + 1  # a tie far apart (bf16 rounds many values equal anyway)
    assert torch.equal(dispatch.argmax(x), x.argmax(dim=-1))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = ARGMAX.argmax(x)
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(_rows(rows, 128256, rows + 1).to(dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, x.argmax(dim=-1))
