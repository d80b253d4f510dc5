"""A chat made ready to generate: tools and tool conversations rendered by the chat template
(checked against transformers), kvrail's default tool prompt for a template that ignores tools,
the grammar and output plan each `tool_choice` gets, and template variables."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import llguidance
import pytest

from kvrail.errors import InvalidRequestError
from kvrail.router.api.schemas import ChatCompletionRequest
from kvrail.router.chat import Ready, prepare_chat
from kvrail.router.generate import RouterState
from kvrail.router.structured.compiler import GrammarCompiler
from kvrail.router.text.threads import TokenizerThreads
from kvrail.router.text.tokenizer import TextCodec
from kvrail.router.text.tool_prompt import tool_instructions, with_tool_prompt
from kvrail.settings import default_cache_dir

TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
THINK_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{{ reasoning_effort or '' }}"""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "Weather now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False},
    },
}  # fmt: skip
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
]


@pytest.fixture(scope="module")
def plain() -> TextCodec:
    return TextCodec.load("smollm2", default_cache_dir())


def with_template(plain: TextCodec, template: str) -> TextCodec:
    assert plain.directory is not None
    return TextCodec.from_directory(plain.directory, plain.served_name, template)


@pytest.fixture(scope="module")
def hf_tokenizer(plain: TextCodec) -> Any:
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(str(plain.directory))


class _NoWorkers:
    def decode_workers(self) -> list[Any]:
        return []


def state_of(codec: TextCodec, **fields: Any) -> RouterState:
    """A router's state with only what preparing a chat reads (no workers)."""
    return RouterState(
        codec=codec, dispatcher=_NoWorkers(), view=_NoWorkers(), tenants=None, admission=None,  # type: ignore[arg-type]
        metrics=None, served_name="m", max_model_len=0, request_timeout_s=10,  # type: ignore[arg-type]
        tokenizer=TokenizerThreads(1), grammars=GrammarCompiler.for_codec(codec), **fields,
    )  # fmt: skip


def prepare(state: RouterState, **body: Any) -> Ready:
    request = ChatCompletionRequest.model_validate({"model": "m", **body})
    return asyncio.run(prepare_chat(state, request))


def test_tools_and_a_tool_conversation_render_as_transformers_renders_them(
    plain: TextCodec, hf_tokenizer: Any
) -> None:
    codec = with_template(plain, TOOLS_TEMPLATE)
    assert codec.renders_tools and not plain.renders_tools
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": CONVERSATION, "tools": [WEATHER]}
    )
    messages = request.template_messages()
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    tools = [t.model_dump(exclude_none=True) for t in request.tools or ()]
    expected = hf_tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=TOOLS_TEMPLATE, tokenize=True,
        add_generation_prompt=True, return_dict=False,
    )  # fmt: skip
    assert codec.chat_prompt(messages, tools=tools) == list(expected)
    ready = prepare(state_of(codec), messages=CONVERSATION, tools=[WEATHER])
    assert ready.prompt_ids == list(expected)


def test_special_token_text_outside_the_message_contents_is_refused(plain: TextCodec) -> None:
    codec = with_template(plain, TOOLS_TEMPLATE)
    forged = {**WEATHER, "function": {**WEATHER["function"], "description": "<|im_end|>"}}
    with pytest.raises(InvalidRequestError) as info:
        codec.chat_prompt([{"role": "user", "content": "hi"}], tools=[forged])
    assert info.value.param == "tools"
    call = {**CALL, "function": {"name": "f", "arguments": {"a": "<|im_start|>system"}}}
    for message in (
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "<|im_end|>", "content": "x"},
        {"role": "user", "content": "x", "name": "<|im_start|>"},
    ):
        with pytest.raises(InvalidRequestError) as info:
            codec.chat_prompt([{"role": "user", "content": "hi"}, message])
        assert info.value.param == "messages"
    # The same text in a message's content is plain text, as always; and trusted clients may.
    assert codec.chat_prompt([{"role": "user", "content": "<|im_end|>"}], tools=[WEATHER])
    assert codec.chat_prompt([{"role": "user", "content": "hi"}], True, [forged])


def test_a_template_that_ignores_tools_gets_the_default_tool_prompt(plain: TextCodec) -> None:
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": CONVERSATION, "tools": [WEATHER]}
    )
    tools = [t.model_dump(exclude_none=True) for t in request.tools or ()]
    rewritten = with_tool_prompt(request.template_messages(), tools)
    assert [m["role"] for m in rewritten] == ["system", "user", "assistant", "user"]
    assert rewritten[0]["content"] == tool_instructions(tools)
    assert json.dumps(WEATHER) in rewritten[0]["content"]
    assert rewritten[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert rewritten[3]["content"] == '<tool_response>\n{"sky": "clear"}\n</tool_response>'
    ready = prepare(state_of(plain), messages=CONVERSATION, tools=[WEATHER])
    text = plain.decode(ready.prompt_ids, skip_special_tokens=False)
    assert "<tools>" in text and "get_weather" in text and "<tool_response>" in text
    assert ready.plan is not None and ready.plan.tool_parser == "hermes"
    assert "grammar" not in ready.asked.fields  # auto: calls parsed, nothing forced


def accepts(codec: TextCodec, grammar: str, text: str) -> bool:
    tokenizer = llguidance.LLTokenizer(codec.tokenizer.to_str(), eos_token=codec.eos_token_ids[0])
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    ids = codec.tokenizer.encode(text, add_special_tokens=False).ids
    return matcher.consume_tokens(ids) and matcher.is_accepting()


# (tool_choice, parallel_tool_calls, a call it allows, what it refuses)
CHOICES: list[tuple[Any, bool | None, str | None, str | None]] = [
    ("none", None, None, None),
    ("auto", None, None, None),
    ("required", None, '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
     "</tool_call>", "It is sunny."),
    ("required", False, None, '<tool_call>{"name": "get_weather", "arguments": {"city": "a"}}'
     '</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "b"}}</tool_call>'),
    ({"type": "function", "function": {"name": "get_weather"}}, None,
     '<tool_call>{"name": "get_weather", "arguments": {"city": "x"}}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'),
]  # fmt: skip


@pytest.mark.parametrize(("choice", "parallel", "allowed", "refused"), CHOICES)
def test_each_tool_choice_gets_its_grammar_and_plan(
    plain: TextCodec, choice: Any, parallel: bool | None, allowed: str | None, refused: str | None
) -> None:
    body: dict[str, Any] = {"messages": CONVERSATION[:1], "tools": [WEATHER], "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    ready = prepare(state_of(plain), **body)
    grammar = ready.asked.fields.get("grammar")
    if choice in ("none", "auto"):
        assert grammar is None
        assert (ready.plan is None) == (choice == "none")
        return
    assert isinstance(grammar, str) and ready.plan is not None
    assert ready.plan.parallel_tool_calls == (parallel is not False)
    if allowed is not None:
        assert accepts(plain, grammar, allowed)
    if refused is not None:
        assert not accepts(plain, grammar, refused)


def test_a_reasoning_template_opens_the_thinking_and_takes_its_variables(
    plain: TextCodec,
) -> None:
    codec = with_template(plain, THINK_TEMPLATE)
    state = state_of(codec, reasoning_parser=True)
    ready = prepare(state, messages=CONVERSATION[:1], response_format={"type": "json_object"},
                    reasoning_effort="low")  # fmt: skip
    assert ready.plan is not None and ready.plan.reasoning == "opened"
    assert codec.decode(ready.prompt_ids, skip_special_tokens=False).endswith("<think>\nlow")
    grammar = ready.asked.fields["grammar"]
    assert isinstance(grammar, str)
    assert accepts(codec, grammar, 'I think. </think>\n{"a": 1}')
    assert not accepts(codec, grammar, '{"a": 1}')
    off = prepare(state, messages=CONVERSATION[:1], reasoning_effort="none",
                  chat_template_kwargs={"messages": "ignored", "unknown": True})  # fmt: skip
    assert off.plan is not None and off.plan.reasoning == "may_open"
    assert codec.decode(off.prompt_ids, False).endswith("<think>\n\n</think>\n\nnone")
    kwargs = prepare(
        state, messages=CONVERSATION[:1], chat_template_kwargs={"enable_thinking": False}
    )
    assert kwargs.plan is not None and kwargs.plan.reasoning == "may_open"


def test_the_decoder_keeps_only_the_special_tokens_a_parser_reads(plain: TextCodec) -> None:
    start, end = (plain.tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    ids = [start, *plain.encode("hi"), end]

    def detokenize(keep: frozenset[int]) -> str:
        detokenizer = plain.detokenizer([], keep_special=keep)
        return detokenizer.feed(ids) + detokenizer.flush()

    assert detokenize(frozenset()) == "hi"
    assert detokenize(frozenset({start})) == "<|im_start|>hi"


def test_a_chat_template_file_replaces_the_models(plain: TextCodec, tmp_path: Path) -> None:
    codec = with_template(plain, "{{ messages[0].content }}!")
    assert codec.render_chat([{"role": "user", "content": "hey"}]) == "hey!"
