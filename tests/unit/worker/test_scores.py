"""Which rows of a step score prompt tokens, and how their scores join a request
(`worker/engine/scores.py`): once each, in prompt order, whatever chunks and recomputes do."""

from __future__ import annotations

import numpy as np
import torch

from kvrail.worker.engine.scores import (
    PromptScores,
    ScoredSpan,
    ScoreRows,
    score_rows,
    token_scores,
)
from kvrail.worker.testing import make_request


def _scores(rows: ScoreRows | None, spans: list[ScoredSpan]) -> PromptScores:
    """Scores of `rows` as a step would give them: row i's logprob -i, its top entries token i
    twice (recognisable values)."""
    assert rows is not None
    m = len(rows.targets)
    chosen = -torch.arange(m, dtype=torch.float32)
    top_ids = torch.arange(m).unsqueeze(1).repeat(1, 2)
    return PromptScores(spans, rows.targets, chosen, top_ids, chosen.unsqueeze(1).repeat(1, 2))


def test_a_chunk_scores_the_prompt_tokens_after_its_positions_and_not_the_sampled_one() -> None:
    """Positions p score token p + 1: a 10-token prompt in chunks of 4, 4 and 2 gets 9 scores;
    the last position samples instead. A request that asks for none adds no row."""
    asking = make_request(10, prompt_logprobs=1)
    other = make_request(6)
    rows, spans = score_rows([(0, 0, asking, 4), (4, 0, other, 6)])
    assert rows is not None and rows.rows.tolist() == [0, 1, 2, 3] and rows.k == 1
    assert rows.targets.tolist() == asking.prompt_token_ids[1:5]
    _scores(rows, spans).apply()
    later, spans = score_rows([(7, 4, asking, 4)])
    assert later is not None and later.rows.tolist() == [7, 8, 9, 10]
    _scores(later, spans).apply()
    last, spans = score_rows([(0, 8, asking, 2)])
    assert last is not None and last.rows.tolist() == [0]  # position 9 samples
    _scores(last, spans).apply()
    assert [e.token_id for e in asking.prompt_logprobs] == asking.prompt_token_ids[1:]
    assert asking.num_prompt_scored == 9


def test_a_recompute_after_preemption_scores_nothing_twice() -> None:
    """After preemption the prompt is computed again from position 0: the positions scored
    already make no rows, and a span that does not continue the scores is dropped."""
    request = make_request(10, prompt_logprobs=0)
    rows, spans = score_rows([(0, 0, request, 6)])
    stale = _scores(rows, spans)
    stale.apply()
    again, spans = score_rows([(0, 0, request, 10)])
    assert again is not None and again.rows.tolist() == [6, 7, 8]
    stale.apply()  # the same span twice: dropped
    _scores(again, spans).apply()
    assert [e.token_id for e in request.prompt_logprobs] == request.prompt_token_ids[1:]
    assert all(e.top_token_ids == () for e in request.prompt_logprobs)  # k = 0


def test_token_scores_are_the_log_softmax_entries_and_the_top_k() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    chosen, top_ids, top_logprobs = token_scores(logits, torch.tensor([0, 2]), 2)
    expected = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(chosen, expected[[0, 1], [0, 2]])
    assert top_ids.tolist() == [[1, 2], [2, 0]]
    assert np.allclose(top_logprobs[0].numpy(), expected[0, [1, 2]].numpy())


def test_the_top_k_of_bf16_logits_gives_the_top_k_of_the_float32_log_softmax_bit_for_bit() -> None:
    """The top-k runs over the raw logits: the values are a top-k over the float32 log-softmax,
    exactly, and each id's log-probability is its value, also where two logits round to one
    log-probability (the last row: 1e-6 and 2e-6 beside 300)."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(7, 1001, generator=gen) * 4).to(torch.bfloat16)
    logits[6] = -50.0
    logits[6, :3] = torch.tensor([300.0, 1e-6, 2e-6])
    tokens = torch.randint(0, 1001, (7,), generator=gen)
    chosen, top_ids, top_logprobs = token_scores(logits, tokens, 5)
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert torch.equal(chosen, expected.gather(1, tokens.unsqueeze(1)).squeeze(1))
    assert torch.equal(top_logprobs, expected.topk(5, dim=-1).values)
    assert torch.equal(expected.gather(1, top_ids), top_logprobs)
    assert top_ids[6, :3].tolist() == [0, 2, 1] and top_logprobs[6, 1] == top_logprobs[6, 2]
    assert token_scores(logits, tokens, 0)[1].shape == (7, 0)
