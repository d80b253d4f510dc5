"""A generation request made ready to generate (`prepare_chat`, `prepare_completion`): its
prompt tokens, its sampling with the grammar its output must follow, and how its output is
parsed (`Ready`).

For a chat: the messages, `tools` and template variables are rendered by the chat template (a
template that ignores tools gets kvrail's default tool prompt, `text.tool_prompt`) and
tokenized on the tokenizer threads; `tool_choice` decides what is parsed and what is forced:
`none` renders the tools and parses no call, `auto` parses calls from free text, `required` and
a named function force calls by the grammar, so their arguments always follow the function's
schema. `response_format` / `structured_outputs` constrain the answer (with tools and `auto`:
the answer or tool calls). The router's reasoning parser splits a reasoning model's thinking
from its answer, and the grammar applies to the answer only. `reasoning_effort` and
`chat_template_kwargs` reach the template as variables, as vLLM passes them: only names the
template reads, never those kvrail sets itself.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvrail.router.api.agent_fields import NamedToolChoice, StructuredOutputs
from kvrail.router.api.errors import ApiError
from kvrail.router.api.sampling import Requested, requested
from kvrail.router.api.schemas import ChatCompletionRequest, CompletionRequest
from kvrail.router.generate import RouterState, context_len
from kvrail.router.output.reasoning import END as THINK_END
from kvrail.router.output.reasoning import START as THINK_START
from kvrail.router.output.tool_calls import HermesParser, Llama3JsonParser, MistralParser
from kvrail.router.output.transform import OutputPlan
from kvrail.router.structured.compiler import CompilerBusy, GrammarCompiler
from kvrail.router.structured.grammar import (
    Constraint,
    GrammarRequest,
    Reasoning,
    ToolFunction,
    ToolMode,
)
from kvrail.router.text.tool_prompt import with_tool_prompt

T = TypeVar("T")
_MARKERS = {
    "hermes": (HermesParser.OPEN, HermesParser.CLOSE),
    "llama3_json": (Llama3JsonParser.TAG,),
    "mistral": (MistralParser.MARKER,),
}
# Render arguments kvrail sets itself: a template variable of the request never replaces them.
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_PROMPT_TAIL_TOKENS = 16  # enough to hold a generation prompt's `<think>` and what follows it


@dataclass(frozen=True, slots=True)
class Ready:
    prompt_ids: list[int]
    asked: Requested
    plan: OutputPlan | None = None
    keep_special: frozenset[int] = frozenset()
    """Special tokens the parsers read, kept in the output's text."""


async def chat_prompt(state: RouterState, body: ChatCompletionRequest) -> list[int]:
    """The chat's prompt tokens: its messages, tools and template variables rendered by the chat
    template, tokenized on the tokenizer threads after `check_length`. The one rendering of a
    chat, for the router and for kvrail's endpoint picker, so both hash the same blocks. Raises
    ApiError, InvalidRequestError (400 naming the field)."""
    codec = state.codec
    messages = body.template_messages()
    tools = _tools(body)
    template_tools = tools
    history_has_tools = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not codec.renders_tools and (tools or history_has_tools):
        messages, template_tools = with_tool_prompt(messages, tools), None
    text_bytes = sum(len((m.get("content") or "").encode()) for m in messages)
    text_bytes += len(json.dumps(template_tools).encode()) if template_tools else 0
    check_length(state, text_bytes, "messages")
    return await state.tokenizer.run(
        codec.chat_prompt, messages, state.allow_special_tokens, template_tools,
        _variables(state, body),
    )  # fmt: skip


async def completion_prompt(state: RouterState, body: CompletionRequest) -> list[int]:
    """A completion's prompt tokens: its token ids as sent, or its text tokenized on the
    tokenizer threads after `check_length` (for the router and kvrail's endpoint picker).
    Raises ApiError (400 naming `prompt`)."""
    text, prompt_ids = body.prompt_text, body.prompt_ids
    if text is not None:
        check_length(state, len(text.encode()), "prompt")
        prompt_ids = await tokenize(state, state.codec.encode, text, state.allow_special_tokens)
    assert prompt_ids is not None
    vocab = state.codec.vocab_size
    if any(t < 0 or t >= vocab for t in prompt_ids):
        raise ApiError(400, f"token ids must be in [0, {vocab})", param="prompt")
    return list(prompt_ids)


async def prepare_chat(state: RouterState, body: ChatCompletionRequest) -> Ready:
    """Raises ApiError, InvalidRequestError (400 naming the field)."""
    codec = state.codec
    tools = _tools(body)
    choice = body.tool_choice or ("auto" if tools else "none")
    prompt_ids = await chat_prompt(state, body)
    reasoning = _reasoning(state, prompt_ids)
    answer = _answer(body.response_format, body.structured_outputs)
    if answer is None and not tools and reasoning is None:
        return Ready(prompt_ids, requested(body))  # a plain chat: nothing to force or parse
    parser = state.tool_call_parser if tools and choice != "none" else None
    markers = [
        *(_MARKERS[parser] if parser else ()),
        *((THINK_START, THINK_END) if reasoning else ()),
    ]
    special = codec.special_ids(markers)
    mode: ToolMode | None = None
    if parser is not None:
        mode = "named" if isinstance(choice, NamedToolChoice) else choice  # type: ignore[assignment]
    grammar_request = GrammarRequest(
        answer=answer,
        tools=tuple(
            ToolFunction(
                t.function.name,
                t.function.parameters,
                bool(t.function.strict),
                f"tools.{i}.function.parameters",
            )
            for i, t in enumerate(body.tools or ())
        ),
        tool_mode=mode,
        named=choice.function.name if isinstance(choice, NamedToolChoice) else None,
        parallel=body.parallel_tool_calls is not False,
        tool_format=state.tool_call_parser,
        reasoning=reasoning,
        special=special,
    )
    asked = await _with_grammar(state, requested(body), grammar_request)
    plan = None
    if reasoning is not None or parser is not None:
        plan = OutputPlan(reasoning, parser, body.parallel_tool_calls is not False)
    return Ready(prompt_ids, asked, plan, frozenset(special.values()))


async def prepare_completion(state: RouterState, body: CompletionRequest) -> Ready:
    """A completion's grammar (no parsing: its text is returned as it comes); the prompt is
    the app's. Raises ApiError, InvalidRequestError."""
    request = GrammarRequest(answer=_answer(body.response_format, body.structured_outputs))
    return Ready([], await _with_grammar(state, requested(body), request))


def check_length(state: RouterState, num_bytes: int, param: str) -> None:
    """Refuse a prompt whose text alone proves it longer than the context, before tokenizing
    it: no token covers more than `TextCodec.max_token_bytes` bytes."""
    at_least = state.codec.at_least_tokens(num_bytes)
    context = context_len(state)
    if at_least > context:
        raise ApiError(
            400, f"the prompt has at least {at_least} tokens ({num_bytes} bytes of text); this "
            f"model's context is {context} tokens", param=param, code="context_length_exceeded",
        )  # fmt: skip


async def tokenize(state: RouterState, encode: Callable[..., T], *args: Any) -> T:
    """Run `encode` on the router's tokenizer threads: the event loop keeps serving meanwhile
    (the tokenizer releases the GIL while it works)."""
    return await state.tokenizer.run(encode, *args)


def _tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    return [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None


def _answer(response_format: Any, structured: StructuredOutputs | None) -> Constraint | None:
    """The answer's constraint, from `response_format` or `structured_outputs`."""
    kind = response_format.type if response_format is not None else "text"
    if kind == "json_object":
        return Constraint("json_object", None, "response_format")
    if kind == "json_schema":
        spec = response_format.json_schema
        if spec.schema_ is None:
            return Constraint("json_object", None, "response_format.json_schema")
        param = "response_format.json_schema.schema"
        return Constraint("json_schema", spec.schema_, param, lenient=not spec.strict)
    if structured is None:
        return None
    flexible = not structured.disable_any_whitespace
    if structured.json_ is not None:
        return Constraint("json_schema", structured.json_, "structured_outputs.json",
                          whitespace_flexible=flexible)  # fmt: skip
    if structured.regex is not None:
        return Constraint("regex", structured.regex, "structured_outputs.regex")
    if structured.choice is not None:
        return Constraint("choice", tuple(structured.choice), "structured_outputs.choice")
    if structured.grammar is not None:
        return Constraint("grammar", structured.grammar, "structured_outputs.grammar")
    return Constraint("json_object", None, "structured_outputs.json_object",
                      whitespace_flexible=flexible)  # fmt: skip


async def _with_grammar(state: RouterState, asked: Requested, request: GrammarRequest) -> Requested:
    compiler = state.grammars
    if compiler is None:  # the first request that needs one makes it
        compiler = state.grammars = GrammarCompiler.for_codec(state.codec)
    try:
        grammar = await compiler.grammar(request)
    except CompilerBusy as err:
        raise ApiError(503, str(err), "service_unavailable_error", code="grammar_busy") from err
    if grammar is None:
        return asked
    return dataclasses.replace(asked, fields={**asked.fields, "grammar": grammar})


def _variables(state: RouterState, body: ChatCompletionRequest) -> dict[str, Any]:
    """The template variables of the request that its template reads: `reasoning_effort` (and
    `enable_thinking`: false for `none`, else true), then `chat_template_kwargs` over them."""
    values: dict[str, Any] = {}
    if body.reasoning_effort is not None:
        values["reasoning_effort"] = body.reasoning_effort
        values["enable_thinking"] = body.reasoning_effort != "none"
    values.update(body.chat_template_kwargs or {})
    reads = state.codec.template_variables
    reserved = _RESERVED | state.codec.special_tokens.keys()
    return {k: v for k, v in values.items() if k in reads and k not in reserved}


def _reasoning(state: RouterState, prompt_ids: Sequence[int]) -> Reasoning | None:
    """With the reasoning parser on: `opened` when the prompt ends inside `<think>`, else
    `may_open`."""
    if not state.reasoning_parser:
        return None
    tail = state.codec.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return "opened" if tail.rfind(THINK_START) > tail.rfind(THINK_END) else "may_open"
