"""The OpenAI API at kvrail's edge: the error format.

`ApiError` is an error as the OpenAI API reports it, an HTTP status and
`{"error": {"message", "type", "param", "code"}}` (`responses.ErrorBody` is that shape for the
OpenAPI schema). The mappings to HTTP are here, and only here: `api_error_of` for kvrail's
exceptions, `dispatch_error` for the codes a request fails with on its way through the workers
(a worker's event error, or the dispatcher's own).
`validation_error` turns the first problem pydantic or FastAPI found in a request body (the
models in `schemas`) into a 400 naming the field; no message ever contains prompt or message
text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from kvrail.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    KvrailError,
    ModelNotFoundError,
)
from kvrail.router.api.schemas import UNSUPPORTED

# Message fields of OpenAI features kvrail lacks (never declared: reported as unsupported).
_MESSAGE_FEATURES = frozenset({"function_call", "audio"})


class ApiError(Exception):
    """An error as the OpenAI API reports it: an HTTP status and `{"error": {...}}`.

    `type` is OpenAI's error type (`invalid_request_error`, `authentication_error`,
    `not_found_error`, `rate_limit_error`, `server_error`, ...), `param` the request field at
    fault (dotted path) and `code` a stable machine-readable code. `headers` go on the HTTP
    response (Retry-After on a 429). The message never contains prompt or completion text.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, {self.type!r}, param={self.param!r})"


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def api_error_of(err: KvrailError) -> ApiError:
    """The one mapping from kvrail's exception hierarchy to HTTP. Only client-facing errors keep
    their message (they never quote the prompt); anything else becomes a generic 500."""
    if isinstance(err, InvalidRequestError):
        return ApiError(400, str(err), "invalid_request_error", err.param)
    if isinstance(err, ModelNotFoundError):
        return ApiError(404, str(err), "not_found_error", "model", "model_not_found")
    if isinstance(err, DeadlineExceededError):
        return ApiError(504, "the request did not finish within its deadline", "timeout_error")
    return ApiError(500, "internal error", "server_error")


# A failed request's code -> (HTTP status, OpenAI error type, message). The codes are worker
# event errors and the dispatcher's own; each is metric-safe and never quotes the request.
_DISPATCH_ERRORS: dict[str, tuple[int, str, str]] = {
    "deadline": (504, "timeout_error", "the request did not finish within its deadline"),
    "invalid_request": (400, "invalid_request_error", "a worker refused the request as invalid"),
    "no_worker": (
        503, "service_unavailable_error",
        "no decode worker is ready to take the request; retry later",
    ),
    "prefill_failed": (
        503, "service_unavailable_error",
        "no prefill worker could prefill the prompt; retry later",
    ),
    "protocol_error": (
        502, "server_error", "a worker answered in a form the router does not understand",
    ),
    "shutting_down": (
        503, "service_unavailable_error",
        "the decode worker shut down before the request finished; retry it",
    ),
    "unsupported_parameter": (
        400, "invalid_request_error", "vLLM pools do not take this parameter",
    ),
    "worker_lost": (
        503, "service_unavailable_error",
        "the decode worker went away before the request finished; retry it",
    ),
}  # fmt: skip


def dispatch_error(code: str, param: str | None = None) -> ApiError:
    """The error a request that failed with `code` gets: a known code's status and message, any
    other a 500 naming the code; `param`, the field at fault (a `SamplingParams` field name, no
    client text), is named in `param` and in the message."""
    status, type_, message = _DISPATCH_ERRORS.get(
        code, (500, "server_error", f"the request failed ({code})")
    )
    if param is not None:
        message = f"{message}: '{param}'"
    return ApiError(status, message, type_, param, code)


def validation_error(exc: ValidationError | Sequence[Mapping[str, Any]] | Any) -> ApiError:
    """A 400 for the first problem in a pydantic `ValidationError` or FastAPI's
    `RequestValidationError.errors()` (or anything with an `errors()` method)."""
    errors = exc.errors() if hasattr(exc, "errors") else exc
    if not errors:
        return ApiError(400, "invalid request")
    first = errors[0]
    kind = str(first.get("type", ""))
    loc = tuple(first.get("loc", ()))
    if loc[:1] == ("body",):  # FastAPI's prefix for the request body
        loc = loc[1:]
    if kind == "json_invalid":
        reason = (first.get("ctx") or {}).get("error")
        detail = f" ({_safe(str(reason))})" if reason else ""
        return ApiError(400, f"the request body is not valid JSON{detail}", code="invalid_json")
    ctx = first.get("ctx") or {}
    code = "unsupported_parameter" if kind == "kvrail_unsupported" else None  # refused by name
    if "param" in ctx:
        return ApiError(400, str(first.get("msg")), param=str(ctx["param"]), code=code)
    path = [p for p in loc if not _is_union_tag(p)]
    if kind == "extra_forbidden" and loc:
        path = path[:-1] + [loc[-1]]  # the unknown key itself may look like a tag
    param = ".".join(_safe(str(p)) for p in path) or None
    if kind == "missing":
        if param is None:
            return ApiError(400, "the request body is missing", code="missing_body")
        return ApiError(400, f"missing required parameter: '{param}'", param=param)
    if param is None:
        return ApiError(400, f"the request body must be a JSON object ({first.get('msg')})")
    top, name = str(path[0]), str(path[-1])
    if kind == "extra_forbidden":
        if top == "messages" and name in _MESSAGE_FEATURES:
            message = f"'{param}' is not supported by kvrail (send tool_calls; no audio)"
            return ApiError(400, message, param=param, code="unsupported_parameter")
        message = f"unrecognized request argument supplied: '{param}'"
        return ApiError(400, message, param=param, code="unknown_parameter")
    # A declared feature field sent with a value other than its neutral one (the Responses body
    # refuses its own by name, in its validators: its fields of the same names differ).
    name = param if param in UNSUPPORTED else top
    if name in UNSUPPORTED and getattr(exc, "title", None) != "ResponsesRequest":
        message = f"'{name}' is not supported by kvrail (accepted: {UNSUPPORTED[name]})"
        return ApiError(400, message, param=name, code="unsupported_parameter")
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind.startswith("kvrail"):
        return ApiError(400, msg, param=param, code=code)
    return ApiError(400, f"invalid '{param}': {msg}", param=param)


def _is_union_tag(part: object) -> bool:
    # pydantic names the union member it tried in `loc` ("str", "list[int]", "function-after[..]").
    return isinstance(part, str) and (
        "[" in part or part in {"str", "int", "float", "bool", "none", "list", "dict"}
    )


def _safe(text: str, limit: int = 64) -> str:
    """A client-supplied name, shortened and printable, fit to quote in a message."""
    cut = "".join(c if c.isprintable() else "?" for c in text[:limit])
    return cut + "..." if len(text) > limit else cut
