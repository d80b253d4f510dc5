"""Grammars and their masks without a model: SmolLM2's real tokenizer, real llguidance matchers.

The compile cache (bounded, failures cached, garbage refused naming `grammar`, no grammar text in
the logs), the mask's width and the tokens past the tokenizer, the hold-backs of `ignore_eos` and
`min_tokens`, a matcher rebuilt by replaying equal to one advanced token by token, the finished
states a token gives (`stop` when the grammar is complete, `grammar` when broken), and the
independent starts a grammar many requests use grows (its lineages)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
from llguidance import LLMatcher

from kvrail.errors import InvalidRequestError
from kvrail.worker.engine import grammar_masks
from kvrail.worker.engine.grammar import GRAMMAR_ERROR, MOVE_TOKENS, Grammars, _Compiled
from kvrail.worker.engine.grammar_masks import MaskFiller, hold_back
from kvrail.worker.engine.request import RequestStatus
from kvrail.worker.testing import make_request

CHOICE = LLMatcher.grammar_from_regex("(yes|no|maybe)")
DIGITS = LLMatcher.grammar_from_regex("[0-9]{1,6}")
EXTRA_TOKENS = 37  # the model's vocabulary past the tokenizer's (padding rows of an LM head)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from kvrail.model_files import resolve
    from kvrail.worker.models.loader import prepare

    return AutoTokenizer.from_pretrained(prepare(resolve("smollm2")))


@pytest.fixture(scope="module")
def grammars(tokenizer: Any) -> Grammars:
    return Grammars.from_hf(tokenizer, tokenizer.eos_token_id, len(tokenizer) + EXTRA_TOKENS)


def _ids(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer(text, add_special_tokens=False).input_ids
    return ids


def _allowed(grammars: Grammars, requests: list[Any]) -> list[set[int]]:
    """The tokens each request's row of a step may take (the step samples its next token)."""
    for request in requests:
        request.num_in_flight = 1
    masks = MaskFiller(grammars, torch.device("cpu")).fill(requests)
    assert masks is not None
    bits = np.unpackbits(masks.bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    return [set(np.nonzero(row)[0].tolist()) for row in bits]


def test_a_garbage_grammar_is_refused_naming_grammar_once_and_never_logged(
    grammars: Grammars, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    garbage = "start: ( SECRET-PROMPT-TEXT {{"
    with pytest.raises(InvalidRequestError) as caught:
        grammars.check(garbage)
    assert caught.value.param == "grammar"
    assert "SECRET" not in str(caught.value) and "SECRET" not in caplog.text
    assert "grammar refused" in caplog.text
    calls = []
    monkeypatch.setattr(grammars, "_compile", lambda g: calls.append(g) or "again")
    with pytest.raises(InvalidRequestError):
        grammars.check(garbage)  # the failure is cached: not compiled again
    assert calls == []
    grammars.check(None)


def test_the_cache_keeps_the_latest_grammars_and_copies_never_share_state(
    tokenizer: Any,
) -> None:
    small = Grammars.from_hf(tokenizer, tokenizer.eos_token_id, len(tokenizer))
    small._cache_size = 2
    first = small.compile(CHOICE)
    small.compile(DIGITS)
    assert small.compile(CHOICE) is first  # a hit moves it to the back
    small.compile(LLMatcher.grammar_from_regex("[a-c]+"))
    assert list(small._cache) == [CHOICE, LLMatcher.grammar_from_regex("[a-c]+")]
    a, b = make_request(grammar=CHOICE), make_request(grammar=CHOICE)
    a.output_token_ids.append(_ids(tokenizer, "yes")[0])
    small.advance(a, None)
    assert small.matcher(b) is not None and not b.grammar_matcher.is_stopped()  # type: ignore[union-attr]


def test_no_token_past_the_tokenizer_is_ever_allowed(tokenizer: Any, grammars: Grammars) -> None:
    anything = LLMatcher.grammar_from_lark("start: /(.|\\n)*/")
    (allowed,) = _allowed(grammars, [make_request(grammar=anything, ignore_eos=False)])
    assert grammars.num_words == (len(tokenizer) + EXTRA_TOKENS + 31) // 32
    assert len(allowed) > 40_000 and max(allowed) < len(tokenizer)
    assert tokenizer.eos_token_id in allowed  # the grammar may end anywhere


def test_ignore_eos_and_min_tokens_hold_eos_back_only_while_the_grammar_allows_more(
    tokenizer: Any, grammars: Grammars
) -> None:
    eos = tokenizer.eos_token_id
    digit = _ids(tokenizer, "7")
    free, ignoring, early, late = (
        make_request(grammar=DIGITS, ignore_eos=False),
        make_request(grammar=DIGITS, ignore_eos=True),
        make_request(grammar=DIGITS, ignore_eos=False, min_tokens=3),
        make_request(grammar=DIGITS, ignore_eos=False, min_tokens=1),
    )
    for request in (free, ignoring, early, late):
        request.output_token_ids.extend(digit)  # the row samples output token 1 (0-based)
    masks = _allowed(grammars, [free, ignoring, early, late])
    assert [eos in m for m in masks] == [True, False, False, True]
    assert masks[0] - {eos} == masks[1] == masks[2]
    row = np.zeros(4, dtype=np.int32)
    row[eos // 32] = np.int32(1 << (eos % 32))
    hold_back(row, [eos])
    assert int(row[eos // 32]) == 1 << (eos % 32)  # nothing else allowed: the grammar wins


def test_a_matcher_rebuilt_by_replaying_equals_one_advanced_token_by_token(
    tokenizer: Any, grammars: Grammars
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
              "required": ["n", "s"], "additionalProperties": False}  # fmt: skip
    grammar = LLMatcher.grammar_from_json_schema(schema)
    tokens = _ids(tokenizer, '{"n": 12, "s": "ab')
    stepped, replayed = make_request(grammar=grammar), make_request(grammar=grammar)
    for token in tokens:
        stepped.output_token_ids.append(token)
        assert grammars.advance(stepped, None) is None
    replayed.output_token_ids.extend(tokens)  # e.g. a decode worker after a remote prefill
    assert replayed.grammar_matcher is None
    first, second = _allowed(grammars, [stepped, replayed])
    assert first == second and _ids(tokenizer, '"')[0] in first


def test_a_complete_grammar_stops_and_a_forbidden_token_fails_the_request(
    tokenizer: Any, grammars: Grammars
) -> None:
    done = make_request(grammar=CHOICE)
    done.output_token_ids.extend(_ids(tokenizer, "maybe"))
    assert grammars.advance(done, RequestStatus.FINISHED_LENGTH) is RequestStatus.FINISHED_STOPPED
    assert done.stop_reason is None and done.error is None
    ended = make_request(grammar=DIGITS)
    ended.output_token_ids.extend([*_ids(tokenizer, "42"), tokenizer.eos_token_id])
    assert grammars.advance(ended, None) is RequestStatus.FINISHED_STOPPED
    assert ended.stop_reason == tokenizer.eos_token_id
    broken = make_request(grammar=CHOICE)
    broken.output_token_ids.extend(_ids(tokenizer, "no"))
    assert grammars.advance(broken, None) is RequestStatus.FINISHED_STOPPED
    broken.output_token_ids.extend(_ids(tokenizer, "x"))
    assert grammars.advance(broken, None) is RequestStatus.FINISHED_ERROR
    assert broken.error == GRAMMAR_ERROR


def _settled(grammars: Grammars, grammar: str) -> _Compiled:
    """The grammar's cache entry once no start is being compiled for it."""
    deadline = time.monotonic() + 30
    while True:
        compiled = grammars._cache[grammar]
        assert isinstance(compiled, _Compiled)
        if not compiled.growing:
            return compiled
        assert time.monotonic() < deadline, "a start took over 30 s to compile"
        time.sleep(0.01)


def test_a_shared_grammar_grows_independent_starts_and_spreads_its_rows_over_them(
    tokenizer: Any, grammars: Grammars, monkeypatch: pytest.MonkeyPatch
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
              "required": ["n", "s"], "additionalProperties": False}  # fmt: skip
    grammar = LLMatcher.grammar_from_json_schema(schema)
    text = _ids(tokenizer, '{"n": 12, "s": "ab')
    grown = Grammars.from_hf(tokenizer, tokenizer.eos_token_id, len(tokenizer), lineages=3)
    grown.check(grammar)
    burst = []  # a burst: every request takes its copy before the other starts exist
    for i in range(12):
        request = make_request(grammar=grammar)
        request.output_token_ids.extend(text[: i % 4])
        assert grown.matcher(request) is not None
        burst.append(request)
    first = _settled(grown, grammar).starts
    assert len(first) == 1 and {r.grammar_group for r in burst} == {first[0][0]}  # used once
    grown.check(grammar)  # a second request checks it: the other starts are compiled
    starts = _settled(grown, grammar).starts
    assert len(starts) == 3 and len({id(m) for _, m in starts}) == 3  # compiled apart, capped
    late = [make_request(grammar=grammar) for _ in range(3)]
    for request in late:
        assert grown.matcher(request) is not None
    assert len({r.grammar_group for r in late}) == 3  # later requests take the starts in turn

    handed: list[LLMatcher] = []
    fill = grammar_masks.fill_next_token_bitmask_par
    monkeypatch.setattr(grammar_masks, "fill_next_token_bitmask_par",
                        lambda ex, matchers, bits: handed.extend(m for m, _ in matchers)
                        or fill(ex, matchers, bits))  # fmt: skip
    masks = _allowed(grown, burst)  # the fill spreads the burst's rows over the three starts
    groups = [r.grammar_group for r in burst]
    assert sorted(groups.count(g) for g, _ in starts) == [4, 4, 4]
    by_matcher = {id(r.grammar_matcher): r.grammar_group for r in burst}
    assert [by_matcher[id(m)] for m in handed] == sorted(groups)  # handed grouped by start
    alone = [make_request(grammar=grammar) for _ in range(4)]
    for i, request in enumerate(alone):
        request.output_token_ids.extend(text[:i])
    expected = _allowed(grammars, alone)  # one start: today's masks
    assert all(mask == expected[i % 4] for i, mask in enumerate(masks))
    long = make_request(grammar=grammar)
    long.output_token_ids.extend(text * (MOVE_TOKENS // len(text) + 1))  # past MOVE_TOKENS
    long.grammar_group, long.grammar_matcher = starts[0][0], starts[0][1].deep_copy()
    crowd = [long, *[make_request(grammar=grammar) for _ in range(2)]]
    for request in crowd[1:]:
        request.grammar_group, request.grammar_matcher = starts[0][0], starts[0][1].deep_copy()
    grown.spread(crowd)
    assert long.grammar_group == starts[0][0]  # too long to replay: stays where it is
    assert sorted(r.grammar_group for r in crowd[1:]) == sorted(g for g, _ in starts[1:])


def test_without_a_tokenizer_every_grammar_is_refused() -> None:
    from kvrail.sampling import SamplingParams
    from kvrail.worker.testing import assert_engine_empty, make_engine, tiny_llama_config

    engine = make_engine(tiny_llama_config())
    with pytest.raises(InvalidRequestError, match="no tokenizer") as caught:
        engine.add_request("g", [5, 6], SamplingParams(max_tokens=3, grammar=CHOICE))
    assert caught.value.param == "grammar"
    assert engine.generate([[5, 6]], SamplingParams(max_tokens=3)) != [[]]
    assert_engine_empty(engine)
