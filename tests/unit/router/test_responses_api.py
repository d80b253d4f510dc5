"""The Responses API at the router's edge (`kvrail.router.api.responses_api`): what a request
may say (a table of refusals by name), its translation to the chat completion that serves it,
and the Response and events rendered from that completion's pieces, checked against the real
`openai` client (its types, and its parser through an in-memory HTTP transport)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import openai
import pytest
from fastapi.openapi.utils import get_openapi
from openai.types.responses import Response as OpenAIResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from kvrail.router.api.errors import ApiError, validation_error
from kvrail.router.api.responses_api import documented_route
from kvrail.router.api.responses_api.body import ResponseObject, restated
from kvrail.router.api.responses_api.output import Output
from kvrail.router.api.responses_api.render import ResponseRender
from kvrail.router.api.responses_api.request import ResponsesRequest
from kvrail.router.api.responses_api.translate import Translation
from kvrail.router.api.sampling import Defaults
from kvrail.router.api.streaming import Last, Piece, Reply
from kvrail.router.output.piece import ToolCallDelta

try:  # the openai client 3.x speaks httpx2, older ones httpx
    import httpx2 as http
except ImportError:  # pragma: no cover
    import httpx as http  # type: ignore[no-redef]

SECRET = "SECRET-PROMPT-TEXT"
BASE: dict[str, Any] = {"model": "m", "input": SECRET}
TOOL = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False},
    "strict": True,
}  # fmt: skip
# What the OpenAI Agents SDK 0.24 sent for an agent with one function tool (captured from its
# default Responses model through an in-memory transport): the first turn, and the second with
# the call and its output.
AGENTS_FIRST = {
    "model": "m", "include": [], "input": [{"content": "Weather in Paris?", "role": "user"}],
    "instructions": "Be brief.", "tool_choice": "required", "tools": [TOOL],
}  # fmt: skip
AGENTS_SECOND = {
    "model": "m", "include": [], "instructions": "Be brief.", "tools": [TOOL],
    "input": [
        {"content": "Weather in Paris?", "role": "user"},
        {"arguments": '{"city": "Paris"}', "call_id": "call_1", "name": "get_weather",
         "type": "function_call", "id": "fc_1", "status": "completed"},
        {"call_id": "call_1", "output": "sunny in Paris", "type": "function_call_output"},
    ],
}  # fmt: skip


def request(**changes: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({**BASE, **changes})


def refusal(**changes: Any) -> ApiError:
    with pytest.raises(ValidationError) as info:
        ResponsesRequest.model_validate({**BASE, **changes})
    err = validation_error(info.value)
    assert err.status == 400 and err.type == "invalid_request_error"
    assert SECRET not in err.message
    return err


# -- the request ---------------------------------------------------------------------------------

REFUSED_BY_NAME: list[tuple[dict[str, Any], str, str]] = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"conversation": "conv_1"}, "conversation", "stores no conversations"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
    ({"store": True}, "store", "omit store or send false"),
    ({"background": True}, "background", "background"),
    ({"truncation": "auto"}, "truncation", "never drops input"),
    ({"include": ["reasoning.encrypted_content"]}, "include.0", "only"),
    ({"tools": [TOOL, {"type": "web_search"}]}, "tools.1.type", "hosted tools"),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools.0.type", "hosted tools"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type", "hosted tools"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0", "stores no responses"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "web_search_call", "id": "ws_1"}]},
     "input.1.type", "hosted tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.1.type", "text only"),
    ({"input": [{"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.output.0.type", "text only"),
    ({"context_management": [{"type": "compaction"}]}, "context_management", "compact"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "param", "fragment"), REFUSED_BY_NAME)
def test_what_kvrail_does_not_serve_is_refused_by_name(
    changes: dict[str, Any], param: str, fragment: str
) -> None:
    err = refusal(**changes)
    assert (err.param, err.code) == (param, "unsupported_parameter")
    assert fragment in err.message


INVALID: list[tuple[dict[str, Any], str, str]] = [
    ({"input": []}, "input", "must not be empty"),
    ({"input": [3]}, "input.0", "an input item is an object"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", "Input should be"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input.0.content.0.text", "missing"),
    ({"input": [{"role": "user", "content": "\ud800"}]}, "input.0.content", "lone surrogate"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0.arguments",
     "missing"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
     "input.0.encrypted_content", "None"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name", "pattern"),
    ({"tool_choice": {"type": "function"}}, "tool_choice.name", "missing"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice",
     "not in tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
     "missing"),
    ({"text": {"format": {"type": "xml"}}}, "text.format", "one of those served"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "at most"),
    ({"metadata": {"k": 1}}, "metadata.k", "valid string"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options", "stream is true"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"temperature": "0"}, "temperature", "valid number"),
    ({"seed": 1}, "seed", "unrecognized request argument"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "param", "fragment"), INVALID)
def test_invalid_requests_get_a_400_naming_the_field(
    changes: dict[str, Any], param: str, fragment: str
) -> None:
    err = refusal(**changes)
    assert err.param == param and fragment in err.message, err.message


def test_what_the_agents_sdk_sends_is_accepted() -> None:
    first = ResponsesRequest.model_validate(AGENTS_FIRST)
    second = ResponsesRequest.model_validate(AGENTS_SECOND)
    assert first.tool_choice == "required" and first.store is None
    assert [type(item).__name__ for item in second.input] == [
        "MessageItem", "FunctionCallItem", "FunctionCallOutputItem",
    ]  # fmt: skip


# -- the translation -----------------------------------------------------------------------------


def test_instructions_and_text_input_become_a_system_and_a_user_message() -> None:
    t = Translation.of(request(instructions="Be brief.", max_output_tokens=9, temperature=0.5,
                               top_p=0.9, user="u", store=False, stream=True))  # fmt: skip
    assert t.body == {
        "model": "m", "stream": True, "max_completion_tokens": 9, "temperature": 0.5,
        "top_p": 0.9, "user": "u",
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": SECRET}],
    }  # fmt: skip
    chat = t.chat_request()
    assert chat.max_completion_tokens == 9 and chat.stream
    assert t.message_params == ("instructions", "input")


def test_items_become_the_messages_of_the_same_conversation() -> None:
    t = Translation.of(request(input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "a"},
                                          {"type": "input_text", "text": "b"}]},
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ]))  # fmt: skip
    assert t.body["messages"] == [
        {"role": "developer", "content": "a\nb"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "think",
         "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        ]},
    ]  # fmt: skip
    # Where each message came from: the reasoning item (2) made none.
    assert t.message_params == ("input.0", "input.1", "input.3", "input.6", "input.7", "input.8")
    # Reasoning before a turn that is not the model's is not put back.
    dropped = Translation.of(request(input=[
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
        {"role": "user", "content": "a"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
        {"role": "assistant", "content": "b"},
    ]))  # fmt: skip
    assert dropped.body["messages"] == [{"role": "user", "content": "a"},
                                        {"role": "assistant", "content": "b"}]  # fmt: skip


def test_tools_choices_formats_and_logprobs_become_their_chat_fields() -> None:
    other = {**TOOL, "name": "other", "description": None, "strict": None}
    t = Translation.of(request(
        tools=[TOOL, other], parallel_tool_calls=False, reasoning={"effort": "low"},
        text={"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"},
                         "strict": True}},
        include=["message.output_text.logprobs"], top_logprobs=3,
    ))  # fmt: skip
    function = {k: v for k, v in TOOL.items() if k != "type"}
    assert t.body["tools"] == [
        {"type": "function", "function": function},
        {"type": "function", "function": {"name": "other", "parameters": TOOL["parameters"]}},
    ]
    assert t.body["parallel_tool_calls"] is False and "tool_choice" not in t.body
    assert t.body["reasoning_effort"] == "low"
    assert t.body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
    }
    assert (t.body["logprobs"], t.body["top_logprobs"]) == (True, 3)
    named = Translation.of(request(tools=[TOOL], tool_choice={"type": "function",
                                                              "name": "get_weather"}))  # fmt: skip
    assert named.body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert Translation.of(request(tools=[TOOL], tool_choice="required")).body["tool_choice"] == (
        "required"
    )
    json_object = Translation.of(request(text={"format": {"type": "json_object"}}))
    assert json_object.body["response_format"] == {"type": "json_object"}
    assert "response_format" not in Translation.of(request(text={"format": {"type": "text"}})).body
    with pytest.raises(ApiError, match="needs include") as info:
        Translation.of(request(top_logprobs=2))
    assert info.value.param == "top_logprobs"


def test_allowed_tools_keep_only_those_tools_and_name_errors_by_their_place() -> None:
    tools = [{**TOOL, "name": n} for n in ("a", "b", "c")]
    allowed = [{"type": "function", "name": "c"}, {"type": "function", "name": "a"}]
    choice = {"type": "allowed_tools", "mode": "required", "tools": allowed}
    t = Translation.of(request(tools=tools, tool_choice=choice))
    assert [tool["function"]["name"] for tool in t.body["tools"]] == ["a", "c"]
    assert t.body["tool_choice"] == "required"
    assert t.tool_params == ("tools.0", "tools.2")
    assert t.responses_param("tools.1.function.parameters") == "tools.2.parameters"
    assert t.responses_param("tools.1") == "tools.2"


@pytest.mark.parametrize(
    ("chat_param", "expected"),
    [
        (None, None),
        ("messages.0.content", "instructions"),
        ("messages.1", "input.0"),
        ("messages.9", "input"),
        ("messages", "input"),
        ("max_tokens", "max_output_tokens"),
        ("max_completion_tokens", "max_output_tokens"),
        ("response_format", "text.format"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("reasoning_effort", "reasoning.effort"),
        ("logprobs", "include"),
        ("tool_choice.function.name", "tool_choice"),
        ("temperature", "temperature"),
        ("grammar", "grammar"),
    ],
)
def test_a_chat_field_is_named_as_the_responses_field_it_came_from(
    chat_param: str | None, expected: str | None
) -> None:
    t = Translation.of(request(instructions="x", input=[{"role": "user", "content": "y"}]))
    assert t.responses_param(chat_param) == expected
    renamed = t.renamed(ApiError(400, "m", param=chat_param, code="c"))
    assert (renamed.param, renamed.message, renamed.code) == (expected, "m", "c")


def test_a_chat_refusal_is_reported_with_the_responses_field() -> None:
    t = Translation.of(request(instructions="x"))
    t.body["messages"][0]["content"] = 5  # what a translation never does: the chat check names it
    with pytest.raises(ApiError) as info:
        t.chat_request()
    assert info.value.param == "instructions"


# -- the output ----------------------------------------------------------------------------------


def kinds(events: Sequence[dict[str, Any]]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


def test_text_opens_a_message_whose_deltas_join_to_its_text() -> None:
    out = Output("resp_abc")
    events = out.text("Hel") + out.text("") + out.text("lo") + out.finish("completed")
    assert kinds(events) == [
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
    ]  # fmt: skip
    [item] = out.items
    assert item == {
        "id": "msg_abc_0", "type": "message", "status": "completed", "role": "assistant",
        "content": [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}],
    }  # fmt: skip
    assert events[0]["item"]["content"] == [] and events[0]["item"]["status"] == "in_progress"
    assert events[-1]["item"] is item and events[4]["text"] == "Hello"
    assert all(e["output_index"] == 0 for e in events)


def test_reasoning_then_text_then_calls_make_items_in_the_models_order() -> None:
    out = Output("resp_abc")
    events = (
        out.reasoning("Think") + out.reasoning("ing.") + out.text("Calling.")
        + out.tool_call(0, "call_1", "f", '{"a"') + out.tool_call(0, None, None, ": 1}")
        + out.tool_call(1, "call_2", "g", "{}") + out.finish("completed")
    )  # fmt: skip
    assert [item["type"] for item in out.items] == [
        "reasoning", "message", "function_call", "function_call",
    ]  # fmt: skip
    reasoning, message, first, second = out.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert reasoning["summary"] == [] and message["content"][0]["text"] == "Calling."
    assert (first["call_id"], first["name"], first["arguments"]) == ("call_1", "f", '{"a": 1}')
    assert (second["call_id"], second["arguments"], second["status"]) == ("call_2", "{}",
                                                                         "completed")  # fmt: skip
    assert kinds(events) == [
        "output_item.added", "content_part.added", "reasoning_text.delta",
        "reasoning_text.delta", "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
        "output_item.done",
    ]  # fmt: skip
    deltas = [e["delta"] for e in events if e["type"].endswith("arguments.delta")]
    assert deltas == ['{"a"', ": 1}", "{}"]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1, 2, 3]
    assert added[2]["item"]["arguments"] == "" and "item_id" not in added[2]
    assert len({item["id"] for item in out.items}) == 4


def test_an_answer_with_nothing_gets_an_empty_message_and_a_cut_one_is_incomplete() -> None:
    out = Output("resp_x")
    assert kinds(out.finish("incomplete"))[0] == "output_item.added"
    assert out.items[0]["status"] == "incomplete" and out.items[0]["content"][0]["text"] == ""


# -- the rendering -------------------------------------------------------------------------------

PIECES = [Piece(" Paris", None, 1), Piece("", None, 2), Piece(" is", None, 3, 0),
          Piece(" nice.", "stop", 4, 16)]  # fmt: skip


async def _pieces(pieces: Sequence[Piece], fail: ApiError | None = None) -> AsyncGenerator[Piece]:
    for piece in pieces:
        yield piece
    if fail is not None:
        raise fail


def render(**changes: Any) -> tuple[ResponseRender, Reply]:
    req = request(**changes)
    reply = Reply("chat", "resp_abc", "SmolLM2", 1_733_000_000, 12)
    return ResponseRender(restated(req, Defaults()), Translation.of(req).renamed), reply


def streamed(r: ResponseRender, reply: Reply, pieces: Sequence[Piece],
             fail: ApiError | None = None) -> tuple[list[dict[str, Any]], list[str]]:  # fmt: skip
    statuses: list[str] = []

    async def run() -> list[bytes]:
        return [c async for c in r.sse(reply, _pieces(pieces, fail), statuses.append)]

    chunks = asyncio.run(run())
    assert type(chunks[-1]) is Last and b"[DONE]" not in b"".join(chunks)
    events = []
    for block in b"".join(chunks).decode().split("\n\n")[:-1]:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        ResponseStreamEvent_.validate_python(event)  # the client's own types take it
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events, statuses


ResponseStreamEvent_: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def test_the_whole_response_parses_as_the_openai_type_and_restates_the_request() -> None:
    r, reply = render(instructions="Be brief.", metadata={"k": "v"}, tools=[TOOL],
                      text={"format": {"type": "json_object"}})  # fmt: skip
    whole = asyncio.run(r.collect(_pieces(PIECES), reply))
    assert ResponseObject.model_validate(whole).model_dump(mode="json") == whole
    parsed = OpenAIResponse.model_validate(whole)
    assert parsed.output_text == " Paris is nice." and parsed.status == "completed"
    assert parsed.id == "resp_abc" and parsed.created_at == 1_733_000_000
    assert parsed.usage is not None and parsed.usage.input_tokens == 12
    assert (parsed.usage.output_tokens, parsed.usage.total_tokens) == (4, 16)
    assert parsed.usage.input_tokens_details.cached_tokens == 16
    assert parsed.instructions == "Be brief." and parsed.metadata == {"k": "v"}
    assert parsed.temperature == 1.0 and parsed.top_p == 1.0  # the defaults that applied
    assert parsed.tools[0].name == "get_weather" and parsed.tool_choice == "auto"
    assert parsed.text is not None and parsed.text.format is not None
    assert parsed.text.format.type == "json_object"
    assert whole["store"] is False and whole["previous_response_id"] is None


def test_the_stream_tells_the_whole_response_event_by_event() -> None:
    r, reply = render()
    events, statuses = streamed(r, reply, PIECES)
    assert statuses == ["200"]
    assert kinds(events) == [
        "created", "in_progress", "output_item.added", "content_part.added",
        "output_text.delta", "output_text.delta", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done", "completed",
    ]  # fmt: skip
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    )
    whole = asyncio.run(r.collect(_pieces(PIECES), reply))
    assert events[-1]["response"] == whole


def test_a_cut_answer_is_incomplete_and_a_failure_is_told_by_response_failed() -> None:
    r, reply = render(max_output_tokens=4)
    cut = [Piece(" Paris", None, 1), Piece(" is", "length", 4)]
    whole = asyncio.run(r.collect(_pieces(cut), reply))
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert whole["output"][0]["status"] == "incomplete"
    events, _ = streamed(r, reply, cut)
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"] == whole
    # A failure midway: the error (its field named as the Responses request's), what came so far.
    failure = ApiError(400, "too long", param="max_tokens", code="context_length_exceeded")
    events, statuses = streamed(r, reply, cut[:1], failure)
    assert statuses == ["400"] and events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert kinds(events)[-4:] == [
        "output_text.done", "content_part.done", "output_item.done", "failed",
    ]  # fmt: skip
    assert failed["status"] == "failed" and failed["output"][0]["status"] == "incomplete"
    assert failed["output"][0]["content"][0]["text"] == " Paris"
    assert failed["usage"]["output_tokens"] == 1
    assert failed["error"] == {
        "code": "invalid_prompt",
        "message": "too long",
        "type": "invalid_request_error",
        "param": "max_output_tokens",
    }
    with pytest.raises(ApiError) as info:
        asyncio.run(r.collect(_pieces(cut[:1], failure), reply))
    assert info.value.param == "max_output_tokens"


def test_reasoning_text_and_calls_of_the_pieces_are_items_in_order_streamed_or_not() -> None:
    r, reply = render(tools=[TOOL])
    pieces = [
        Piece("", None, 2, reasoning="Paris? "), Piece("", None, 5, reasoning="Use the tool."),
        Piece("Let me look.", None, 8, reasoning=""),
        Piece("", None, 12, tool_calls=(ToolCallDelta(0, "call_a", "get_weather", '{"city"'),)),
        Piece("", "tool_calls", 15, tool_calls=(ToolCallDelta(0, None, None, ': "Paris"}'),)),
    ]  # fmt: skip
    whole = asyncio.run(r.collect(_pieces(pieces), reply))
    parsed = OpenAIResponse.model_validate(whole)
    assert [item.type for item in parsed.output] == ["reasoning", "message", "function_call"]
    reasoning, _, call = parsed.output
    assert reasoning.content is not None  # type: ignore[union-attr]
    assert reasoning.content[0].text == "Paris? Use the tool."  # type: ignore[union-attr]
    assert parsed.output_text == "Let me look." and parsed.status == "completed"
    assert (call.call_id, call.name, call.arguments) == (  # type: ignore[union-attr]
        "call_a",
        "get_weather",
        '{"city": "Paris"}',
    )
    assert parsed.usage is not None and parsed.usage.output_tokens == 15
    assert parsed.usage.output_tokens_details.reasoning_tokens == 5  # the pieces of reasoning only
    events, _ = streamed(r, reply, pieces)
    assert events[-1]["response"] == whole


def _client(handler: Callable[[Any], Any]) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="sk-test", base_url="http://kvrail.test/v1", max_retries=0,
        http_client=http.Client(transport=http.MockTransport(handler)),
    )  # fmt: skip


def test_the_openai_client_reads_the_response_and_its_stream() -> None:
    def handler(request: Any) -> Any:
        body = json.loads(request.content)
        ResponsesRequest.model_validate(body)  # what the client sends, we accept
        r, reply = render(**{k: v for k, v in body.items() if k != "model"})
        if body.get("stream"):
            statuses: list[str] = []

            async def run() -> bytes:
                return b"".join([c async for c in r.sse(reply, _pieces(PIECES), statuses.append)])

            content = asyncio.run(run())
            return http.Response(200, content=content, headers={"content-type":
                                                               "text/event-stream"})  # fmt: skip
        return http.Response(200, json=asyncio.run(r.collect(_pieces(PIECES), reply)))

    client = _client(handler)
    whole = client.responses.create(model="m", input="hi", max_output_tokens=8, temperature=0)
    assert whole.output_text == " Paris is nice."
    with client.responses.stream(model="m", input="hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text


def test_the_openapi_document_states_the_request_and_the_response() -> None:
    document = get_openapi(title="t", version="1", routes=[documented_route({})])
    schemas = document["components"]["schemas"]
    request_schema = schemas["ResponsesRequest"]
    assert request_schema["additionalProperties"] is False
    assert request_schema["required"] == ["model", "input"]
    assert "/v1/responses" in document["paths"] and "ResponseObject" in schemas
