"""The output pipeline: tool calls and reasoning parsed out of text as it streams. Every parser
must give the same content, reasoning and calls whatever pieces the text arrives in (how a
whole response equals its stream), never let call markup into the content, and send a call's
name before its arguments are complete."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncGenerator, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrail.router.output import detect
from kvrail.router.output.call_reader import CallReader
from kvrail.router.output.piece import Piece, ToolCallDelta
from kvrail.router.output.reasoning import ReasoningSplitter
from kvrail.router.output.tool_calls import ParserName, tool_call_parser
from kvrail.router.output.transform import OutputPlan, parse_pieces

Call = tuple[int, str | None, str | None, str]


def parse(
    name: ParserName, text: str, cuts: Sequence[int] = (), parallel: bool = True
) -> tuple[str, list[Call], int]:
    """`text` fed in the pieces `cuts` makes: (content, whole calls, calls announced)."""
    counter = itertools.count()
    parser = tool_call_parser(name, parallel, lambda: f"call_{next(counter)}")
    content: list[str] = []
    deltas: list[ToolCallDelta] = []
    bounds = [0, *cuts, len(text)]
    for start, end in itertools.pairwise(bounds):
        more, calls = parser.feed(text[start:end])
        content.append(more)
        deltas += calls
    more, calls = parser.flush()
    content.append(more)
    deltas += calls
    joined = [(d.index, d.id, d.name, d.arguments) for d in ToolCallDelta.join(deltas)]
    return "".join(content), joined, parser.num_calls


# (parser, model text, content, calls as (name, arguments))
CASES: list[tuple[ParserName, str, str, list[tuple[str, str]]]] = [
    ("hermes",
     'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>\n<tool_call>{"name":"now","arguments":{}}</tool_call>\n',
     "Let me check.\n", [("get_weather", '{"city": "Paris"}'), ("now", "{}")]),
    ("hermes", 'no call <tool_ here', "no call <tool_ here", []),
    ("hermes", "<tool_call> not a call </tool_call> then",
     "<tool_call> not a call </tool_call> then", []),
    ("hermes", '<tool_call>{"arguments": {"a": "}"}, "name": "f"}</tool_call>', "",
     [("f", '{"a": "}"}')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "",
     [("f", '{"a": 1}')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": [1, {"b": "x\\"}"}]', "",
     [("f", '{"a": [1, {"b": "x\\"}"}]')]),  # cut off mid-call: the call stands as it was
    ("hermes", '<tool_call>{"name": "f"}</tool_call> And some text.', "And some text.",
     [("f", "{}")]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>\n{"na', "",
     [("f", "{}")]),  # a call cut off before its name is dropped, markup and all
    ("llama3_json", '{"name": "f", "parameters": {"x": [1, 2]}}; {"name": "g", "parameters": {}}',
     "", [("f", '{"x": [1, 2]}'), ("g", "{}")]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"s": "{"}}', "",
     [("f", '{"s": "{"}')]),
    ("llama3_json", ' Paris is sunny. {"name": "f"}', ' Paris is sunny. {"name": "f"}', []),
    ("mistral", 'Sure [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, '
     '{"name": "g", "arguments": {"b": "]"}}]', "Sure ", [("f", '{"a": 1}'), ("g", '{"b": "]"}')]),
    ("mistral", "[TOOL_CALLS]oops", "[TOOL_CALLS]oops", []),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_a_parser_gives_the_same_content_and_calls_whatever_the_pieces(
    name: ParserName, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    whole = parse(name, text)
    assert whole[0] == content
    assert [(c[2], c[3]) for c in whole[1]] == calls
    assert [c[1] for c in whole[1]] == [f"call_{i}" for i in range(len(calls))]
    for cut in range(len(text) + 1):
        assert parse(name, text, [cut]) == whole
    assert parse(name, text, list(range(1, len(text)))) == whole  # a character at a time
    rng = random.Random(7)
    for _ in range(100):
        assert parse(name, text, sorted(rng.sample(range(len(text)), rng.randint(0, 6)))) == whole


def test_a_calls_name_leaves_before_its_arguments_are_complete() -> None:
    parser = tool_call_parser("hermes", new_id=lambda: "call_x")
    _, first = parser.feed('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert first == [
        ToolCallDelta(0, "call_x", "get_weather", ""), ToolCallDelta(0, arguments='{"ci'),
    ]  # fmt: skip
    _, more = parser.feed('ty": "Rome"}}</tool_call>')
    assert more == [ToolCallDelta(0, arguments='ty": "Rome"}')]
    assert parser.flush() == ("", []) and parser.num_calls == 1


def test_without_parallel_calls_only_the_first_call_is_kept() -> None:
    text = CASES[0][1]
    content, calls, announced = parse("hermes", text, parallel=False)
    assert content == "Let me check.\n" and [c[2] for c in calls] == ["get_weather"]
    assert announced == 1


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list('<>/{}[]":, abtoolcalnmesrgu_TOOLCAS\n\\')),
                 max_size=60),
    cut=st.integers(0, 60),
)  # fmt: skip
def test_any_text_parses_the_same_split_anywhere(text: str, cut: int) -> None:
    for name in ("hermes", "llama3_json", "mistral"):
        assert parse(name, text, [min(cut, len(text))]) == parse(name, text)  # type: ignore[arg-type]


def test_a_call_reader_reads_one_object_and_tells_where_it_ends() -> None:
    reader = CallReader()
    text = '{"name": "f", "arguments": {"a": "}"}} tail'
    assert reader.feed(text) == len(text) - len(" tail")
    assert reader.done and reader.name == "f" and reader.whole_arguments == '{"a": "}"}'
    for bad in ("[1]", '{"name": 5}', '{"x" 1}', '{"name": "f", "name": "g"}'):
        reader = CallReader()
        reader.feed(bad)
        reader.finish()
        assert reader.bad, bad


# (opened by the prompt, text, reasoning, content)
THINKING: list[tuple[bool, str, str, str]] = [
    (False, "\n<think>\nhmm </thinking> ok\n</think>\n\nThe answer <think>x",
     "\nhmm </thinking> ok\n", "The answer <think>x"),
    (True, "I ponder</think>  A", "I ponder", "A"),
    (False, "plain answer", "", "plain answer"),
    (False, "  <thi", "", "  <thi"),
    (False, "<think>cut short", "cut short", ""),
    (True, "all thinking", "all thinking", ""),
]  # fmt: skip


def split(opened: bool, text: str, cuts: Sequence[int]) -> tuple[str, str]:
    splitter = ReasoningSplitter(opened)
    reasoning, content = [], []
    for start, end in itertools.pairwise([0, *cuts, len(text)]):
        r, c = splitter.feed(text[start:end])
        reasoning.append(r)
        content.append(c)
    r, c = splitter.flush()
    return "".join([*reasoning, r]), "".join([*content, c])


@pytest.mark.parametrize(("opened", "text", "reasoning", "content"), THINKING)
def test_reasoning_is_split_from_the_answer_whatever_the_pieces(
    opened: bool, text: str, reasoning: str, content: str
) -> None:
    assert split(opened, text, ()) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert split(opened, text, [cut]) == (reasoning, content)
    assert split(opened, text, list(range(1, len(text)))) == (reasoning, content)


async def _pieces(texts: Sequence[str], finish: str = "stop") -> AsyncGenerator[Piece, None]:
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        yield Piece(text, finish if last else None, i + 1)
        await asyncio.sleep(0)


async def _run(texts: Sequence[str], plan: OutputPlan, finish: str = "stop") -> list[Piece]:
    return [p async for p in parse_pieces(_pieces(texts, finish), plan, lambda: "call_1")]


async def test_pieces_carry_reasoning_content_and_calls_and_finish_with_tool_calls() -> None:
    plan = OutputPlan(reasoning="opened", tool_parser="hermes")
    texts = [
        "I should",
        " call.</thi",
        'nk>\n<tool_call>{"name": "f", ',
        '"arguments": {}}</tool_call>',
    ]
    pieces = await _run(texts, plan)
    assert "".join(p.reasoning for p in pieces) == "I should call."
    assert "".join(p.text for p in pieces) == ""
    assert ToolCallDelta.join(d for p in pieces for d in p.tool_calls) == [
        ToolCallDelta(0, "call_1", "f", "{}")
    ]
    assert [p.finish_reason for p in pieces] == [None, None, None, "tool_calls"]
    assert [p.num_tokens for p in pieces] == [1, 2, 3, 4]
    cut = await _run(texts[:3], plan, finish="length")  # a call cut short keeps `length`
    assert cut[-1].finish_reason == "length"
    plain = await _run(["just ", "text"], OutputPlan(tool_parser="hermes"))
    assert [p.text for p in plain] == ["just ", "text"] and all(p.is_plain for p in plain)
    assert plain[-1].finish_reason == "stop"


def test_the_parsers_are_read_from_the_chat_template_unless_set() -> None:
    assert detect.tool_parser("auto", "{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect.tool_parser("auto", "<tool_call>\n{{ tools }}") == "hermes"
    assert detect.tool_parser("auto", "<|python_tag|>{{ tools }}") == "llama3_json"
    assert detect.tool_parser("auto", "{{ messages }}") == "hermes"
    assert detect.tool_parser("mistral", "<tool_call>") == "mistral"
    assert detect.reasoning_parser("auto", "<think>\n{{ x }}</think>")
    assert not detect.reasoning_parser("auto", "<think> only")
    assert not detect.reasoning_parser("none", "<think></think>")
    assert detect.reasoning_parser("think", None)
