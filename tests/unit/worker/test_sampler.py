"""Sampler: greedy, top-k/top-p masks, seeded reproducibility, no mutation of inputs."""

from __future__ import annotations

import torch

from kvrail.worker.engine.request import Request
from kvrail.worker.engine.sampler import Sampler, apply_top_k_top_p
from kvrail.worker.testing import make_request


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """One token per row, on the host."""
    token_ids: list[int] = Sampler().sample(logits, requests).tolist()
    return token_ids


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 4.9]])
    assert sample(logits, [make_request(2), make_request(2)]) == [1, 0]


def test_top_k_keeps_exactly_the_k_most_likely_tokens() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(masked).tolist() == [[False, True, True, False]]


def test_top_p_keeps_the_smallest_nucleus_reaching_p_and_always_the_best_token() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(  # noqa: E731
        apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([p]))
    ).tolist()[0]
    assert kept(0.7) == [True, True, False, False]
    assert kept(0.8) == [True, True, False, False]
    assert kept(0.81) == [True, True, True, False]
    assert kept(0.01) == [True, False, False, False]


def test_sampling_does_not_mutate_the_logits() -> None:
    logits = torch.randn(2, 11, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    sample(logits, [make_request(2, temperature=0.7, top_k=3, top_p=0.9, seed=1)] * 2)
    assert torch.equal(logits, before)


def test_same_seed_gives_the_same_tokens_whatever_the_batch() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))

    def draw(batch_rows: list[int]) -> list[int]:
        request = make_request(2, temperature=1.0, seed=1234)
        others = [make_request(2, temperature=1.0) for _ in batch_rows[1:]]
        tokens = []
        for _ in range(5):
            out = sample(logits[batch_rows], [request, *others])
            tokens.append(out[0])
        return tokens

    assert draw([0]) == draw([0, 1, 2])
    assert len(set(draw([0]))) > 1  # it really samples


def test_high_temperature_sampling_only_returns_tokens_inside_top_k() -> None:
    logits = torch.arange(20, dtype=torch.float32).unsqueeze(0)
    request = make_request(2, temperature=5.0, top_k=3, seed=7)
    seen = {sample(logits, [request])[0] for _ in range(40)}
    assert seen <= {17, 18, 19} and len(seen) > 1


def test_a_seeded_row_draws_the_same_whatever_the_other_rows_mask() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))

    def draw(other_top_p: float) -> list[int]:
        request = make_request(2, temperature=1.0, seed=99)
        others = [make_request(2, temperature=1.0, top_p=other_top_p) for _ in range(2)]
        return [sample(logits, [request, *others])[0] for _ in range(6)]

    assert draw(1.0) == draw(0.5)


def test_mixed_batch_returns_argmax_for_greedy_rows_and_valid_draws_for_the_rest() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(3))
    requests = [
        make_request(2),
        make_request(2, temperature=0.9),
        make_request(2, temperature=0.9, seed=5),
        make_request(2),
        make_request(2, temperature=2.0, top_k=2),
        make_request(2, temperature=0.5, top_p=0.3, seed=6),
    ]
    tokens = sample(logits, requests)
    assert tokens[0] == int(logits[0].argmax()) and tokens[3] == int(logits[3].argmax())
    assert tokens[4] in logits[4].topk(2).indices.tolist()
    assert all(isinstance(t, int) and 0 <= t < 30 for t in tokens)


def test_without_top_k_or_top_p_every_token_can_be_drawn() -> None:
    logits = torch.zeros(1, 8)  # uniform
    request = make_request(2, temperature=1.0, seed=11)
    seen = {sample(logits, [request])[0] for _ in range(200)}
    assert seen == set(range(8))
