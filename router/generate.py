"""One generation, from a tokenized prompt to its last text piece (`serve`).

`serve` checks the prompt and `max_tokens` against the context every ready decode worker can
hold (an omitted `max_tokens` means the room left, as in vLLM), admits the request against its
tenant's limits, builds its `SamplingParams` once (`kvrail.router.api.sampling`), and follows
the dispatcher's stream until the last token (one per choice when it asks for several:
`kvrail.router.choices`): streamed as server-sent events or collected into one body, and
cancelled on every worker when the client leaves either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.responses import JSONResponse
from starlette.types import Receive

from kvrail.errors import InvalidRequestError
from kvrail.outputs import RequestOutput
from kvrail.router import choices
from kvrail.router.api import asgi, streaming
from kvrail.router.api.errors import ApiError, dispatch_error
from kvrail.router.api.sampling import Defaults, Requested
from kvrail.router.api.streaming import Kind
from kvrail.router.discovery.view import WorkerView
from kvrail.router.metrics import RouterMetrics
from kvrail.router.output.tool_calls import ParserName
from kvrail.router.output.transform import OutputPlan, parse_pieces
from kvrail.router.streams.dispatcher import Dispatcher
from kvrail.router.streams.job import DispatchError, Job
from kvrail.router.structured.compiler import GrammarCompiler
from kvrail.router.tenants import Admission, Rejected, Tenant, TenantTable, Ticket
from kvrail.router.text.detokenizer import Detokenizer
from kvrail.router.text.threads import TokenizerThreads
from kvrail.router.text.tokenizer import TextCodec

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048  # when neither the settings nor any worker says
TOKENIZER_THREADS = 2  # prompts tokenized at once; more wait (tokenizing releases the GIL)


def _tokenizer_threads() -> TokenizerThreads:
    return TokenizerThreads(TOKENIZER_THREADS)


@dataclass(slots=True)
class RouterState:
    codec: TextCodec
    dispatcher: Dispatcher
    view: WorkerView
    tenants: TenantTable
    admission: Admission
    metrics: RouterMetrics
    served_name: str
    max_model_len: int  # 0: the workers' (see `context_len`)
    request_timeout_s: float
    defaults: Defaults = field(default_factory=Defaults)
    allow_special_tokens: bool = False
    max_choices: int = 16  # the most `n` (or `best_of`) a request may ask for
    created: int = 0  # when the router started: the served model's `created`
    tokenizer: TokenizerThreads = field(default_factory=_tokenizer_threads)
    grammars: GrammarCompiler | None = None  # None: made on first use (`chat`)
    tool_call_parser: ParserName = "hermes"  # the tool-call format (`tool_call_parser`)
    reasoning_parser: bool = False  # split `<think>` reasoning from the answer


class Render(Protocol):
    """Another shape for a chat's answer than the chat completion's (the Responses API's,
    `kvrail.router.api.responses_api`): its whole body, or its events, from the same pieces."""

    def collect(
        self, pieces: AsyncGenerator[streaming.Piece, None], reply: streaming.Reply
    ) -> Awaitable[dict[str, Any]]: ...

    def sse(
        self, reply: streaming.Reply, pieces: AsyncGenerator[streaming.Piece, None],
        count: Callable[[str], None],
    ) -> AsyncIterator[bytes]: ...  # fmt: skip


def context_len(state: RouterState) -> int:
    """The longest prompt + completion every ready decode worker the dispatcher sends to can
    hold (each announces its model's limit or what its KV pool holds, whichever is smaller),
    capped by the configured context; `DEFAULT_MAX_MODEL_LEN` when nothing says."""
    workers = state.dispatcher.decode_workers()
    limits = [r.max_model_len for r in workers if r.max_model_len]
    if state.max_model_len:
        limits.append(state.max_model_len)
    return min(limits, default=DEFAULT_MAX_MODEL_LEN)


async def serve(
    state: RouterState,
    receive: Receive,
    endpoint: str,
    kind: Kind,
    tenant: Tenant,
    prompt_ids: Sequence[int],
    asked: Requested,
    request_id: str,
    echo_text: str = "",
    output: OutputPlan | None = None,
    keep_special: frozenset[int] = frozenset(),
    render: Render | None = None,
) -> JSONResponse | streaming.EventStream:
    """The response to one generation request, `request_id` (the completion's id, and the
    response's x-request-id header). Its body was read from `receive`; the client's departure
    is read from it too. With `echo` (`asked.delivery`) the text begins with `echo_text`, the
    prompt's. `output` says how each choice's text is parsed (reasoning, tool calls), reading
    the special tokens `keep_special` too; `render` renders the answer in another shape than
    the chat's. Raises ApiError, asgi.ClientLeft (not streamed, the client left before the end;
    counted as 499)."""
    started = time.monotonic()
    param = "messages" if kind == "chat" else "prompt"
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", param=param)
    context = context_len(state)
    room = context - len(prompt_ids)
    if room < 1:
        raise ApiError(
            400, f"the prompt has {len(prompt_ids)} tokens; this model's context is "
            f"{context} tokens", param=param, code="context_length_exceeded",
        )  # fmt: skip
    max_tokens = asked.max_tokens if asked.max_tokens is not None else room
    if max_tokens > room:
        raise ApiError(
            400, f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds "
            f"this model's context of {context} tokens", param="max_tokens",
            code="context_length_exceeded",
        )  # fmt: skip
    params = asked.params(max_tokens, state.defaults)  # InvalidRequestError: a 400 naming it
    vocab = state.codec.vocab_size
    if any(t >= vocab for t in params.stop_token_ids):
        raise ApiError(400, f"stop_token_ids must be below {vocab}", param="stop_token_ids")
    if any(b.token_id >= vocab for b in params.logit_bias):
        raise ApiError(400, f"logit_bias token ids must be below {vocab}", param="logit_bias")
    try:
        params.check_prompt_scores(len(prompt_ids))
    except InvalidRequestError as err:
        raise ApiError(400, str(err), param="echo") from err
    count = asked.best_of or asked.n
    if count > state.max_choices:
        raise ApiError(
            400, f"at most {state.max_choices} choices per request (this router's max_choices)",
            param="best_of" if asked.best_of else "n",
        )  # fmt: skip
    if asked.best_of and asked.best_of > asked.n and params.logprobs is None:
        params = dataclasses.replace(params, logprobs=0)  # ranked by them, not returned
    try:
        ticket = state.admission.admit(tenant, len(prompt_ids) + count * max_tokens)
    except Rejected as err:
        state.metrics.rejected.labels("rate_limited" if err.status == 429 else "too_large").inc()
        headers = {"Retry-After": str(int(err.retry_after_s))} if err.retry_after_s else {}
        kind_ = "rate_limit_error" if err.status == 429 else "invalid_request_error"
        raise ApiError(err.status, err.message, kind_, headers=headers) from err
    response_id = request_id
    job = Job(
        request_id=response_id, token_ids=tuple(prompt_ids), sampling=params,
        deadline_unix_s=time.time() + state.request_timeout_s, tenant_salt=tenant.salt,
    )  # fmt: skip
    state.metrics.prompt_tokens.labels(tenant.name).inc(len(prompt_ids))
    delivery = asked.delivery
    reply = streaming.Reply(
        kind, response_id, state.served_name, int(time.time()), len(prompt_ids),
        delivery.include_usage, delivery.continuous_usage_stats,
        None if asked.fields.get("logprobs") is None else state.codec.token_text, count,
        reasoning=output is not None and output.reasoning is not None,
    )  # fmt: skip
    share = choices.SharedTicket(ticket, len(prompt_ids), count) if count > 1 else ticket

    def start(job: Job, on_first: choices.OnFirst | None) -> AsyncGenerator[streaming.Piece]:
        detok = state.codec.detokenizer(prompt_ids, delivery.stop, params.min_tokens, keep_special)
        pieces = _generate(state, job, detok, started, tenant, share, on_first)
        if output is not None:
            pieces = parse_pieces(pieces, output)
        return _echoed(pieces, echo_text, prompt_ids[0]) if delivery.echo else pieces

    if count == 1:
        pieces = start(job, None)
    else:
        pieces = choices.pieces_of(choices.choice_jobs(job, count), start)
    if delivery.stream:
        sse = (render.sse if render is not None else streaming.sse)(
            reply, pieces, lambda status: state.metrics.requests.labels(endpoint, status).inc()
        )
        return streaming.EventStream(
            sse, on_close=lambda: ticket.release(0), request_id=response_id
        )
    try:
        keep = asked.n if asked.best_of and asked.best_of > asked.n else None
        work = (
            render.collect(pieces, reply) if render is not None
            else streaming.collect(pieces, reply, keep)
        )  # fmt: skip
        body = await streaming.until_disconnect(receive, work)
    except asgi.ClientLeft:
        state.metrics.requests.labels(endpoint, "499").inc()
        raise
    finally:
        ticket.release(0)  # a no-op once the request released it with its real usage
    state.metrics.requests.labels(endpoint, "200").inc()
    return JSONResponse(body, headers={streaming.REQUEST_ID_HEADER: response_id})


async def _echoed(
    pieces: AsyncGenerator[streaming.Piece, None], text: str, first_token_id: int
) -> AsyncGenerator[streaming.Piece, None]:
    """The pieces with the prompt's `text` before the first one's (which also names the
    prompt's first token, the one the prompt's scores leave out)."""
    async with contextlib.aclosing(pieces):
        first = True
        async for piece in pieces:
            if first:
                piece = dataclasses.replace(piece, text=text + piece.text, echo=(first_token_id,))
                first = False
            yield piece


def _feed_to_stop(detok: Detokenizer, output: RequestOutput) -> tuple[str, RequestOutput]:
    """The text of an output of several tokens with logprobs, fed one token at a time: when a
    stop string completes, the output is cut after the token that completed it, so that the
    tokens after it get no logprobs (vLLM's rule; the usage still counts them)."""
    text, num_fed = detok.feed_each(output.token_ids)
    if num_fed < len(output.token_ids):
        output = dataclasses.replace(
            output, token_ids=output.token_ids[:num_fed], logprobs=output.logprobs[:num_fed]
        )
    return text, output


async def _generate(
    state: RouterState,
    job: Job,
    detok: Detokenizer,
    started: float,
    tenant: Tenant,
    ticket: Ticket | choices.SharedTicket,
    on_first: choices.OnFirst | None = None,
) -> AsyncGenerator[streaming.Piece, None]:
    """Text pieces of one request, in order; the last has a finish reason. `on_first` gets the
    worker that sent its first event. Raises ApiError."""
    m = state.metrics
    num_tokens = 0
    num_cached = 0
    outcome = "error"
    m.in_flight.inc()
    try:
        async with state.dispatcher.open(job) as stream:
            last = started
            try:
                async for event in stream:
                    output = event.output
                    now = time.monotonic()
                    if event.seq == 0:
                        m.first_event(event, now - started)
                        num_cached = output.num_cached_tokens
                        if on_first is not None:
                            on_first(stream.worker_id)
                    elif output.token_ids:
                        n = len(output.token_ids)
                        m.itl.observe((now - last) / n, n)
                    last = now
                    if output.error is not None:
                        raise DispatchError(output.error)
                    num_tokens += len(output.token_ids)
                    if output.logprobs and len(output.token_ids) > 1 and detok.has_stop_strings:
                        text, output = _feed_to_stop(detok, output)
                    else:
                        text = detok.feed(output.token_ids)
                    if detok.stopped:
                        await stream.cancel("stop")
                        outcome = "stop"
                        yield streaming.Piece(text, "stop", num_tokens, num_cached, output)
                        return
                    finish = None
                    if output.finish_reason is not None:
                        if output.finish_reason not in ("stop", "length"):
                            raise DispatchError("aborted")
                        finish = output.finish_reason
                        text += detok.flush()
                        outcome = finish
                    yield streaming.Piece(text, finish, num_tokens, num_cached, output)
            except DispatchError as err:
                await stream.cancel("deadline" if err.code == "deadline" else "error")
                log.info("request failed request_id=%s worker=%s code=%s",
                         job.request_id, stream.worker_id, err.code)  # fmt: skip
                raise dispatch_error(err.code, err.param) from err
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    finally:
        m.in_flight.dec()
        m.generation_tokens.labels(tenant.name).inc(num_tokens)
        m.duration.labels(outcome).observe(time.monotonic() - started)
        ticket.release(len(job.token_ids) + num_tokens)
