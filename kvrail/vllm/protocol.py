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

Nothing here quotes a body in an error: vLLM's messages and chunks may hold prompt or completion
text, so `VllmProtocolError` names the problem and a metric-safe `code` only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

from kvrail.errors import KvrailError
from kvrail.sampling import SamplingParams

COMPLETIONS_PATH: Final = "/v1/completions"
REQUEST_ID_HEADER: Final = "X-Request-Id"
DONE_DATA: Final = "[DONE]"
INVALID_REQUEST_STATUSES: Final = frozenset({400, 413, 422})
"""Statuses vLLM answers for input it refuses (too long, bad parameters): the client's error.
Every other non-2xx status (404 a model name mismatch, 429, 5xx, ...) is the server's, and
another server may take the request."""

Failure = Literal["invalid_request", "unavailable"]
ErrorCode = Literal["malformed", "engine_error"]


class VllmProtocolError(KvrailError):
    """vLLM answered something kvrail cannot use. `code` is `malformed` (not the protocol above)
    or `engine_error` (vLLM reported an error inside the stream); the text never quotes it."""

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
    """What one stream chunk adds: the ids generated since the last chunk, and the finish reason
    (`stop`, `length`, `abort`) on the chunk that ends the choice."""

    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None


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


def _sampling(s: SamplingParams) -> dict[str, Any]:
    """vLLM's names are kvrail's (`kvrail.sampling` follows vLLM's `SamplingParams`); neutral
    values are left out, so a server answers exactly as it would to a plain OpenAI request.
    `logprobs` is not carried (nor read back from the chunks): the router's vLLM stream refuses
    a request that asks for them."""
    out: dict[str, Any] = {"temperature": s.temperature, "top_p": s.top_p}
    optional: dict[str, Any] = {
        "top_k": (s.top_k, 0), "min_p": (s.min_p, 0.0), "seed": (s.seed, None),
        "min_tokens": (s.min_tokens, 0), "stop_token_ids": (list(s.stop_token_ids), []),
        "ignore_eos": (s.ignore_eos, False), "repetition_penalty": (s.repetition_penalty, 1.0),
        "presence_penalty": (s.presence_penalty, 0.0),
        "frequency_penalty": (s.frequency_penalty, 0.0),
        "logit_bias": ({str(b.token_id): b.bias for b in s.logit_bias}, {}),
    }  # fmt: skip
    for name, (value, neutral) in optional.items():
        if value != neutral:
            out[name] = value
    return out


def prefill_body(c: Completion) -> dict[str, Any]:
    """Step 1's JSON body: prefill the prompt, sample one (discarded) token, keep the KV."""
    return {
        "model": c.model,
        "prompt": list(c.prompt_token_ids),
        "max_tokens": 1,
        **_sampling(replace(c.sampling, max_tokens=1, min_tokens=min(c.sampling.min_tokens, 1))),
        "stream": False,
        "kv_transfer_params": remote_decode_params(),
    }


def decode_body(c: Completion, kv_transfer_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Step 2's JSON body: stream the whole answer as token ids, reading the prompt's KV from
    the prefill server named in `kv_transfer_params` (None: prefill locally)."""
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


def parse_sse_line(line: str) -> Delta | Done | None:
    """One line of a decode stream: a `Delta`, `DONE`, or None for a line that carries nothing
    (blank, comment, a field other than `data`). Raises VllmProtocolError."""
    if not line or line.startswith(":"):
        return None
    name, _, value = line.partition(":")
    if name != "data":
        return None
    value = value.removeprefix(" ")
    if value == DONE_DATA:
        return DONE
    return parse_chunk(value)


def parse_chunk(data: str) -> Delta:
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
    return Delta(_token_ids(choice.get("token_ids")), _finish_reason(choice.get("finish_reason")))


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
