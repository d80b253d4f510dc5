"""OpenAI request validation, error bodies and response builders, checked against the real
`openai` client (its types, and its parser through an in-memory HTTP transport)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion as OpenAICompletion
from openai.types import Model as OpenAIModel
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatCompletionChunk
from pydantic import BaseModel, ValidationError

from kvrail.errors import DeadlineExceededError, InvalidRequestError, KvrailError
from kvrail.errors import ModelNotFoundError as ModelMissing
from kvrail.router.api import errors as api_errors
from kvrail.router.api import responses, schemas

try:  # the openai client 3.x speaks httpx2, older ones httpx
    import httpx2 as http
except ImportError:  # pragma: no cover
    import httpx as http  # type: ignore[no-redef]

from kvrail.router.api.errors import ApiError, validation_error
from kvrail.router.api.sampling import Defaults, Delivery, Requested, requested
from kvrail.router.api.schemas import ChatCompletionRequest, CompletionRequest
from kvrail.sampling import SamplingParams

SECRET = "SECRET-PROMPT-TEXT"
CHAT = {"model": "m", "messages": [{"role": "user", "content": SECRET}]}
COMPLETION = {"model": "m", "prompt": SECRET}


def chat(**changes: Any) -> dict[str, Any]:
    return {**CHAT, **changes}


def completion(**changes: Any) -> dict[str, Any]:
    return {**COMPLETION, **changes}


def message(**changes: Any) -> dict[str, Any]:
    return {"role": "user", "content": SECRET, **changes}


def tool(name: str, **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


def call(call_id: str, arguments: str, name: str = "f") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def rejected(model: type[BaseModel], body: Any) -> ApiError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    err = validation_error(info.value)
    assert err.status == 400 and err.type == "invalid_request_error"
    assert SECRET not in json.dumps(err.body())
    return err


# (request body, expected param, a fragment of the message, expected code)
CHAT_ERRORS: list[tuple[dict[str, Any], str | None, str, str | None]] = [
    ({"model": "m"}, "messages", "missing required parameter", None),
    (chat(messages=[]), "messages", "at least 1", None),
    (chat(bogus=1), "bogus", "unrecognized request argument supplied: 'bogus'",
     "unknown_parameter"),
    (chat(tools=[{"type": "function"}]), "tools.0.function", "missing required parameter", None),
    (chat(tools=[{"type": "code_interpreter"}]), "tools.0.type", "Input should be 'function'",
     None),
    (chat(tools=[tool("get-weather!")]), "tools.0.function.name", "should match pattern", None),
    (chat(tools=[tool("f"), tool("f")]), "tools", "the same name", None),
    (chat(tools=[tool("f", parameters=[SECRET])]), "tools.0.function.parameters",
     "valid dictionary", None),
    (chat(tools=[tool("f", strict="yes")]), "tools.0.function.strict", "valid boolean", None),
    (chat(tools=[tool(f"f{i}") for i in range(129)]), "tools", "at most 128", None),
    (chat(tool_choice="required"), "tool_choice", "needs tools", None),
    (chat(tool_choice=SECRET), "tool_choice", "'none', 'auto' or 'required'", None),
    (chat(tools=[tool("f")], tool_choice={"type": "function", "function": {"name": "g"}}),
     "tool_choice", "not in tools", None),
    (chat(tool_choice={"type": "function", "function": {}}), "tool_choice.function.name",
     "missing required parameter", None),
    (chat(parallel_tool_calls="no"), "parallel_tool_calls", "valid boolean", None),
    (chat(functions=[{}]), "functions", "not supported", "unsupported_parameter"),
    (chat(function_call="auto"), "function_call", "send tool_choice", "unsupported_parameter"),
    (chat(response_format={"type": SECRET}), "response_format",
     "must be text, json_object or json_schema", None),
    (chat(response_format={"type": "json_schema"}), "response_format.json_schema",
     "missing required parameter", None),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "a b"}}),
     "response_format.json_schema.name", "should match pattern", None),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}),
     "response_format.json_schema.schema", "valid dictionary", None),
    (chat(response_format={"type": "json_object", "schema": {}}), "response_format.schema",
     "unrecognized", "unknown_parameter"),
    (chat(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs",
     "exactly one of", None),
    (chat(structured_outputs={}), "structured_outputs", "exactly one of", None),
    (chat(structured_outputs={"json_object": False}), "structured_outputs", "exactly one", None),
    (chat(structured_outputs={"json": "[1]"}), "structured_outputs.json",
     "JSON schema object", None),
    (chat(structured_outputs={"json": SECRET}), "structured_outputs.json", "JSON schema", None),
    (chat(structured_outputs={"choice": []}), "structured_outputs.choice", "at least 1", None),
    (chat(structured_outputs={"regex": "a", "structural_tag": "x"}),
     "structured_outputs.structural_tag", "not supported", "unsupported_parameter"),
    (chat(structured_outputs={"regex": "a", "whitespace_pattern": " "}),
     "structured_outputs.whitespace_pattern", "not supported", "unsupported_parameter"),
    (chat(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}),
     "structured_outputs", "not both", None),
    (chat(reasoning_effort="extreme"), "reasoning_effort", "Input should be", None),
    (chat(chat_template_kwargs={"enable_thinking": [1]}), "chat_template_kwargs.enable_thinking",
     "valid", None),
    (chat(top_logprobs=3), "top_logprobs", "needs logprobs: true", None),
    (chat(logprobs=False, top_logprobs=1), "top_logprobs", "needs logprobs: true", None),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20", None),
    (chat(logprobs=True, top_logprobs=-1), "top_logprobs", "greater than or equal to 0", None),
    (chat(logprobs=1), "logprobs", "valid boolean", None),
    (chat(logit_bias={"42": 101}), "logit_bias", "numbers in [-100, 100]", None),
    (chat(logit_bias={"42": "5"}), "logit_bias", "numbers in [-100, 100]", None),
    (chat(logit_bias={"word": 5}), "logit_bias", "token ids (strings of digits)", None),
    (chat(logit_bias=[5]), "logit_bias", "an object of token ids", None),
    (chat(logit_bias={str(i): 1 for i in range(301)}), "logit_bias", "at most 300", None),
    (chat(frequency_penalty=2.5), "frequency_penalty", "less than or equal to 2", None),
    (chat(presence_penalty=-3), "presence_penalty", "greater than or equal to -2", None),
    (chat(top_k=-2), "top_k", "greater than or equal to -1", None),
    (chat(min_p=1.5), "min_p", "less than or equal to 1", None),
    (chat(min_tokens=-1), "min_tokens", "greater than or equal to 0", None),
    (chat(repetition_penalty=0), "repetition_penalty", "greater than 0", None),
    (chat(stop_token_ids=[-1]), "stop_token_ids.0", "greater than or equal to 0", None),
    (chat(ignore_eos="yes"), "ignore_eos", "valid boolean", None),
    (chat(skip_special_tokens=False), "skip_special_tokens", "not supported",
     "unsupported_parameter"),
    (chat(include_stop_str_in_output=True), "include_stop_str_in_output", "not supported",
     "unsupported_parameter"),
    (chat(audio={"voice": "x"}), "audio", "not supported", "unsupported_parameter"),
    (chat(modalities=["text", "audio"]), "modalities", "not supported", "unsupported_parameter"),
    (chat(prediction={"type": "content"}), "prediction", "not supported", "unsupported_parameter"),
    (chat(n=0), "n", "greater than or equal to 1", None),
    (chat(n=129), "n", "less than or equal to 128", None),
    (chat(stream_options={"include_usage": True}), "stream_options", "only allowed when stream",
     None),
    (chat(stream=False, stream_options={}), "stream_options", "only allowed when stream", None),
    (chat(max_tokens=5, max_completion_tokens=6), "max_completion_tokens", "disagree", None),
    (chat(max_completion_tokens=0), "max_completion_tokens", "greater than or equal to 1", None),
    (chat(temperature=2.5), "temperature", "less than or equal to 2", None),
    (chat(temperature="1"), "temperature", "valid number", None),
    (chat(top_p=0), "top_p", "greater than 0", None),
    (chat(top_p=1.01), "top_p", "less than or equal to 1", None),
    (chat(stop=""), "stop", "empty", None),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop", "1 to 4", None),
    (chat(stop=["a", ""]), "stop", "1 to 4 non-empty", None),
    (chat(stop=7), "stop", "a string or a list of strings", None),
    (chat(seed=2**63), "seed", "less than or equal to", None),
    (chat(seed=1.5), "seed", "valid integer", None),
    (chat(stream="true"), "stream", "valid boolean", None),
    (chat(max_tokens=True), "max_tokens", "valid integer", None),
    (chat(user=5), "user", "valid string", None),
    (chat(messages=[message(role="tool")]), "messages.0", "needs tool_call_id", None),
    (chat(messages=[message(tool_call_id="c")]), "messages.0", "only a tool message", None),
    (chat(messages=[message(role="function")]), "messages.0.role",
     "role 'function' is not supported", None),
    (chat(messages=[{"role": "assistant"}]), "messages.0", "content or tool_calls", None),
    (chat(messages=[message(role="assistant", tool_calls=[call("c", {"a": 1})])]),
     "messages.0.tool_calls.0.function.arguments", "valid string", None),
    (chat(messages=[message(role="assistant", tool_calls=[{"id": "c", "type": "function"}])]),
     "messages.0.tool_calls.0.function", "missing required parameter", None),
    (chat(messages=[message(reasoning_content="r")]), "messages.0", "only assistant", None),
    (chat(messages=[message(function_call={"name": "f"})]), "messages.0.function_call",
     "not supported", "unsupported_parameter"),
    (chat(messages=[message(role="robot")]), "messages.0.role", "Input should be", None),
    (chat(messages=[message(content=None)]), "messages.0.content", "string or a list", None),
    (chat(messages=[message(content=[{"type": "image_url", "image_url": {"url": "x"}}])]),
     "messages.0.content", "type 'image_url' are not supported", None),
    (chat(messages=[message(content=[{"type": SECRET}])]), "messages.0.content",
     "other than 'text'", None),
    (chat(messages=[message(content=[{"type": "text", "text": 5}])]),
     "messages.0.content.0.text", "valid string", None),
    (chat(messages=[message(content=[{"type": "text", "text": "x", "extra": 1}])]),
     "messages.0.content.0.extra", "unrecognized", "unknown_parameter"),
    (chat(messages=[message(tool_calls=[])]), "messages.0", "only assistant messages", None),
    (chat(messages=[message(content="\ud800" + SECRET)]), "messages.0.content", "surrogate",
     None),
    (chat(messages=[message(), "hello"]), "messages.1", "valid dictionary", None),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param", "fragment", "code"), CHAT_ERRORS)
def test_an_invalid_chat_request_is_a_400_naming_the_field(
    body: dict[str, Any], param: str | None, fragment: str, code: str | None
) -> None:
    err = rejected(ChatCompletionRequest, body)
    assert (err.param, err.code) == (param, code)
    assert fragment in err.message


COMPLETION_ERRORS: list[tuple[dict[str, Any], str | None, str, str | None]] = [
    ({"model": "m"}, "prompt", "missing required parameter", None),
    (completion(prompt=["a", "b"]), "prompt", "batches of several prompts", None),
    (completion(prompt=[[1, 2], [3]]), "prompt", "batches", None),
    (completion(prompt=[[1, -2]]), "prompt", "integers >= 0", None),
    (completion(prompt=[[]]), "prompt", "integers >= 0", None),
    (completion(prompt=[]), "prompt", "must not be empty", None),
    (completion(prompt=[1, -2]), "prompt", "integers >= 0", None),
    (completion(prompt=[1, True]), "prompt", "integers >= 0", None),
    (completion(prompt=None), "prompt", "valid string", None),
    (completion(echo=1), "echo", "valid boolean", None),
    (completion(suffix="x"), "suffix", "not supported", "unsupported_parameter"),
    (completion(logprobs=21), "logprobs", "less than or equal to 20", None),
    (completion(logprobs=-1), "logprobs", "greater than or equal to 0", None),
    (completion(logprobs=True), "logprobs", "valid integer", None),
    (completion(best_of=2, n=3), "best_of", "best_of must be at least n", None),
    (completion(best_of=3, stream=True), "best_of", "cannot be streamed", None),
    (completion(n=1.5), "n", "valid integer", None),
    (completion(max_tokens=0), "max_tokens", "greater than or equal to 1", None),
    (completion(stream_options={"include_usage": False}), "stream_options", "only allowed", None),
    (completion(messages=[]), "messages", "unrecognized", "unknown_parameter"),
    (completion(tools=[]), "tools", "unrecognized", "unknown_parameter"),
    (completion(stream=True, stream_options={"store": True}), "stream_options.store",
     "unrecognized", "unknown_parameter"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param", "fragment", "code"), COMPLETION_ERRORS)
def test_an_invalid_completion_request_is_a_400_naming_the_field(
    body: dict[str, Any], param: str | None, fragment: str, code: str | None
) -> None:
    err = rejected(CompletionRequest, body)
    assert (err.param, err.code) == (param, code)
    assert fragment in err.message


def test_neutral_values_of_unsupported_features_are_accepted() -> None:
    neutral = chat(
        tools=[], tool_choice="none", functions=None, logprobs=False, top_logprobs=0,
        logit_bias={}, response_format={"type": "text"}, modalities=["text"], store=False,
        service_tier="auto", user="u", safety_identifier="s", prompt_cache_key="k", n=1,
        parallel_tool_calls=False, skip_special_tokens=True, include_stop_str_in_output=False,
    )  # fmt: skip
    assert requested(ChatCompletionRequest.model_validate(neutral)) == requested(
        ChatCompletionRequest.model_validate(CHAT)
    )
    assert CompletionRequest.model_validate(completion(echo=False, best_of=1, logprobs=None))
    one = CompletionRequest.model_validate(completion(prompt=[[5, 6]], echo=True, logprobs=1))
    assert one.prompt_ids == [5, 6] and one.prompt_text is None


def test_logprobs_reach_the_sampling_params_as_the_number_of_most_likely_tokens() -> None:
    def logprobs(model: type[ChatCompletionRequest | CompletionRequest], body: Any) -> Any:
        return requested(model.model_validate(body)).params(8, Defaults()).logprobs

    assert logprobs(ChatCompletionRequest, CHAT) is None
    assert logprobs(ChatCompletionRequest, chat(logprobs=False, top_logprobs=0)) is None
    assert logprobs(ChatCompletionRequest, chat(logprobs=True)) == 0
    assert logprobs(ChatCompletionRequest, chat(logprobs=True, top_logprobs=None)) == 0
    assert logprobs(ChatCompletionRequest, chat(logprobs=True, top_logprobs=20)) == 20
    assert logprobs(CompletionRequest, COMPLETION) is None
    assert logprobs(CompletionRequest, completion(logprobs=0)) == 0
    assert logprobs(CompletionRequest, completion(logprobs=5)) == 5


def test_a_chat_request_normalizes_both_spellings_of_max_tokens() -> None:
    plain = requested(ChatCompletionRequest.model_validate(CHAT))
    assert plain == Requested(max_tokens=None, delivery=Delivery(), fields={})
    both = chat(max_tokens=7, max_completion_tokens=7)
    for body in [chat(max_tokens=7), chat(max_completion_tokens=7), both]:
        assert requested(ChatCompletionRequest.model_validate(body)).max_tokens == 7
    full = chat(
        temperature=0, top_p=0.5, seed=-3, stop=["\n", "END", "\n"], stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    r = requested(ChatCompletionRequest.model_validate(full))
    assert r.fields == {"temperature": 0.0, "top_p": 0.5, "seed": -3}
    assert r.delivery == Delivery(stop=("\n", "END"), stream=True, include_usage=True)
    nulls = chat(temperature=None, top_p=None, stream=None, stop=None, n=None)
    assert requested(ChatCompletionRequest.model_validate(nulls)) == plain
    streamed = requested(ChatCompletionRequest.model_validate(chat(stream=True)))
    assert streamed.delivery.stream and not streamed.delivery.include_usage


def test_a_completion_defaults_to_16_tokens_and_null_means_unbounded() -> None:
    assert requested(CompletionRequest.model_validate(COMPLETION)).max_tokens == 16
    unbounded = CompletionRequest.model_validate(completion(max_tokens=None))
    assert requested(unbounded).max_tokens is None
    assert requested(CompletionRequest.model_validate(completion(stop="x"))).delivery.stop == ("x",)


def test_omitted_fields_take_the_defaults_and_sent_ones_win() -> None:
    model = Defaults.of("model", {"temperature": 0.2, "top_p": 0.9, "top_k": 50.0})
    assert (model.temperature, model.top_p, model.top_k, model.source) == (0.2, 0.9, 50, "model")
    assert Defaults.of("openai", {"temperature": 0.2}) == Defaults() == Defaults.of("model", {})
    omitted = requested(ChatCompletionRequest.model_validate(CHAT)).params(30, model)
    assert omitted == SamplingParams(max_tokens=30, temperature=0.2, top_p=0.9, top_k=50)
    sent = chat(temperature=0, top_k=-1, top_p=1)
    assert requested(ChatCompletionRequest.model_validate(sent)).params(30, model) == (
        SamplingParams(max_tokens=30, temperature=0.0, top_p=1.0, top_k=0)
    )
    assert requested(ChatCompletionRequest.model_validate(CHAT)).params(30, Defaults()) == (
        SamplingParams(max_tokens=30, temperature=1.0)
    )


def test_vllms_sampling_extensions_reach_the_sampling_params() -> None:
    body = chat(
        min_tokens=3, ignore_eos=True, top_k=40, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, stop_token_ids=[7, 7, 9], seed=1,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    asked = requested(ChatCompletionRequest.model_validate(body))
    params = asked.params(10, Defaults())
    assert (params.min_tokens, params.ignore_eos, params.top_k, params.min_p) == (3, True, 40, 0.05)
    assert (params.repetition_penalty, params.presence_penalty) == (1.1, 0.5)
    assert (params.frequency_penalty, params.stop_token_ids) == (-0.5, (7, 9))
    assert asked.delivery.continuous_usage_stats


def test_min_tokens_above_max_tokens_is_a_400_naming_min_tokens() -> None:
    asked = requested(ChatCompletionRequest.model_validate(chat(min_tokens=9)))
    with pytest.raises(InvalidRequestError, match="min_tokens") as info:
        asked.params(5, Defaults())
    assert info.value.param == "min_tokens"
    assert api_errors.api_error_of(info.value).param == "min_tokens"


def test_a_completion_prompt_is_text_or_token_ids() -> None:
    text = CompletionRequest.model_validate(completion(prompt="hi"))
    assert (text.prompt_text, text.prompt_ids) == ("hi", None)
    one = CompletionRequest.model_validate(completion(prompt=["hi"]))
    assert (one.prompt_text, one.prompt_ids) == ("hi", None)
    ids = CompletionRequest.model_validate(completion(prompt=[5, 0, 7]))
    assert (ids.prompt_text, ids.prompt_ids) == (None, [5, 0, 7])


def test_template_messages_flatten_text_parts_and_keep_names() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = ChatCompletionRequest.model_validate(
        chat(
            messages=[message(role="developer", content="sys", name="ops"), message(content=parts)]
        )
    )
    assert req.template_messages() == [
        {"role": "developer", "content": "sys", "name": "ops"},
        {"role": "user", "content": "a\nb"},
    ]


def test_api_error_body_headers_and_the_mapping_from_kvrail_errors() -> None:
    err = ApiError(429, "slow down", "rate_limit_error", headers={"Retry-After": "3"})
    assert err.body() == {
        "error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": None}
    }
    assert err.headers == {"Retry-After": "3"} and str(err) == "slow down"
    cases: list[tuple[KvrailError, int, str]] = [
        (InvalidRequestError("bad template"), 400, "bad template"),
        (ModelMissing("no such model"), 404, "no such model"),
        (DeadlineExceededError("t"), 504, "deadline"),
        (KvrailError("/secret/path leaked"), 500, "internal error"),
    ]
    for source, status, fragment in cases:
        mapped = api_errors.api_error_of(source)
        assert mapped.status == status and fragment in mapped.message
        assert "/secret/path" not in mapped.message


# -- the same validation behind FastAPI ---------------------------------------------------------


@pytest.fixture(scope="module")
def app() -> FastAPI:
    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc.errors())
        return JSONResponse(err.body(), status_code=err.status)

    @app.post("/v1/chat/completions", response_model=responses.ChatCompletion)
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        return responses.chat_completion("c", body.model, 1, "ok", "stop", responses.usage(1, 1))

    @app.post("/v1/completions", response_model=responses.Completion)
    async def completions(body: CompletionRequest) -> Any:
        return responses.completion("c", body.model, 1, "ok", "length", responses.usage(1, 1))

    return app


def test_fastapi_validation_problems_become_openai_400s(app: FastAPI) -> None:
    client = TestClient(app)
    cases: list[tuple[str, bytes, str | None, str]] = [
        ("/v1/chat/completions", b'{"model": "m", "messages": [', None, "not valid JSON"),
        ("/v1/chat/completions", b"", None, "missing"),
        ("/v1/chat/completions", b"[1, 2]", None, "must be a JSON object"),
        ("/v1/chat/completions", b'{"model":"m","messages":[],"temperature":NaN}',
         "temperature", "finite"),
        ("/v1/chat/completions", json.dumps(chat(top_p=float("inf"))).encode(), "top_p",
         "finite"),
        ("/v1/chat/completions", json.dumps(chat(messages=[{"role": "user"}])).encode(),
         "messages.0.content", "missing required parameter"),
        ("/v1/completions", json.dumps(completion(prompt=["a", "b"])).encode(), "prompt",
         "batches"),
    ]  # fmt: skip
    for path, body, param, fragment in cases:
        response = client.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["param"] == param and fragment in error["message"]
        assert error["type"] == "invalid_request_error"
    ok = client.post("/v1/chat/completions", json=chat(top_p=1))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok"


def test_the_openapi_schema_states_exactly_what_is_accepted(app: FastAPI) -> None:
    components = app.openapi()["components"]["schemas"]
    request = components["ChatCompletionRequest"]
    assert request["additionalProperties"] is False and request["required"] == [
        "model",
        "messages",
    ]
    props = request["properties"]
    assert props["tools"]["anyOf"][0]["maxItems"] == 128
    assert props["tools"]["anyOf"][0]["items"] == {"$ref": "#/components/schemas/Tool"}
    assert props["functions"]["anyOf"][0] == {"items": {}, "maxItems": 0, "type": "array"}
    assert props["logprobs"]["anyOf"][0] == {"type": "boolean"}
    assert props["top_logprobs"]["anyOf"][0]["maximum"] == 20
    function = components["FunctionDefinition"]
    assert function["additionalProperties"] is False and function["required"] == ["name"]
    assert props["n"]["anyOf"][0]["maximum"] == schemas.MAX_CHOICES
    # The seed bound survives FastAPI writing bounds as floats.
    assert int(props["seed"]["anyOf"][0]["maximum"]) == schemas.SEED_MAX
    assert ChatCompletionRequest.model_validate(chat(seed=schemas.SEED_MAX)).seed
    prompt = components["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert {"type": "string"} in prompt
    assert components["ChatCompletion"]["properties"]["object"]["const"] == "chat.completion"


# -- responses, parsed by the openai client -----------------------------------------------------

USAGE = responses.usage(12, 3)
_SSE = {"content-type": "text/event-stream"}


def test_usage_counts_add_up_and_may_report_cached_prompt_tokens() -> None:
    assert USAGE == {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    cached = responses.usage(12, 3, cached_tokens=8)
    parsed = OpenAICompletion.model_validate(
        responses.completion("c", "m", 1, "x", "stop", cached)
    ).usage
    assert parsed is not None and parsed.prompt_tokens_details is not None
    assert parsed.prompt_tokens_details.cached_tokens == 8


def _roundtrip(model: type[BaseModel], body: dict[str, Any]) -> None:
    """`body` has exactly the fields of our response model, with the same values."""
    assert model.model_validate(body).model_dump(mode="json", exclude_unset=True) == body


def test_whole_responses_parse_as_the_openai_types() -> None:
    body = responses.chat_completion("chatcmpl-1", "m", 7, "Hi!", "length", USAGE, "fp_1")
    _roundtrip(responses.ChatCompletion, body)
    parsed = OpenAIChatCompletion.model_validate(body)
    assert (
        parsed.choices[0].message.content == "Hi!" and parsed.choices[0].finish_reason == "length"
    )
    assert parsed.usage is not None and parsed.usage.total_tokens == 15
    assert parsed.system_fingerprint == "fp_1"
    body = responses.completion("cmpl-1", "m", 7, "Hi!", "stop", USAGE)
    _roundtrip(responses.Completion, body)
    done = OpenAICompletion.model_validate(body)
    assert done.choices[0].text == "Hi!" and done.object == "text_completion"
    listing = responses.model_list(["a", "b"], 5)
    _roundtrip(responses.ModelList, listing)
    assert [OpenAIModel.model_validate(m).id for m in listing["data"]] == ["a", "b"]
    _roundtrip(responses.ErrorBody, ApiError(400, "x", param="p").body())


def _chat_stream(include_usage: bool) -> list[dict[str, Any]]:
    def chunk(
        text: str | None, role: bool = False, finish: str | None = None, usage: Any = None
    ) -> dict[str, Any]:
        out: dict[str, Any] = responses.chat_chunk(
            "chatcmpl-2", "m", 9, text, role, finish, usage, include_usage=include_usage
        )
        return out

    chunks = [chunk("", True), chunk("Hel"), chunk("lo"), chunk(None, False, "stop")]
    if include_usage:
        chunks.append(chunk(None, False, None, USAGE))
    return chunks


def test_chat_chunks_parse_as_openai_chunks() -> None:
    for include_usage in (False, True):
        chunks = _chat_stream(include_usage)
        for chunk in chunks:
            _roundtrip(responses.ChatCompletionChunk, chunk)
            OpenAIChatCompletionChunk.model_validate(chunk)
            assert ("usage" in chunk) == include_usage
        first, *_, finish = chunks[:4]
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert finish["choices"][0] == {
            "index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"
        }  # fmt: skip
    last = _chat_stream(True)[-1]
    assert last["choices"] == [] and last["usage"] == USAGE


def test_completion_chunks_share_the_completion_shape() -> None:
    args = ("cmpl-2", "m", 9)
    text = responses.completion_chunk(*args, "Hel")
    finish = responses.completion_chunk(*args, None, "length")
    usage = responses.completion_chunk(*args, None, None, USAGE)
    for chunk in (text, finish, usage):
        _roundtrip(responses.Completion, chunk)
        assert chunk["object"] == "text_completion"
    assert text["choices"][0]["finish_reason"] is None and text["choices"][0]["text"] == "Hel"
    assert OpenAICompletion.model_validate(finish).choices[0].finish_reason == "length"
    assert usage["choices"] == [] and OpenAICompletion.model_validate(usage).usage is not None


def _sse(chunks: list[dict[str, Any]]) -> bytes:
    events = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks]
    return b"".join(events) + b"data: [DONE]\n\n"


def _client(handler: Callable[[Any], Any]) -> openai.OpenAI:
    transport = http.MockTransport(handler)
    return openai.OpenAI(
        api_key="sk-test", base_url="http://kvrail.test/v1", max_retries=0,
        http_client=http.Client(transport=transport),
    )  # fmt: skip


def test_the_openai_client_reads_every_response_unchanged() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: Any) -> Any:
        path = request.url.path
        if path == "/v1/models":
            return http.Response(200, json=responses.model_list(["SmolLM2"], 3))
        body = json.loads(request.content)
        seen.append(body)
        stream = body.get("stream", False)
        if path == "/v1/chat/completions":
            ChatCompletionRequest.model_validate(body)  # what the client sends, we accept
            if stream:
                events = _sse(_chat_stream(True))
                return http.Response(200, content=events, headers=_SSE)
            whole = responses.chat_completion("chatcmpl-3", "m", 1, "Hello", "stop", USAGE)
            return http.Response(200, json=whole)
        CompletionRequest.model_validate(body)
        if stream:
            args = ("cmpl-3", "m", 1)
            chunks = [responses.completion_chunk(*args, "Hel"), responses.completion_chunk(*args,
                      "lo", "stop")]  # fmt: skip
            return http.Response(200, content=_sse(chunks), headers=_SSE)
        whole = responses.completion("cmpl-3", "m", 1, "Hello", "length", USAGE)
        return http.Response(200, json=whole)

    client = _client(handler)
    messages: Any = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=4, seed=1)
    assert reply.choices[0].message.content == "Hello" and reply.usage is not None
    stream = client.chat.completions.create(
        model="m", messages=messages, stream=True, stream_options={"include_usage": True},
        stop=["\n"], max_completion_tokens=4, temperature=0.2, top_p=0.9,
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    assert client.completions.create(model="m", prompt="hi").choices[0].text == "Hello"
    streamed = client.completions.create(model="m", prompt=[1, 2, 3], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "Hello"
    assert [m.id for m in client.models.list()] == ["SmolLM2"]
    assert len(seen) == 4


def test_the_openai_client_asks_for_logprobs_as_we_accept_and_reads_them() -> None:
    entry = {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}
    lists = {"tokens": ["Hi"], "token_logprobs": [-0.5], "top_logprobs": [{"Hi": -0.5}],
             "text_offset": [0]}  # fmt: skip
    asked: list[int | None] = []

    def handler(request: Any) -> Any:
        body = json.loads(request.content)
        if request.url.path == "/v1/chat/completions":
            asked.append(requested(ChatCompletionRequest.model_validate(body)).fields["logprobs"])
            logprobs = {"content": [entry], "refusal": None}
            whole = responses.chat_completion("c", "m", 1, "Hi", "stop", USAGE, logprobs=logprobs)
            return http.Response(200, json=whole)
        asked.append(requested(CompletionRequest.model_validate(body)).fields["logprobs"])
        whole = responses.completion("c", "m", 1, "Hi", "stop", USAGE, logprobs=lists)
        return http.Response(200, json=whole)

    client = _client(handler)
    messages: Any = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model="m", messages=messages, logprobs=True, top_logprobs=2
    ).choices[0]
    assert chat.logprobs is not None and chat.logprobs.content is not None
    assert chat.logprobs.content[0].token == "Hi"
    done = client.completions.create(model="m", prompt="hi", logprobs=3).choices[0]
    assert done.logprobs is not None and done.logprobs.text_offset == [0]
    assert asked == [2, 3]


def test_the_openai_client_raises_our_errors_with_their_fields() -> None:
    invalid = rejected(ChatCompletionRequest, chat(n=0))
    limited = ApiError(
        429, "tenant over its limit", "rate_limit_error", headers={"Retry-After": "2"}
    )
    for err, kind in ((invalid, openai.BadRequestError), (limited, openai.RateLimitError)):

        def reply(_: Any, e: ApiError = err) -> Any:
            return http.Response(e.status, json=e.body(), headers=e.headers)

        client = _client(reply)
        with pytest.raises(kind) as info:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert info.value.body == err.body()["error"] and err.message in info.value.message
        assert info.value.param == err.param and info.value.code == err.code
        assert info.value.type == err.type


# -- no message ever quotes the request's text --------------------------------------------------

_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.just(SECRET),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["k", "type", "text", "include_usage"]), inner, max_size=2
        )
    ),
    max_leaves=6,
)
_FIELDS = sorted(
    set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields) | {"zz", "type"}
)


@settings(max_examples=300, deadline=None)
@given(
    changes=st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=3),
    part=st.sampled_from([SECRET, [{"type": "text", "text": SECRET}], [{"type": SECRET}], 5]),
)
def test_no_error_message_quotes_the_request_text(changes: dict[str, Any], part: Any) -> None:
    for model, base in ((ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)):
        body = {**base, **changes}
        if "messages" not in changes and model is ChatCompletionRequest:
            body["messages"] = [message(content=part)]
        try:
            model.model_validate(body)
        except ValidationError as exc:
            err = validation_error(exc)
            assert err.status == 400 and SECRET not in json.dumps(err.body())


# -- what agent frameworks send, accepted as sent -----------------------------------------------

_TOOL_CALL = {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
_CALLED = {
    "id": "c", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None,
                 "message": {"role": "assistant", "content": None, "refusal": None,
                             "tool_calls": [_TOOL_CALL], "reasoning_content": "hm",
                             "reasoning": "hm"}}],
    "usage": USAGE,
}  # fmt: skip


def _accepting(answer: dict[str, Any], seen: list[ChatCompletionRequest]) -> Callable[[Any], Any]:
    def handler(request: Any) -> Any:
        seen.append(ChatCompletionRequest.model_validate(json.loads(request.content)))
        return http.Response(200, json=answer)

    return handler


def test_the_openai_clients_tool_round_trip_and_parse_are_accepted_as_sent() -> None:
    seen: list[ChatCompletionRequest] = []
    client = _client(_accepting(_CALLED, seen))
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "strict": True,
                                                    "parameters": {"type": "object"}}}]  # fmt: skip
    messages: Any = [{"role": "user", "content": "Weather?"}]
    called = client.chat.completions.create(
        model="m", messages=messages, tools=tools, tool_choice="required"
    )
    reply = called.choices[0].message
    assert reply.tool_calls and getattr(reply, "reasoning_content", None) == "hm"
    tool_result: Any = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    client.chat.completions.create(model="m", messages=[*messages, reply, tool_result])
    history = seen[-1].template_messages()
    assert history[1] == {
        "role": "assistant", "content": None, "reasoning_content": "hm",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }  # fmt: skip
    assert history[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    # Arguments a call cut short left unfinished reach the template as the text they are.
    cut = {**_TOOL_CALL, "function": {"name": "get_weather", "arguments": '{"city": "Par'}}
    body = chat(messages=[message(role="assistant", content=None, tool_calls=[cut])])
    rendered = ChatCompletionRequest.model_validate(body).template_messages()[0]
    assert rendered["tool_calls"][0]["function"]["arguments"] == '{"city": "Par'

    class City(BaseModel):
        name: str

    with pytest.raises(openai.LengthFinishReasonError):  # the canned answer ends in `length`
        _client(_accepting({**_CALLED, "choices": [{**_CALLED["choices"][0],  # type: ignore[dict-item]
                "finish_reason": "length"}]}, seen)).chat.completions.parse(
            model="m", messages=messages, response_format=City)  # fmt: skip
    assert seen[-1].response_format is not None and seen[-1].response_format.type == "json_schema"


def test_langchains_tools_and_structured_output_are_accepted_as_sent() -> None:
    from langchain_openai import ChatOpenAI

    seen: list[ChatCompletionRequest] = []
    answer = {**_CALLED, "choices": [{**_CALLED["choices"][0], "finish_reason": "stop",  # type: ignore[dict-item]
              "message": {"role": "assistant", "content": '{"name": "Paris"}'}}]}  # fmt: skip
    llm = ChatOpenAI(
        model="m", api_key="sk-test", base_url="http://kvrail.test/v1", max_retries=0,  # type: ignore[arg-type]
        http_client=http.Client(transport=http.MockTransport(_accepting(answer, seen))),
    )  # fmt: skip

    class City(BaseModel):
        name: str

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert seen[-1].tools and seen[-1].tools[0].function.name == "get_weather"
    assert llm.with_structured_output(City).invoke("Facts?") == City(name="Paris")
    assert seen[-1].response_format is not None and seen[-1].response_format.type == "json_schema"
