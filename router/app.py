"""The OpenAI-compatible HTTP API (DESIGN.md, steps 1-2): FastAPI over the dispatcher.

`/v1/chat/completions` and `/v1/completions` (streamed as server-sent events or not), `/v1/models`,
`/health` (the process answers), `/ready` (a ready decode worker is known), `/metrics`.
Every error has OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the
status the OpenAI API uses (400 bad input, 401 no valid key, 404 unknown model, 429 over a
tenant's limits with Retry-After, 503 no worker, 504 deadline); FastAPI's own 422 never reaches
a client. A request is tokenized here, admitted against its tenant's limits, and followed until
its last token; a client that goes away (streaming or not) cancels it on every worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrail.errors import KvrailError
from kvrail.router.api import errors as api_errors
from kvrail.router.api import responses, schemas, streaming
from kvrail.router.api.errors import ApiError
from kvrail.router.api.schemas import Sampling
from kvrail.router.api.streaming import Kind
from kvrail.router.discovery.view import WorkerView
from kvrail.router.metrics import RouterMetrics
from kvrail.router.streams.dispatcher import Dispatcher
from kvrail.router.streams.job import DispatchError, Job
from kvrail.router.tenants import Admission, Rejected, Tenant, TenantTable, Ticket
from kvrail.router.text.detokenizer import Detokenizer
from kvrail.router.text.tokenizer import TextCodec

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_MODEL_LEN = 2048  # when neither the settings nor any worker says

# Worker and dispatcher error codes -> (HTTP status, OpenAI error type).
_ERRORS: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "deadline": (504, "timeout_error"),
    "no_worker": (503, "service_unavailable_error"),
    "prefill_failed": (503, "service_unavailable_error"),
    "protocol_error": (502, "server_error"),
    "shutting_down": (503, "service_unavailable_error"),
    "worker_lost": (503, "service_unavailable_error"),
}


_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": responses.ErrorBody} for status in (400, 401, 404, 413, 429, 503, 504)
}


@dataclass(slots=True)
class RouterState:
    codec: TextCodec
    dispatcher: Dispatcher
    view: WorkerView
    tenants: TenantTable
    admission: Admission
    metrics: RouterMetrics
    served_name: str
    max_model_len: int  # 0: the workers' (see `_context_len`)
    request_timeout_s: float
    created: int = 0


def create_app(state: RouterState) -> FastAPI:
    app = FastAPI(title="kvrail router", version="1", docs_url=None, redoc_url=None)
    state.created = state.created or int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(state, request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(state, request, api_errors.validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(state, request, ApiError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(KvrailError)
    async def _kvrail(request: Request, exc: KvrailError) -> JSONResponse:
        return _error_response(state, request, api_errors.api_error_of(exc))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error path=%s", request.url.path, exc_info=exc)
        return _error_response(state, request, ApiError(500, "internal error", "server_error"))

    @app.middleware("http")
    async def _limit_body(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            too_big = f"request body above {MAX_BODY_BYTES} bytes"
            return _error_response(state, request, ApiError(413, too_big, "invalid_request_error"))
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        workers = state.view.decode_workers() if state.view.ready.is_set() else []
        body = {"ready": bool(workers), "decode_workers": len(workers)}
        return JSONResponse(body, status_code=200 if workers else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        data = state.metrics.render(state.view, state.dispatcher.in_flight)
        return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=responses.ModelList)
    async def models(authorization: str | None = Header(None)) -> dict[str, Any]:
        _authenticate(state, authorization)
        return responses.model_list([state.served_name], state.created)

    @app.post(
        "/v1/chat/completions", response_model=responses.ChatCompletion, responses=_ERROR_RESPONSES
    )
    async def chat_completions(
        body: schemas.ChatCompletionRequest,
        request: Request,
        authorization: str | None = Header(None),
    ) -> Response:
        tenant = _authenticate(state, authorization)
        _check_model(state, body.model)
        prompt_ids = await _off_loop(state.codec.chat_prompt, body.template_messages())
        return await _serve(state, request, "chat", tenant, prompt_ids, schemas.sampling_of(body))

    @app.post("/v1/completions", response_model=responses.Completion, responses=_ERROR_RESPONSES)
    async def completions(
        body: schemas.CompletionRequest,
        request: Request,
        authorization: str | None = Header(None),
    ) -> Response:
        tenant = _authenticate(state, authorization)
        _check_model(state, body.model)
        text, prompt_ids = body.prompt_text, body.prompt_ids
        if text is not None:
            prompt_ids = await _off_loop(state.codec.encode, text)
        assert prompt_ids is not None
        vocab = state.codec.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param="prompt")
        return await _serve(
            state, request, "completion", tenant, prompt_ids, schemas.sampling_of(body)
        )

    return app


async def _off_loop(encode: Callable[[Any], list[int]], arg: Any) -> list[int]:
    """Tokenize; prompts above a few thousand characters leave the event loop meanwhile."""
    if len(str(arg)) < 4096:
        return encode(arg)
    return await asyncio.to_thread(encode, arg)


def _authenticate(state: RouterState, authorization: str | None) -> Tenant:
    try:
        return state.tenants.authenticate(authorization)
    except Rejected as err:
        state.metrics.rejected.labels("unauthenticated").inc()
        raise ApiError(401, err.message, "authentication_error", code="invalid_api_key") from err


def _context_len(state: RouterState) -> int:
    """The configured context, else the smallest any ready decode worker announces."""
    if state.max_model_len:
        return state.max_model_len
    announced = [r.max_model_len for r in state.view.decode_workers() if r.max_model_len]
    return min(announced, default=DEFAULT_MAX_MODEL_LEN)


def _check_model(state: RouterState, model: str) -> None:
    if model != state.served_name:
        raise ApiError(
            404, f"model {model[:200]!r} is not served here (this pool serves "
            f"{state.served_name!r})", "not_found_error", param="model", code="model_not_found",
        )  # fmt: skip


def _error_response(state: RouterState, request: Request, exc: ApiError) -> JSONResponse:
    state.metrics.requests.labels(_endpoint(request), str(exc.status)).inc()
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _endpoint(request: Request) -> str:
    path = request.url.path
    return path if path.startswith("/v1/") and path.count("/") == 2 else "other"


async def _serve(
    state: RouterState,
    request: Request,
    kind: Kind,
    tenant: Tenant,
    prompt_ids: Sequence[int],
    sampling: Sampling,
) -> Response:
    started = time.monotonic()
    if not prompt_ids:
        param = "prompt" if kind == "completion" else "messages"
        raise ApiError(400, "the prompt is empty", param=param)
    context = _context_len(state)
    room = context - len(prompt_ids)
    if room < 1:
        raise ApiError(
            400, f"the prompt has {len(prompt_ids)} tokens; this model's context is "
            f"{context} tokens", param="messages" if kind == "chat" else "prompt",
            code="context_length_exceeded",
        )  # fmt: skip
    max_tokens = sampling.max_tokens if sampling.max_tokens is not None else room
    if max_tokens > room:
        raise ApiError(
            400, f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds "
            f"this model's context of {context} tokens", param="max_tokens",
            code="context_length_exceeded",
        )  # fmt: skip
    try:
        ticket = state.admission.admit(tenant, len(prompt_ids) + max_tokens)
    except Rejected as err:
        state.metrics.rejected.labels("rate_limited" if err.status == 429 else "too_large").inc()
        headers = {"Retry-After": str(int(err.retry_after_s))} if err.retry_after_s else {}
        kind_ = "rate_limit_error" if err.status == 429 else "invalid_request_error"
        raise ApiError(err.status, err.message, kind_, headers=headers) from err
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    job = Job(
        request_id=response_id, token_ids=tuple(prompt_ids), max_tokens=max_tokens,
        deadline_unix_s=time.time() + state.request_timeout_s,
        temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
        tenant_salt=tenant.salt,
    )  # fmt: skip
    state.metrics.prompt_tokens.labels(tenant.name).inc(len(prompt_ids))
    detok = state.codec.detokenizer(prompt_ids, sampling.stop)
    reply = streaming.Reply(
        kind, response_id, state.served_name, state.created, len(prompt_ids),
        sampling.include_usage,
    )  # fmt: skip
    pieces = _generate(state, job, detok, started, tenant, ticket)
    endpoint = _endpoint(request)
    if sampling.stream:
        sse = streaming.sse(
            reply, pieces, sampling.include_usage,
            lambda status: state.metrics.requests.labels(endpoint, status).inc(),
        )  # fmt: skip
        return streaming.EventStream(sse, on_close=lambda: ticket.release(0))
    try:
        text, finish, num_tokens = await streaming.until_disconnect(
            request, streaming.collect(pieces)
        )
    finally:
        ticket.release(0)  # a no-op once the request released it with its real usage
    state.metrics.requests.labels(endpoint, "200").inc()
    return JSONResponse(reply.whole(text, finish, num_tokens))


async def _generate(
    state: RouterState,
    job: Job,
    detok: Detokenizer,
    started: float,
    tenant: Tenant,
    ticket: Ticket,
) -> AsyncGenerator[streaming.Piece, None]:
    """Text pieces of one request, in order; the last has a finish reason. Raises ApiError."""
    m = state.metrics
    num_tokens = 0
    outcome = "error"
    m.in_flight.inc()
    try:
        async with state.dispatcher.open(job) as stream:
            last = started
            try:
                async for event in stream:
                    now = time.monotonic()
                    if event.seq == 0:
                        m.first_event(event, now - started)
                    elif event.token_ids:
                        gap = (now - last) / len(event.token_ids)
                        for _ in event.token_ids:
                            m.itl.observe(gap)
                    last = now
                    if event.error is not None:
                        raise DispatchError(event.error)
                    num_tokens += len(event.token_ids)
                    text = detok.feed(event.token_ids)
                    if detok.stopped:
                        await stream.cancel("stop")
                        outcome = "stop"
                        yield streaming.Piece(text, "stop", num_tokens)
                        return
                    finish = None
                    if event.finish_reason is not None:
                        if event.finish_reason not in ("stop", "length"):
                            raise DispatchError("aborted")
                        finish = event.finish_reason
                        text += detok.flush()
                        outcome = finish
                    yield streaming.Piece(text, finish, num_tokens)
            except DispatchError as err:
                await stream.cancel("deadline" if err.code == "deadline" else "error")
                log.info("request failed request_id=%s worker=%s code=%s",
                         job.request_id, stream.worker_id, err.code)  # fmt: skip
                status, type_ = _ERRORS.get(err.code, (500, "server_error"))
                raise ApiError(status, _message(err.code), type_, code=err.code) from err
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    finally:
        m.in_flight.dec()
        m.generation_tokens.labels(tenant.name).inc(num_tokens)
        m.duration.labels(outcome).observe(time.monotonic() - started)
        ticket.release(len(job.token_ids) + num_tokens)


def _message(code: str) -> str:
    return {
        "deadline": "the request did not finish within its deadline",
        "no_worker": "no decode worker is ready to take the request; retry later",
        "invalid_request": "a worker refused the request as invalid",
        "prefill_failed": "no prefill worker could prefill the prompt; retry later",
        "protocol_error": "a worker answered in a form the router does not understand",
        "shutting_down": "the decode worker shut down before the request finished; retry it",
        "worker_lost": "the decode worker went away before the request finished; retry it",
    }.get(code, f"the request failed ({code})")
