"""Grammars checked, validated and cached off the event loop (`GrammarCompiler`), so that a
hostile schema costs its sender a 400 and nobody else anything.

Each request's parts (the answer's constraint, every tool's parameters) are checked
(`Constraint.key`: size, depth, references), converted and validated by llguidance
(`LLMatcher.validate_grammar_with_warnings`, with the model's tokenizer so special tokens are
known, and `LLParserLimits` with `verbose_errors` off so no message carries the grammar back),
then assembled (`grammar.assemble`). All of it runs on `num_threads` threads of its own:
llguidance releases the GIL while it compiles, and the router's event loop and tokenizer
threads keep serving. A request waits at most `timeout_s` for its grammar: past that it gets a
400 if its compile had started (llguidance's limits end that compile soon after, on its thread)
and `CompilerBusy` (a 503) if it never got a thread. Validated parts and refusals are cached by
their canonical text (a bounded LRU), so a repeated schema, or a repeated hostile one, costs a
lookup.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import llguidance

from kvrail.errors import InvalidRequestError, KvrailError
from kvrail.router.structured.grammar import Constraint, GrammarRequest, assemble
from kvrail.router.text.tokenizer import TextCodec
from kvrail.sampling import MAX_GRAMMAR_CHARS

log = logging.getLogger(__name__)

COMPILE_THREADS = 2
COMPILE_TIMEOUT_S = 10.0
CACHE_ENTRIES = 256
CACHE_CHARS = 16 << 20  # of canonical text, summed over the entries
_MESSAGE_CHARS = 200


class CompilerBusy(KvrailError):
    """A grammar waited its whole deadline for a compile thread (others' compiles were ahead)."""


class GrammarCompiler:
    """See the module docstring. `tokenizer` makes the model's `LLTokenizer` (called once, on a
    compile thread, the first time a grammar is validated; None or a failure: validated
    without one, special tokens then unchecked)."""

    def __init__(
        self,
        tokenizer: Callable[[], llguidance.LLTokenizer] | None = None,
        num_threads: int = COMPILE_THREADS,
        timeout_s: float = COMPILE_TIMEOUT_S,
        max_entries: int = CACHE_ENTRIES,
        max_chars: int = CACHE_CHARS,
    ) -> None:
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        self._timeout_s = timeout_s
        self._make_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[str, tuple[dict[str, Any] | None, str]] = OrderedDict()
        self._cache_chars = 0
        self._cache_lock = threading.Lock()
        self._max_entries = max_entries
        self._max_chars = max_chars
        self.num_compiled = 0
        """Parts validated by llguidance (cache misses), for tests and metrics."""

    @classmethod
    def for_codec(cls, codec: TextCodec, **kwargs: Any) -> GrammarCompiler:
        """A compiler that validates with `codec`'s tokenizer (made on first use)."""

        def tokenizer() -> llguidance.LLTokenizer:
            eos = list(codec.eos_token_ids) or None
            return llguidance.LLTokenizer(codec.tokenizer.to_str(), eos_token=eos)

        return cls(tokenizer, **kwargs)

    async def grammar(self, request: GrammarRequest) -> str | None:
        """The request's grammar (None when it needs none), every part validated, tools' too
        when nothing forces them. Raises InvalidRequestError naming the field at fault,
        CompilerBusy."""
        if not request.needs_grammar and not request.tools:
            return None
        started = threading.Event()

        def build() -> str | None:
            started.set()
            return self._build(request)

        future = asyncio.wrap_future(self._pool.submit(build))
        try:
            return await asyncio.wait_for(future, self._timeout_s)
        except TimeoutError:
            if not started.is_set():
                raise CompilerBusy(
                    f"no grammar compiler was free within {self._timeout_s:g} s; retry later"
                ) from None
            param = request.answer.param if request.answer is not None else "tools"
            raise InvalidRequestError(
                f"{param} took longer than {self._timeout_s:g} s to compile", param
            ) from None

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _build(self, request: GrammarRequest) -> str | None:
        answer = self._entry(request.answer) if request.answer is not None else None
        arguments = [self._entry(tool.constraint()) for tool in request.tools]
        grammar = assemble(request, answer, arguments)
        if grammar is not None and len(grammar) > MAX_GRAMMAR_CHARS:
            param = "tools" if request.tools else "response_format"
            raise InvalidRequestError(
                f"the grammar of this request's schemas is {len(grammar):,} characters; at "
                f"most {MAX_GRAMMAR_CHARS:,}", param,
            )  # fmt: skip
        return grammar

    def _entry(self, constraint: Constraint) -> dict[str, Any]:
        """A part's validated grammar entry, from the cache when its text was seen. Raises
        InvalidRequestError naming the part's field."""
        key = constraint.key()
        with self._cache_lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            cached = self._validate(constraint)
            self._keep(key, cached)
        entry, reason = cached
        if entry is None:
            raise InvalidRequestError(f"invalid {constraint.param}: {reason}", constraint.param)
        return entry

    def _validate(self, constraint: Constraint) -> tuple[dict[str, Any] | None, str]:
        self.num_compiled += 1
        try:
            entry = constraint.entry()
        except ValueError as err:
            return None, _reason(str(err))
        grammar = json.dumps({"grammars": [entry]}, ensure_ascii=False)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._llg_tokenizer(), limits=self._limits
        )
        if is_error:
            return None, _reason(messages[0] if messages else "it does not compile")
        if messages:  # a lenient schema's ignored keywords, and the like
            log.debug("grammar warnings param=%s count=%d", constraint.param, len(messages))
        return entry, ""

    def _keep(self, key: str, value: tuple[dict[str, Any] | None, str]) -> None:
        with self._cache_lock:
            if key in self._cache:
                return
            self._cache[key] = value
            self._cache_chars += len(key)
            while self._cache and (
                len(self._cache) > self._max_entries or self._cache_chars > self._max_chars
            ):
                old, _ = self._cache.popitem(last=False)
                self._cache_chars -= len(old)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer | None:
        if self._make_tokenizer is None:
            return None
        with self._tokenizer_lock:
            if self._tokenizer is None and self._make_tokenizer is not None:
                try:
                    self._tokenizer = self._make_tokenizer()
                except Exception as err:  # validated without one from now on
                    log.warning("no tokenizer for grammar validation: %s", type(err).__name__)
                    self._make_tokenizer = None
            return self._tokenizer


def _reason(message: str) -> str:
    """llguidance's message, its first line only (later lines show the grammar), cut short."""
    line = message.strip().splitlines()[0] if message.strip() else "it does not compile"
    line = "".join(c if c.isprintable() else "?" for c in line)
    return line if len(line) <= _MESSAGE_CHARS else line[:_MESSAGE_CHARS] + "..."
