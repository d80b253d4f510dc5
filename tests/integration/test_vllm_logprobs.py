"""Logprobs, logit_bias and grammars through a vLLM pool, live: kvrail's router in front of a
real vLLM prefill server and a real vLLM decode server (vLLM's CPU build, SmolLM2 in float32,
each with its agent, over real etcd and NATS), driven with the real `openai` client, and
compared with what the decode server itself answers to the same request sent to it straight.

The router's vLLM stream turns vLLM's logprobs into kvrail's `TokenLogprobs` and renders them
with the one renderer kvrail's own engine uses, so the two answers must agree field by field:
token texts and bytes, log-probabilities, the most likely tokens in order, text offsets.

- A prompt under `REMOTE_FROM` tokens is prefilled by the decode server itself (`local`): the
  very computation of the direct request, so the values must be equal.
- A longer one is prefilled by the prefill server and its KV read over NIXL (`remote`, checked
  on the decode server's `/metrics`): the decode server then computes the first token in a
  one-token step on that KV rather than in the prompt's own pass, and float32 sums in another
  order differ in the last digits (about 1e-5 here), so values agree within `TOLERANCE` and
  tokens exactly.

Grammars (structured outputs, forced tool calls) have no counterpart to compare with (vLLM's
own chat endpoint would build its grammar and template its tools its own way): what the router's
grammar allows must hold, whichever server prefilled.

Prefix caching is off on both servers, so that each request computes its prompt from scratch and
neither answer reads KV an earlier one left. Needs `.venv-vllm` (`make vllm-env`); the pair takes
60-200 s to start here.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.router.text.tokenizer import TextCodec
from kvrail.settings import default_cache_dir
from kvrail.testing.pool import LocalPool
from kvrail.testing.vllm import (
    SERVED_MODEL_NAME,
    VllmEnvMissing,
    VllmPool,
    VllmServer,
    serve_config,
    vllm_model_dir,
    vllm_python,
)
from kvrail.vllm.serve import VllmRole

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

POOL = f"vp-{uuid.uuid4().hex[:8]}"
MAX_MODEL_LEN = 1024
MAX_TOKENS = 12
TOP = 5
REMOTE_FROM = 200
"""`min_remote_prefill_tokens`: the short prompts below are local, the long ones remote."""
TOLERANCE = 1e-4
Path = Literal["local", "remote"]
LONG_TEXT = " ".join(
    f"Item {i}: the lighthouse on island {i * 5 % 11} was painted {['red', 'white'][i % 2]} "
    f"in {1900 + i * 7}, and its keeper counted {i * 13 % 17} ships that winter."
    for i in range(14)
)
CHATS: dict[Path, list[ChatCompletionMessageParam]] = {
    "local": [{"role": "user", "content": "What is the capital of France? One sentence."}],
    "remote": [{"role": "user", "content": LONG_TEXT + "\nWhich island has the lighthouse?"}],
}
PROMPTS: dict[Path, str] = {
    "local": "The capital of France is",
    "remote": LONG_TEXT + "\nThe first lighthouse",
}


@dataclass(frozen=True, slots=True)
class Stack:
    vllm: VllmPool
    router: openai.OpenAI
    """kvrail's router of the vLLM pool."""
    direct: openai.OpenAI
    """The decode server itself."""

    @property
    def decode(self) -> VllmServer:
        return self.vllm.servers["decode-0"]


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stack(
    etcd_server: EtcdServer, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    try:
        vllm_python()
    except VllmEnvMissing as err:
        pytest.fail(str(err))
    logs = tmp_path_factory.mktemp("vllm-logprobs")
    model_dir = vllm_model_dir()
    vllm = VllmPool({"KVRAIL_POOL": POOL, **etcd_server.client_env()}, logs, model_dir)
    routing = LocalPool(etcd_server, nats_server, logs, POOL, {
        "KVRAIL_MIN_REMOTE_PREFILL_TOKENS": str(REMOTE_FROM),
        "KVRAIL_KV_LOAD_FAILURE_POLICY": "fail", "KVRAIL_REQUEST_TIMEOUT_S": "120",
    })  # fmt: skip
    port = free_port()
    try:
        roles: tuple[tuple[str, VllmRole, int], ...] = (
            ("prefill-0", "prefill", 0),  # name, role, OpenMP core
            ("decode-0", "decode", 1),
        )
        servers = {}
        for name, role, core in roles:
            cfg = serve_config(model_dir, role, free_port(), free_port(), MAX_MODEL_LEN)
            cfg = dataclasses.replace(
                cfg, extra_args=(*cfg.extra_args, "--no-enable-prefix-caching")
            )
            servers[name] = (cfg, core)
        vllm.start(servers)
        routing.start_router("router", KVRAIL_HTTP_PORT=str(port))
        routing.wait_ready("router")
        direct = client(f"{vllm.servers['decode-0'].url}/v1")
        yield Stack(vllm, client(f"http://127.0.0.1:{port}/v1"), direct)
    finally:
        routing.stop()
        vllm.stop()


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.load("smollm2", default_cache_dir())


def transferred(server: VllmServer) -> float:
    """The prompt tokens `server` has read over NIXL so far."""
    return server.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def assert_path(path: Path, num_transferred: float, num_prompt_tokens: int) -> None:
    """The request was prefilled the way `path` says: by the prefill server, whose KV the
    decode server read (all of it but at most the last token, which it computes itself), or by
    the decode server alone. vLLM counts a prompt's tokens at its first step, long before the
    last token of an answer is sent."""
    if path == "remote":
        assert num_transferred >= num_prompt_tokens - 1, num_transferred
    else:
        assert num_transferred == 0, num_transferred


def assert_values(got: list[float], want: list[float], path: Path) -> None:
    if path == "local":
        assert got == want
    else:
        assert got == pytest.approx(want, abs=TOLERANCE)


def chat_rows(content: list[Any]) -> list[tuple[str, list[int] | None, list[str]]]:
    """A chat choice's `logprobs.content` without its values: each token's text and bytes,
    and its most likely tokens' texts in order."""
    return [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in content]


def chat_values(content: list[Any]) -> list[float]:
    return [v for e in content for v in (e.logprob, *(t.logprob for t in e.top_logprobs))]


@pytest.mark.parametrize("path", ["local", "remote"])
def test_chat_logprobs_equal_vllms_own_streamed_or_not(stack: Stack, path: Path) -> None:
    ask: dict[str, Any] = dict(
        model=SERVED_MODEL_NAME, messages=CHATS[path], max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, top_logprobs=TOP,
    )  # fmt: skip
    want = stack.direct.chat.completions.create(**ask)
    before = transferred(stack.decode)
    got = stack.router.chat.completions.create(**ask)
    num_transferred = transferred(stack.decode) - before
    assert got.usage is not None and want.usage is not None
    assert got.usage.prompt_tokens == want.usage.prompt_tokens  # one prompt, one template
    assert_path(path, num_transferred, got.usage.prompt_tokens)
    assert got.choices[0].logprobs is not None and want.choices[0].logprobs is not None
    content, expected = got.choices[0].logprobs.content, want.choices[0].logprobs.content
    assert content is not None and expected is not None
    assert len(content) == got.usage.completion_tokens == want.usage.completion_tokens
    assert chat_rows(content) == chat_rows(expected)
    assert_values(chat_values(content), chat_values(expected), path)
    for entry in content:  # greedy: the token is the most likely one
        assert len(entry.top_logprobs) == TOP
        top = entry.top_logprobs[0]
        assert (entry.token, entry.logprob) == (top.token, top.logprob)
    # The end-of-sequence token that ended the answer is listed, though the text leaves it out.
    num_text = len(content) - (got.choices[0].finish_reason == "stop")
    assert "".join(e.token for e in content[:num_text]) == got.choices[0].message.content
    streamed: list[Any] = []
    for chunk in stack.router.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.content or []
    assert chat_rows(streamed) == chat_rows(content)
    assert_values(chat_values(streamed), chat_values(content), path)


def completion_values(logprobs: Any) -> list[float]:
    return [*logprobs.token_logprobs, *(v for top in logprobs.top_logprobs for v in top.values())]


@pytest.mark.parametrize(("path", "k"), [("local", 0), ("local", TOP), ("remote", TOP)])
def test_completion_logprobs_equal_vllms_own_streamed_or_not(
    stack: Stack, path: Path, k: int
) -> None:
    ask: dict[str, Any] = dict(
        model=SERVED_MODEL_NAME, prompt=PROMPTS[path], max_tokens=MAX_TOKENS, temperature=0,
        logprobs=k,
    )  # fmt: skip
    want = stack.direct.completions.create(**ask)
    before = transferred(stack.decode)
    got = stack.router.completions.create(**ask)
    num_transferred = transferred(stack.decode) - before
    assert got.usage is not None and want.usage is not None
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert_path(path, num_transferred, got.usage.prompt_tokens)
    lp, expected = got.choices[0].logprobs, want.choices[0].logprobs
    assert lp is not None and expected is not None and lp.top_logprobs and expected.top_logprobs
    assert lp.tokens == expected.tokens and len(lp.tokens) == got.usage.completion_tokens
    assert [list(top) for top in lp.top_logprobs] == [list(top) for top in expected.top_logprobs]
    assert lp.text_offset == expected.text_offset
    assert_values(completion_values(lp), completion_values(expected), path)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == max(k, 1)  # greedy: the token is among the k most likely
        assert next(iter(top.items())) == (token, value)
    streamed: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for chunk in stack.router.completions.create(**ask, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key, items in streamed.items():
                items += getattr(chunk.choices[0].logprobs, key) or []
    assert streamed["tokens"] == lp.tokens
    assert_values(streamed["token_logprobs"], lp.token_logprobs or [], path)
    assert [list(top) for top in streamed["top_logprobs"]] == [list(t) for t in lp.top_logprobs]


def test_logit_bias_forces_or_bans_a_token_as_vllm_does(stack: Stack, codec: TextCodec) -> None:
    """+100 on one token makes it every token, -100 on the greedy first token makes the second
    most likely one first; logprobs stay the model's own (before the bias), and the router's
    answers equal the decode server's to each request."""
    base: dict[str, Any] = dict(
        model=SERVED_MODEL_NAME, prompt=PROMPTS["local"], max_tokens=4, temperature=0, logprobs=2
    )  # fmt: skip
    plain = stack.router.completions.create(**base).choices[0].logprobs
    assert plain is not None and plain.tokens and plain.top_logprobs
    (forced,) = codec.encode(" banana")
    first_id = codec.encode(plain.tokens[0])
    assert len(first_id) == 1 and codec.token_text(first_id[0]) == plain.tokens[0]
    for bias, check in (({str(forced): 100}, "forced"), ({str(first_id[0]): -100}, "banned")):
        ask = {**base, "logit_bias": bias}
        got = stack.router.completions.create(**ask)
        want = stack.direct.completions.create(**ask)
        lp, expected = got.choices[0].logprobs, want.choices[0].logprobs
        assert lp is not None and expected is not None and lp.top_logprobs is not None
        assert (got.choices[0].text, lp.tokens, lp.token_logprobs, lp.top_logprobs) == (
            want.choices[0].text, expected.tokens, expected.token_logprobs, expected.top_logprobs
        )  # fmt: skip
        if check == "forced":
            assert lp.tokens == [codec.token_text(forced)] * 4
            assert lp.token_logprobs is not None  # the model's own: not what it expected
            assert lp.token_logprobs[0] < max(lp.top_logprobs[0].values())
        else:
            second = list(plain.top_logprobs[0])[1]
            assert lp.tokens[0] == second != plain.tokens[0]
            assert lp.top_logprobs[0] == plain.top_logprobs[0]  # same position, unbiased values


def test_n_choices_are_the_answers_to_each_choices_seed_and_echo_leads_with_the_prompt(
    stack: Stack,
) -> None:
    """n=3 with a seed through the router: choice i is the answer to the same request with
    `n: 1` and seed + i (each choice is one request to vLLM); `echo` puts the prompt first."""
    base: dict[str, Any] = dict(
        model=SERVED_MODEL_NAME, prompt=PROMPTS["local"], max_tokens=6, temperature=1.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    got = stack.router.completions.create(n=3, seed=21, **base)
    assert [c.index for c in got.choices] == [0, 1, 2]
    for index, choice in enumerate(got.choices):
        want = stack.router.completions.create(seed=21 + index, **base)
        assert choice.text == want.choices[0].text
    assert got.usage is not None and got.usage.completion_tokens == 3 * 6
    assert len({c.text for c in got.choices}) > 1
    echoed = stack.router.completions.create(seed=21, echo=True, **base)
    assert echoed.choices[0].text == PROMPTS["local"] + got.choices[0].text


ORDER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "rooms": {"type": "integer", "minimum": 1, "maximum": 9},
        "view": {"enum": ["sea", "garden", "street"]},
    },
    "required": ["city", "rooms", "view"],
    "additionalProperties": False,
}
BOOK = {
    "type": "function",
    "function": {"name": "book", "description": "Book rooms in a hotel.", "parameters": ORDER},
}


@pytest.mark.parametrize("path", ["local", "remote"])
def test_structured_outputs_and_forced_tool_calls_hold_through_a_vllm_pool(
    stack: Stack, path: Path
) -> None:
    """The router's grammar reaches the decode server (vLLM's llguidance backend) whichever
    server prefilled: the answer validates against the schema, a forced call's arguments too."""
    import jsonschema

    schema_format = {"type": "json_schema",
                     "json_schema": {"name": "order", "schema": ORDER, "strict": True}}  # fmt: skip
    before = transferred(stack.decode)
    got = stack.router.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=CHATS[path], max_tokens=120, temperature=0,
        response_format=schema_format,  # type: ignore[arg-type]
    )  # fmt: skip
    assert got.usage is not None
    assert_path(path, transferred(stack.decode) - before, got.usage.prompt_tokens)
    assert got.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got.choices[0].message.content or ""), ORDER)
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stack.router.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=CHATS[path], max_tokens=160, temperature=0,
        tools=[BOOK], tool_choice="required", parallel_tool_calls=False, stream=True,  # type: ignore[list-item]
    ):  # fmt: skip
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.function is not None:
                    calls.setdefault(delta.index, []).append(delta.function.arguments or "")
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    jsonschema.validate(json.loads("".join(calls[0])), ORDER)


@pytest.mark.parametrize("path", ["local", "remote"])
def test_the_responses_api_through_a_vllm_pool_is_its_chat_completion(
    stack: Stack, path: Path
) -> None:
    """`/v1/responses` reaches a vLLM pool the way chat completions do (the router turns one into
    the other before choosing a server): the answer is the chat completion of the same
    conversation, token for token, streamed or not; `text.format` json_schema and a required
    function tool hold, whichever server prefilled."""
    import jsonschema

    question = CHATS[path][0]["content"]
    assert isinstance(question, str)
    before = transferred(stack.decode)
    response = stack.router.responses.create(
        model=SERVED_MODEL_NAME, input=question, max_output_tokens=MAX_TOKENS, temperature=0
    )
    assert response.usage is not None
    assert_path(path, transferred(stack.decode) - before, response.usage.input_tokens)
    chat = stack.router.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=CHATS[path], max_tokens=MAX_TOKENS, temperature=0
    )
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]
    events = list(stack.router.responses.create(
        model=SERVED_MODEL_NAME, input=question, max_output_tokens=MAX_TOKENS, temperature=0,
        stream=True,
    ))  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text
    assert events[-1].type in ("response.completed", "response.incomplete")

    shaped = stack.router.responses.create(
        model=SERVED_MODEL_NAME, input=question, max_output_tokens=120, temperature=0,
        text={"format": {"type": "json_schema", "name": "order", "schema": ORDER,
                         "strict": True}},
    )  # fmt: skip
    assert shaped.status == "completed"
    jsonschema.validate(json.loads(shaped.output_text), ORDER)
    tool = {"type": "function", "name": "book", "parameters": ORDER,
            "description": "Book rooms in a hotel."}  # fmt: skip
    called = stack.router.responses.create(
        model=SERVED_MODEL_NAME, input=question, max_output_tokens=160, temperature=0,
        tools=[tool], tool_choice="required", parallel_tool_calls=False,  # type: ignore[list-item]
    )  # fmt: skip
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "book"
    jsonschema.validate(json.loads(calls[0].arguments), ORDER)
