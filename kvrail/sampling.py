"""How a request picks its tokens and when it may stop: one `SamplingParams` from the router's
edge to the sampler.

The router builds it once per request, from the client's fields and the request defaults
(`kvrail.router.api.sampling`); it travels inside `GenerateRequest` and `PrefillJob` and the
engine samples with the very same object. It is validated when built, so a decoded message and
an engine request can both trust it: an invalid value raises `InvalidRequestError` naming the
field, and nothing downstream checks it again. The field defaults are the neutral values (greedy,
no penalty, no minimum); what a field the client omitted means is decided at the edge only.

Semantics follow vLLM's `SamplingParams`:
- `temperature == 0` is greedy (top_p, top_k, min_p and seed are then irrelevant);
- `top_k == 0` and `min_p == 0` are off; `min_p` drops tokens less likely than `min_p` times the
  most likely one;
- `min_tokens`: until that many tokens were generated, the end-of-sequence token (unless
  `ignore_eos`) and `stop_token_ids` cannot be sampled, and stop strings do not apply;
- `repetition_penalty` (1 = off) divides the positive logits and multiplies the negative ones of
  every token in the prompt or the output so far; `presence_penalty` and `frequency_penalty`
  (0 = off, OpenAI's definition) subtract a constant and a multiple of the count from the logits
  of the tokens in the output so far;
- `ignore_eos`: the end-of-sequence token does not end generation (benchmarks use it for fixed
  lengths);
- `logit_bias` (OpenAI's): a bias in [-100, 100] added to a token's logit before anything else
  (penalties, temperature, greedy choice), at most `MAX_LOGIT_BIAS` tokens, each once: -100
  all but bans a token, +100 all but forces it;
- `logprobs`: None (the default) computes no log-probabilities; an integer k in [0,
  `MAX_LOGPROBS`] returns, with every sampled token, its log-probability and the k most likely
  tokens at its position with theirs (vLLM's raw log-probabilities: the model's log-softmax,
  before logit_bias, penalties or temperature);
- `prompt_logprobs` (vLLM's; completions `echo` with `logprobs`): None computes none; an integer
  k in [0, `MAX_LOGPROBS`] scores the prompt: every prompt token after the first gets its
  log-probability given the tokens before it and the k most likely tokens at its position. A
  cached prefix has no logits, so such a request reads nothing from the prefix cache: its whole
  prompt is computed (its blocks still join the cache for others). At most
  `MAX_PROMPT_LOGPROB_ENTRIES` entries (prompt tokens times k + 1) per request, so that the
  scores fit one message;
- `grammar` (structured outputs, forced tool calls): None samples freely; else an llguidance
  grammar (the JSON of its `TopLevelGrammar`, as `llguidance.LLMatcher.grammar_from_*` and the
  router's `kvrail.router.structured` write it) that every output token must keep valid: tokens it
  does not allow are masked before sampling, and the end-of-sequence token is allowed only where
  the grammar may end. The grammar wins over `ignore_eos` and `min_tokens`: they hold the
  end-of-sequence token (and, before `min_tokens`, the stop token ids) back only while the grammar
  allows some other token, and a complete grammar ends the request. The router has validated it;
  at most `MAX_GRAMMAR_CHARS` characters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvrail.errors import InvalidRequestError

MAX_STOP_TOKEN_IDS = 64
MAX_PENALTY = 2.0  # OpenAI's bound for presence and frequency penalties
MAX_LOGIT_BIAS = 300  # tokens a request may bias (OpenAI documents the same bound)
MAX_BIAS = 100.0  # OpenAI's bound for one token's bias
MAX_LOGPROBS = 20  # most likely tokens a request may ask for at each position (vLLM's cap)
MAX_PROMPT_LOGPROB_ENTRIES = 65_536  # prompt tokens x (prompt_logprobs + 1): < 5 MiB as JSON
MAX_GRAMMAR_CHARS = 1 << 20  # a grammar as it travels (the router caps a schema well below)


def _fail(name: str, value: object, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"sampling parameter {name}={value!r} is invalid: {why}", name)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class TokenBias:
    """One `logit_bias` entry: `bias` is added to token `token_id`'s logit."""

    token_id: int
    bias: float


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """See the module docstring. Frozen, and checked in `__post_init__`."""

    max_tokens: int
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[TokenBias, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _fail("max_tokens", self.max_tokens, "must be an integer of at least 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _fail("min_tokens", self.min_tokens, "must be an integer in [0, max_tokens]")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise _fail("temperature", self.temperature, "must be a finite number >= 0")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _fail("top_p", self.top_p, "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise _fail("top_k", self.top_k, "must be an integer >= 0 (0 disables it)")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _fail("min_p", self.min_p, "must be in [0, 1] (0 disables it)")
        if self.seed is not None and not _is_int(self.seed):
            raise _fail("seed", self.seed, "must be an integer or None")
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or not all(_is_int(i) and i >= 0 for i in ids):
            raise _fail("stop_token_ids", ids, "must be a list of non-negative integers")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise _fail("stop_token_ids", len(ids), f"at most {MAX_STOP_TOKEN_IDS} ids")
        if not isinstance(self.ignore_eos, bool):
            raise _fail("ignore_eos", self.ignore_eos, "must be true or false")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise _fail("repetition_penalty", self.repetition_penalty, "must be > 0 (1 is off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise _fail(name, value, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        self._check_logit_bias()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise _fail(name, value, f"must be an integer in [0, {MAX_LOGPROBS}]")
        grammar = self.grammar
        if grammar is not None and (not isinstance(grammar, str) or not grammar):
            raise _fail("grammar", "...", "must be a non-empty string or None")
        if grammar is not None and len(grammar) > MAX_GRAMMAR_CHARS:
            raise _fail("grammar", "...", f"at most {MAX_GRAMMAR_CHARS} characters")
        set_ = object.__setattr__
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):  # fmt: skip
            set_(self, name, float(getattr(self, name)))

    def _check_logit_bias(self) -> None:
        entries = self.logit_bias
        if not isinstance(entries, tuple) or not all(isinstance(e, TokenBias) for e in entries):
            raise _fail("logit_bias", entries, "must be a list of token biases")
        if len(entries) > MAX_LOGIT_BIAS:
            raise _fail("logit_bias", len(entries), f"at most {MAX_LOGIT_BIAS} tokens")
        for entry in entries:
            if not _is_int(entry.token_id) or entry.token_id < 0:
                raise _fail("logit_bias", entry.token_id, "token ids must be integers >= 0")
            if not _is_number(entry.bias) or not -MAX_BIAS <= entry.bias <= MAX_BIAS:
                raise _fail("logit_bias", entry.bias, f"biases must be in [-{MAX_BIAS:g}, "
                            f"{MAX_BIAS:g}]")  # fmt: skip
        if len({e.token_id for e in entries}) != len(entries):
            raise _fail("logit_bias", "...", "a token id may appear once")

    def check_prompt_scores(self, num_prompt_tokens: int) -> None:
        """Raise InvalidRequestError (naming `prompt_logprobs`) when scoring a prompt this long
        would exceed `MAX_PROMPT_LOGPROB_ENTRIES`."""
        k = self.prompt_logprobs
        if k is not None and num_prompt_tokens * (k + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
            most = MAX_PROMPT_LOGPROB_ENTRIES // (k + 1)
            raise InvalidRequestError(
                f"scoring the prompt with {k} top log-probabilities per token covers at most "
                f"{most} prompt tokens; this prompt has {num_prompt_tokens}",
                "prompt_logprobs",
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
