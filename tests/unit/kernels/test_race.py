"""The race-scores kernel against the reference (`kernels/reference.py`): interpreted on CPU
with keys whose halves use all 32 bits and rows that span several blocks, and under the `gpu`
marker on CUDA at the Llama-3 vocabulary; the drawn token (the argmax) is the same. Inputs are
seeded."""

from __future__ import annotations

import pytest
import torch

from kvrail.kernels import reference
from kvrail.kernels.testing import load_kernels

HAS_CUDA = torch.cuda.is_available()
RACE = load_kernels()["race"]
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _inputs(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, cols, generator=g).softmax(dim=-1)
    low = torch.randint(0, 2**32, (rows,), generator=g, dtype=torch.int64)
    high = torch.randint(0, 2**32, (rows,), generator=g, dtype=torch.int64)
    high[0], low[0] = 2**32 - 1, 2**32 - 1  # every bit of both halves set
    return probs.to(DEVICE), low.to(DEVICE), high.to(DEVICE)


@pytest.mark.parametrize("cols", [1, 5, RACE.BLOCK + 3, 3 * RACE.BLOCK])
def test_scores_and_draws_equal_the_reference(cols: int) -> None:
    probs, low, high = _inputs(4, cols, cols)
    got = RACE.race_scores(probs, low, high)
    want = reference.race_scores(probs, low, high)
    assert torch.allclose(got, want, rtol=1e-5, atol=0)
    assert torch.equal(got.argmax(dim=-1), want.argmax(dim=-1))


def test_a_zero_probability_never_wins_and_a_bad_shape_is_refused() -> None:
    probs, low, high = _inputs(3, 40, 7)
    probs[:, :39] = 0.0
    probs[:, 39] = 1.0
    assert RACE.race_scores(probs, low, high).argmax(dim=-1).tolist() == [39, 39, 39]
    with pytest.raises(ValueError, match="one key"):
        RACE.race_scores(probs, low[:2], high)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_on_a_gpu_at_the_llama3_vocabulary() -> None:
    probs, low, high = _inputs(256, 128_256, 3)
    got = RACE.race_scores(probs, low, high)
    want = reference.race_scores(probs, low, high)
    assert torch.allclose(got, want, rtol=1e-5, atol=0)
    assert torch.equal(got.argmax(dim=-1), want.argmax(dim=-1))


def test_the_largest_and_smallest_hashes_make_uniforms_strictly_inside_0_1() -> None:
    """-log of a uniform of 1 is 0, and p / 0 would win (or lose) every race: the largest hash
    must map below 1, the smallest above 0."""
    uniform = reference.race_uniform(torch.tensor([2**32 - 1, 0], dtype=torch.int64))
    assert 0.0 < float(uniform[1]) < float(uniform[0]) < 1.0
    probs, low, high = _inputs(8, RACE.BLOCK, 5)
    assert torch.isfinite(RACE.race_scores(probs, low, high)).all()
