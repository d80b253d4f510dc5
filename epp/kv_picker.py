"""The endpoint kvrail's router would choose for a request, by the router's own code.

:class:`KvAwarePicker` holds a router's state (:class:`~kvrail.router.generate.RouterState`: its
tokenizer and chat template, its ``WorkerView`` of the pool's etcd records and KV events, its
``Dispatcher`` and ``Chooser``) and, for each whole request, does what the router does before it
sends one, with the router's functions:

1. ``app.authenticate`` (a 401 without a valid API key, when the pool has keys: the tenant salts
   the block hashes, so the picker must know it) and ``app.parse_body`` (a 400 for a body that is
   not JSON or not valid, naming the field; a 404 for a model the pool does not serve);
2. ``chat.chat_prompt`` / ``chat.completion_prompt``: the prompt's tokens, rendered and tokenized
   on the router's tokenizer threads (a bounded pool, off the event loop) after the length check,
   the body already bounded by the EPP's cap;
3. ``Dispatcher.rank``: ``Dispatcher.choose``'s decision (the chooser's scorers: prefix hits in
   every KV tier, load, KV utilisation, over the ready decode workers), then the next cheapest
   workers as the gateway's fallbacks, from the same scoring pass.

A refusal is a :class:`~kvrail.epp.picker.Refused` pick carrying the router's OpenAI error body;
it is logged with its status, code and field, never the body. Other paths (``/v1/responses``,
``/v1/models``) carry no prompt the picker reads: they go by load alone.

Only workers whose record advertises an HTTP front (``WorkerRecord.http_front``, ``ip:port``: a
router pinned to that worker) are picked, and the endpoint named is that address, never anything
the request says. Each pick books one request on its worker in the dispatcher's in-flight table
(the chooser's ``load`` reads it, as the router's own requests) until the stream ends.

A detached stream (the EPP's ``--detach``: the gateway serves the response without the EPP)
ends as soon as its request is routed, long before the request does. Its booking is then handed
over to the worker's own count: it stays in the table until the first record of the worker that
arrives at least ``COUNTED_AFTER_S`` after the pick, which counts the request among its running
or waiting ones if it is still there, and leaves the table as that record arrives, so it is
never counted twice nor dropped before the worker counts it. A worker that never reports again
(it left) releases its handed-over bookings after ``MAX_HOLD_S``.
"""

from __future__ import annotations

import collections
import functools
import logging
import time

from kvrail.endpoints import parse_endpoint
from kvrail.epp.picker import (
    NoEndpoint,
    Pick,
    PickRequest,
    Refused,
    Routed,
    is_allowed,
)
from kvrail.errors import KvrailError
from kvrail.router import app, chat
from kvrail.router.api import schemas
from kvrail.router.api.errors import ApiError, api_error_of
from kvrail.router.generate import RouterState
from kvrail.router.policy import NoWorkerError
from kvrail.router.streams.job import Job
from kvrail.sampling import SamplingParams

log = logging.getLogger("kvrail.epp")

_SAMPLING = SamplingParams(max_tokens=1)  # a `Job` needs one; choosing never reads it

COUNTED_AFTER_S = 0.5
"""A worker's record written this long after a detached pick counts that request: the gateway
forwarded it, the front tokenized it and the worker admitted it (tens of milliseconds; the rest
is room for a loaded host)."""
MAX_HOLD_S = 5.0
"""A handed-over booking is released after this long even if its worker never reports again."""


class KvAwarePicker:
    """Picks as kvrail's router does (module docstring); ``num_endpoints``: the primary and the
    fallbacks named to the gateway, at most."""

    def __init__(self, state: RouterState, *, num_endpoints: int = 3) -> None:
        if num_endpoints < 1:
            raise ValueError("num_endpoints: must be at least 1")
        self.state = state
        self.dispatcher = state.dispatcher
        self.num_endpoints = num_endpoints
        self.booked: dict[int, str] = {}
        """The worker each open stream is booked on."""
        self.handed_over: dict[str, collections.deque[float]] = {}
        """Per worker, when each detached booking still in the table was made, oldest first."""
        state.view.track_load(self._ours_in_report)

    async def pick(self, request: PickRequest) -> Pick:
        try:
            token_ids, salt = await self._prompt(request)
        except (ApiError, KvrailError) as err:
            refused = err if isinstance(err, ApiError) else api_error_of(err)
            log.info(
                "stream %d refused status=%d code=%s param=%s", request.stream_id,
                refused.status, refused.code or refused.type, refused.param or "-",
            )  # fmt: skip
            return Refused(refused.status, refused.body())
        fronts = self.fronts(request.eligible)
        if not fronts:
            among = " among the eligible endpoints" if request.eligible is not None else ""
            return NoEndpoint(f"no ready decode worker with an HTTP front{among}")
        job = Job(f"epp-{request.stream_id}", token_ids, _SAMPLING, 0.0, tenant_salt=salt)
        exclude = {r.worker_id for r in self.dispatcher.decode_workers()} - fronts.keys()
        try:
            decisions = self.dispatcher.rank(job, exclude, self.num_endpoints)
        except NoWorkerError:
            return NoEndpoint("no ready decode worker with an HTTP front")
        self._release_handed_over(time.monotonic() - MAX_HOLD_S)
        self.finished(request.stream_id)  # one booking per stream, even if picked twice
        self._book(request.stream_id, decisions[0].worker_id)
        return Routed(tuple(fronts[d.worker_id] for d in decisions))

    def served(self, stream_id: int, endpoint: str) -> None:
        booked = self.booked.get(stream_id)
        if booked is None:
            return
        worker_id = next((w for w, e in self.fronts(None).items() if e == endpoint), None)
        if worker_id is None or worker_id == booked:
            return
        self.finished(stream_id)
        self._book(stream_id, worker_id)

    def detached(self, stream_id: int) -> None:
        """The booking stays until the worker's own report counts the request (module
        docstring)."""
        worker_id = self.booked.pop(stream_id, None)
        if worker_id is not None:
            self.handed_over.setdefault(worker_id, collections.deque()).append(time.monotonic())

    def finished(self, stream_id: int) -> None:
        worker_id = self.booked.pop(stream_id, None)
        if worker_id is not None:
            self.dispatcher.count_in_flight(worker_id, -1)

    def _ours_in_report(self, worker_id: str) -> int:
        """The view's load hook (``WorkerView.track_load``), read as each record of
        ``worker_id`` arrives: the detached bookings that record counts leave the table first,
        then the dispatcher says how many of ours it may count."""
        self._release_handed_over(time.monotonic() - COUNTED_AFTER_S, worker_id)
        return self.dispatcher.ours_in_report(worker_id)

    def _release_handed_over(self, before: float, worker_id: str | None = None) -> None:
        """Release the handed-over bookings made before ``before`` (of one worker, or all). They
        leave the table as counted by the worker, not as ended requests."""
        for worker in [worker_id] if worker_id is not None else list(self.handed_over):
            times = self.handed_over.get(worker)
            num_released = 0
            while times and times[0] < before:
                times.popleft()
                num_released += 1
            if times is not None and not times:
                del self.handed_over[worker]
            if num_released:
                self.dispatcher.count_in_flight(worker, -num_released, ended=False)

    def fronts(self, eligible: frozenset[str] | None) -> dict[str, str]:
        """The HTTP front of every ready decode worker that has one (normalised ``ip:port``),
        by worker id, of those the subset hint allows."""
        out: dict[str, str] = {}
        for record in self.dispatcher.decode_workers():
            endpoint = _endpoint(record.http_front) if record.http_front else ""
            if endpoint and is_allowed(endpoint, eligible):
                out[record.worker_id] = endpoint
        return out

    def _book(self, stream_id: int, worker_id: str) -> None:
        self.booked[stream_id] = worker_id
        self.dispatcher.count_in_flight(worker_id, 1)

    async def _prompt(self, request: PickRequest) -> tuple[tuple[int, ...], str]:
        """The request's prompt tokens (none where the path has no prompt the router reads) and
        its tenant's salt, as the router computes them. Raises ApiError, KvrailError."""
        state, headers = self.state, request.headers
        tenant = app.authenticate(state, headers.get("authorization"))
        path = headers.get(":path", "").partition("?")[0]
        if path == app.CHAT_PATH:
            body = app.parse_body(
                state, schemas.ChatCompletionRequest, request.body, headers.get("content-type")
            )
            return tuple(await chat.chat_prompt(state, body)), tenant.salt
        if path == app.COMPLETIONS_PATH:
            body = app.parse_body(
                state, schemas.CompletionRequest, request.body, headers.get("content-type")
            )
            return tuple(await chat.completion_prompt(state, body)), tenant.salt
        return (), tenant.salt


@functools.lru_cache(maxsize=4096)
def _endpoint(http_front: str) -> str:
    """The front's address normalised, or "" when it is not ``ip:port`` (the worker checks its
    own; a record written by hand may not be). Cached: every pick reads every worker's."""
    try:
        return parse_endpoint(http_front)
    except ValueError:
        return ""
