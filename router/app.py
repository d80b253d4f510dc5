"""The OpenAI-compatible HTTP API over the dispatcher (`RouterApp`).

`/v1/chat/completions`, `/v1/completions`, `/v1/responses` (streamed as server-sent events or not),
`/v1/models` and `/v1/models/{model}`, `/health` (the process answers), `/ready` (a ready decode
worker is known), `/metrics`. The generation endpoints are plain ASGI (`RouterApp.__call__`,
`kvrail.router.api.asgi`): FastAPI's per-request machinery cost more than the rest of a short
request; everything else is FastAPI. Every error has OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, with the status the OpenAI API uses (400 bad
input, 401 no valid key, 404 unknown model, 413 body too large, 429 over a tenant's limits with
Retry-After, 503 no worker, 504 deadline); FastAPI's own 422 never reaches a client, and every
refusal is logged with its status, code and field (never the prompt).

A prompt is tokenized here, on the router's tokenizer threads (the event loop keeps serving
meanwhile), after a check that its length alone does not already prove it too long for the
context; then `generate.serve` admits it and follows it until its last token.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from kvrail.errors import KvrailError
from kvrail.router import chat, generate
from kvrail.router.api import asgi, responses, responses_api, schemas, streaming
from kvrail.router.api import errors as api_errors
from kvrail.router.api.errors import ApiError
from kvrail.router.generate import Render, RouterState, context_len
from kvrail.router.tenants import Rejected, Tenant

__all__ = ["RouterApp", "RouterState", "create_app"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": responses.ErrorBody} for status in (400, 401, 404, 413, 429, 503, 504)
}


CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = responses_api.PATH


def create_app(state: RouterState) -> RouterApp:
    state.created = state.created or int(time.time())
    app = RouterApp(state)

    async def _failed(request: Request, exc: Exception) -> JSONResponse:
        failure = _api_error_of(exc, request.url.path)
        return error_response(state, endpoint_of(request), failure)

    for kind in (ApiError, KvrailError, Exception):
        app.add_exception_handler(kind, _failed)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        invalid = api_errors.validation_error(exc.errors())
        return error_response(state, endpoint_of(request), invalid)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        failure = ApiError(exc.status_code, str(exc.detail), kind, headers=exc.headers)
        return error_response(state, endpoint_of(request), failure)

    app.add_middleware(_BodyLimit, state=state)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        workers = state.dispatcher.decode_workers() if state.view.ready.is_set() else []
        body = {"ready": bool(workers), "decode_workers": len(workers)}
        return JSONResponse(body, status_code=200 if workers else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        data = state.metrics.render(state.view, state.dispatcher.in_flight)
        return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=responses.ModelList)
    async def models(authorization: str | None = Header(None)) -> dict[str, Any]:
        authenticate(state, authorization)
        return responses.model_list([state.served_name], state.created)

    @app.get("/v1/models/{model_id:path}", response_model=responses.ModelCard)
    async def model(model_id: str, authorization: str | None = Header(None)) -> dict[str, Any]:
        authenticate(state, authorization)
        _check_model(state, model_id)
        return responses.model_card(state.served_name, state.created)

    return app


# The generation endpoints ----------------------------------------------------------------------
Served = JSONResponse | streaming.EventStream


async def _chat(
    state: RouterState,
    body: schemas.ChatCompletionRequest,
    tenant: Tenant,
    receive: Receive,
    request_id: str,
    render: Render | None = None,
) -> Served:
    ready = await chat.prepare_chat(state, body)
    return await generate.serve(
        state, receive, CHAT_PATH if render is None else RESPONSES_PATH, "chat", tenant,
        ready.prompt_ids, ready.asked, request_id, output=ready.plan,
        keep_special=ready.keep_special, render=render,
    )  # fmt: skip


async def _completion(
    state: RouterState,
    body: schemas.CompletionRequest,
    tenant: Tenant,
    receive: Receive,
    request_id: str,
) -> Served:
    text = body.prompt_text
    prompt_ids = await chat.completion_prompt(state, body)
    echo_text = ""
    if body.echo:  # the prompt as sent, or its token ids' text
        echo_text = (
            text if text is not None
            else await chat.tokenize(state, state.codec.decode, prompt_ids)
        )  # fmt: skip
    ready = await chat.prepare_completion(state, body)
    return await generate.serve(
        state, receive, COMPLETIONS_PATH, "completion", tenant, prompt_ids, ready.asked,
        request_id, echo_text,
    )  # fmt: skip


async def _responses(state: RouterState, body: responses_api.ResponsesRequest, tenant: Tenant,
                     receive: Receive, request_id: str) -> Served:  # fmt: skip
    """Served as the chat completion it translates to (`kvrail.router.api.responses_api`)."""
    return await responses_api.respond(body, state.defaults, lambda chat, render: _chat(
        state, chat, tenant, receive, request_id, render))  # fmt: skip


_ID_PREFIX = {CHAT_PATH: "chatcmpl-", COMPLETIONS_PATH: "cmpl-", RESPONSES_PATH: "resp_"}
GenerationBody = type[schemas.ChatCompletionRequest | schemas.CompletionRequest
                      | responses_api.ResponsesRequest]  # fmt: skip
_GENERATION: dict[str, tuple[GenerationBody, Callable[..., Awaitable[Served]]]] = {
    CHAT_PATH: (schemas.ChatCompletionRequest, _chat),
    COMPLETIONS_PATH: (schemas.CompletionRequest, _completion),
    RESPONSES_PATH: (responses_api.ResponsesRequest, _responses),
}


class RouterApp(FastAPI):
    """The router's ASGI application: FastAPI, except for the two generation endpoints, which
    `__call__` serves before FastAPI routes anything (`kvrail.router.api.asgi` says why and
    what they keep of FastAPI's behaviour). `/openapi.json` still describes them
    (`_documented_routes`)."""

    def __init__(self, state: RouterState) -> None:
        super().__init__(title="kvrail router", version="1", docs_url=None, redoc_url=None)
        self.router_state = state
        self.request_ids = RandomIds()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        served = _GENERATION.get(scope["path"]) if scope["type"] == "http" else None
        if served is None:
            await super().__call__(scope, receive, send)
            return
        state, path = self.router_state, scope["path"]
        # The id the request is known by: its completion's `id`, the router's and workers' logs'
        # request_id, and every response's x-request-id header (OpenAI's name for it).
        request_id = f"{_ID_PREFIX[path]}{self.request_ids.next()}"
        if scope["method"] != "POST":
            refused = ApiError(405, "Method Not Allowed", headers={"Allow": "POST"})
            await error_response(state, path, refused, request_id)(scope, receive, send)
            return
        model, handler = served
        response: Any
        try:
            too_big = _declared_too_big(scope)
            if too_big is not None:
                raise too_big
            # the key before the body: a client without one gets nothing parsed
            tenant = authenticate(state, asgi.header(scope, b"authorization"))
            raw = await asgi.read_body(receive, MAX_BODY_BYTES)
            body = parse_body(state, model, raw, asgi.header(scope, b"content-type"))
            response = await handler(state, body, tenant, receive, request_id)
        except asgi.ClientLeft:
            return  # nothing to answer: the client is gone
        except Exception as exc:
            response = error_response(state, path, _api_error_of(exc, path), request_id)
        await response(scope, receive, send)

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            self.openapi_schema = get_openapi(
                title=self.title, version=self.version,
                routes=[*self.routes, *_documented_routes()],
            )  # fmt: skip
        return self.openapi_schema


class RandomIds:
    """128 random bits in hex per id, from the OS's generator (`secrets`), `batch` ids per call:
    each call lets go of the GIL, and while a tokenizer thread runs Python the event loop can
    then wait up to the interpreter's switch interval (5 ms) to get it back."""

    def __init__(self, batch: int = 256) -> None:
        self._batch = batch
        self._ids: list[str] = []

    def next(self) -> str:
        if not self._ids:
            raw = secrets.token_bytes(16 * self._batch)
            self._ids = [raw[i : i + 16].hex() for i in range(0, len(raw), 16)]
        return self._ids.pop()


def _documented_routes() -> list[APIRoute]:
    """The generation endpoints as FastAPI would declare them, for the OpenAPI document only
    (`RouterApp.__call__` serves them; the functions below are never called)."""

    async def chat_completions(
        body: schemas.ChatCompletionRequest, authorization: str | None = Header(None)
    ) -> None:
        """Create a chat completion (OpenAI's API)."""

    async def completions(
        body: schemas.CompletionRequest, authorization: str | None = Header(None)
    ) -> None:
        """Create a completion (OpenAI's API)."""

    return [
        APIRoute(CHAT_PATH, chat_completions, methods=["POST"],
                 response_model=responses.ChatCompletion, responses=_ERROR_RESPONSES),
        APIRoute(COMPLETIONS_PATH, completions, methods=["POST"],
                 response_model=responses.Completion, responses=_ERROR_RESPONSES),
        responses_api.documented_route(_ERROR_RESPONSES),
    ]  # fmt: skip


def parse_body(
    state: RouterState, model: GenerationBody, raw: bytes, content_type: str | None
) -> Any:
    """A generation request's body as `model` validates it, for a model this pool serves: the
    router's parsing, and kvrail's endpoint picker's. Raises ApiError (400 for a body that is
    not JSON or not valid, naming the field; 404 for another model)."""
    context = context_len(state)
    payload = asgi.json_body(raw, content_type, _max_commas(context))
    _check_message_count(context, payload)
    try:
        body = model.model_validate(payload)
    except ValidationError as err:
        raise api_errors.validation_error(err) from None
    _check_model(state, body.model)
    return body


def _max_commas(context: int) -> int:
    """The most commas a generation request's body may have: a few per token of the context (a
    prompt of token ids has one each, a chat a few per message, each message at least a token),
    and room for text that has them. 8,176 tokens: 98,240, parsed in at most about 10 ms."""
    return 4 * context + 65_536


def _check_message_count(context: int, payload: Any) -> None:
    """Refuse a chat with more messages than the context has tokens (each message takes at
    least one) before validating them: validation costs about 3 us a message on the event loop,
    and a body within the comma bound can hold 30,000 of them."""
    param = "input" if isinstance(payload, dict) and "input" in payload else "messages"  # items
    messages = payload.get(param) if isinstance(payload, dict) else None
    if isinstance(messages, list) and len(messages) > context:
        raise ApiError(
            400, f"{len(messages)} {param}: more than this model's context of {context} tokens "
            "can hold (each message or item takes at least one)", param=param,
            code="context_length_exceeded",
        )  # fmt: skip


def _declared_too_big(scope: Scope) -> ApiError | None:
    """A 413 when the request's Content-Length is above `MAX_BODY_BYTES` (or not a number)."""
    length = asgi.header(scope, b"content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        return ApiError(413, f"request body above {MAX_BODY_BYTES} bytes")
    return None


class _BodyLimit:
    """Refuses a body above `MAX_BODY_BYTES` (by its Content-Length) with a 413, before any of
    it is read, on the paths FastAPI serves. Plain ASGI, not Starlette's `BaseHTTPMiddleware`:
    that one hides a client's disconnect from the endpoints behind it."""

    def __init__(self, app: ASGIApp, state: RouterState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            too_big = _declared_too_big(scope)
            if too_big is not None:
                response = error_response(self.state, endpoint_of(Request(scope)), too_big)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def authenticate(state: RouterState, authorization: str | None) -> Tenant:
    """The tenant of an `Authorization` header value; raises ApiError (401)."""
    try:
        return state.tenants.authenticate(authorization)
    except Rejected as err:
        state.metrics.rejected.labels("unauthenticated").inc()
        raise ApiError(401, err.message, "authentication_error", code="invalid_api_key") from err


def _check_model(state: RouterState, model: str) -> None:
    if model != state.served_name:
        raise ApiError(
            404, f"model {model[:200]!r} is not served here (this pool serves "
            f"{state.served_name!r})", "not_found_error", param="model", code="model_not_found",
        )  # fmt: skip


def _api_error_of(exc: Exception, path: str) -> ApiError:
    """What an exception out of a request becomes: an ApiError as it is, a KvrailError by
    `api_error_of`, anything else a logged 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, KvrailError):
        return api_errors.api_error_of(exc)
    log.error("unhandled error path=%s", path, exc_info=exc)
    return ApiError(500, "internal error", "server_error")


def error_response(
    state: RouterState, endpoint: str, exc: ApiError, request_id: str | None = None
) -> JSONResponse:
    """The error's response, counted under `endpoint` (with the request's `x-request-id`, when
    it has one); a client's error is logged with its status, code and field (never the
    prompt)."""
    state.metrics.requests.labels(endpoint, str(exc.status)).inc()
    if exc.status < 500:
        log.info(
            "request refused endpoint=%s status=%d code=%s param=%s request_id=%s",
            endpoint, exc.status, exc.code or exc.type, exc.param or "-", request_id or "-",
        )  # fmt: skip
    headers = dict(exc.headers or {})
    if request_id is not None:
        headers[streaming.REQUEST_ID_HEADER] = request_id
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def endpoint_of(request: Request) -> str:
    """The route template the request matches (`/v1/chat/completions`,
    `/v1/models/{model_id}`), or `other`: a client never chooses a metric label value."""
    app = request.scope.get("app")
    for route in app.router.routes if app is not None else ():
        match, _ = route.matches(request.scope)
        if match is Match.FULL:
            return str(getattr(route, "path", "other")).replace(":path}", "}")
    return "other"
