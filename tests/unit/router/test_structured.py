"""Structured outputs and forced tool calls as llguidance grammars, checked with llguidance's own
matcher over SmolLM2's tokenizer: an allowed output is accepted to the end, a forbidden one is
refused; and every hostile schema is a 400 naming its field, with a short message."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import llguidance
import pytest

from kvrail.errors import InvalidRequestError
from kvrail.router.structured import compiler as compiler_module
from kvrail.router.structured.compiler import CompilerBusy, GrammarCompiler
from kvrail.router.structured.grammar import Constraint, GrammarRequest, ToolFunction
from kvrail.router.structured.schema import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, schema_text
from kvrail.router.text.tokenizer import TextCodec
from kvrail.settings import default_cache_dir
from kvrail.vllm.protocol import lark_of

SECRET = "SECRET-SCHEMA-TEXT"
WEATHER = {
    "type": "object",
    "properties": {"city": {"$ref": "#/$defs/City"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
    "$defs": {"City": {"type": "string", "maxLength": 12}},
}


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.load("smollm2", default_cache_dir())


@pytest.fixture(scope="module")
def compiler(codec: TextCodec) -> GrammarCompiler:
    return GrammarCompiler.for_codec(codec)


@pytest.fixture(scope="module")
def tokenizer(codec: TextCodec) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(codec.tokenizer.to_str(), eos_token=list(codec.eos_token_ids))


def accepts(
    tokenizer: llguidance.LLTokenizer, codec: TextCodec, grammar: str, text: str,
    special: tuple[int, ...] = (),
) -> bool:  # fmt: skip
    """Whether the grammar takes `text` (after the tokens `special`) whole and may end there."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = [*special, *codec.tokenizer.encode(text, add_special_tokens=False).ids]
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def build(compiler: GrammarCompiler, request: GrammarRequest) -> str:
    grammar = asyncio.run(compiler.grammar(request))
    assert grammar is not None
    return grammar


TOOLS = (
    ToolFunction("get_weather", WEATHER, True, "tools.0.function.parameters"),
    ToolFunction("now", None, False, "tools.1.function.parameters"),
)
# (request, allowed outputs, forbidden outputs)
GRAMMARS: list[tuple[GrammarRequest, list[str], list[str]]] = [
    (GrammarRequest(answer=Constraint("json_schema", WEATHER, "p")),
     ['{"city": "Paris", "unit": "c"}', '{"city":"Rome","unit":"f"}'],
     ['{"city": "Paris"}', '{"unit": "c", "city": "Paris"}', '{"city": "Llanfairpwllgwyngyll", '
      '"unit": "c"}', ' {"city": "Paris", "unit": "c"}']),
    (GrammarRequest(answer=Constraint("json_object", None, "p")), ['{"any": [1, {}]}'],
     ["[1]", '"text"']),
    (GrammarRequest(answer=Constraint("regex", r"\d{3}-[a-z]+", "p")), ["123-abc"],
     ["12-abc", "123-ABC"]),
    (GrammarRequest(answer=Constraint("choice", ('say "yes"', "naïve\\no"), "p")),
     ['say "yes"', "naïve\\no"], ["say yes", "naïve"]),
    (GrammarRequest(answer=Constraint("grammar", 'root ::= "yes" | "no"', "p")), ["yes", "no"],
     ["maybe"]),
    (GrammarRequest(answer=Constraint("grammar", 'start: "a"+ "b"', "p")), ["aab"], ["b"]),
    (GrammarRequest(tools=TOOLS, tool_mode="required"),
     ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
      '</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>'],
     ["It is sunny.", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
      "</tool_call>", '<tool_call>{"name": "now", "arguments": {"x": 1}}</tool_call>',
      '<tool_call>{"name": "other", "arguments": {}}</tool_call>']),
    (GrammarRequest(tools=TOOLS, tool_mode="required", parallel=False),
     ['<tool_call>{"name": "now", "arguments": {}}</tool_call>'],
     ['<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "now", '
      '"arguments": {}}</tool_call>']),
    (GrammarRequest(tools=TOOLS, tool_mode="named", named="now"),
     ['<tool_call>{"name": "now", "arguments": {}}</tool_call>'],
     ['<tool_call>{"name": "get_weather", "arguments": {"city": "a", "unit": "c"}}</tool_call>']),
    (GrammarRequest(tools=TOOLS, tool_mode="required", tool_format="llama3_json"),
     ['{"name": "now", "parameters": {}}; {"name": "now", "parameters": {}}'],
     ['{"name": "now", "arguments": {}}']),
    (GrammarRequest(tools=TOOLS, tool_mode="required", tool_format="mistral"),
     ['[TOOL_CALLS][{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": '
      '{"city": "x", "unit": "f"}}]'], ["[TOOL_CALLS][]", '[{"name": "now", "arguments": {}}]']),
    # tools with `auto` and an answer format: either calls or the answer, nothing else
    (GrammarRequest(answer=Constraint("json_schema", WEATHER, "p"), tools=TOOLS,
                    tool_mode="auto"),
     ['{"city": "Paris", "unit": "c"}', '<tool_call>{"name": "now", "arguments": {}}</tool_call>'],
     ["Hello", '{"city": 1}']),
    # a reasoning model: free thinking up to </think>, then the answer's grammar
    (GrammarRequest(answer=Constraint("json_schema", WEATHER, "p"), reasoning="opened"),
     ['Let me think {not json} </think>\n\n{"city": "Paris", "unit": "c"}'],
     ['{"city": "Paris", "unit": "c"}', 'hmm </think> nope']),
    (GrammarRequest(answer=Constraint("grammar", 'start: "a"+ "b"', "p"), reasoning="opened"),
     ["x </think> aab"], ["aab", "x </think> b"]),  # a client's Lark keeps its own rules
    (GrammarRequest(answer=Constraint("choice", ("yes", "no"), "p"), reasoning="opened"),
     ["hm</think>yes"], ["hm</think>maybe"]),
    (GrammarRequest(answer=Constraint("regex", "[0-9]{2}/[a-z]", "p"), tools=TOOLS,
                    tool_mode="auto"),
     ["12/a", '<tool_call>{"name": "now", "arguments": {}}</tool_call>'], ["1/a"]),
    (GrammarRequest(tools=TOOLS, tool_mode="required", reasoning="may_open"),
     ['<think>call now</think>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>',
      '<tool_call>{"name": "now", "arguments": {}}</tool_call>'],
     ["<think>no call</think> I will not call."]),
]  # fmt: skip


@pytest.mark.parametrize(("request_", "allowed", "forbidden"), GRAMMARS)
def test_a_grammar_takes_what_is_allowed_and_refuses_what_is_not(
    compiler: GrammarCompiler, tokenizer: llguidance.LLTokenizer, codec: TextCodec,
    request_: GrammarRequest, allowed: list[str], forbidden: list[str],
) -> None:  # fmt: skip
    grammar = build(compiler, request_)
    for text in allowed:
        assert accepts(tokenizer, codec, grammar, text), text
    for text in forbidden:
        assert not accepts(tokenizer, codec, grammar, text), text


def test_a_marker_that_is_a_special_token_is_matched_as_that_token(
    compiler: GrammarCompiler, tokenizer: llguidance.LLTokenizer, codec: TextCodec
) -> None:
    marker = codec.tokenizer.token_to_id("<|im_start|>")  # stands in for Mistral's [TOOL_CALLS]
    request = GrammarRequest(
        tools=TOOLS, tool_mode="required", tool_format="mistral",
        special={"[TOOL_CALLS]": marker},
    )  # fmt: skip
    grammar = build(compiler, request)
    call = '[{"name": "now", "arguments": {}}]'
    assert accepts(tokenizer, codec, grammar, call, special=(marker,))
    assert not accepts(tokenizer, codec, grammar, "[TOOL_CALLS]" + call)


@pytest.mark.parametrize(("request_", "allowed", "forbidden"), GRAMMARS)
def test_a_grammar_of_one_part_is_what_vllm_pools_take(
    compiler: GrammarCompiler, request_: GrammarRequest, allowed: list[str],
    forbidden: list[str],
) -> None:  # fmt: skip
    grammar = build(compiler, request_)
    parts = json.loads(grammar)["grammars"]
    own_lark = request_.answer is not None and request_.answer.kind == "grammar"
    if len(parts) > 1:  # only a client's own Lark grammar next to something else
        assert own_lark and request_.reasoning is not None and len(parts) == 2
    else:
        assert lark_of(grammar)


def test_no_grammar_when_nothing_is_constrained(compiler: GrammarCompiler) -> None:
    assert asyncio.run(compiler.grammar(GrammarRequest())) is None
    auto = GrammarRequest(tools=TOOLS, tool_mode="auto")  # validated, parsed, not forced
    assert asyncio.run(compiler.grammar(auto)) is None


def _deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):  # built without recursion: no depth is too deep to build
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# (schema, fragment of the message)
HOSTILE: list[tuple[Any, str]] = [
    ({"$ref": "#/$defs/Gone"}, "'#/$defs/Gone', which is not in the schema"),
    ({"$ref": "https://evil.test/schema.json"}, "only references inside the schema"),
    ({"$ref": "other.json#/a"}, "only references inside the schema"),
    ({"$ref": 5}, "not a string"),
    ({"items": {"$ref": "#/items/0"}}, "not in the schema"),
    ({"type": "object", "description": "x" * MAX_SCHEMA_BYTES}, "bytes as compact JSON"),
    ({"enum": [float("nan")]}, "JSON cannot state"),
    (_deep(10_000), f"more than {MAX_SCHEMA_DEPTH} levels"),
    (_deep(MAX_SCHEMA_DEPTH), f"more than {MAX_SCHEMA_DEPTH} levels"),  # 2 JSON levels each
    ({"not": {"type": "string"}}, 'Unimplemented keys: ["not"]'),
    ({"type": "frobnicate", "description": SECRET}, "Invalid type"),
    ({"type": "object", "properties": [SECRET]}, "properties must be an object"),
    ({"type": "string", "pattern": "(" + SECRET}, "regex parse error"),
    ([SECRET], "must be a JSON schema object"),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "fragment"), HOSTILE)
def test_a_hostile_schema_is_refused_naming_its_field(
    compiler: GrammarCompiler, schema: Any, fragment: str
) -> None:
    param = "response_format.json_schema.schema"
    request = GrammarRequest(answer=Constraint("json_schema", schema, param))
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(compiler.grammar(request))
    assert info.value.param == param and fragment in str(info.value)
    assert SECRET not in str(info.value) and len(str(info.value)) < 300
    tool = ToolFunction(
        "f", schema if isinstance(schema, dict) else {}, True, "tools.3.function.parameters"
    )
    if isinstance(schema, dict):  # the same schema as a tool's parameters names the tool
        with pytest.raises(InvalidRequestError) as info:
            asyncio.run(compiler.grammar(GrammarRequest(tools=(tool,), tool_mode="auto")))
        assert info.value.param == "tools.3.function.parameters"


def test_a_schema_that_is_not_strict_ignores_what_is_not_implemented(
    compiler: GrammarCompiler, tokenizer: llguidance.LLTokenizer, codec: TextCodec
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "not": {"required": ["b"]}}
    grammar = build(compiler, GrammarRequest(answer=Constraint("json_schema", schema, "p", True)))
    assert accepts(tokenizer, codec, grammar, '{"a": "x"}')


def test_a_backtracking_regex_compiles_and_runs_in_linear_time(
    compiler: GrammarCompiler, tokenizer: llguidance.LLTokenizer, codec: TextCodec
) -> None:
    started = time.monotonic()
    grammar = build(compiler, GrammarRequest(answer=Constraint("regex", "(a+)+b", "p")))
    assert accepts(tokenizer, codec, grammar, "a" * 200 + "b")
    assert not accepts(tokenizer, codec, grammar, "a" * 200 + "c")
    assert time.monotonic() - started < 5


def test_a_refusal_and_a_grammar_are_cached_by_their_text(codec: TextCodec) -> None:
    compiler = GrammarCompiler.for_codec(codec, max_entries=2)
    for param in ("a", "b"):  # the cached refusal names the field of the request at hand
        with pytest.raises(InvalidRequestError) as info:
            asyncio.run(
                compiler.grammar(
                    GrammarRequest(answer=Constraint("json_schema", {"not": {}}, param))
                )
            )
        assert info.value.param == param
    assert compiler.num_compiled == 1
    good = GrammarRequest(answer=Constraint("json_schema", WEATHER, "a"))
    assert asyncio.run(compiler.grammar(good)) == asyncio.run(compiler.grammar(good))
    assert compiler.num_compiled == 2
    for i in range(3):  # beyond its bound the oldest entries go
        asyncio.run(compiler.grammar(GrammarRequest(answer=Constraint("regex", f"x{i}", "a"))))
    assert compiler.num_cached == 2
    asyncio.run(compiler.grammar(good))  # gone from the cache: compiled again
    assert compiler.num_compiled == 6


def test_a_compile_past_its_deadline_is_a_400_and_one_that_never_started_a_503(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiler = GrammarCompiler(num_threads=1, timeout_s=0.2)
    release = threading.Event()
    slow = compiler._build

    def held(request: GrammarRequest) -> str | None:
        release.wait(5)
        return slow(request)

    monkeypatch.setattr(compiler, "_build", held)
    request = GrammarRequest(answer=Constraint("regex", "a", "structured_outputs.regex"))

    async def both() -> list[BaseException | str | None]:
        return await asyncio.gather(
            compiler.grammar(request), compiler.grammar(request), return_exceptions=True
        )

    first, second = asyncio.run(both())
    release.set()
    assert isinstance(first, InvalidRequestError) and first.param == "structured_outputs.regex"
    assert "took longer than 0.2 s" in str(first)
    assert isinstance(second, CompilerBusy)
    compiler.shutdown()


def test_schema_text_keeps_the_key_order_and_resolves_local_pointers() -> None:
    schema = {
        "b": 1,
        "a": {"x~y/z": {"type": "string"}, "$ref": "#/a/x~0y~1z"},
        "c": [{"$ref": "#"}],
    }
    text = schema_text(schema, "p")
    assert text.startswith('{"b":1,"a":') and json.loads(text) == schema
    assert compiler_module.COMPILE_THREADS >= 1
