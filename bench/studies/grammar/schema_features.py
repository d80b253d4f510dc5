"""Which JSON Schema keywords each library enforces, as OpenAI's `strict: true` schemas and the
pydantic models of client SDKs use them: for each keyword, does the schema compile (or what
error), is a valid instance accepted, and is an invalid one rejected?

    /tmp/gvenv/bin/python bench/studies/grammar/schema_features.py \
        | tee bench/studies/grammar/schema_features.txt

An instance is accepted when the matcher takes all of its tokens (SmolLM2's tokenizer) and then
the stop token. `enforced` = compiled, valid accepted, invalid rejected; `ignored` = compiled
but the invalid instance got through; `too strict` = the valid instance was refused. Each
library runs with its defaults (xgrammar `any_whitespace=True`, `strict_mode=True`; llguidance
`grammar_from_json_schema` with no options).
"""

from __future__ import annotations

from typing import Any

from workload import LLGuidance, XGrammar, clean_error, load_tokenizer, machine_line, versions

OBJ_A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
INT = {"type": "integer"}

FEATURES: list[tuple[str, Any, str, str | None]] = [
    # name, schema, a valid instance, an invalid instance (None: JSON Schema has none to try)
    ("additionalProperties: false", {**OBJ_A, "additionalProperties": False},
     '{"a": 1}', '{"a": 1, "b": 2}'),
    ("additionalProperties absent (extra keys valid)", OBJ_A, '{"a": 1, "b": 2}', None),
    ("additionalProperties: schema", {**OBJ_A, "additionalProperties": {"type": "string"}},
     '{"a": 1, "b": "x"}', '{"a": 1, "b": 2}'),
    ("required (b optional, absent)", {"type": "object", "properties": {"a": INT, "b": INT},
     "required": ["a"]}, '{"a": 1}', '{"b": 2}'),
    ("required, keys in the declared order", {"type": "object",
     "properties": {"a": INT, "b": INT}, "required": ["a", "b"]}, '{"a": 1, "b": 2}', '{"a": 1}'),
    ("required, keys in another order", {"type": "object",
     "properties": {"a": INT, "b": INT}, "required": ["a", "b"]}, '{"b": 2, "a": 1}', None),
    ("enum", {"enum": ["x", "y"]}, '"x"', '"z"'),
    ("const", {"const": "fixed"}, '"fixed"', '"other"'),
    ("anyOf with null (pydantic Optional)", {"anyOf": [{"type": "string"}, {"type": "null"}]},
     "null", "1"),
    ('type ["string", "null"]', {"type": ["string", "null"]}, "null", "1"),
    ("oneOf", {"oneOf": [INT, {"type": "string"}]}, "1", "true"),
    ("allOf", {"allOf": [OBJ_A, {"type": "object", "properties": {"b": INT},
                                 "required": ["b"]}]}, '{"a": 1, "b": 2}', '{"a": 1}'),
    ("not", {"not": {"type": "string"}}, "1", '"s"'),
    ("if / then", {"type": "object", "properties": {"k": {"type": "string"}, "x": INT},
                   "if": {"properties": {"k": {"const": "a"}}}, "then": {"required": ["x"]}},
     '{"k": "b"}', '{"k": "a"}'),
    ("$defs / $ref", {"$defs": {"n": INT}, "type": "object",
                      "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"]},
     '{"a": 1}', '{"a": "x"}'),
    ("recursive $ref", {"$defs": {"t": {"type": "object", "properties": {"c": {"type": "array",
                        "items": {"$ref": "#/$defs/t"}}}, "required": ["c"]}},
                        "$ref": "#/$defs/t"}, '{"c": [{"c": []}]}', '{"c": [{}]}'),
    ("pattern", {"type": "string", "pattern": "^[A-Z]{3}$"}, '"ABC"', '"abc"'),
    ("format: email", {"type": "string", "format": "email"}, '"ada@example.com"', '"no at"'),
    ("format: date-time", {"type": "string", "format": "date-time"},
     '"2026-12-06T05:40:13Z"', '"yesterday"'),
    ("format: uuid", {"type": "string", "format": "uuid"},
     '"123e4567-e89b-12d3-a456-426614174000"', '"xyz"'),
    ("minLength / maxLength", {"type": "string", "minLength": 2, "maxLength": 3},
     '"ab"', '"abcd"'),
    ("minimum / maximum", {"type": "integer", "minimum": 1, "maximum": 10}, "5", "11"),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, "0.5", "0"),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, "10", "7"),
    ("minItems / maxItems", {"type": "array", "items": INT, "minItems": 1, "maxItems": 2},
     "[1]", "[1, 2, 3]"),
    ("uniqueItems", {"type": "array", "items": INT, "uniqueItems": True}, "[1, 2]", "[1, 1]"),
    ("prefixItems + items: false", {"type": "array", "prefixItems": [INT, {"type": "string"}],
                                    "items": False}, '[1, "a"]', '["a", 1]'),
    ("contains", {"type": "array", "contains": {"const": 3}}, "[1, 3]", "[1, 2]"),
    ("patternProperties", {"type": "object", "patternProperties": {"^x_": INT},
                           "additionalProperties": False}, '{"x_a": 1}', '{"y": 1}'),
    ("minProperties / maxProperties", {"type": "object", "minProperties": 1,
                                       "maxProperties": 1}, '{"a": 1}', "{}"),
    ("dependentRequired", {"type": "object", "properties": {"a": {}, "b": {}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1, "b": 2}', '{"a": 1}'),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
     '{"ab": 1}', '{"AB": 1}'),
    ("unknown keyword x-foo", {"type": "string", "x-foo": 1}, '"a"', "1"),
    ("description / title / default / examples", {"type": "integer", "description": "d",
     "title": "t", "default": 1, "examples": [2]}, "3", '"3"'),
]  # fmt: skip


def accepts(lib: Any, compiled: Any, tokenizer: Any, text: str) -> bool:
    matcher = lib.matcher(compiled)
    tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return all(lib.accept(matcher, t) for t in tokens) and lib.finished(matcher)


def verdict(lib: Any, tokenizer: Any, schema: Any, valid: str, invalid: str | None) -> str:
    try:
        compiled = lib.compile("json_schema", schema)
    except Exception as exc:
        return "error: " + clean_error(str(exc), 70)
    ok = accepts(lib, compiled, tokenizer, valid)
    if invalid is None:
        return "accepted" if ok else "too strict: refused"
    refused = not accepts(lib, compiled, tokenizer, invalid)
    if ok and refused:
        return "enforced"
    if ok:
        return "ignored (invalid accepted)"
    return "too strict (valid refused)"


def main() -> None:
    print(machine_line())
    print(versions())
    tokenizer, vocab_size = load_tokenizer("smollm2")
    libs = [XGrammar(tokenizer, vocab_size), LLGuidance(tokenizer, vocab_size)]
    for name, schema, valid, invalid in FEATURES:
        print(f"\n{name}: valid {valid}, invalid {invalid or '-'}")
        for lib in libs:
            print(f"  {lib.name:10s} {verdict(lib, tokenizer, schema, valid, invalid)}", flush=True)


if __name__ == "__main__":
    main()
