"""The engine enforces `SamplingParams.grammar` on the real SmolLM2-135M-Instruct (float32, CPU;
the [cuda] twins on a GPU, with CUDA graphs): JSON that validates against a nested schema, greedy
and seeded, scheduled ahead or not; regex and choice grammars; constrained rows beside
unconstrained ones that they do not change; a remote prefill equal to a colocated one;
preemption mid-answer; a grammar that cannot compile or that breaks fails its request only; and
a constrained request decodes a token every step while scheduled ahead."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import replace
from typing import Any

import jsonschema
import pytest
import torch
from llguidance import LLMatcher

from kvrail.errors import InvalidRequestError
from kvrail.kernels import reference
from kvrail.outputs import RequestOutput
from kvrail.sampling import SamplingParams
from kvrail.worker import metrics
from kvrail.worker.engine.config import EngineConfig
from kvrail.worker.engine.engine import LLMEngine
from kvrail.worker.testing import assert_engine_empty

pytestmark = pytest.mark.slow

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {"enum": ["new", "vip", "staff"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
JSON = LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
COLORS = ("red", "green", "blue")
GPU = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)
DEVICES = ["cpu", GPU]


def _engine(smollm2: Any, device: str = "cpu", **overrides: Any) -> LLMEngine:
    values: dict[str, Any] = {"num_blocks": 160, "block_size": 16, "max_num_batched_tokens": 256}
    values.update(overrides)
    return LLMEngine.from_loaded(smollm2, EngineConfig(**values), device=device)


def _chat(smollm2: Any, text: str) -> list[int]:
    ids = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    return list(ids)


def _text(smollm2: Any, ids: list[int]) -> str:
    text: str = smollm2.tokenizer.decode(ids, skip_special_tokens=True)
    return text


Requests = dict[str, tuple[list[int], SamplingParams]]


def _run(engine: LLMEngine, requests: Requests, added: list[Any] | None = None) -> dict[str, Any]:
    """Each request's output tokens and how it ended (`finish_reason`, or `error:<code>`); the
    engine's `Request`s go to `added`."""
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    ended: dict[str, str] = {}
    for rid, (prompt, params) in requests.items():
        request = engine.add_request(rid, prompt, params)
        if added is not None:
            added.append(request)
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id not in ended, "an output after the request ended"
            tokens[output.request_id].extend(output.token_ids)
            if output.is_last:
                ended[output.request_id] = output.finish_reason or f"error:{output.error}"
    assert_engine_empty(engine)
    return {rid: (tokens[rid], ended[rid]) for rid in requests}


def _json_requests(smollm2: Any) -> Requests:
    prompt = _chat(smollm2, "Make up a user record for a web shop, as JSON.")
    top_p = SamplingParams(max_tokens=90, temperature=0.8, top_p=0.9, seed=5, grammar=JSON)
    return {
        "greedy": (prompt, SamplingParams(max_tokens=90, grammar=JSON)),
        "seeded": (prompt, SamplingParams(max_tokens=90, temperature=1.0, seed=11, grammar=JSON)),
        "top-p": (prompt, top_p),
    }


def _assert_valid_json(smollm2: Any, outputs: dict[str, Any]) -> None:
    for tokens, ended in outputs.values():
        assert ended == "stop"
        jsonschema.validate(json.loads(_text(smollm2, tokens)), SCHEMA)


@pytest.mark.parametrize("device", DEVICES)
def test_json_schema_output_validates_greedy_and_seeded_sync_or_scheduled_ahead(
    smollm2: Any, device: str
) -> None:
    sync = _run(_engine(smollm2, device, async_scheduling=False), _json_requests(smollm2))
    _assert_valid_json(smollm2, sync)
    ahead = _engine(smollm2, device, async_scheduling=True)
    assert ahead.pipeline.async_scheduling
    assert _run(ahead, _json_requests(smollm2)) == sync


def test_regex_and_choice_grammars_hold(smollm2: Any) -> None:
    date = LLMatcher.grammar_from_regex(DATE)
    choice = LLMatcher.grammar_from_lark("start: " + " | ".join(f'"{c}"' for c in COLORS))
    prompt = _chat(smollm2, "Name a colour and a date.")
    requests = {
        f"{kind}-{i}": (prompt, SamplingParams(max_tokens=20, temperature=t, seed=i, grammar=g))
        for kind, g in (("date", date), ("color", choice))
        for i, t in enumerate((0.0, 1.0, 1.5))
    }
    outputs = _run(_engine(smollm2, async_scheduling=True), requests)
    for rid, (tokens, ended) in outputs.items():
        text = _text(smollm2, tokens)
        assert ended == "stop"
        assert re.fullmatch(DATE, text) if rid.startswith("date") else text in COLORS


@pytest.mark.parametrize("device", DEVICES)
def test_unconstrained_rows_are_untouched_by_constrained_ones_in_the_batch(
    smollm2: Any, device: str
) -> None:
    free = {
        f"free-{i}": (_chat(smollm2, text), SamplingParams(max_tokens=12, ignore_eos=True))
        for i, text in enumerate(("Tell me about the sea.", "What is 2 + 2?"))
    }
    free["free-seeded"] = (_chat(smollm2, "Write a line of poetry."),
                           SamplingParams(max_tokens=12, temperature=1.0, seed=3))  # fmt: skip
    alone = _run(_engine(smollm2, device, async_scheduling=True), free)
    both = {**free, **_json_requests(smollm2)}
    mixed = _run(_engine(smollm2, device, async_scheduling=True), both)
    assert {rid: mixed[rid] for rid in free} == alone
    _assert_valid_json(smollm2, {rid: v for rid, v in mixed.items() if rid not in free})


def test_a_remote_prefill_gives_the_colocated_tokens(smollm2: Any) -> None:
    """The prefill engine samples the first token under the grammar; the decode engine rebuilds
    the matcher by replaying it at install, then goes on as a colocated engine would."""
    prompt, params = _json_requests(smollm2)["seeded"]
    colocated = _engine(smollm2, async_scheduling=True)
    expected = _run(colocated, {"r": (prompt, params)})["r"]
    decode = _engine(smollm2, async_scheduling=True)
    reservation = decode.reserve_remote("r", prompt, params)
    assert reservation is not None and reservation.num_cached_tokens == 0
    prefill = colocated  # its own KV pool: nothing cached from the run above is reused
    first = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    job = prefill.add_request("r-prefill", prompt, first, retain_blocks=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    src = torch.tensor(prefill.retained_block_ids("r-prefill"))
    packed = reference.gather_blocks(prefill.kv_cache.tensor, src)
    reference.scatter_blocks(packed, decode.kv_cache.tensor, torch.tensor(reservation.block_ids))
    prefill.release("r-prefill")
    tokens = list(decode.install_remote("r", job.output_token_ids[0]).token_ids)
    assert decode.scheduler.requests["r"].grammar_matcher is not None
    while decode.has_unfinished_requests():
        for output in decode.step():
            tokens.extend(output.token_ids)
            ended = output.finish_reason
    assert (tokens, ended) == expected
    assert_engine_empty(prefill)
    assert_engine_empty(decode)


def test_preemption_mid_answer_keeps_each_grammar_state(smollm2: Any) -> None:
    prompts = [_chat(smollm2, f"User number {i}: give the record as JSON.") for i in range(4)]
    requests = {
        f"r{i}": (p, SamplingParams(max_tokens=90, temperature=i % 2, seed=i, grammar=JSON))
        for i, p in enumerate(prompts)
    }
    expected = _run(_engine(smollm2, async_scheduling=True), requests)
    added: list[Any] = []
    short = _engine(smollm2, num_blocks=17, async_scheduling=True)  # 16 blocks for 4 x 6-8
    assert _run(short, requests, added) == expected
    assert sum(r.num_preemptions for r in added) > 0
    _assert_valid_json(smollm2, expected)


def test_a_constrained_request_decodes_every_step_scheduled_ahead(smollm2: Any) -> None:
    """Not one token every other step: each step gives it a token, the step after it already
    queued (its mask filled while the forward runs), and each step's masks are filled once, for
    the constrained row only."""
    engine = _engine(smollm2, async_scheduling=True)
    prompt, params = _json_requests(smollm2)["greedy"]
    engine.add_request("json", prompt, params)
    engine.add_request("free", prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    filled: list[int] = []
    fill = engine.pipeline.masks.fill

    def counting(requests: Any) -> Any:
        masks = fill(requests)
        filled.append(0 if masks is None else masks.rows.shape[0])
        return masks

    engine.pipeline.masks.fill = counting  # type: ignore[method-assign]
    before = _fill_count()
    steps = []
    while "json" in engine.scheduler.requests:
        steps.append([o.request_id for o in engine.step()])
        assert engine.pipeline._in_flight is not None
    assert all("json" in s for s in steps), "a step without the constrained token"
    # One fill per step, the constrained row only; the last is of the step queued past its end
    # (its token is discarded: the row gets no mask).
    assert filled == [1] * len(steps) + [0]
    assert _fill_count() - before == filled.count(1)  # the metric counts the fills that ran
    engine.abort("free")
    while engine.has_unfinished_requests():
        engine.step()
    calls = len(filled)
    _run(engine, {"plain": (prompt, SamplingParams(max_tokens=5, ignore_eos=True))})
    assert len(filled) == calls  # a step without a constrained row does no grammar work


def _before(step: Any, first: Any) -> Any:
    """`step`, calling `first` once before its second call (with requests in flight)."""
    calls = []

    def wrapped() -> Any:
        calls.append(1)
        if len(calls) == 2:
            first()
        return step()

    return wrapped


def _fill_count() -> float:
    for metric in metrics.GRAMMAR_MASK_FILL_SECONDS.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                return sample.value
    raise AssertionError("no count sample")


def test_ignore_eos_and_min_tokens_yield_to_the_grammar(smollm2: Any) -> None:
    """`ignore_eos` holds the end back while the grammar allows more digits (six, then it is
    complete and ends with `stop`); `min_tokens` holds it back for three."""
    digits = LLMatcher.grammar_from_regex("[0-9]{1,6}")
    prompt = _chat(smollm2, "Pick a number.")
    outputs = _run(_engine(smollm2), {
        "ignoring": (prompt, SamplingParams(max_tokens=30, ignore_eos=True, grammar=digits)),
        "min": (prompt, SamplingParams(max_tokens=30, min_tokens=3, temperature=1.0, seed=2,
                                       grammar=digits)),
        "short": (prompt, SamplingParams(max_tokens=4, ignore_eos=True, grammar=digits)),
    })  # fmt: skip
    tokens, ended = outputs["ignoring"]
    assert ended == "stop" and re.fullmatch("[0-9]{6}", _text(smollm2, tokens))
    tokens, ended = outputs["min"]
    assert ended == "stop" and re.fullmatch("[0-9]{3,6}", _text(smollm2, tokens))
    tokens, ended = outputs["short"]
    assert ended == "length" and re.fullmatch("[0-9]{4}", _text(smollm2, tokens))


def test_a_grammar_that_does_not_compile_fails_only_its_request(smollm2: Any) -> None:
    prompt = _chat(smollm2, "Hello!")
    free = {"free": (prompt, SamplingParams(max_tokens=8, ignore_eos=True)),
            "json": _json_requests(smollm2)["greedy"]}  # fmt: skip
    expected = _run(_engine(smollm2, async_scheduling=True), free)
    engine = _engine(smollm2, async_scheduling=True)
    garbage = ["start: ( {{", '{"grammars": [{"json_schema": {"type": "nope"}}]}']

    def refuse_garbage() -> None:
        for grammar in garbage:
            params = SamplingParams(max_tokens=8, grammar=grammar)
            with pytest.raises(InvalidRequestError) as caught:
                engine.add_request("bad", prompt, params)
            assert caught.value.param == "grammar"
            with pytest.raises(InvalidRequestError):
                engine.reserve_remote("bad", prompt, params)

    engine.step = _before(engine.step, refuse_garbage)  # type: ignore[method-assign]
    assert _run(engine, free) == expected


async def test_a_grammar_broken_mid_answer_fails_its_request_once_and_no_other(
    smollm2: Any,
) -> None:
    """A first token the grammar forbids (from a remote prefill: never under the mask) fails
    its request with the error `grammar`, delivered once; the service then forgets it (no
    deadline error later), a prefill whose grammar cannot compile raises naming it, and a
    request beside them finishes as it would alone."""
    from kvrail.worker.service import EngineService

    engine = _engine(smollm2, async_scheduling=True)
    prompt, params = _json_requests(smollm2)["greedy"]
    free_params = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = _run(engine, {"free": (prompt, free_params)})["free"][0]
    service = EngineService(engine, asyncio.get_running_loop()).start()
    try:
        got: dict[str, list[RequestOutput]] = {"free": [], "broken": []}
        ended = {rid: asyncio.Event() for rid in got}

        def collect(rid: str) -> Any:
            def on_output(output: RequestOutput) -> None:
                got[rid].append(output)
                if output.is_last:
                    ended[rid].set()

            return on_output

        await service.submit("free", prompt, free_params, collect("free"))
        assert await service.reserve("broken", prompt, params) is not None
        not_json = smollm2.tokenizer("x", add_special_tokens=False).input_ids[0]
        await service.install("broken", not_json, collect("broken"),
                              deadline_monotonic=time.monotonic() + 0.5)  # fmt: skip
        with pytest.raises(InvalidRequestError) as caught:
            await service.prefill("p", prompt, SamplingParams(max_tokens=1, grammar="{{"))
        assert caught.value.param == "grammar"
        await asyncio.wait_for(ended["free"].wait(), 60)
        await asyncio.sleep(0.6)  # past the broken one's deadline: no second output
        assert [(o.token_ids, o.error, o.finish_reason) for o in got["broken"]] == [
            ((), "grammar", None)
        ]
        assert [t for o in got["free"] for t in o.token_ids] == expected
    finally:
        await service.close()
    assert_engine_empty(engine)
