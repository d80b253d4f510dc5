"""Sampler: greedy, top-k/top-p masks, seeded reproducibility, no mutation of inputs."""

from __future__ import annotations

import torch

from kvrail.sampling import TokenBias
from kvrail.worker.engine.request import Request
from kvrail.worker.engine.sampler import Sampler, apply_min_p, apply_penalties, apply_top_k_top_p
from kvrail.worker.testing import make_request


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """One token per row, on the host, as an engine step samples them: each request's token is
    in flight while it is drawn, then joins its output (a seeded draw depends on its position)."""
    unique = list({id(r): r for r in requests}.values())
    for request in unique:
        request.num_in_flight += 1
    token_ids: list[int] = Sampler().sample(logits, requests).tolist()
    for request in unique:
        request.num_in_flight -= 1
        request.output_token_ids.append(token_ids[requests.index(request)])
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


def test_a_seeded_draw_depends_on_its_position_not_on_who_drew_the_earlier_tokens() -> None:
    """After a remote prefill the decode worker holds the first token without having drawn it:
    its draw for the second token equals the one a request that drew the first itself makes."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(4))
    drew_first = make_request(2, temperature=1.0, seed=77)
    first, second = sample(logits, [drew_first]), sample(logits, [drew_first])
    installed = make_request(2, temperature=1.0, seed=77)
    installed.output_token_ids.append(first[0])  # what `install_remote` does
    assert sample(logits, [installed]) == second
    other_seed = make_request(2, temperature=1.0, seed=78)
    draws = [sample(logits, [other_seed])[0] for _ in range(8)]
    assert draws != [sample(logits, [drew_first])[0] for _ in range(8)]


def test_logit_bias_moves_its_tokens_and_leaves_other_rows_alone() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [0.0, 5.0, 1.0, 2.0]])
    banned = make_request(2, logit_bias=(TokenBias(1, -100.0),))
    plain = make_request(2)
    assert sample(logits, [banned, plain]) == [3, 1]  # the argmax banned: the next best
    forced = make_request(2, temperature=1.5, seed=3, logit_bias=(TokenBias(2, 100.0),))
    assert {sample(logits[:1], [forced])[0] for _ in range(20)} == {2}
    nudged = make_request(2, logit_bias=(TokenBias(0, 4.5), TokenBias(3, -1.0)))
    assert sample(logits[:1], [nudged]) == [1]  # 4.5 < 5: not enough to win


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


def _with_outputs(request: Request, output_ids: list[int]) -> Request:
    """`request` as the sampler sees it while it samples output token `len(output_ids)`."""
    request.output_token_ids.extend(output_ids)
    request.num_in_flight = 1  # the step being sampled
    return request


def test_eos_and_stop_ids_cannot_be_sampled_before_min_tokens() -> None:
    eos = 2
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0]])  # EOS best, then token 3
    sampler = Sampler(eos_token_id=eos)

    def pick(request: Request) -> int:
        return int(sampler.sample(logits, [request])[0])

    params = {"max_tokens": 8, "min_tokens": 2, "ignore_eos": False}
    assert pick(_with_outputs(make_request(4, **params), [])) == 3  # first token: EOS masked
    assert pick(_with_outputs(make_request(4, **params), [5])) == 3  # second: still masked
    assert pick(_with_outputs(make_request(4, **params), [5, 5])) == eos  # then allowed
    stop_id = make_request(4, max_tokens=8, min_tokens=1, stop_token_ids=(3,), ignore_eos=True)
    assert pick(_with_outputs(stop_id, [])) == eos  # ignore_eos: EOS stays, the stop id goes
    assert int(Sampler(eos_token_id=eos).sample(logits, [make_request(4)])[0]) == eos


def test_penalties_follow_vllms_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = apply_penalties(logits, [[0]], [[1, 3, 3]], [2.0], [0.5], [0.25])[0].tolist()
    # token 0: prompt only, repetition: 2.0 / 2; token 1: output once, -1 * 2 - 0.25 - 0.5;
    # token 2: unseen; token 3: output twice, 3 / 2 - 0.5 - 2 * 0.25.
    assert out == [1.0, -2.75, 0.5, 0.5]
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0]]  # not mutated


def test_a_penalized_greedy_row_avoids_what_it_already_said() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0]])
    plain = make_request(prompt_token_ids=[0], max_tokens=4)
    penalized = make_request(prompt_token_ids=[0], max_tokens=4, frequency_penalty=2.0)
    rows = logits.repeat(2, 1)
    requests = [_with_outputs(plain, [1]), _with_outputs(penalized, [1])]
    assert Sampler().sample(rows, requests).tolist() == [1, 2]


def test_min_p_drops_tokens_far_below_the_best() -> None:
    probs = torch.tensor([[0.6, 0.3, 0.08, 0.02]])
    kept = torch.isfinite(apply_min_p(probs.log(), torch.tensor([0.1]))).tolist()[0]
    assert kept == [True, True, True, False]  # 0.02 < 0.1 * 0.6 <= 0.08


def test_a_row_whose_logits_overflow_takes_its_best_token_and_spares_the_others() -> None:
    """Temperatures and repetition penalties near 0 are valid input whose scaled logits overflow
    float32; the fuzzer found that such a row made `torch.multinomial` fail the whole step."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0]] * 5)
    requests = [
        make_request(2, temperature=5e-324),  # 0 in float32: every logit divided by 0
        make_request(2, temperature=1e-45, seed=4),  # a float32 subnormal: logits overflow
        make_request(prompt_token_ids=[2, 2], temperature=0.7, repetition_penalty=1e-300, seed=5),
        make_request(2, temperature=1.0, seed=7),
        make_request(2),
    ]
    requests[2].output_token_ids.append(3)  # penalized: 2.0 / 1e-300 overflows to inf
    tokens = sample(logits, requests)
    assert tokens[:2] == [1, 1]
    assert tokens[2] == 3  # the overflowed logit is the largest
    assert 0 <= tokens[3] < 4 and tokens[4] == 1
    alone = sample(logits[3:4], [make_request(2, temperature=1.0, seed=7)])
    assert tokens[3] == alone[0]  # the healthy row drew as it would have alone


def test_logprobs_are_the_raw_log_softmax_of_the_rows_that_ask_and_none_when_none_does() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(9))
    requests = [make_request(2, logprobs=3, temperature=0.5, seed=1), make_request(2),
                make_request(2, logprobs=1, logit_bias=(TokenBias(4, 50.0),))]  # fmt: skip
    sampler = Sampler()
    tokens = sampler.sample(logits, requests)
    step = sampler.logprobs(logits, requests, tokens)
    assert step is not None and step.rows == [0, 2]
    by_id = step.for_rows(requests, tokens.tolist())
    expected = torch.log_softmax(logits, dim=-1)
    for i in (0, 2):
        entry = by_id[requests[i].request_id]
        k = requests[i].sampling_params.logprobs
        assert entry.token_id == int(tokens[i])
        assert abs(entry.logprob - float(expected[i, entry.token_id])) < 1e-6
        top = expected[i].topk(k or 0)
        assert list(entry.top_token_ids) == top.indices.tolist()
        assert torch.allclose(torch.tensor(entry.top_logprobs), top.values)
    assert requests[1].request_id not in by_id
    assert sampler.logprobs(logits, [make_request(2)] * 3, tokens) is None


def test_seeded_draws_follow_the_distribution() -> None:
    """The exponential race picks each token with its probability: 4,000 seeded draws (one key
    per position) from p = (0.1, 0.2, 0.3, 0.4, 0) land within 4 standard errors of 4,000 p."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    logits = torch.log(p).unsqueeze(0)
    counts = [0] * 5
    for position in range(4000):
        request = make_request(2, temperature=1.0, seed=123)
        request.output_token_ids = [0] * position
        request.num_in_flight = 1
        counts[int(sample(logits, [request])[0])] += 1
    assert counts[4] == 0
    for token, share in enumerate(p.tolist()[:4]):
        expected, spread = 4000 * share, (4000 * share * (1 - share)) ** 0.5
        assert abs(counts[token] - expected) < 4 * spread, counts
