"""The grammar bitmask kernel against the reference (`kernels/reference.py`): interpreted on CPU
with irregular shapes (a vocabulary that is not a multiple of 32 or of the tile, a mask narrower
than the vocabulary, rows out of order, bit 31 set), and under the `gpu` marker on CUDA at the
Llama-3 vocabulary with 256 constrained rows of 300; both in every float dtype. Inputs are
seeded."""

from __future__ import annotations

import pytest
import torch

from kvrail.kernels import dispatch, reference
from kvrail.kernels.testing import load_kernels

HAS_CUDA = torch.cuda.is_available()
KERNEL = load_kernels()["token_bitmask"]
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(
    num_logit_rows: int, cols: int, rows: list[int], words: int, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_logit_rows, cols, generator=g).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31, (len(rows), words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    if len(rows) > 1:
        bitmask[1] = -1  # every token of the row allowed, bit 31 included
    return logits.to(DEVICE), bitmask.to(DEVICE), torch.tensor(rows, dtype=torch.int64).to(DEVICE)


def _allowed_by_hand(bitmask: torch.Tensor, cols: int) -> torch.Tensor:
    """The bits one by one, the slow way: [m, cols] bool."""
    out = torch.zeros(bitmask.shape[0], cols, dtype=torch.bool)
    words = bitmask.cpu().tolist()
    for i, row in enumerate(words):
        for t in range(min(cols, 32 * len(row))):
            out[i, t] = (row[t // 32] >> (t % 32)) & 1 == 1
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("cols", "words"), [(37, 2), (KERNEL.BLOCK + 45, (KERNEL.BLOCK + 45 + 31) // 32), (200, 3)]
)
def test_masked_rows_equal_the_reference_and_other_rows_are_untouched(
    dtype: torch.dtype, cols: int, words: int
) -> None:
    """(200, 3): a mask of 96 tokens over a 200-token vocabulary, the tokens past it masked."""
    logits, bitmask, rows = _inputs(6, cols, [4, 0, 2], words, cols, dtype)
    before = logits.clone()
    want = logits.clone()
    reference.apply_token_bitmask(want, bitmask, rows)
    KERNEL.apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, want)
    allowed = _allowed_by_hand(bitmask, cols).to(DEVICE)
    for i, row in enumerate(rows.tolist()):
        assert torch.equal(want[row][allowed[i]], before[row][allowed[i]])
        assert bool(torch.isneginf(want[row][~allowed[i]]).all())
    for row in (1, 3, 5):
        assert torch.equal(logits[row], before[row])


def test_no_constrained_row_changes_nothing_and_bad_shapes_are_refused() -> None:
    logits, bitmask, rows = _inputs(3, 40, [], 2, 1, torch.float32)
    before = logits.clone()
    KERNEL.apply_token_bitmask(logits, bitmask, rows)
    reference.apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, before)
    _, bitmask, rows = _inputs(3, 40, [0, 2], 2, 1, torch.float32)
    with pytest.raises(ValueError, match="row index"):
        KERNEL.apply_token_bitmask(logits, bitmask, rows[:1])
    with pytest.raises(ValueError, match="int32"):
        KERNEL.apply_token_bitmask(logits, bitmask.to(torch.int64), rows)


def test_dispatch_on_cpu_takes_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_triton(name: str) -> None:
        raise AssertionError(f"CPU dispatch reached Triton module {name}")

    monkeypatch.setattr(dispatch, "_triton", no_triton)
    logits, bitmask, rows = _inputs(4, 70, [3, 1], 3, 2, torch.float32)
    logits, bitmask, rows = logits.cpu(), bitmask.cpu(), rows.cpu()
    want = logits.clone()
    reference.apply_token_bitmask(want, bitmask, rows)
    dispatch.apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_on_a_gpu_at_the_llama3_vocabulary(dtype: torch.dtype) -> None:
    cols = 128_256
    rows = list(range(299, 43, -1))  # 256 of 300 rows, in reverse order
    logits, bitmask, index = _inputs(300, cols, rows, cols // 32, 3, dtype)
    want = logits.clone()
    reference.apply_token_bitmask(want, bitmask, index)
    dispatch.apply_token_bitmask(logits, bitmask, index)
    assert torch.equal(logits, want)
