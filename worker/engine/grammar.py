"""Grammars (`SamplingParams.grammar`): compiled once per grammar string, a matcher per request.

A grammar is an llguidance grammar string (what `llguidance.LLMatcher.grammar_from_*` and the
router write). The router has validated it, but the worker never trusts the wire: `check`
compiles it (and computes its first mask, where some grammars only fail) and raises
`InvalidRequestError` naming `grammar` when it cannot, so the request is refused and nothing else
is touched. llguidance has no compiled object apart from a matcher, so `Grammars` keeps a bounded
LRU cache of start-state matchers by grammar string (failures too, so a bad grammar sent again
costs nothing), and a request's matcher is a `deep_copy` of the cached one (microseconds).
Compiling releases the GIL: `EngineService` compiles off the engine thread before it queues a
request, so the engine thread finds the grammar in the cache.

Copies share their start's lexer (the states it builds lazily, as masks need them), and two fill
threads masking rows that share a lexer take turns: 256 rows of one schema filled no faster on
12 threads than on 1 (bench/studies/grammar/lineages.py). So a grammar that more than one
request uses gets `lineages` (the fill's thread count) independently compiled starts: the first
compiled before its first request, the others in the background once a second request checks it
(the engine thread never waits for them; a grammar used once costs one compile). Requests take
copies of the starts in turn, and `spread` moves the rows that took copies before the other
starts existed (a burst of requests with a new schema) while that is cheap: it remakes a row's
matcher from a less used start by replaying its output, for rows of at most `MOVE_TOKENS`
tokens, at most `MAX_MOVES` a step. A request's `grammar_group` names its start, and
`MaskFiller` hands the fill its rows grouped by it, so each thread's share of the rows mostly
shares one lexer.

A request's matcher (`Request.grammar_matcher`) is a function of its grammar and its output
tokens, like every per-request sampler state (see `sampler`): it advances with each output token
as it joins the request (`advance`, from `Scheduler._append_token`), and wherever it does not
exist yet (a decode worker after a remote prefill, whose first token the prefill worker sampled;
a request that arrives with output tokens) it is rebuilt by replaying the request's output
tokens (1,000 tokens in under 1 ms). After a token: a matcher in an error state (a token the
grammar forbids: it cannot happen under the mask, but a peer or a bug could send one) fails the
request with the error code `grammar`; a stopped matcher (the grammar is complete, nothing can
follow) ends it with finish reason `stop`.

Other sampling parameters under a grammar (the grammar wins, and nothing is refused):
- the end-of-sequence token is allowed exactly where the grammar may end, and sampling it there
  ends the request with `stop`;
- `ignore_eos` and `min_tokens` hold the end-of-sequence token (and, before `min_tokens`, the
  stop token ids) back only while the grammar allows some other token (`hold_back_ids`, applied
  to the mask): a complete grammar ends the request, whatever they say;
- a stop token id ends the request as without a grammar, where the grammar allows it at all;
- `max_tokens` still ends it (`length`), with the grammar incomplete.

Tokens beyond the tokenizer's (a model vocabulary, the logits' width, larger than the
tokenizer's) are never allowed in a constrained row: the tokenizer is told the model's size,
and llguidance allows no token it has no bytes for. Error messages are never logged or raised:
llguidance's (even with `verbose_errors` off) can quote the grammar, which is user text; logs
name the request, the grammar's size and a digest of it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from kvrail.errors import InvalidRequestError
from kvrail.worker.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

CACHE_SIZE = 256
"""Grammar strings whose start-state matcher (or failure) is kept."""
GRAMMAR_ERROR = "grammar"
"""The error code of a request whose grammar failed mid-answer (`RequestOutput.error`)."""
MOVE_TOKENS = 128
"""The longest output a row may have for `Grammars.spread` to move it (replaying costs ~1 us a
token)."""
MAX_MOVES = 64
"""The most rows one `Grammars.spread` moves."""


def fill_threads(num_threads: int = 0) -> int:
    """The mask fill's threads: `num_threads`, or for 0 llguidance's own default (80% of the
    CPUs, at least 1, at most 32)."""
    return num_threads or max(1, min(32, int(0.8 * (os.cpu_count() or 1))))


@dataclass(slots=True)
class _Compiled:
    """A grammar's compiled starts, each with its group number (`starts`: one per lineage, the
    first always there), how many requests checked it (`checked`) and took copies (`taken`),
    and whether the other starts are being compiled (`growing`)."""

    starts: list[tuple[int, LLMatcher]]
    checked: int = 0
    taken: int = 0
    growing: bool = False


def parser_limits() -> LLParserLimits:
    """llguidance's limits for every matcher here. Its defaults, except: a mask step's lexer fuel
    halved (100,000: about 7 ms of one core at the documented 14k/ms), so one pathological row
    costs a step little; lexer states capped at 50,000 (1-2 kB each: at most about 100 MB per
    request, where the default 250,000 would allow 500 MB); and errors without the parser's
    state or the grammar's text (`verbose_errors` off). A grammar past a limit puts its own
    matcher in an error state: its request fails, no other."""
    return LLParserLimits(step_lexer_fuel=100_000, max_lexer_states=50_000, verbose_errors=False)


def digest(grammar: str) -> str:
    """A short digest of a grammar, to name it in logs without quoting it."""
    return hashlib.sha256(grammar.encode()).hexdigest()[:12]


class Grammars:
    """The tokenizer llguidance masks with, the compile cache, and the per-request matchers.

    `tokenizer` None: this engine cannot enforce grammars (it has no tokenizer, or one that
    llguidance cannot read), and `check` refuses every grammar. `vocab_size` is the width of the
    masks (the tokenizer's size, set to the model's vocabulary when that is larger).
    `lineages`: the most starts one grammar gets (see the module docstring; the mask fill's
    threads). Thread-safe for `compile` and `check`; the per-request methods are the engine
    thread's.
    """

    def __init__(
        self, tokenizer: LLTokenizer | None, cache_size: int = CACHE_SIZE, lineages: int = 1
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size if tokenizer is not None else 0
        self.eos_token_id = tokenizer.eos_token if tokenizer is not None else None
        self.lineages = max(1, lineages)
        self._cache: OrderedDict[str, _Compiled | str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._groups = 0
        self._grower: ThreadPoolExecutor | None = None

    @classmethod
    def from_hf(
        cls, hf_tokenizer: Any, eos_token_id: int | None, vocab_size: int, lineages: int = 1
    ) -> Grammars:
        """From the engine's Hugging Face tokenizer (built once: 0.3 s at 49k tokens, about 2 s
        at 128k, holding the GIL), its end-of-sequence token (the one the engine stops on), the
        model's vocabulary size and `lineages`. Without a (fast) tokenizer: a `Grammars` that
        refuses."""
        if hf_tokenizer is None:
            return cls(None)
        import llguidance.hf

        n_vocab = max(vocab_size, len(hf_tokenizer))
        try:
            tokenizer = llguidance.hf.from_tokenizer(
                hf_tokenizer, n_vocab=n_vocab, eos_token=eos_token_id
            )
        except (ValueError, TypeError) as err:  # not a fast tokenizer
            logger.warning("grammars disabled: llguidance cannot read the tokenizer (%s)",
                           type(err).__name__)  # fmt: skip
            return cls(None)
        return cls(tokenizer, lineages=lineages)

    @property
    def num_words(self) -> int:
        """int32 words in one row of a mask."""
        return (self.vocab_size + 31) // 32

    def compile(self, grammar: str) -> LLMatcher | str:
        """The first start-state matcher of `grammar` (shared: `deep_copy` it), or why it cannot
        be used (llguidance's message: never log it). Cached by grammar string."""
        compiled = self._compiled(grammar)
        return compiled if isinstance(compiled, str) else compiled.starts[0][1]

    def _compiled(self, grammar: str, *, checking: bool = False) -> _Compiled | str:
        """The grammar's cache entry (compiled on a miss). `checking` (once per request): count
        the request, and start compiling the other starts at the second."""
        with self._lock:
            cached = self._cache.get(grammar)
            if cached is not None:
                self._cache.move_to_end(grammar)
                if checking and isinstance(cached, _Compiled):
                    cached.checked += 1
                    self._grow_if_shared(grammar, cached)
                return cached
        start = self._compile(grammar)
        with self._lock:
            compiled = (
                start if isinstance(start, str)
                else _Compiled([(self._group(), start)], checked=int(checking))
            )  # fmt: skip
            self._cache[grammar] = compiled
            self._cache.move_to_end(grammar)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _group(self) -> int:
        self._groups += 1
        return self._groups

    def _grow_if_shared(self, grammar: str, compiled: _Compiled) -> None:
        """(Under the lock.) Compile the other starts in the background from the second request
        that checks the grammar on."""
        if compiled.growing or compiled.checked < 2 or len(compiled.starts) >= self.lineages:
            return
        compiled.growing = True
        if self._grower is None:
            self._grower = ThreadPoolExecutor(1, thread_name_prefix="kvrail-grammar")
        self._grower.submit(self._grow, grammar, compiled)

    def _grow(self, grammar: str, compiled: _Compiled) -> None:
        """Compile `grammar`'s other starts one by one (it compiled before: it compiles again),
        each usable as soon as it is there."""
        while len(compiled.starts) < self.lineages:
            start = self._compile(grammar)
            if isinstance(start, str):  # not expected; the grammar keeps the starts it has
                return
            with self._lock:
                compiled.starts.append((self._group(), start))
        with self._lock:
            compiled.growing = False

    def _take(self, compiled: _Compiled) -> tuple[int, LLMatcher]:
        """The start the next request copies: each in turn."""
        with self._lock:
            taken = compiled.starts[compiled.taken % len(compiled.starts)]
            compiled.taken += 1
            return taken

    def spread(self, requests: Iterable[Request]) -> None:
        """Move the constrained rows of one step that crowd a start onto the grammar's less used
        starts (see the module docstring): a row over its start's share (the grammar's rows
        here over its starts, rounded up) is remade from the start with the fewest rows, if its
        output is at most `MOVE_TOKENS` long; at most `MAX_MOVES` rows a call."""
        by_grammar: dict[str, list[Request]] = {}
        for request in requests:
            grammar = request.sampling_params.grammar
            if grammar is not None and request.grammar_matcher is not None:
                by_grammar.setdefault(grammar, []).append(request)
        moves = MAX_MOVES
        for grammar, rows in by_grammar.items():
            with self._lock:
                compiled = self._cache.get(grammar)
                starts = dict(compiled.starts) if isinstance(compiled, _Compiled) else {}
            if len(starts) < 2:
                continue
            share = -(-len(rows) // len(starts))
            counts = Counter({group: 0 for group in starts})
            counts.update(request.grammar_group for request in rows)
            for request in rows:
                if moves == 0:
                    break
                if counts[request.grammar_group] <= share or (
                    request.num_output_tokens > MOVE_TOKENS
                ):
                    continue
                target = min(starts, key=counts.__getitem__)  # only for a row that would move
                if counts[target] >= share:
                    break
                matcher = starts[target].deep_copy()
                if request.output_token_ids:
                    matcher.consume_tokens(request.output_token_ids)
                counts[request.grammar_group] -= 1
                counts[target] += 1
                request.grammar_group, request.grammar_matcher = target, matcher
                moves -= 1

    def _compile(self, grammar: str) -> LLMatcher | str:
        if self.tokenizer is None:
            return "this worker has no tokenizer that llguidance can read"
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=parser_limits())
        if not matcher.is_error():
            matcher.compute_bitmask()  # some grammars compile, then fail at their first mask
        if matcher.is_error():
            error = matcher.get_error()
            logger.warning("grammar refused chars=%d digest=%s", len(grammar), digest(grammar))
            return error or "the grammar does not compile"
        return matcher

    def check(self, grammar: str | None) -> None:
        """Raise InvalidRequestError (naming `grammar`) unless `grammar` is None or compiles."""
        if grammar is None:
            return
        if isinstance(self._compiled(grammar, checking=True), str):
            detail = (
                "no tokenizer to enforce it with"
                if self.tokenizer is None
                else ("it does not compile here")
            )
            raise InvalidRequestError(f"the worker cannot enforce the grammar: {detail}",
                                      "grammar")  # fmt: skip

    def matcher(self, request: Request) -> LLMatcher | None:
        """The request's matcher, in the state after its output tokens: made (a copy of the
        start state, the output replayed) when it has none. None when it cannot be (its grammar
        does not compile, or its output breaks it): the request fails as its next token joins."""
        matcher = request.grammar_matcher
        if matcher is None:
            grammar = request.sampling_params.grammar
            assert grammar is not None, "only a request with a grammar has a matcher"
            compiled = self._compiled(grammar)
            if isinstance(compiled, str):
                return None
            request.grammar_group, start = self._take(compiled)
            matcher = start.deep_copy()
            if request.output_token_ids:
                matcher.consume_tokens(request.output_token_ids)
            request.grammar_matcher = matcher
        return None if matcher.is_error() else matcher

    def advance(self, request: Request, status: RequestStatus | None) -> RequestStatus | None:
        """Advance the request's matcher by its last output token (just appended; or make the
        matcher by replaying them all); `status` is what the stop checks decided without the
        grammar. Returns the request's finished status: FINISHED_ERROR (its `error` set) when the
        token breaks the grammar, FINISHED_STOPPED when the grammar is complete, else
        `status`."""
        existed = request.grammar_matcher is not None
        matcher = self.matcher(request)
        if matcher is not None and existed:
            matcher.consume_token(request.output_token_ids[-1])
        if matcher is None or matcher.is_error():
            request.error = GRAMMAR_ERROR
            logger.warning(
                "grammar broken request_id=%s output_tokens=%d",
                request.request_id, request.num_output_tokens,
            )  # fmt: skip
            return RequestStatus.FINISHED_ERROR
        if matcher.is_stopped() and status is not RequestStatus.FINISHED_STOPPED:
            last = request.output_token_ids[-1]
            request.stop_reason = last if last == self.eos_token_id else None
            return RequestStatus.FINISHED_STOPPED
        return status

    def hold_back_ids(self, request: Request) -> list[int]:
        """The token ids the request's next token should avoid if its grammar allows any other
        (see the module docstring): the end-of-sequence token under `ignore_eos` or before
        `min_tokens`, and the stop token ids before `min_tokens`."""
        params = request.sampling_params
        # The row samples output token number `num_output_tokens + num_in_flight - 1` (0-based).
        early = request.num_output_tokens + request.num_in_flight - 1 < params.min_tokens
        ids = list(params.stop_token_ids) if early else []
        if (early or params.ignore_eos) and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids
