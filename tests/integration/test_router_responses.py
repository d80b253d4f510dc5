"""POST /v1/responses end to end: the real `openai` client (and the OpenAI Agents SDK) against a
real router and a real SmolLM2 worker.

One colocated worker and one router over the session's real etcd and NATS. Greedy sampling
throughout, so a Response's text can be compared with the chat completion of the same
conversation, which serves it (`kvrail.router.api.responses_api`), and a stream with the whole
body. Every test ends with the worker's blocks free.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from nats.aio.client import Client as NatsClient
from pydantic import BaseModel

from kvrail.bus import connect
from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.testing.pool import LocalPool

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France? Answer in one sentence."
INSTRUCTIONS = "You are a geography teacher."
PORT, THINK_PORT = free_port(), free_port()
URL = f"http://127.0.0.1:{PORT}/v1"
# The second router's template is a reasoning model's: its generation prompt opens `<think>`,
# unless the request turns thinking off (`reasoning.effort: none`), which closes it empty.
THINK_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def pool(
    etcd_server: EtcdServer, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPool]:
    env = {"KVRAIL_DISAGGREGATION_MODE": "colocated", "KVRAIL_NUM_KV_BLOCKS": "128",
           "KVRAIL_MAX_MODEL_LEN": "1024", "KVRAIL_REQUEST_TIMEOUT_S": "120"}  # fmt: skip
    logs = tmp_path_factory.mktemp("responses-pool")
    (logs / "think.jinja").write_text(THINK_TEMPLATE)
    p = LocalPool(etcd_server, nats_server, logs, f"resp-{uuid.uuid4().hex[:8]}", env)
    try:
        p.start("colo-0", "colocated")
        p.wait_ready("colo-0")
        p.start_router("router", KVRAIL_HTTP_PORT=str(PORT))
        p.start_router("router-think", KVRAIL_HTTP_PORT=str(THINK_PORT),
                       KVRAIL_CHAT_TEMPLATE=str(logs / "think.jinja"))  # fmt: skip
        p.wait_ready("router")
        p.wait_ready("router-think")
        yield p
    finally:
        p.stop()


@pytest.fixture
async def nc(pool: LocalPool) -> AsyncIterator[NatsClient]:
    client_ = await connect(pool.settings, "responses-test")
    yield client_
    await pool.assert_all_blocks_free(client_)
    await client_.close()


def client(pool: LocalPool, port: int = PORT) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


def chat_text(pool: LocalPool, max_tokens: int, **messages: str) -> tuple[str, str]:
    """The chat completion of the same conversation: its text and finish reason."""
    turns: list[Any] = [{"role": role, "content": text} for role, text in messages.items()]
    done = client(pool).chat.completions.create(
        model=MODEL, messages=turns, max_tokens=max_tokens, temperature=0
    )
    return done.choices[0].message.content or "", done.choices[0].finish_reason


@pytest.mark.usefixtures("nc")
def test_a_response_is_the_chat_completion_of_the_same_conversation(pool: LocalPool) -> None:
    response = client(pool).responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=32,
        temperature=0, metadata={"run": "1"},
    )  # fmt: skip
    text, finish = chat_text(pool, 32, system=INSTRUCTIONS, user=QUESTION)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == MODEL and response.metadata == {"run": "1"}
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == text and "Paris" in text
    # The chat's finish reason, as the Responses API says it.
    expected = ("completed", "completed") if finish == "stop" else ("incomplete", "incomplete")
    assert (response.status, message.status) == expected
    if finish == "length":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert usage is not None and usage.input_tokens > 10 and 0 < usage.output_tokens <= 32
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.temperature == 0 and response.store is False  # type: ignore[attr-defined]


@pytest.mark.usefixtures("nc")
def test_a_streamed_response_tells_the_same_response_event_by_event(pool: LocalPool) -> None:
    c = client(pool)
    whole = c.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
    stream = c.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0, stream=True
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:5] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
    ]  # fmt: skip
    last = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        last,
    ]  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text and len(deltas) > 1
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The stream helper accumulates the same response.
    with c.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=12,
                            temperature=0) as stream:  # fmt: skip
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert text == stream.get_final_response().output_text == whole.output_text


@pytest.mark.usefixtures("nc")
def test_earlier_turns_given_as_items_make_the_same_prompt_as_chat_messages(
    pool: LocalPool,
) -> None:
    items: Any = [
        {"role": "developer", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
        {"role": "user", "content": "Name a country in Europe."},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "France.", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Its capital?"}]},
    ]  # fmt: skip
    response = client(pool).responses.create(
        model=MODEL, input=items, max_output_tokens=16, temperature=0
    )
    turns: Any = [
        {"role": "developer", "content": INSTRUCTIONS},
        {"role": "user", "content": "Name a country in Europe."},
        {"role": "assistant", "content": "France."},
        {"role": "user", "content": "Its capital?"},
    ]
    chat = client(pool).chat.completions.create(
        model=MODEL, messages=turns, max_tokens=16, temperature=0
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.usefixtures("nc")
def test_logprobs_asked_by_include_are_the_chat_completions(pool: LocalPool) -> None:
    c = client(pool)
    response = c.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0, top_logprobs=2,
        include=["message.output_text.logprobs"],
    )  # fmt: skip
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    expected = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert expected is not None and len(part.logprobs) == len(expected) == 6
    for got, want in zip(part.logprobs, expected, strict=True):
        assert (got.token, got.bytes) == (want.token, want.bytes)
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
    streamed = c.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0, top_logprobs=2,
        include=["message.output_text.logprobs"], stream=True,
    )  # fmt: skip
    tokens = [lp.token for e in streamed if e.type == "response.output_text.delta"
              for lp in e.logprobs]  # fmt: skip
    assert tokens == [lp.token for lp in part.logprobs]


@pytest.mark.usefixtures("nc")
def test_what_a_stateless_server_cannot_do_is_refused_by_name(pool: LocalPool) -> None:
    c = client(pool)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0.type"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["reasoning.encrypted_content"]}, "include.0"),
    ]  # fmt: skip
    for fields, param in cases:
        body: dict[str, Any] = {"model": MODEL, "input": QUESTION, **fields}
        with pytest.raises(openai.BadRequestError) as info:
            c.responses.create(**body)
        error = info.value.body
        assert isinstance(error, dict), fields
        assert (error["param"], error["code"]) == (param, "unsupported_parameter"), fields
        assert info.value.response.headers["x-request-id"].startswith("resp_")
    with pytest.raises(openai.BadRequestError, match="unrecognized request argument"):
        c.responses.create(model=MODEL, input=QUESTION, extra_body={"nonsense": 1})
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(model=MODEL, input=QUESTION, max_output_tokens=5000)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "max_output_tokens"
    # Omitted, `store` is served (nothing is kept), and the response says so.
    ok = c.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, store=False)
    assert ok.status == "incomplete" and ok.store is False  # type: ignore[attr-defined]


@pytest.mark.usefixtures("nc")
def test_a_reasoning_models_thinking_is_a_reasoning_item_before_the_answer(
    pool: LocalPool,
) -> None:
    c = client(pool, THINK_PORT)
    args: dict[str, Any] = {"model": MODEL, "max_output_tokens": 48, "temperature": 0}
    response = c.responses.create(input=QUESTION, **args)
    chat = c.chat.completions.create(
        messages=[{"role": "user", "content": QUESTION}], model=MODEL, max_tokens=48,
        temperature=0,
    ).choices[0]  # fmt: skip
    thinking = getattr(chat.message, "reasoning_content", None)
    assert thinking  # the template opened the thinking: the answer starts with it
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [part.text for part in reasoning.content or ()] == [thinking]
    assert response.output_text == (chat.message.content or "")
    usage = response.usage
    assert usage is not None and usage.output_tokens_details.reasoning_tokens > 0
    assert usage.output_tokens_details.reasoning_tokens <= usage.output_tokens
    # Streamed: the reasoning in reasoning_text deltas, the same response at the end.
    events = list(c.responses.create(input=QUESTION, stream=True, **args))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == thinking
    streamed = events[-1].response.output  # type: ignore[union-attr]
    assert [i.model_dump(exclude={"id"}) for i in streamed] == [
        i.model_dump(exclude={"id"}) for i in response.output
    ]
    # Thinking turned off (the template closes it): no reasoning item, only the answer.
    off = c.responses.create(input=QUESTION, reasoning={"effort": "none"}, **args)
    assert [item.type for item in off.output] == ["message"] and off.output_text


# -- tools and structured output (the grammar forces SmolLM2's calls: it makes none unasked) ----

WEATHER: Any = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False},
    "strict": True,
}  # fmt: skip
WEATHER_QUESTION = "What is the weather in Paris?"


def chat_tool(tool: dict[str, Any]) -> Any:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


@pytest.mark.usefixtures("nc")
def test_a_required_tool_call_is_a_function_call_item_as_chat_makes_it(pool: LocalPool) -> None:
    c = client(pool)
    response = c.responses.create(
        model=MODEL, input=WEATHER_QUESTION, tools=[WEATHER], tool_choice="required",
        max_output_tokens=64, temperature=0,
    )  # fmt: skip
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": WEATHER_QUESTION}],
        tools=[chat_tool(WEATHER)], tool_choice="required", max_tokens=64, temperature=0,
    )  # fmt: skip
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) >= 1 and response.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    arguments = json.loads(call.arguments)  # the grammar held them to the function's schema
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    chat_calls = chat.choices[0].message.tool_calls or []
    assert [(t.function.name, t.function.arguments) for t in chat_calls] == [  # type: ignore[union-attr]
        (item.name, item.arguments) for item in calls
    ]
    # Streamed: the same call, its arguments in deltas that join to them.
    events = list(c.responses.create(
        model=MODEL, input=WEATHER_QUESTION, tools=[WEATHER], tool_choice="required",
        max_output_tokens=64, temperature=0, stream=True,
    ))  # fmt: skip
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added[0].item.type == "function_call" and added[0].item.name == "get_weather"  # type: ignore[union-attr]
    deltas = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
        and e.output_index == added[0].output_index
    )  # fmt: skip
    assert deltas == call.arguments
    assert events[-1].type == "response.completed"


@pytest.mark.usefixtures("nc")
def test_a_function_call_output_round_trip_answers_from_the_result(pool: LocalPool) -> None:
    c = client(pool)
    first = c.responses.create(
        model=MODEL, input=WEATHER_QUESTION, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=64, temperature=0,
    )  # fmt: skip
    [call] = [item for item in first.output if item.type == "function_call"]
    result = "It is sunny and 24 degrees in Paris."
    history: Any = [
        {"role": "user", "content": WEATHER_QUESTION},
        *[item.model_dump(exclude_none=True) for item in first.output],  # replayed as the SDKs do
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    second = c.responses.create(
        model=MODEL, input=history, tools=[WEATHER], tool_choice="none", max_output_tokens=32,
        temperature=0,
    )  # fmt: skip
    # The same conversation as chat messages: the same prompt, so the same answer.
    chat = c.chat.completions.create(
        model=MODEL, tools=[chat_tool(WEATHER)], tool_choice="none", max_tokens=32,
        temperature=0, messages=[
            {"role": "user", "content": WEATHER_QUESTION},
            {"role": "assistant", "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": result},
        ],
    )  # fmt: skip
    assert [item.type for item in second.output] == ["message"]
    assert second.output_text == chat.choices[0].message.content and second.output_text
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]


@pytest.mark.usefixtures("nc")
def test_text_format_json_schema_answers_json_valid_against_it(pool: LocalPool) -> None:
    schema = {
        "type": "object",
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
        "required": ["country", "capital"], "additionalProperties": False,
    }  # fmt: skip
    response = client(pool).responses.create(
        model=MODEL, input="Name a country and its capital, as JSON.", max_output_tokens=64,
        temperature=0, text={"format": {"type": "json_schema", "name": "capital",
                                        "schema": schema, "strict": True}},
    )  # fmt: skip
    answer = json.loads(response.output_text)
    assert set(answer) == {"country", "capital"}
    assert all(isinstance(v, str) for v in answer.values())
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"
    # The client's own helper: a pydantic model as the schema, the answer parsed into it.
    parsed = client(pool).responses.parse(
        model=MODEL, input="Name a country and its capital, as JSON.", max_output_tokens=64,
        temperature=0, text_format=Capital,
    )  # fmt: skip
    assert isinstance(parsed.output_parsed, Capital)
    assert parsed.output_parsed.model_dump() == json.loads(parsed.output_text)


class Capital(BaseModel):
    country: str
    capital: str


# -- the OpenAI Agents SDK -------------------------------------------------------------------------


def _agent_client(hosts: list[str], bodies: list[Any] | None = None) -> Any:
    """An async client for the router that records every host it is asked to reach (and the
    bodies it sends, into `bodies`)."""

    async def record(request: Any) -> None:
        hosts.append(request.url.host)
        if bodies is not None:
            bodies.append(json.loads(request.content))

    http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [record]})
    return openai.AsyncOpenAI(base_url=URL, api_key="none", max_retries=0, http_client=http)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
@pytest.mark.usefixtures("nc")
def test_an_agent_with_one_function_tool_completes_a_run(pool: LocalPool, api: str) -> None:
    """The Agents SDK's run loop against the router, through its default model (the Responses
    API) and through its chat-completions model. SmolLM2 calls no tool unasked, so the agent
    forces one (`tool_choice: required`, enforced by the grammar; `parallel_tool_calls: false`,
    or SmolLM2 calls it twice) and stops at it
    (`stop_on_first_tool`: the tool's result is the run's final output, no second model turn
    whose text SmolLM2 would decide). What is asserted: the SDK made one model request, to the
    router only (tracing off, an explicit client: nothing reached api.openai.com); the model's
    call named the tool with arguments valid against its schema; the SDK ran the tool with
    them; and the run ended with the tool's result as its output."""
    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    hosts: list[str] = []
    client_ = _agent_client(hosts)
    model = (
        OpenAIResponsesModel(MODEL, client_) if api == "responses"
        else OpenAIChatCompletionsModel(MODEL, client_)
    )  # fmt: skip
    agent = Agent(
        name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
        model=model, tool_use_behavior="stop_on_first_tool",
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64
        ),
    )  # fmt: skip
    result = asyncio.run(Runner.run(agent, WEATHER_QUESTION, max_turns=2))
    assert len(result.raw_responses) == 1 and set(hosts) == {"127.0.0.1"}
    assert len(cities) == 1 and result.final_output == f"It is sunny in {cities[0]}."
    calls = [i.raw_item for i in result.new_items if i.type == "tool_call_item"]
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert len(calls) == 1 and len(outputs) == 1
    assert getattr(calls[0], "name", None) == "get_weather"
    assert json.loads(getattr(calls[0], "arguments", "")) == {"city": cities[0]}


@pytest.mark.usefixtures("nc")
def test_an_agent_answers_from_its_tools_result_the_same_through_either_api(
    pool: LocalPool,
) -> None:
    """The SDK's default loop: a forced call on the first turn, the tool run, its result sent
    back (a `function_call_output` item, or a `tool` message through chat completions) with
    `tool_choice` reset (`reset_tool_choice`, the default), and the model's answer ending the
    run. Asserted: two model requests each, the second carrying the tool's result; the same
    final answer through the Responses API as through chat completions (greedy, and the same
    conversation makes the same prompt), which is the run's output."""
    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"It is sunny in {city}."

    answers, sent = {}, {}
    for api in ("responses", "chat_completions"):
        hosts: list[str] = []
        bodies: list[Any] = []
        client_ = _agent_client(hosts, bodies)
        model = (
            OpenAIResponsesModel(MODEL, client_) if api == "responses"
            else OpenAIChatCompletionsModel(MODEL, client_)
        )  # fmt: skip
        agent = Agent(
            name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
            model=model, model_settings=ModelSettings(
                tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64
            ),
        )  # fmt: skip
        result = asyncio.run(Runner.run(agent, WEATHER_QUESTION, max_turns=4))
        assert set(hosts) == {"127.0.0.1"} and len(result.raw_responses) == len(bodies) == 2
        assert [i.type for i in result.new_items] == [
            "tool_call_item", "tool_call_output_item", "message_output_item",
        ]  # fmt: skip
        answers[api] = result.final_output
        sent[api] = bodies[1]
    assert answers["responses"] == answers["chat_completions"] and answers["responses"]
    [output] = [i for i in sent["responses"]["input"] if i.get("type") == "function_call_output"]
    [tool] = [m for m in sent["chat_completions"]["messages"] if m["role"] == "tool"]
    assert output["output"] == tool["content"] and output["output"].startswith("It is sunny in")
    assert "tool_choice" not in sent["responses"]  # reset after the call: the model may answer
