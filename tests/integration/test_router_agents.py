"""What agents and structured-output clients send, end to end: the real `openai` client against
router processes in front of a real kvrail decode worker (SmolLM2 on CPU), over real etcd and
NATS.

Three routers share the pool: `router-tools` renders tools with a Hermes-style chat template
given here (SmolLM2's own ignores tools), `router-plain` keeps SmolLM2's template (so it gets
kvrail's default tool prompt), and `router-think` has a template whose generation prompt opens
`<think>` (a reasoning model's). Greedy decoding throughout, so a streamed answer must equal
the whole one. Every test ends with every worker's blocks free.

Forced outputs (`parse`, `tool_choice: required` or named, `structured_outputs`) need the
worker to enforce `SamplingParams.grammar`; the router's side (grammar built, validated,
parsed back) is what these tests drive.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from nats.aio.client import Client as NatsClient
from openai.types.chat import ChatCompletionMessageParam
from pydantic import BaseModel, ConfigDict, Field

from kvrail.bus import connect
from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.testing.pool import LocalPool

POOL = f"ag-{uuid.uuid4().hex[:8]}"
MODEL = "SmolLM2-135M-Instruct"
PORTS = {"router-tools": free_port(), "router-plain": free_port(), "router-think": free_port()}

# ChatML as SmolLM2 knows it, with tools stated in the system turn, calls written in the Hermes
# format and tool results given back as user turns.
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call these functions, one JSON object each:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, write <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}{% if not (loop.first and message.role == 'system') %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# A reasoning model's template: the generation prompt opens the thinking, unless the request
# turns it off (`reasoning_effort: none` sets enable_thinking false), which closes it empty.
THINK_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather like in Paris today?"}
]


# Schemas that bound every value: a 135M model held to a schema writes what it allows, and an
# unbounded integer or extra properties let it ramble until max_tokens.
class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


class CityFacts(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=99)


def function(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function",
            "function": {"name": name, "description": description, "parameters": parameters,
                         "strict": True}}  # fmt: skip


WEATHER = function("get_weather", "The weather in a city now.", Weather.model_json_schema())
TIME = function(
    "get_time", "The local time in a time zone.",
    {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
     "required": ["zone"], "additionalProperties": False},
)  # fmt: skip


@pytest.fixture(scope="module")
def pool(
    etcd_server: EtcdServer, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPool]:
    logs = tmp_path_factory.mktemp("agents-pool")
    (logs / "tools.jinja").write_text(TOOLS_TEMPLATE)
    (logs / "think.jinja").write_text(THINK_TEMPLATE)
    env = {
        "KVRAIL_MIN_REMOTE_PREFILL_TOKENS": "100000",
        "KVRAIL_NUM_KV_BLOCKS": "256",
        "KVRAIL_MAX_MODEL_LEN": "2048",
        "KVRAIL_REQUEST_TIMEOUT_S": "120",
    }
    p = LocalPool(etcd_server, nats_server, logs, POOL, env)
    templates = {"router-tools": "tools.jinja", "router-think": "think.jinja"}
    try:
        p.start("decode-0", "decode")
        p.wait_ready("decode-0")
        for name, port in PORTS.items():
            extra = (
                {"KVRAIL_CHAT_TEMPLATE": str(logs / templates[name])} if name in templates else {}
            )
            p.start_router(name, KVRAIL_HTTP_PORT=str(port), **extra)
        for name in PORTS:
            p.wait_ready(name)
        yield p
    finally:
        p.stop()


def client(router: str = "router-tools") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{PORTS[router]}/v1", api_key="sk-none", max_retries=0
    )


@pytest.fixture
async def nc(pool: LocalPool) -> AsyncIterator[NatsClient]:
    client_ = await connect(pool.settings, "agents-test")
    yield client_
    await pool.assert_all_blocks_free(client_)
    await client_.close()


def streamed_calls(chunks: list[Any]) -> tuple[str, list[dict[str, Any]], list[str | None]]:
    """A streamed chat's content, its calls joined from their deltas, and finish reasons."""
    content, calls, finishes = "", {}, []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finishes.append(choice.finish_reason)
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            if delta.id is not None:  # a call's first delta names it
                assert delta.index not in calls and delta.type == "function"
                assert delta.function is not None and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            calls[delta.index]["arguments"] += (delta.function and delta.function.arguments) or ""
    return content, [calls[i] for i in sorted(calls)], finishes


@pytest.mark.usefixtures("nc")
def test_parse_with_a_pydantic_model_returns_the_parsed_object() -> None:
    reply = client("router-plain").chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Give facts about Paris as JSON."}],
        response_format=CityFacts, max_tokens=80, temperature=0,
    )  # fmt: skip
    message = reply.choices[0].message
    assert isinstance(message.parsed, CityFacts), message.content
    assert CityFacts.model_validate_json(message.content or "") == message.parsed


@pytest.mark.usefixtures("nc")
@pytest.mark.parametrize("router", ["router-tools", "router-plain"])
def test_a_required_tool_call_validates_against_its_schema_streamed_or_not(router: str) -> None:
    c = client(router)
    args: dict[str, Any] = dict(
        model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=96, temperature=0,
    )  # fmt: skip
    whole = c.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and choice.message.content is None
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        schema = Weather if call.function.name == "get_weather" else None
        arguments = json.loads(call.function.arguments)
        if schema is not None:
            schema.model_validate(arguments)
        else:
            assert call.function.name == "get_time" and arguments["zone"] in ("UTC", "CET")
    content, streamed, finishes = streamed_calls(
        list(c.chat.completions.create(**args, stream=True))
    )
    assert content == "" and finishes[-1] == "tool_calls"
    assert [(s["name"], s["arguments"]) for s in streamed] == [
        (call.function.name, call.function.arguments) for call in calls
    ]


@pytest.mark.usefixtures("nc")
def test_a_named_tool_choice_calls_that_function_once() -> None:
    reply = client().chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=64, temperature=0,
    )  # fmt: skip
    calls = reply.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_time"]
    assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET")


@pytest.mark.usefixtures("nc")
def test_each_choice_is_parsed_on_its_own_and_keeps_its_logprobs() -> None:
    c = client()
    args: dict[str, Any] = dict(
        model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=64, temperature=0, n=2, logprobs=True,
    )  # fmt: skip
    whole = c.chat.completions.create(**args)
    assert [ch.index for ch in whole.choices] == [0, 1]
    for choice in whole.choices:
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == "tool_calls" and len(calls) == 1
        assert choice.logprobs is not None and choice.logprobs.content
    assert whole.usage is not None
    assert sum(len(ch.logprobs.content or []) for ch in whole.choices if ch.logprobs) == (
        whole.usage.completion_tokens
    )
    chunks = list(c.chat.completions.create(**args, stream=True))
    for index, choice in enumerate(whole.choices):
        mine = [ch for ch in chunks if ch.choices and ch.choices[0].index == index]
        _, calls, finishes = streamed_calls(mine)
        assert finishes[-1] == "tool_calls"
        assert [(k["name"], k["arguments"]) for k in calls] == [
            (k.function.name, k.function.arguments) for k in choice.message.tool_calls or []
        ]
        entries = [
            e for ch in mine if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content or ()
        ]
        assert choice.logprobs is not None
        assert len(entries) == len(choice.logprobs.content or [])


@pytest.mark.usefixtures("nc")
@pytest.mark.parametrize("router", ["router-tools", "router-plain"])
def test_a_tool_round_trip_call_result_then_answer(router: str) -> None:
    c = client(router)
    first = c.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_tokens=64, temperature=0,
    )  # fmt: skip
    message = first.choices[0].message
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    history: list[Any] = [
        *QUESTION,
        message,  # as agent loops append it: the client's own message object
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    answer = c.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=24,
        temperature=0,
    )  # fmt: skip
    final = answer.choices[0]
    assert final.finish_reason in ("stop", "length") and final.message.tool_calls is None
    assert final.message.content
    assert answer.usage is not None and answer.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


@pytest.mark.usefixtures("nc")
def test_structured_outputs_choice_and_regex_on_completions_and_chat() -> None:
    c = client()
    choice = c.completions.create(
        model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert choice.choices[0].text in ("yes", "no")
    regex = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give a phone number."}],
        max_tokens=24, temperature=0, extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
    )  # fmt: skip
    text = regex.choices[0].message.content or ""
    assert len(text) == 8 and text[3] == "-" and (text[:3] + text[4:]).isdigit(), text
    # A regex that makes a backtracking engine take exponential time is linear here.
    started = time.monotonic()
    served = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say aaa."}], max_tokens=8,
        temperature=0, extra_body={"structured_outputs": {"regex": "(a+)+b"}},
    )  # fmt: skip
    assert served.choices[0].message.content is not None and time.monotonic() - started < 30


@pytest.mark.usefixtures("nc")
def test_reasoning_is_split_from_the_answer_streamed_or_not() -> None:
    c = client("router-think")
    args: dict[str, Any] = dict(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    whole = c.chat.completions.create(**args).choices[0].message
    reasoning = getattr(whole, "reasoning_content", None)
    assert reasoning and getattr(whole, "reasoning", None) == reasoning
    assert "<think>" not in reasoning and "</think>" not in reasoning
    chunks = list(c.chat.completions.create(**args, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == (whole.content or "")
    # Thinking turned off by the template: no reasoning, the text is the answer.
    off = c.chat.completions.create(**args, reasoning_effort="none").choices[0].message
    assert getattr(off, "reasoning_content", None) is None and off.content


async def test_hostile_inputs_get_a_400_naming_the_field_and_no_stream_stalls(
    pool: LocalPool, nc: NatsClient
) -> None:
    """Every hostile body is refused by name while another client streams; that stream's
    longest gap between tokens while they are refused stays short (measured, printed), and no
    block is left behind."""
    chat_url = f"http://127.0.0.1:{PORTS['router-tools']}/v1/chat/completions"
    base = {"model": MODEL, "messages": QUESTION, "max_tokens": 4}

    def schema_format(schema: Any) -> dict[str, Any]:
        return {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": True},
        }

    deep = '{"type":"object","properties":{"a":' * 10_000 + '{"type":"string"}' + "}}" * 10_000
    bodies: list[tuple[str, bytes, str]] = [
        ("dangling $ref", _body(base, response_format=schema_format({"$ref": "#/$defs/Gone"})),
         "response_format.json_schema.schema"),
        ("10 MB schema", _body(base, response_format=schema_format(
            {"type": "object", "description": "x" * (10 << 20)})),
         "response_format.json_schema.schema"),
        ("10 MB enum", _body(base, response_format=schema_format(
            {"enum": [f"v{i}" for i in range(1_200_000)]})), "response_format"),
        ("10,000 deep", _body(base, response_format=schema_format("@")).replace(
            b'"@"', deep.encode()), "response_format.json_schema.schema"),
        ("200 deep", _body(base, response_format=schema_format(json.loads(
            '{"type":"object","properties":{"a":' * 100 + "{}" + "}}" * 100))),
         "response_format.json_schema.schema"),
        ("unsupported keyword", _body(base, response_format=schema_format({"not": {}})),
         "response_format.json_schema.schema"),
        ("invalid tool schema", _body(base, tools=[function("f", "", {"type": "frobnicate"})]),
         "tools.0.function.parameters"),
        ("remote $ref", _body(base, tools=[function("f", "", {"$ref": "https://x.test/s"})]),
         "tools.0.function.parameters"),
        ("broken regex", _body(base, structured_outputs={"regex": "(abc"}),
         "structured_outputs.regex"),
    ]  # fmt: skip
    story = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
             "max_tokens": 300, "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    arrivals: list[float] = []
    running = asyncio.Event()
    hostile = (0.0, 0.0)
    async with httpx.AsyncClient(timeout=120) as http:

        async def follow() -> None:
            async with http.stream("POST", chat_url, json=story) as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())
                        if len(arrivals) == 5:
                            running.set()

        streaming = asyncio.create_task(follow())
        await running.wait()
        started = time.monotonic()
        for name, body, param in bodies:
            answer = await http.post(
                chat_url, content=body, headers={"content-type": "application/json"}
            )
            assert answer.status_code == 400, (name, answer.text[:300])
            error = answer.json()["error"]
            assert error["param"] == param and len(error["message"]) < 400, (name, error)
        hostile = (started, time.monotonic())
        await streaming
    gaps = list(itertools.pairwise(arrivals))
    during = [b - a for a, b in gaps if hostile[0] <= b <= hostile[1] + 0.5]
    before = [b - a for a, b in gaps if b < hostile[0]]
    print(
        f"hostile bodies refused in {hostile[1] - hostile[0]:.2f} s; the stream's longest gap "
        f"between chunks then {max(during):.3f} s (before them {max(before):.3f} s)"
    )
    assert len(arrivals) >= 300 and during
    assert max(during) < 1.0, during
    await pool.assert_all_blocks_free(nc, timeout_s=30)


def _body(base: dict[str, Any], **fields: Any) -> bytes:
    return json.dumps({**base, **fields}).encode()
