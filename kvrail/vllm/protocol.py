"""vLLM's disaggregated-serving protocol, as kvrail's router speaks it: pure, no I/O.

Measured against vLLM 0.32 with the NIXL connector (prefill servers `kv_producer`, decode servers
`kv_consumer`; `kvrail.vllm.serve`). The router tokenizes and detokenizes itself and sends token
ids, so stop strings, usage and chat templates behave as with kvrail's own engine.

1. Prefill: a non-streaming `POST /v1/completions` with `max_tokens: 1` and
   `kv_transfer_params: {"do_remote_decode": true, ...}` (`prefill_body`). Non-streaming because
   streamed chunks never carry the answer's `kv_transfer_params`, a top-level JSON object that
   tells a decode server where to read the prompt's KV. kvrail passes it on unchanged and checks
   only that it is an object (`kv_transfer_params_of`).
2. Decode: a streaming `POST /v1/completions` with those params (or none: the decode server
   prefills locally), `return_token_ids: true` and the real `max_tokens` (`decode_body`). The
   decode server generates the whole answer, its first token included; the prefill's one
   sampled token is discarded. Each server-sent `data:` line holds one chunk whose only choice
   carries `token_ids`, the ids generated since the previous chunk (`parse_sse_line`); a last
   chunk may have no choices (usage only); `data: [DONE]` ends the stream.

Log-probabilities come with the tokens that the decode server samples, the first included, so
only step 2 asks for them: `logprobs: k` with `return_tokens_as_token_ids: true`, which names
each token `token_id:<id>` in the choice's `logprobs` (`tokens`, `token_logprobs`,
`top_logprobs`, one item per token of `token_ids`). vLLM's values are what kvrail's engine
computes (the model's log-softmax before logit_bias, penalties and temperature: vLLM's default
`logprobs_mode`, `raw_logprobs`); `token_logprobs_of` turns an item into a `TokenLogprobs`.

A grammar (`SamplingParams.grammar`: structured outputs, forced tool calls) is enforced by the
decode server with the same engine kvrail's workers use: vLLM's `structured_outputs.grammar`,
which vLLM's llguidance backend (`GRAMMAR_BACKEND`, set by `kvrail.vllm.serve`) reads as Lark,
llguidance's dialect (`lark_of` turns the grammar into it). The prefill server's one token is
discarded, so it is not sent the grammar.

Every `SamplingParams` field is either carried with kvrail's meaning (`CARRIED`) or, set to
anything but its default, refused by name (`uncarried`): nothing is dropped silently.

Nothing here quotes a body in an error: vLLM's messages and chunks may hold prompt or completion
text, so `VllmProtocolError` names the problem and a metric-safe `code` only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields, replace
from itertools import pairwise
from typing import Any, Final, Literal

from kvrail.errors import KvrailError
from kvrail.outputs import TokenLogprobs
from kvrail.sampling import SamplingParams

COMPLETIONS_PATH: Final = "/v1/completions"
REQUEST_ID_HEADER: Final = "X-Request-Id"
DONE_DATA: Final = "[DONE]"
INVALID_REQUEST_STATUSES: Final = frozenset({400, 413, 422})
"""Statuses vLLM answers for input it refuses (too long, bad parameters): the client's error.
Every other non-2xx status (404 a model name mismatch, 429, 5xx, ...) is the server's, and
another server may take the request."""

TOKEN_ID_PREFIX: Final = "token_id:"
"""How vLLM names a token in `logprobs` under `return_tokens_as_token_ids`."""
CARRIED: Final = frozenset({
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "stop_token_ids", "ignore_eos", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "logit_bias", "logprobs", "grammar",
})  # fmt: skip
"""The `SamplingParams` fields `decode_body` hands to vLLM, each under vLLM's name for the same
meaning (`kvrail.sampling` follows vLLM's `SamplingParams`)."""

GRAMMAR_BACKEND: Final = "guidance"
"""vLLM's structured-outputs backend for kvrail's grammars: llguidance, the engine the router
validated them with (vLLM's `auto` might pick another, which reads Lark differently or not)."""

Failure = Literal["invalid_request", "unavailable"]
ErrorCode = Literal["malformed", "engine_error", "unsupported"]


class VllmProtocolError(KvrailError):
    """vLLM answered something kvrail cannot use. `code` is `malformed` (not the protocol above)
    or `engine_error` (vLLM reported an error inside the stream); the text never quotes it.
    `unsupported`: a request kvrail cannot put in vLLM's words (`lark_of`)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code


@dataclass(frozen=True, slots=True)
class Completion:
    """One request in vLLM's words: what both steps send."""

    model: str
    """The served model name (`--served-model-name`)."""
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("a vLLM completion needs the served model name")
        if not self.prompt_token_ids:
            raise ValueError("a vLLM completion needs a prompt")


@dataclass(frozen=True, slots=True)
class Delta:
    """What one stream chunk adds: the ids generated since the last chunk, their logprobs (one
    per id, when the request asked), and the finish reason (`stop`, `length`, `abort`) on the
    chunk that ends the choice."""

    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True, slots=True)
class Done:
    """`data: [DONE]`: the stream's last line."""


DONE: Final = Done()


def remote_decode_params() -> dict[str, Any]:
    """The `kv_transfer_params` that ask a prefill server to keep the prompt's KV for a decode
    server to read (a fresh dict per call)."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def uncarried(s: SamplingParams, carried: frozenset[str] = CARRIED) -> str | None:
    """The first field of `s` that vLLM would not be sent (one outside `carried`) and that is
    set to anything but its default, or a grammar `lark_of` cannot state; None: vLLM can serve
    the request as asked."""
    for f in fields(s):
        if f.name in carried:
            continue
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            return f.name  # required, so always set
        if getattr(s, f.name) != default:
            return f.name
    if s.grammar is not None and "grammar" in carried:
        try:
            lark_of(s.grammar)
        except VllmProtocolError:
            return "grammar"
    return None


def _sampling(s: SamplingParams) -> dict[str, Any]:
    """The fields of `CARRIED` but `max_tokens`, under vLLM's names (kvrail's); neutral values
    are left out, so a server answers exactly as it would to a plain OpenAI request."""
    out: dict[str, Any] = {"temperature": s.temperature, "top_p": s.top_p}
    optional: dict[str, Any] = {
        "top_k": (s.top_k, 0), "min_p": (s.min_p, 0.0), "seed": (s.seed, None),
        "min_tokens": (s.min_tokens, 0), "stop_token_ids": (list(s.stop_token_ids), []),
        "ignore_eos": (s.ignore_eos, False), "repetition_penalty": (s.repetition_penalty, 1.0),
        "presence_penalty": (s.presence_penalty, 0.0),
        "frequency_penalty": (s.frequency_penalty, 0.0),
        "logit_bias": ({str(b.token_id): b.bias for b in s.logit_bias}, {}),
        "logprobs": (s.logprobs, None),
    }  # fmt: skip
    for name, (value, neutral) in optional.items():
        if value != neutral:
            out[name] = value
    if s.logprobs is not None:
        out["return_tokens_as_token_ids"] = True
    if s.grammar is not None:
        out["structured_outputs"] = {"grammar": lark_of(s.grammar)}
    return out


def lark_of(grammar: str) -> str:
    """A grammar as vLLM's `structured_outputs.grammar` takes it: Lark text unchanged; an
    llguidance `TopLevelGrammar` (JSON, as `llguidance.LLMatcher.grammar_from_json_schema`
    writes one) of a single Lark or JSON-schema grammar as the same Lark (`%json{...}`; the
    schema's options ride in its `x-guidance`). Raises VllmProtocolError for any other
    `TopLevelGrammar`: vLLM is not sent what it would read differently."""
    if not grammar.lstrip().startswith("{"):
        return grammar
    try:
        top = json.loads(grammar)
        (only,) = top["grammars"]
        lark, schema = only.get("lark_grammar"), only.get("json_schema")
        bounded = top.get("max_tokens") is not None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise VllmProtocolError("unsupported", _ONE_PART) from err
    if isinstance(lark, str) and schema is None and not bounded:
        return lark
    if isinstance(schema, dict) and lark is None and not bounded:
        return "start: %json" + json.dumps(schema, separators=(",", ":"))
    raise VllmProtocolError("unsupported", _ONE_PART)


_ONE_PART = "only a grammar of one Lark or JSON-schema part, unbounded, reaches vLLM"


def prefill_body(c: Completion) -> dict[str, Any]:
    """Step 1's JSON body: prefill the prompt, sample one (discarded) token, keep the KV. No
    logprobs: the decode server computes the first token's itself."""
    one = replace(
        c.sampling, max_tokens=1, min_tokens=min(c.sampling.min_tokens, 1), logprobs=None,
        grammar=None,
    )  # fmt: skip
    return {
        "model": c.model,
        "prompt": list(c.prompt_token_ids),
        "max_tokens": 1,
        **_sampling(one),
        "stream": False,
        "kv_transfer_params": remote_decode_params(),
    }


def decode_body(c: Completion, kv_transfer_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Step 2's JSON body: stream the whole answer as token ids (with their logprobs when the
    request asks), reading the prompt's KV from the prefill server named in
    `kv_transfer_params` (None: prefill locally)."""
    body: dict[str, Any] = {
        "model": c.model,
        "prompt": list(c.prompt_token_ids),
        "max_tokens": c.sampling.max_tokens,
        **_sampling(c.sampling),
        "stream": True,
        "return_token_ids": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    return body


def kv_transfer_params_of(body: object) -> dict[str, Any]:
    """The `kv_transfer_params` object of a prefill's decoded JSON answer, unchanged; raises
    VllmProtocolError when there is none (e.g. the server is not a `kv_producer`)."""
    if not isinstance(body, dict):
        raise VllmProtocolError("malformed", "the prefill answer is not a JSON object")
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise VllmProtocolError(
            "malformed", "the prefill answer has no kv_transfer_params object (is the server a "
            "kv_producer?)",
        )  # fmt: skip
    return params


def failure_of_status(status: int) -> Failure:
    """How a non-2xx answer fails the step: the client's input, or this server."""
    if 200 <= status < 300:
        raise ValueError(f"HTTP {status} is not a failure")
    return "invalid_request" if status in INVALID_REQUEST_STATUSES else "unavailable"


def parse_sse_line(line: str, num_logprobs: int | None = None) -> Delta | Done | None:
    """One line of a decode stream: a `Delta`, `DONE`, or None for a line that carries nothing
    (blank, comment, a field other than `data`). `num_logprobs`: the request's
    `SamplingParams.logprobs` (None: none are read). Raises VllmProtocolError."""
    if not line or line.startswith(":"):
        return None
    name, _, value = line.partition(":")
    if name != "data":
        return None
    value = value.removeprefix(" ")
    if value == DONE_DATA:
        return DONE
    return parse_chunk(value, num_logprobs)


def parse_chunk(data: str, num_logprobs: int | None = None) -> Delta:
    """One chunk's JSON (a `data:` line's value); raises VllmProtocolError."""
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError as err:
        raise VllmProtocolError("malformed", "a stream chunk is not valid JSON") from err
    if not isinstance(chunk, dict):
        raise VllmProtocolError("malformed", "a stream chunk is not a JSON object")
    if "error" in chunk or chunk.get("object") == "error":
        raise VllmProtocolError("engine_error", "vLLM reported an error in the stream")
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        raise VllmProtocolError("malformed", "a stream chunk has no choices list")
    if not choices:
        return Delta()  # the usage-only last chunk
    if len(choices) != 1 or not isinstance(choices[0], dict):
        raise VllmProtocolError("malformed", "a stream chunk must hold exactly one choice")
    choice = choices[0]
    token_ids = _token_ids(choice.get("token_ids"))
    finish_reason = _finish_reason(choice.get("finish_reason"))
    if num_logprobs is None:
        return Delta(token_ids, finish_reason)
    return Delta(token_ids, finish_reason, _logprobs(choice.get("logprobs"), token_ids,
                                                     num_logprobs))  # fmt: skip


def _logprobs(value: object, token_ids: tuple[int, ...], k: int) -> tuple[TokenLogprobs, ...]:
    """A choice's `logprobs` (completions' four lists) as one `TokenLogprobs` per token."""
    if value is None and not token_ids:
        return ()
    if not isinstance(value, dict):
        raise VllmProtocolError("malformed", "a stream chunk's choice has no logprobs object")
    tokens, values, tops = (value.get(n) for n in ("tokens", "token_logprobs", "top_logprobs"))
    for items in (tokens, values, tops):
        if not isinstance(items, list) or len(items) != len(token_ids):
            raise VllmProtocolError(
                "malformed", "a stream chunk's logprobs lists do not match its token_ids"
            )
    assert isinstance(tokens, list) and isinstance(values, list) and isinstance(tops, list)
    return tuple(
        token_logprobs_of(token_id, name, logprob, top, k)
        for token_id, name, logprob, top in zip(token_ids, tokens, values, tops, strict=True)
    )


def token_logprobs_of(
    token_id: int, name: object, logprob: object, top: object, k: int
) -> TokenLogprobs:
    """One token's item of a completion choice's `logprobs` (`return_tokens_as_token_ids`), for
    a request of `logprobs: k`, as kvrail's `TokenLogprobs`. Raises VllmProtocolError.

    vLLM's `top_logprobs` item maps the sampled token first, then the k most likely most likely
    first, the sampled one not twice: k + 1 entries when it is not among those k, k when it is.
    In the second case it is put back at its rank: before every entry no more likely than it
    (vLLM's rank counts the tokens strictly more likely)."""
    if name != f"{TOKEN_ID_PREFIX}{token_id}":
        raise VllmProtocolError("malformed", "a logprobs token does not name its token id")
    if not isinstance(top, dict):
        raise VllmProtocolError("malformed", "a logprobs top_logprobs item is not an object")
    entries = [(_id_of(key), _number(value)) for key, value in top.items()]
    if not entries or entries[0][0] != token_id or len(entries) not in (k, k + 1):
        raise VllmProtocolError(
            "malformed", "a logprobs top_logprobs item is not the sampled token and the top k"
        )
    sampled, rest = entries[0], entries[1:]
    if any(later[1] > earlier[1] for earlier, later in pairwise(rest)):
        raise VllmProtocolError("malformed", "a logprobs top_logprobs item is not in rank order")
    if len(entries) == k:  # the sampled token is one of the k
        rank = sum(1 for _, value in rest if value > sampled[1])
        rest.insert(rank, sampled)
    return TokenLogprobs(
        token_id, _number(logprob), tuple(i for i, _ in rest), tuple(v for _, v in rest)
    )


def _id_of(key: str) -> int:
    digits = key.removeprefix(TOKEN_ID_PREFIX)
    if digits == key or not (digits.isascii() and digits.isdigit()):
        raise VllmProtocolError("malformed", "a logprobs token is not named token_id:<id>")
    return int(digits)


def _number(value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise VllmProtocolError("malformed", "a logprob is not a number")
    return float(value)


def _token_ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise VllmProtocolError(
            "malformed", "a stream chunk's choice has no token_ids list (return_token_ids unset?)"
        )
    if any(type(t) is not int or t < 0 for t in value):
        raise VllmProtocolError("malformed", "a stream chunk's token_ids are not ids")
    return tuple(value)


def _finish_reason(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.isidentifier() or len(value) > 32:
        raise VllmProtocolError("malformed", "a stream chunk's finish_reason is not a word")
    return value
