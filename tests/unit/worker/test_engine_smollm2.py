"""The engine on the real SmolLM2-135M-Instruct equals transformers' greedy `generate`, token for
token (float32, CPU): mixed-length batches, chunked prefill of a long prompt, prefix-cache hits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvrail.errors import InvalidRequestError
from kvrail.sampling import SamplingParams
from kvrail.worker.engine.config import EngineConfig
from kvrail.worker.engine.engine import LLMEngine
from kvrail.worker.testing import assert_engine_empty

pytestmark = pytest.mark.slow

SHORT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Hi",
]
LONG_TEXT = " ".join(
    f"Paragraph {i}: the river {['Loire', 'Danube', 'Nile', 'Amazon'][i % 4]} flows past "
    f"{i * 7 % 13} villages, and its water level was {i * 3} centimetres in spring."
    for i in range(24)
)


def _expected(hf: Any, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    return out[0, len(prompt) :].tolist()


def _engine(smollm2: Any, **overrides: Any) -> Any:
    return LLMEngine.from_loaded(smollm2, EngineConfig(**overrides))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_length_batch_equals_transformers_greedy(
    smollm2: Any, smollm2_hf: Any, async_scheduling: bool
) -> None:
    tokenizer = smollm2.tokenizer
    prompts = [tokenizer(p).input_ids for p in SHORT_PROMPTS]
    engine = _engine(
        smollm2, num_blocks=128, block_size=16, max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    outputs = engine.generate(prompts, SamplingParams(max_tokens=20))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == _expected(smollm2_hf, prompt, 20, tokenizer.eos_token_id)
    assert_engine_empty(engine)


def test_chunked_prefill_of_a_long_prompt_and_a_prefix_hit_equal_transformers(
    smollm2: Any, smollm2_hf: Any
) -> None:
    tokenizer = smollm2.tokenizer
    long_prompt = tokenizer(LONG_TEXT + " Which river is mentioned first?").input_ids
    assert len(long_prompt) > 400
    engine = _engine(smollm2, num_blocks=160, block_size=16, max_num_batched_tokens=48)
    first = engine.generate([long_prompt], SamplingParams(max_tokens=12))[0]
    assert first == _expected(smollm2_hf, long_prompt, 12, tokenizer.eos_token_id)
    # Same long prefix, different question: the prefix comes from the cache.
    second_prompt = tokenizer(LONG_TEXT + " How many paragraphs are there?").input_ids
    request = engine.add_request("prefix-hit", second_prompt, SamplingParams(max_tokens=12))
    while engine.has_unfinished_requests():
        engine.step()
    assert request.num_cached_tokens >= 16 * ((len(long_prompt) - 20) // 16)
    assert request.output_token_ids == _expected(
        smollm2_hf, second_prompt, 12, tokenizer.eos_token_id
    )
    assert_engine_empty(engine)


def test_requests_sharing_a_cached_prompt_decode_over_shared_blocks_and_equal_transformers(
    smollm2: Any, smollm2_hf: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four requests of one long prompt (three of them prefix-cache hits, as a request's `n`
    choices are): their decode steps group them (`find_shared_prefixes`; on the CPU the reference
    attention checks each group against the real block tables) and every output equals
    transformers'."""
    from kvrail.worker.testing import record_shared_prefixes

    found = record_shared_prefixes(monkeypatch)
    tokenizer = smollm2.tokenizer
    prompt = tokenizer(LONG_TEXT + " Which river is mentioned first?").input_ids
    engine = _engine(
        smollm2, num_blocks=160, block_size=16, max_num_batched_tokens=512,
        shared_prefix_decode=True,
    )  # fmt: skip
    params = SamplingParams(max_tokens=10)
    lead = engine.add_request("lead", prompt, params)
    while not lead.num_output_tokens:
        engine.step()
    others = [engine.add_request(f"choice-{i}", prompt, params) for i in range(3)]
    while engine.has_unfinished_requests():
        engine.step()
    expected = _expected(smollm2_hf, prompt, 10, tokenizer.eos_token_id)
    assert [r.output_token_ids for r in [lead, *others]] == [expected] * 4
    groups = [g for g in found if g is not None]
    assert groups and max(int((g.rows >= 0).sum()) for g in groups) == 4
    assert all(r.num_cached_tokens >= 16 * (len(prompt) // 16 - 1) for r in others)
    assert_engine_empty(engine)


def test_bad_requests_raise_and_leave_the_engine_empty(smollm2: Any) -> None:
    engine = _engine(smollm2, num_blocks=8, block_size=16, max_model_len=2048)
    with pytest.raises(InvalidRequestError, match="model limit"):
        engine.add_request("long", [1] * 2049, SamplingParams(max_tokens=16))
    with pytest.raises(InvalidRequestError, match="KV pool"):
        engine.add_request("huge", [1] * 200, SamplingParams(max_tokens=1))
    assert_engine_empty(engine)


def test_cancelled_request_frees_all_its_blocks_mid_generation(smollm2: Any) -> None:
    engine = _engine(smollm2, num_blocks=64, block_size=16, max_num_batched_tokens=64)
    prompt = smollm2.tokenizer(LONG_TEXT[:300]).input_ids
    engine.add_request("cancel-me", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("keep-me", prompt[:20], SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.kv_cache_manager.get_block_ids("cancel-me")
    assert engine.abort("cancel-me")
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_empty(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_logprobs_equal_transformers_log_softmax_and_greedy_takes_the_top_entry(
    smollm2: Any, smollm2_hf: Any, async_scheduling: bool
) -> None:
    """Each output token's logprob and its top 5 equal transformers' log-softmax at that
    position within 1e-4 (float32), in a batch where other rows ask for none or fewer; a row
    that did not ask gets none."""
    tokenizer = smollm2.tokenizer
    prompts = [tokenizer(p).input_ids for p in SHORT_PROMPTS[:3]]
    engine = _engine(smollm2, num_blocks=128, block_size=16, async_scheduling=async_scheduling)
    asked = [SamplingParams(max_tokens=6, logprobs=5), SamplingParams(max_tokens=6, logprobs=0),
             SamplingParams(max_tokens=6)]  # fmt: skip
    for i, (prompt, params) in enumerate(zip(prompts, asked, strict=True)):
        engine.add_request(f"lp-{i}", prompt, params)
    got: dict[str, list[Any]] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            got.setdefault(output.request_id, []).extend(output.logprobs)
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
    assert got["lp-2"] == []
    for i, k in ((0, 5), (1, 0)):
        rid = f"lp-{i}"
        sequence = prompts[i] + tokens[rid]
        with torch.inference_mode():
            logits = smollm2_hf(torch.tensor([sequence])).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)[len(prompts[i]) - 1 : -1]
        assert len(got[rid]) == len(tokens[rid]) == expected.shape[0]
        for position, (entry, token) in enumerate(zip(got[rid], tokens[rid], strict=True)):
            row = expected[position]
            assert entry.token_id == token
            assert abs(entry.logprob - float(row[token])) < 1e-4
            assert len(entry.top_token_ids) == len(entry.top_logprobs) == k
            if k:
                top = row.topk(k)
                assert torch.allclose(torch.tensor(entry.top_logprobs), top.values, atol=1e-4)
                assert entry.top_token_ids[0] == token == int(top.indices[0])  # greedy
    assert_engine_empty(engine)


def _assert_prompt_scores(hf: Any, prompt: list[int], got: Any, k: int) -> None:
    """`got` scores every prompt token after the first as transformers' log-softmax does."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[:-1]
    assert [e.token_id for e in got] == prompt[1:]
    for position, entry in enumerate(got):
        row = expected[position]
        assert abs(entry.logprob - float(row[prompt[position + 1]])) < 1e-4
        top = row.topk(k)
        assert list(entry.top_token_ids) == top.indices.tolist()
        assert torch.allclose(torch.tensor(entry.top_logprobs), top.values, atol=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_equal_transformers_over_chunks_and_a_cached_prefix(
    smollm2: Any, smollm2_hf: Any, async_scheduling: bool
) -> None:
    """Prompt scores cover the whole prompt, chunked (a 64-token step budget), for a prompt
    whose prefix is in the cache (its blocks are recomputed: a cached block has no logits), in a
    batch with a request that asks for none; they come with the first output only."""
    tokenizer = smollm2.tokenizer
    head = tokenizer(LONG_TEXT).input_ids[:150]
    engine = _engine(
        smollm2, num_blocks=128, block_size=16, max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    engine.generate([head], SamplingParams(max_tokens=1))  # the head's blocks are now cached
    prompt = head + tokenizer(" and then the sea").input_ids
    engine.add_request("scored", prompt, SamplingParams(max_tokens=3, prompt_logprobs=2))
    engine.add_request("plain", head, SamplingParams(max_tokens=3))
    outputs: dict[str, list[Any]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    scored, plain = outputs["scored"], outputs["plain"]
    assert plain[0].num_cached_tokens == 144 and scored[0].num_cached_tokens == 0
    assert all(not o.prompt_logprobs for o in plain + scored[1:])
    _assert_prompt_scores(smollm2_hf, prompt, scored[0].prompt_logprobs, 2)
    assert_engine_empty(engine)


def test_prompt_logprobs_too_long_for_one_message_are_refused(smollm2: Any) -> None:
    engine = _engine(smollm2, num_blocks=64, block_size=16)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("x", [1] * 7000, SamplingParams(max_tokens=1, prompt_logprobs=20))
    assert err.value.param == "prompt_logprobs"
    assert_engine_empty(engine)
