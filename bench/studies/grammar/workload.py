"""What the grammar study's scripts share: the two tokenizers, the grammars of each request kind
(OpenAI `json_object` and `json_schema`, vLLM's regex, choice and grammar), outputs that follow
them, and one adapter per library so that every script drives xgrammar and llguidance the same way.

Not run by itself. The scripts beside it import it (run them with the scratch venv's python,
from the repository root, without `-P`, so that this folder is on `sys.path`).
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
LLAMA3_LIKE_DIR = Path(os.environ.get("GRAMMAR_LLAMA3_LIKE", "/tmp/gtok/llama3-like"))
SMOLLM2_VOCAB = 49_152
LLAMA3_VOCAB = 128_256
THREADS = int(os.environ.get("GRAMMAR_THREADS", "2"))
"""Threads each library may use to compile or fill masks: this VM's cores unless told."""


def smollm2_dir() -> Path:
    """The folder `kvrail model prepare` makes for the default model (tokenizer included)."""
    if "GRAMMAR_SMOLLM2" in os.environ:
        return Path(os.environ["GRAMMAR_SMOLLM2"])
    out = subprocess.run(
        [str(REPO / ".venv/bin/kvrail"), "model", "prepare"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def load_tokenizer(name: str) -> tuple[Any, int]:
    """A transformers tokenizer and the model's vocabulary (the logits' width) by name."""
    from transformers import AutoTokenizer

    if name == "smollm2":
        return AutoTokenizer.from_pretrained(smollm2_dir()), SMOLLM2_VOCAB
    if name == "llama3-like":
        if not (LLAMA3_LIKE_DIR / "tokenizer.json").exists():
            raise SystemExit(f"{LLAMA3_LIKE_DIR} is missing: run llama3_like_tokenizer.py first")
        return AutoTokenizer.from_pretrained(LLAMA3_LIKE_DIR), LLAMA3_VOCAB
    raise ValueError(name)


# --- the grammars -------------------------------------------------------------------------------

ORDER_SCHEMA: dict[str, Any] = {
    "title": "Order",
    "type": "object",
    "$defs": {
        "Address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 120},
                "city": {"type": "string"},
                "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string", "enum": ["US", "CA", "GB", "DE", "FR"]},
            },
            "required": ["street", "city", "postal_code", "country"],
            "additionalProperties": False,
        },
        "Item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "name": {"type": "string", "minLength": 1, "maxLength": 80},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                "unit_price": {"type": "number", "minimum": 0, "maximum": 10000},
                "category": {
                    "type": "string",
                    "enum": ["book", "electronics", "grocery", "toy", "clothing"],
                },
                "gift_wrap": {"type": "boolean"},
            },
            "required": ["sku", "name", "quantity", "unit_price", "category"],
            "additionalProperties": False,
        },
    },
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{8}$"},
        "status": {
            "type": "string",
            "enum": ["pending", "paid", "shipped", "delivered", "cancelled"],
        },
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "phone": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "address": {"$ref": "#/$defs/Address"},
            },
            "required": ["name", "email", "address"],
            "additionalProperties": False,
        },
        "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1},
        "notes": {"type": "string"},
        "total": {"type": "number", "minimum": 0},
    },
    "required": ["order_id", "status", "customer", "items", "total"],
    "additionalProperties": False,
}
"""A realistic nested `json_schema`: $defs/$ref, an array of objects, enums, bounded numbers,
patterns, optional and nullable fields, `additionalProperties: false` (as OpenAI strict mode)."""

JSON_OBJECT_SCHEMA = {"type": "object"}
"""`response_format: json_object`: any JSON object (what vLLM and SGLang compile it to)."""

DATE_TIME_REGEX = (
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,6})?Z"
)
CHOICES = ["positive", "negative", "neutral", "mixed"]

SQL_EBNF = r"""
root ::= "SELECT " columns " FROM " ident where? ";"
columns ::= "*" | ident (", " ident)*
where ::= " WHERE " cond (" AND " cond)*
cond ::= ident " " op " " value
op ::= "=" | "!=" | "<" | "<=" | ">" | ">="
value ::= [0-9]+ | "'" [a-zA-Z0-9 ]* "'"
ident ::= [a-z_] [a-z0-9_]*
"""
"""vLLM's `structured_outputs.grammar` in xgrammar's native GBNF-style EBNF."""

SQL_LARK = r"""
start: "SELECT " columns " FROM " IDENT where? ";"
columns: "*" | IDENT (", " IDENT)*
where: " WHERE " cond (" AND " cond)*
cond: IDENT " " OP " " value
OP: "=" | "!=" | "<" | "<=" | ">" | ">="
value: NUMBER | STRING
NUMBER: /[0-9]+/
STRING: /'[a-zA-Z0-9 ]*'/
IDENT: /[a-z_][a-z0-9_]*/
"""
"""The same grammar in Lark, llguidance's native format."""


@dataclass(frozen=True, slots=True)
class Case:
    """One request kind: its grammar per library and an output that follows it."""

    name: str
    kind: str  # json_schema | regex | choice | grammar
    spec: Any
    sample: str


def cases() -> list[Case]:
    order = json.dumps(make_order(random.Random(0), 2))
    return [
        Case("json_object", "json_schema", JSON_OBJECT_SCHEMA, '{"answer": 42, "ok": true}'),
        Case("json_schema (order)", "json_schema", ORDER_SCHEMA, order),
        Case("regex (date-time)", "regex", DATE_TIME_REGEX, "2026-12-06T05:40:13.250Z"),
        Case("choice (4)", "choice", CHOICES, "neutral"),
        Case(
            "grammar (SQL)",
            "grammar",
            {"ebnf": SQL_EBNF, "lark": SQL_LARK},
            "SELECT id, name FROM users WHERE age >= 21 AND city = 'Paris';",
        ),
    ]


FIRST = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "Ken"]
LAST = ["Lovelace", "Hopper", "Turing", "Dijkstra", "Liskov", "Knuth", "Allen", "Thompson"]
CITIES = ["Springfield", "Riverside", "Franklin", "Greenville", "Bristol", "Clinton"]
PRODUCTS = ["USB-C cable", "paperback novel", "wooden train set", "green tea (100 bags)",
            "wool scarf", "noise-cancelling headphones", "chess set", "rain jacket"]  # fmt: skip
CATEGORIES = ["book", "electronics", "grocery", "toy", "clothing"]


def make_order(rng: random.Random, num_items: int) -> dict[str, Any]:
    """A valid instance of ORDER_SCHEMA (keys in the schema's order, as a model would emit)."""
    first, last = rng.choice(FIRST), rng.choice(LAST)
    items = []
    total = 0.0
    for _ in range(num_items):
        item: dict[str, Any] = {
            "sku": "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(3))
            + f"-{rng.randrange(10_000):04d}",
            "name": rng.choice(PRODUCTS),
            "quantity": rng.randint(1, 12),
            "unit_price": round(rng.uniform(1, 400), 2),
            "category": rng.choice(CATEGORIES),
        }
        if rng.random() < 0.3:
            item["gift_wrap"] = rng.random() < 0.5
        total += item["quantity"] * item["unit_price"]
        items.append(item)
    order: dict[str, Any] = {
        "order_id": f"ORD-{rng.randrange(10**8):08d}",
        "status": rng.choice(["pending", "paid", "shipped", "delivered", "cancelled"]),
        "customer": {
            "name": f"{first} {last}",
            "email": f"{first.lower()}.{last.lower()}@example.com",
            "phone": rng.choice([None, f"+1 555 {rng.randrange(10_000):04d}"]),
            "address": {
                "street": f"{rng.randint(1, 999)} Main Street",
                "city": rng.choice(CITIES),
                "postal_code": f"{rng.randrange(100_000):05d}",
                "country": rng.choice(["US", "CA", "GB", "DE", "FR"]),
            },
        },
        "items": items,
    }
    if rng.random() < 0.5:
        order["notes"] = "Leave the parcel at the door, please."
    order["total"] = round(total, 2)
    return order


def order_tokens(tokenizer: Any, seed: int, num_items: int) -> list[int]:
    """An order's tokens as the model would sample them, ending with the stop token."""
    text = json.dumps(make_order(random.Random(seed), num_items))
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


# --- timing -------------------------------------------------------------------------------------


def summary(seconds: Sequence[float]) -> dict[str, float]:
    """Mean, p50, p99 and max, in microseconds."""
    s = sorted(seconds)
    return {
        "mean": statistics.fmean(s) * 1e6,
        "p50": s[len(s) // 2] * 1e6,
        "p99": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6,
        "max": s[-1] * 1e6,
    }


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def cpu_timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """Wall time and the process's CPU time (all its threads) of one call: with CI on the other
    core the wall time also counts time spent waiting for a core, the CPU time does not."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def clean_error(error: str, width: int = 140) -> str:
    """An error's gist on one line: xgrammar's carry a timestamp, a C++ source path and line,
    and can end with the whole schema echoed back."""
    gist = error.split(". The JSON string is:")[0]
    gist = re.sub(r"\[\d\d:\d\d:\d\d\] /\S+:\d+: ", "", gist)
    gist = re.sub(r"Check failed: \(.*?\) is false: ", "", gist)
    gist = " ".join(gist.split())
    return gist if len(gist) <= width else gist[: width - 3] + "..."


def machine_line() -> str:
    load = os.getloadavg()
    return (
        f"machine: {os.cpu_count()} vCPU ({_cpu_model()}), load average {load[0]:.1f} "
        f"(a CI run shares these cores)"
    )


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def versions() -> str:
    from importlib.metadata import version

    names = ["xgrammar", "llguidance", "apache-tvm-ffi", "torch", "transformers", "tokenizers"]
    return ", ".join(f"{n} {version(n)}" for n in names)


# --- one adapter per library --------------------------------------------------------------------


class Library:
    """The calls an engine makes, spelled the same for both libraries.

    `prepare` does what is done once per model; `compile` turns a request's grammar into the
    object to cache; `matcher` makes a request's state from it (at the grammar's start).
    """

    name: str
    vocab_size: int

    def compile(self, kind: str, spec: Any) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matcher: Any, bitmask: Any, row: int) -> None: ...
    def fill_batch(self, matchers: list[Any], bitmask: Any) -> None: ...
    def accept(self, matcher: Any, token: int) -> bool: ...
    def accept_batch(self, matchers: list[Any], tokens: list[int]) -> None: ...
    def accept_many(self, matcher: Any, tokens: list[int]) -> bool: ...
    def rollback(self, matcher: Any, num_tokens: int) -> None: ...
    def finished(self, matcher: Any) -> bool: ...
    def reset(self, matcher: Any) -> None: ...
    def fork(self, matcher: Any) -> Any: ...
    def set_threads(self, n: int) -> None: ...


class XGrammar(Library):
    name = "xgrammar"

    def __init__(
        self, tokenizer: Any, vocab_size: int, *, cache: bool = True, dynamic: bool = False
    ) -> None:
        """`dynamic`: xgrammar's `enable_dynamic_compilation` (masks built on first use)."""
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        if dynamic:
            self.name = "xgrammar-dyn"
        start = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.prepare_s = time.perf_counter() - start
        self.compiler = xgr.GrammarCompiler(
            self.info,
            max_threads=THREADS,
            cache_enabled=cache,
            enable_dynamic_compilation=dynamic,
        )
        self.set_threads(THREADS)

    def set_threads(self, n: int) -> None:
        """The threads of the batched fill."""
        self.batch = self.xgr.BatchGrammarMatcher(max_threads=n)

    def compile(self, kind: str, spec: Any) -> Any:
        if kind == "json_schema":
            text = spec if isinstance(spec, str) else json.dumps(spec)
            return self.compiler.compile_json_schema(text, any_whitespace=True)
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        if kind == "choice":  # as vLLM does: an EBNF alternation
            return self.compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c) for c in spec)
            )
        if kind == "grammar":
            return self.compiler.compile_grammar(spec["ebnf"] if isinstance(spec, dict) else spec)
        if kind == "lark":
            return self.compiler.compile_lark(spec)
        raise ValueError(kind)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list[Any], bitmask: Any) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def accept_batch(self, matchers: list[Any], tokens: list[int]) -> None:
        self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def accept_many(self, matcher: Any, tokens: list[int]) -> bool:
        return all(matcher.accept_token(t) for t in tokens)

    def rollback(self, matcher: Any, num_tokens: int) -> None:
        matcher.rollback(num_tokens)

    def finished(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())

    def reset(self, matcher: Any) -> None:
        matcher.reset()

    def fork(self, matcher: Any) -> Any:
        return matcher.fork()


class LLGuidance(Library):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.llg_torch = llguidance.torch
        self.vocab_size = vocab_size
        start = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.prepare_s = time.perf_counter() - start
        self.set_threads(THREADS)

    def set_threads(self, n: int) -> None:
        """The threads of the batched fill and accept."""
        self.executor = self.llg.LLExecutor(num_threads=n)

    def grammar(self, kind: str, spec: Any) -> str:
        """The library's grammar text (a cheap Python-side step; the work is in `compile`)."""
        m = self.llg.LLMatcher
        if kind == "json_schema":
            return m.grammar_from_json_schema(spec if isinstance(spec, str) else json.dumps(spec))
        if kind == "regex":
            return m.grammar_from_regex(spec)
        if kind == "choice":
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        if kind == "grammar":
            return m.grammar_from_lark(spec["lark"] if isinstance(spec, dict) else spec)
        raise ValueError(kind)

    def compile(self, kind: str, spec: Any) -> Any:
        """llguidance has no compiled-grammar object: a matcher at the start state is the thing
        to cache, and `matcher` deep-copies it."""
        matcher = self.llg.LLMatcher(self.tokenizer, self.grammar(kind, spec), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        self.llg_torch.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers: list[Any], bitmask: Any) -> None:
        self.llg_torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def accept_batch(self, matchers: list[Any], tokens: list[int]) -> None:
        self.executor.consume_token_par(list(zip(matchers, tokens, strict=True)))

    def accept_many(self, matcher: Any, tokens: list[int]) -> bool:
        return bool(matcher.consume_tokens(tokens))

    def rollback(self, matcher: Any, num_tokens: int) -> None:
        matcher.rollback(num_tokens)

    def finished(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())

    def reset(self, matcher: Any) -> None:
        matcher.reset()

    def fork(self, matcher: Any) -> Any:
        return matcher.deep_copy()


def libraries(tokenizer: Any, vocab_size: int) -> list[Library]:
    return [XGrammar(tokenizer, vocab_size), LLGuidance(tokenizer, vocab_size)]


def allowed(bitmask: Any, row: int, token: int) -> bool:
    """Whether a filled bitmask row allows `token`."""
    word = int(bitmask[row, token // 32])
    return bool((word >> (token % 32)) & 1)
