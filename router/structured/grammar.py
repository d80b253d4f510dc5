"""From what a request asks of its output to one llguidance grammar (`SamplingParams.grammar`):
the answer's constraint (`Constraint`: a JSON schema, any JSON object, a regex, a choice of
strings, a Lark or GBNF grammar), forced tool calls (`ToolFunction`s with `required` or a named
function), and the thinking a reasoning model does first. Pure: no grammar is compiled here
(`kvrail.router.structured.compiler` validates each part and calls `assemble`).

The grammar is llguidance's `TopLevelGrammar` as JSON. Each part a client wrote (its `entry`)
is validated and cached alone; when there is more than the answer's, the parts join one Lark
grammar, a JSON schema inline as `%json {...}` (its own root: its `#/$defs/...` references
resolve), a regex or a choice as a rule's body, and only a client's own Lark or GBNF grammar
as a grammar of its own referenced by name (`@answer`), so its rules stay its own. A grammar of
one part is what vLLM pools can be sent too (`kvrail.vllm.protocol.lark_of`).

- Tool calls are written in the parser family's format (`hermes`: `<tool_call>{"name": "f",
  "arguments": {...}}</tool_call>`, `llama3_json`: `{"name": "f", "parameters": {...}}`,
  `mistral`: `[TOOL_CALLS][{"name": "f", "arguments": {...}}]`), the name first, the arguments
  those of that function's schema; several calls unless `parallel` is off.
- With tools and `tool_choice: auto`, an answer constraint allows either tool calls or the
  constrained answer (the model chooses); without one, `auto` needs no grammar.
- A reasoning model's thinking is free text up to `</think>`, and the grammar applies to what
  follows: from the start when the prompt opened the thinking (`opened`), else after an
  optional `<think>...</think>` (`may_open`).
- A marker that is a special token of the tokenizer (Mistral's `[TOOL_CALLS]`) is matched as
  that token (`special`), never as text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import llguidance

from kvrail.router.output.reasoning import END as THINK_END
from kvrail.router.output.reasoning import START as THINK_START
from kvrail.router.output.tool_calls import HermesParser, MistralParser, ParserName
from kvrail.router.structured.schema import check_text, schema_text

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
ToolMode = Literal["auto", "required", "named"]
Reasoning = Literal["opened", "may_open"]
_WS = "WS: /[ \\t\\r\\n]*/"
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the answer must be. `value`: the schema (dict), the regex or grammar text, or the
    list of choices; `param`: the request field named when it is refused; `lenient`: JSON
    schema keywords the library does not implement are ignored instead of refused (a schema
    that is not `strict`); `whitespace_flexible`: JSON may hold whitespace between tokens."""

    kind: Kind
    value: Any
    param: str
    lenient: bool = False
    whitespace_flexible: bool = True

    def key(self) -> str:
        """The constraint's canonical text, checked (`schema_text`, `check_text`): the cache
        key of its grammar. Raises InvalidRequestError naming `param`."""
        head = f"{self.kind}\0{int(self.lenient)}{int(self.whitespace_flexible)}\0"
        if self.kind == "json_schema":
            return head + schema_text(_without_options(self.value), self.param)
        if self.kind == "json_object":
            return head
        if self.kind == "choice":
            text = json.dumps(self.value, ensure_ascii=False)
            return head + check_text(text, self.param, "list of choices")
        return head + check_text(self.value, self.param, self.kind)

    def entry(self) -> dict[str, Any]:
        """The constraint as one grammar of the list (not yet validated). Raises ValueError with
        llguidance's reason when a grammar cannot even be converted (GBNF that does not
        parse)."""
        options = {"lenient": self.lenient, "whitespace_flexible": self.whitespace_flexible}
        if self.kind == "json_schema":
            return {"json_schema": {**_without_options(self.value), "x-guidance": options}}
        if self.kind == "json_object":
            return {"json_schema": {"type": "object", "x-guidance": options}}
        if self.kind == "choice":
            lark = "start: " + " | ".join(_literal(c) for c in self.value)
            return _first(llguidance.LLMatcher.grammar_from_lark(lark))
        if self.kind == "regex":
            return _first(llguidance.LLMatcher.grammar_from_regex(self.value))
        return _first(llguidance.grammar_from("grammar", self.value))


@dataclass(frozen=True, slots=True)
class ToolFunction:
    """A function tool: its name, its parameters' JSON schema (None: it takes none), whether
    that schema is `strict` (else unimplemented keywords are ignored), and its field."""

    name: str
    parameters: dict[str, Any] | None
    strict: bool
    param: str

    def constraint(self) -> Constraint:
        schema = self.parameters if self.parameters is not None else _NO_ARGUMENTS
        return Constraint("json_schema", schema, self.param, lenient=not self.strict)


@dataclass(frozen=True, slots=True)
class GrammarRequest:
    """Everything a request's grammar depends on."""

    answer: Constraint | None = None
    tools: tuple[ToolFunction, ...] = ()
    tool_mode: ToolMode | None = None
    """`required`, `named` (`named` says which), `auto`; None: tool calls are not parsed."""
    named: str | None = None
    parallel: bool = True
    tool_format: ParserName = "hermes"
    reasoning: Reasoning | None = None
    special: Mapping[str, int] = field(default_factory=dict)
    """Marker text -> its token id, for markers that are special tokens."""

    @property
    def forces_calls(self) -> bool:
        return self.tool_mode in ("required", "named")

    @property
    def needs_grammar(self) -> bool:
        return self.answer is not None or self.forces_calls


def assemble(
    request: GrammarRequest,
    answer: Mapping[str, Any] | None,
    arguments: Sequence[Mapping[str, Any]],
) -> str | None:
    """The request's grammar (see the module docstring), from its validated parts: the answer's
    entry and each tool's arguments entry (in `request.tools`' order); None when nothing is
    constrained."""
    if not request.needs_grammar:
        return None
    rules: list[str] = []
    parts: dict[str, Mapping[str, Any]] = {}  # rule name -> its grammar entry
    bodies: list[str] = []
    if request.forces_calls or (request.tool_mode == "auto" and request.tools):
        chosen = [
            i for i, t in enumerate(request.tools)
            if request.tool_mode != "named" or t.name == request.named
        ]  # fmt: skip
        rules += _call_rules(request, chosen)
        parts.update((f"args_{i}", arguments[i]) for i in chosen)
        bodies.append("calls")
    if answer is not None and not request.forces_calls:
        if not bodies and request.reasoning is None:  # the answer's grammar alone
            return json.dumps({"grammars": [answer]}, ensure_ascii=False)
        parts["answer"] = answer
        bodies.append("answer")
    body = " | ".join(bodies)
    if request.reasoning == "opened":
        start = f"start: think WS ({body})"
    elif request.reasoning == "may_open":
        start = f"start: ({_marker(THINK_START, request.special)} think WS)? ({body})"
    else:
        start = f"start: {body}"
    if request.reasoning is not None:
        rules += _think_rules(request.special)
    inline = {name: _inline(entry) for name, entry in parts.items()}
    subgrammars = []
    for name, entry in parts.items():
        if inline[name] is not None:
            rules.append(f"{name}: {inline[name]}")
        else:  # a client's own Lark grammar keeps its rules to itself: a grammar of its own
            rules.append(f"{name}: @{name}")
            subgrammars.append({**entry, "name": name})
    lark = "\n".join([start, *rules, _WS])
    return json.dumps({"grammars": [{"lark_grammar": lark}, *subgrammars]}, ensure_ascii=False)


def _inline(entry: Mapping[str, Any]) -> str | None:
    """A part as the body of a Lark rule, so the whole grammar is one Lark grammar (what vLLM's
    `structured_outputs.grammar` takes too): a JSON schema as `%json {...}` (its own root, its
    options in its `x-guidance`), a regex or a choice (`start: ...` on one line, as the
    router writes them) as its rule's body; None for a client's Lark or GBNF grammar."""
    schema = entry.get("json_schema")
    if schema is not None:
        return "%json " + json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    lark = entry.get("lark_grammar")
    if isinstance(lark, str) and lark.startswith("start: ") and "\n" not in lark:
        return lark.removeprefix("start: ")
    return None


def _call_rules(request: GrammarRequest, chosen: Sequence[int]) -> list[str]:
    key = "parameters" if request.tool_format == "llama3_json" else "arguments"
    functions = [
        f'fn_{i}: "{{" WS {_literal(json.dumps("name"))} WS ":" WS '
        f'{_literal(json.dumps(request.tools[i].name))} WS "," WS {_literal(json.dumps(key))} '
        f'WS ":" WS args_{i} WS "}}"'
        for i in chosen
    ]
    one = "(" + " | ".join(f"fn_{i}" for i in chosen) + ")"
    many = request.parallel and request.tool_mode != "named"
    special = request.special
    if request.tool_format == "hermes":
        open_, close = _marker(HermesParser.OPEN, special), _marker(HermesParser.CLOSE, special)
        calls = "calls: call (WS call)*" if many else "calls: call"
        return [calls, f"call: {open_} WS {one} WS {close}", *functions]
    if request.tool_format == "llama3_json":
        return [f'calls: {one} (WS ";" WS {one})*' if many else f"calls: {one}", *functions]
    more = f' (WS "," WS {one})*' if many else ""
    mark = _marker(MistralParser.MARKER, special)
    return [f'calls: {mark} WS "[" WS {one}{more} WS "]"', *functions]


def _think_rules(special: Mapping[str, int]) -> list[str]:
    if THINK_END in special:  # a special token ends the thinking: any text before it
        return [f"think: THINK_TEXT {_marker(THINK_END, special)}", "THINK_TEXT: /(.|\\n)*/"]
    return ["think[lazy]: /(.|\\n)*<\\/think>/"]


def _marker(text: str, special: Mapping[str, int]) -> str:
    token = special.get(text)
    return f"<[{token}]>" if token is not None else _literal(text)


def _literal(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _first(grammar: str) -> dict[str, Any]:
    """The one grammar entry of what llguidance's `grammar_from_*` gave: a `TopLevelGrammar`'s
    JSON (its first grammar) or Lark text."""
    if not grammar.lstrip().startswith("{"):
        return {"lark_grammar": grammar}
    entry: dict[str, Any] = json.loads(grammar)["grammars"][0]
    entry.pop("name", None)
    return {k: v for k, v in entry.items() if v is not None}


def _without_options(schema: Any) -> Any:
    """The schema without llguidance's own `x-guidance` options (the router sets them)."""
    if isinstance(schema, dict) and "x-guidance" in schema:
        return {k: v for k, v in schema.items() if k != "x-guidance"}
    return schema
